//! Validation and compilation: raw model → [`Domain`] with the lookup tables matching needs.
//!
//! Every semantic check of a policy file (docs/src/policies/index.md) lives here and every problem is
//! collected, so an operator fixes a file in one pass. The output is immutable; matching never
//! parses, allocates or compiles anything.

use std::collections::HashMap;
use std::sync::Arc;

use super::Problem;
use super::matcher::Domain;
use super::matcher::{Level, Pattern, TreeNode};
use super::model::{RawDescriptor, RawPolicy, RawRateLimit, Spanned};
use super::rule::{Cost, Limit, Metadata, Rate, Rule, Unit};
use super::yaml::{Node, Pos, Value};
use crate::limiter::gcra::NANOS_PER_SEC;
use crate::limiter::{KeyBuilder, Quota, QuotaError};

/// The largest `unit_multiplier` accepted (a multiple of a unit beyond this is better written
/// in a larger unit).
const MAX_UNIT_MULTIPLIER: u64 = 1_000_000;

/// The longest `delay` accepted: a caller waiting longer than this for an answer is better told
/// to come back (Envoy's rate-limit filter waits 20 ms unless told otherwise).
pub const MAX_DELAY_NANOS: u64 = 60 * NANOS_PER_SEC;

/// Compiles the raw policies of one domain, appending problems: one file, or with merged
/// domains every file naming it, in load order, their top-level descriptors concatenated into
/// one tree (as envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG` does: a top-level key and value
/// given in two files is a duplicate, named with both files; nothing deeper is merged). Returns
/// `None` when a file has errors.
pub(super) fn compile(files: &[(&str, RawPolicy)], problems: &mut Vec<Problem>) -> Option<Domain> {
    let (first, _) = files.first()?;
    let before = problems.len();
    let mut c = Compiler {
        file: first,
        problems,
        nodes: Vec::new(),
    };
    let mut root = Level::default();
    let mut seen = HashMap::new();
    let mut name = String::new();
    for (file, raw) in files {
        c.file = file;
        name = c.domain_name(raw);
        c.extend_level(&mut root, &mut seen, &name, &raw.descriptors, &[], None);
    }
    let nodes = c.nodes;
    (problems.len() == before).then(|| Domain {
        name,
        files: files.iter().map(|(f, _)| (*f).to_string()).collect(),
        root,
        nodes,
    })
}

struct Compiler<'a> {
    file: &'a str,
    problems: &'a mut Vec<Problem>,
    nodes: Vec<TreeNode>,
}

/// One step of a descriptor's path from the domain: its key and how its value is matched.
#[derive(Clone)]
struct Step {
    key: String,
    value: Option<String>,
}

impl Compiler<'_> {
    /// The file's domain, with a problem when it is missing or empty.
    fn domain_name(&mut self, raw: &RawPolicy) -> String {
        match &raw.domain {
            Some(d) if !d.value.is_empty() => d.value.clone(),
            Some(d) => {
                self.problem(
                    Some(d.pos),
                    "domain",
                    "config file cannot have empty domain".into(),
                );
                String::new()
            }
            None => {
                // Unless the model already reported a `domain` that is not text.
                let file = self.file;
                if !self
                    .problems
                    .iter()
                    .any(|p| p.file == file && p.path == "domain")
                {
                    self.problem(
                        Some(Pos { line: 1, col: 1 }),
                        "domain",
                        "missing domain".into(),
                    );
                }
                String::new()
            }
        }
    }

    fn problem(&mut self, pos: Option<Pos>, path: &str, message: String) {
        self.problems.push(Problem {
            file: self.file.to_string(),
            pos,
            path: path.to_string(),
            message,
        });
    }

    /// Compiles sibling descriptors into one level of the tree; `ancestor` is the nearest node
    /// above with a limit of its own (for cost nodes).
    fn level(
        &mut self,
        domain: &str,
        raws: &[RawDescriptor],
        parents: &[Step],
        ancestor: Option<usize>,
    ) -> Level {
        let mut level = Level::default();
        self.extend_level(
            &mut level,
            &mut HashMap::new(),
            domain,
            raws,
            parents,
            ancestor,
        );
        level
    }

    /// Adds sibling descriptors to `level`; `seen` holds the (key, value) pairs already in it
    /// with the file and path that gave each.
    fn extend_level(
        &mut self,
        level: &mut Level,
        seen: &mut HashMap<(String, Option<String>), (String, String)>,
        domain: &str,
        raws: &[RawDescriptor],
        parents: &[Step],
        ancestor: Option<usize>,
    ) {
        for raw in raws {
            let key = match &raw.key {
                Some(k) if !k.value.is_empty() => k.value.clone(),
                _ => {
                    self.problem(Some(raw.pos), &raw.path, "descriptor has empty key".into());
                    continue;
                }
            };
            let value = raw
                .value
                .as_ref()
                .map(|v| v.value.clone())
                .filter(|v| !v.is_empty());
            if let Some((file, first)) = seen.get(&(key.clone(), value.clone())) {
                let shown = match &value {
                    Some(v) => format!("{key}: {v}"),
                    None => key.clone(),
                };
                let at = if file == self.file {
                    first.clone()
                } else {
                    format!("{first} of {file}")
                };
                self.problem(
                    Some(raw.pos),
                    &raw.path,
                    format!("duplicate descriptor `{shown}` (already at {at})"),
                );
                continue;
            }
            seen.insert(
                (key.clone(), value.clone()),
                (self.file.to_string(), raw.path.clone()),
            );
            let mut steps = parents.to_vec();
            steps.push(Step {
                key: key.clone(),
                value: value.clone(),
            });
            let id = self.node(domain, raw, &steps, ancestor);
            let group = level.groups.entry(key.into()).or_default();
            match value {
                Some(v) if v.contains('*') => group.wildcards.push((Pattern::new(&v), id)),
                Some(v) => {
                    group.exact.insert(v.into(), id);
                }
                None => group.any = Some(id),
            }
        }
    }

    /// Compiles one descriptor and its children; returns its node index.
    fn node(
        &mut self,
        domain: &str,
        raw: &RawDescriptor,
        steps: &[Step],
        ancestor: Option<usize>,
    ) -> usize {
        let is_pattern = steps
            .last()
            .and_then(|s| s.value.as_deref())
            .is_some_and(|v| v.contains('*'));
        let share_threshold = match &raw.share_threshold {
            Some(Spanned { value: true, pos }) if !is_pattern => {
                self.problem(
                    Some(*pos),
                    &format!("{}.share_threshold", raw.path),
                    "share_threshold needs a value with a `*` wildcard".into(),
                );
                false
            }
            Some(s) => s.value,
            None => false,
        };
        let rules = self.rules(domain, raw, steps);
        let cost = self.cost(domain, raw, steps, ancestor);
        let metadata = raw.metadata.as_ref().and_then(|m| {
            let path = format!("{}.metadata", raw.path);
            match self.metadata_value(m, &path) {
                Some(serde_json::Value::Object(map)) if !map.is_empty() => Some(map),
                _ => None,
            }
        });
        let limited = raw.rate_limit.is_some()
            || raw
                .rate_limits
                .as_ref()
                .is_some_and(|l| !l.value.is_empty());
        let index = self.nodes.len();
        self.nodes.push(TreeNode {
            children: Level::default(),
            rules: rules.into_iter().map(Arc::new).collect(),
            cost,
            share_threshold,
            metadata,
        });
        let below = if limited { Some(index) } else { ancestor };
        let children = self.level(domain, &raw.descriptors, steps, below);
        self.nodes[index].children = children;
        index
    }

    /// The node's rules: its `rate_limit`, or each entry of its `rate_limits`.
    fn rules(&mut self, domain: &str, raw: &RawDescriptor, steps: &[Step]) -> Vec<Rule> {
        let Some(list) = &raw.rate_limits else {
            return raw
                .rate_limit
                .as_ref()
                .and_then(|r| self.rule(domain, raw, r, steps, None))
                .into_iter()
                .collect();
        };
        let path = format!("{}.rate_limits", raw.path);
        if raw.rate_limit.is_some() {
            self.problem(
                Some(list.pos),
                &path,
                "rate_limit and rate_limits cannot both be given (put every limit in rate_limits)"
                    .into(),
            );
            return Vec::new();
        }
        if list.value.is_empty() {
            self.problem(
                Some(list.pos),
                &path,
                "rate_limits must not be empty".into(),
            );
            return Vec::new();
        }
        let several = list.value.len() > 1;
        let mut names: HashMap<&str, &str> = HashMap::new();
        let mut rules = Vec::new();
        for (i, r) in list.value.iter().enumerate() {
            let name = r.name.as_ref().filter(|n| !n.value.is_empty());
            match name {
                None if several => {
                    self.problem(
                        Some(r.pos),
                        &r.path,
                        "each of several rate_limits needs a name (it tells their counters, \
                         metrics and statuses apart)"
                            .into(),
                    );
                    continue;
                }
                Some(n) => {
                    if let Some(first) = names.insert(&n.value, &r.path) {
                        self.problem(
                            Some(n.pos),
                            &format!("{}.name", r.path),
                            format!(
                                "duplicate rate_limits name {:?} (already at {first})",
                                n.value
                            ),
                        );
                        continue;
                    }
                }
                None => {}
            }
            // The entry's identity: its name, else its index (only a single entry has none).
            let entry = name.map_or_else(|| i.to_string(), |n| n.value.clone());
            rules.extend(self.rule(domain, raw, r, steps, Some(&entry)));
        }
        if several {
            for rule in &mut rules {
                rule.entry.clone_from(&rule.name);
            }
        }
        rules
    }

    /// The node's `cost`, checked against its nearest limited ancestor.
    fn cost(
        &mut self,
        domain: &str,
        raw: &RawDescriptor,
        steps: &[Step],
        ancestor: Option<usize>,
    ) -> Option<Cost> {
        let c = raw.cost.as_ref()?;
        let path = format!("{}.cost", raw.path);
        if raw.rate_limit.is_some() || raw.rate_limits.is_some() {
            self.problem(
                Some(c.pos),
                &path,
                "cost is for a node without a limit of its own (it draws from an ancestor's)"
                    .into(),
            );
            return None;
        }
        let n = self.bounded(Some(c), &path, 1, 0)?;
        let Some(ancestor) = ancestor else {
            self.problem(
                Some(c.pos),
                &path,
                "cost needs an ancestor descriptor with a rate_limit to draw from".into(),
            );
            return None;
        };
        let rules = &self.nodes[ancestor].rules;
        let of = rules.first().map(|r| r.stats_key.clone())?;
        let smallest = rules
            .iter()
            .filter_map(|r| match r.limit {
                Limit::Limited(rate) if rate.requests_per_unit > 0 => Some(rate.burst),
                _ => None,
            })
            .min();
        if let Some(burst) = smallest
            && n > u64::from(burst)
        {
            self.problem(
                Some(c.pos),
                &path,
                format!(
                    "cost {n} is above the burst {burst} of {of}, so such a request could never pass"
                ),
            );
            return None;
        }
        let (_, levels) = identity(domain, steps);
        Some(Cost {
            cost: n,
            path: raw.path.clone(),
            stats_key: format!("{domain}.{}", levels.join(".")),
            of,
        })
    }

    fn rule(
        &mut self,
        domain: &str,
        raw: &RawDescriptor,
        r: &RawRateLimit,
        steps: &[Step],
        entry: Option<&str>,
    ) -> Option<Rule> {
        let before = self.problems.len();
        let field = |name: &str| format!("{}.{name}", r.path);
        let name = r
            .name
            .as_ref()
            .map(|n| n.value.clone())
            .filter(|n| !n.is_empty());
        if let Some(n) = &r.name
            && let Some(bad) = n
                .value
                .chars()
                .find(|c| matches!(c, '"' | '\\' | '\r' | '\n'))
        {
            self.problem(
                Some(n.pos),
                &field("name"),
                format!(
                    "name must not contain {bad:?}: Envoy writes it unescaped into the \
                         x-ratelimit-limit header"
                ),
            );
        }
        let mut replaces = Vec::new();
        for (i, rep) in r.replaces.iter().enumerate() {
            let path = format!("{}.replaces[{i}].name", r.path);
            if rep.value.is_empty() {
                self.problem(
                    Some(rep.pos),
                    &path,
                    "should not have an empty replaces entry".into(),
                );
            } else if name.as_deref() == Some(rep.value.as_str()) {
                self.problem(
                    Some(rep.pos),
                    &path,
                    "replaces should not contain name of same descriptor".into(),
                );
            } else {
                replaces.push(rep.value.clone());
            }
        }
        let limit = if r.unlimited {
            for (given, what) in [
                (r.unit.as_ref().map(|u| u.pos), "unit"),
                (r.burst.as_ref().map(|b| b.pos), "burst"),
                (r.unit_multiplier.as_ref().map(|m| m.pos), "unit_multiplier"),
                (r.delay.as_ref().map(|d| d.pos), "delay"),
            ] {
                if let Some(pos) = given {
                    self.problem(
                        Some(pos),
                        &field(what),
                        format!("should not specify rate limit {what} when unlimited"),
                    );
                }
            }
            Limit::Unlimited
        } else {
            Limit::Limited(self.rate(r)?)
        };
        if self.problems.len() > before {
            return None;
        }
        let (mut id, levels) = identity(domain, steps);
        if let Some(entry) = entry {
            id.part(b"rate_limits").part(entry.as_bytes());
        }
        let stats_key = format!("{domain}.{}", levels.join("."));
        Some(Rule {
            id: id.finish(),
            path: if entry.is_some() {
                r.path.clone()
            } else {
                raw.path.clone()
            },
            stats_key,
            levels,
            limit,
            name,
            replaces,
            shadow_mode: raw.shadow_mode,
            quota_mode: raw.quota_mode,
            detailed_metric: raw.detailed_metric,
            value_to_metric: raw.value_to_metric,
            entry: None,
        })
    }

    /// Validates a limited `rate_limit` block into a [`Rate`].
    fn rate(&mut self, r: &RawRateLimit) -> Option<Rate> {
        let field = |name: &str| format!("{}.{name}", r.path);
        let unit = match &r.unit {
            None => {
                self.problem(
                    Some(r.pos),
                    &field("unit"),
                    "missing unit (or `unlimited: true`)".into(),
                );
                None
            }
            Some(u) => {
                let unit = Unit::parse(&u.value);
                if unit.is_none() {
                    self.problem(
                        Some(u.pos),
                        &field("unit"),
                        format!(
                            "invalid rate limit unit {:?} (expected second, minute, hour, day, \
                             week, month or year)",
                            u.value
                        ),
                    );
                }
                unit
            }
        };
        let requests = self.bounded(
            r.requests_per_unit.as_ref(),
            &field("requests_per_unit"),
            0,
            0,
        );
        let multiplier = self.bounded(
            r.unit_multiplier.as_ref(),
            &field("unit_multiplier"),
            1,
            MAX_UNIT_MULTIPLIER,
        );
        let burst = self.bounded(r.burst.as_ref(), &field("burst"), 1, 0);
        let (unit, requests, multiplier, burst) = (unit?, requests?, multiplier?, burst?);
        let burst = if r.burst.is_some() { burst } else { requests };
        let max_delay_nanos = match &r.delay {
            None => 0,
            Some(d) => match parse_delay(&d.value) {
                Ok(_) if requests == 0 => {
                    self.problem(
                        Some(d.pos),
                        &field("delay"),
                        "a rule of 0 requests admits nothing, so it has no slot to wait for".into(),
                    );
                    return None;
                }
                Ok(nanos) => nanos,
                Err(message) => {
                    self.problem(Some(d.pos), &field("delay"), message);
                    return None;
                }
            },
        };
        let Some(period) = period_nanos(unit, multiplier) else {
            let pos = r.unit_multiplier.as_ref().map_or(r.pos, |m| m.pos);
            self.problem(
                Some(pos),
                &field("unit_multiplier"),
                format!(
                    "{multiplier} × {} is {} seconds, longer than the longest period sluice \
                     can count (2^64 nanoseconds, about 584 years)",
                    unit.name().to_ascii_lowercase(),
                    u128::from(unit.seconds()) * u128::from(multiplier),
                ),
            );
            return None;
        };
        let quota = match Quota::new(period, requests, burst) {
            Ok(q) => q,
            Err(QuotaError::TooLong) => {
                self.problem(
                    Some(r.pos),
                    &r.path,
                    "burst × period / requests_per_unit is longer than 146 years".into(),
                );
                return None;
            }
            Err(e) => {
                self.problem(Some(r.pos), &r.path, e.to_string());
                return None;
            }
        };
        Some(Rate {
            requests_per_unit: u32::try_from(requests).ok()?,
            unit,
            unit_multiplier: u32::try_from(multiplier).ok()?,
            burst: u32::try_from(burst).ok()?,
            burst_set: r.burst.is_some(),
            max_delay_nanos,
            quota,
        })
    }

    /// A `metadata` value as JSON, typed as the reference's YAML reading types it: plain
    /// `true`/`false` are booleans, plain `null`/`~`/empty are null, plain decimal numbers are
    /// numbers, everything else (quoted or block scalars included) is text; map keys are their
    /// text. A key that is not a scalar, a key given twice, and a number that is not finite are
    /// problems. The model has already checked that the top is a map.
    fn metadata_value(&mut self, node: &Node, path: &str) -> Option<serde_json::Value> {
        use serde_json::Value as Json;
        match &node.value {
            _ if node.is_null() => Some(Json::Null),
            Value::Scalar { text, plain: false } => Some(Json::String(text.clone())),
            Value::Scalar { text, plain: true } => match text.as_str() {
                "true" | "True" | "TRUE" => Some(Json::Bool(true)),
                "false" | "False" | "FALSE" => Some(Json::Bool(false)),
                t => match plain_number(t) {
                    PlainNumber::Not => Some(Json::String(t.to_string())),
                    PlainNumber::Number(n) => Some(Json::Number(n)),
                    PlainNumber::Infinite => {
                        self.problem(
                            Some(node.pos),
                            path,
                            format!("metadata number {t} is not finite"),
                        );
                        None
                    }
                },
            },
            Value::Seq(items) => {
                let mut list = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    list.push(self.metadata_value(item, &format!("{path}[{i}]"))?);
                }
                Some(Json::Array(list))
            }
            Value::Map(entries) => {
                let mut map = Metadata::new();
                let mut ok = true;
                for (k, v) in entries {
                    let Value::Scalar { text, .. } = &k.value else {
                        self.problem(
                            Some(k.pos),
                            path,
                            format!("metadata keys must be text, found {}", k.kind()),
                        );
                        ok = false;
                        continue;
                    };
                    let at = format!("{path}.{text}");
                    if map.contains_key(text) {
                        self.problem(
                            Some(k.pos),
                            &at,
                            format!("metadata key `{text}` is given twice"),
                        );
                        ok = false;
                        continue;
                    }
                    match self.metadata_value(v, &at) {
                        Some(value) => {
                            map.insert(text.clone(), value);
                        }
                        None => ok = false,
                    }
                }
                ok.then_some(Json::Object(map))
            }
        }
    }

    /// A number in `min..=max` (`max` 0 = `u32::MAX`), or the default `min` when absent.
    fn bounded(&mut self, n: Option<&Spanned<u64>>, path: &str, min: u64, max: u64) -> Option<u64> {
        let max = if max == 0 { u64::from(u32::MAX) } else { max };
        let Some(n) = n else {
            return Some(min);
        };
        if n.value < min || n.value > max {
            self.problem(
                Some(n.pos),
                path,
                format!("must be between {min} and {max}, found {}", n.value),
            );
            return None;
        }
        Some(n.value)
    }
}

/// A `delay` as written: a whole number of milliseconds (`250ms`) or seconds (`1s`), more than
/// 0 and at most [`MAX_DELAY_NANOS`]; in nanoseconds.
fn parse_delay(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (digits, scale) = if let Some(ms) = t.strip_suffix("ms") {
        (ms, 1_000_000)
    } else if let Some(s) = t.strip_suffix('s') {
        (s, NANOS_PER_SEC)
    } else {
        return Err(format!(
            "expected a duration such as 250ms or 1s, found {text:?}"
        ));
    };
    let n: u64 = if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        digits
            .parse()
            .map_err(|_| format!("{text:?} is too long a delay"))?
    } else {
        return Err(format!(
            "expected a duration such as 250ms or 1s, found {text:?}"
        ));
    };
    match n.checked_mul(scale) {
        Some(nanos) if nanos > 0 && nanos <= MAX_DELAY_NANOS => Ok(nanos),
        Some(0) => Err("must be more than 0 (leave it out to refuse at once)".into()),
        _ => Err(format!(
            "must be at most {}s, found {text:?}: a caller held that long is better refused with its wait",
            MAX_DELAY_NANOS / NANOS_PER_SEC
        )),
    }
}

/// `multiplier` units in nanoseconds; `None` past `u64::MAX` (about 584 years), which must be
/// refused rather than wrapped into a shorter period.
fn period_nanos(unit: Unit, multiplier: u64) -> Option<u64> {
    unit.seconds()
        .checked_mul(multiplier)?
        .checked_mul(NANOS_PER_SEC)
}

/// A descriptor path's identity (a hash of the domain and each level's key and configured
/// value, unfinished so an entry of `rate_limits` can add its own) and its stats-key levels.
fn identity(domain: &str, steps: &[Step]) -> (KeyBuilder, Vec<String>) {
    let mut id = KeyBuilder::new(0);
    id.part(domain.as_bytes());
    let mut levels = Vec::with_capacity(steps.len());
    for s in steps {
        id.part(s.key.as_bytes());
        match &s.value {
            Some(v) => {
                id.part(&[1]).part(v.as_bytes());
                levels.push(format!("{}_{}", s.key, v));
            }
            None => {
                id.part(&[0]);
                levels.push(s.key.clone());
            }
        }
    }
    (id, levels)
}

/// How a plain scalar of `metadata` reads as a number.
enum PlainNumber {
    /// Not a number: it stays text.
    Not,
    /// A finite number.
    Number(serde_json::Number),
    /// Written as a number but too large for a double.
    Infinite,
}

/// A plain scalar as a YAML decimal number: an integer (kept exact when it fits 64 bits) or a
/// float (`1.5`, `-2e3`, `.5`). `.inf`, `.nan`, hex and octal stay text.
fn plain_number(text: &str) -> PlainNumber {
    let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
    if digits.is_empty()
        || !digits
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_digit() || b == b'.')
    {
        return PlainNumber::Not;
    }
    if digits.bytes().all(|b| b.is_ascii_digit()) {
        let unsigned = text.strip_prefix('+').unwrap_or(text);
        if let Ok(n) = unsigned.parse::<i64>() {
            return PlainNumber::Number(n.into());
        }
        if let Ok(n) = unsigned.parse::<u64>() {
            return PlainNumber::Number(n.into());
        }
    }
    let (mantissa, exponent) = match digits.find(['e', 'E']) {
        Some(i) => (&digits[..i], Some(&digits[i + 1..])),
        None => (digits, None),
    };
    let mantissa_ok = mantissa.bytes().any(|b| b.is_ascii_digit())
        && mantissa.bytes().filter(|b| *b == b'.').count() <= 1
        && mantissa.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    let exponent_ok = exponent.is_none_or(|e| {
        let e = e.strip_prefix(['-', '+']).unwrap_or(e);
        !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit())
    });
    if !mantissa_ok || !exponent_ok {
        return PlainNumber::Not;
    }
    match text.parse::<f64>().ok().map(serde_json::Number::from_f64) {
        Some(Some(n)) => PlainNumber::Number(n),
        Some(None) => PlainNumber::Infinite,
        None => PlainNumber::Not,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{problems, set};
    use crate::policy::{Limit, Unit};

    /// `found` holds exactly one problem per entry of `expect`, each containing its entry.
    fn exactly_these(found: &[Problem], expect: &[&str]) {
        let shown: Vec<String> = found.iter().map(ToString::to_string).collect();
        for e in expect {
            assert!(
                shown.iter().any(|s| s.contains(e)),
                "missing {e:?} in:\n{}",
                shown.join("\n")
            );
        }
        assert_eq!(shown.len(), expect.len(), "{}", shown.join("\n"));
    }

    #[test]
    fn rule_identity_survives_a_reload_and_ignores_the_rate() {
        let a = set(
            "domain: test-domain\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1}}]",
        );
        let b = set(
            "domain: test-domain\ndescriptors:\n  - key: x\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 9, burst: 3}\n",
        );
        let ka = a
            .domain("test-domain")
            .unwrap()
            .resolve([("k", "v")])
            .unwrap();
        let kb = b
            .domain("test-domain")
            .unwrap()
            .resolve([("k", "v")])
            .unwrap();
        assert_eq!(ka.key(&ka.rules[0]), kb.key(&kb.rules[0]));
        assert_ne!(ka.rules[0].limit, kb.rules[0].limit);
    }

    #[test]
    fn extensions_and_units() {
        let s = set(r"
domain: test-domain
descriptors:
  - key: a
    rate_limit: {unit: MINUTE, requests_per_unit: 100, unit_multiplier: 5, burst: 10}
  - key: b
    rate_limit: {unit: Week, requests_per_unit: 7}
  - key: c
    rate_limit: {unit: second, requests_per_unit: 0}
");
        let d = s.domain("test-domain").unwrap();
        let Limit::Limited(a) = d.resolve([("a", "x")]).unwrap().rules[0].limit else {
            panic!("limited")
        };
        assert_eq!((a.burst, a.unit_multiplier, a.unit), (10, 5, Unit::Minute));
        assert!(a.burst_set);
        assert_eq!(a.quota.interval(), 3 * NANOS_PER_SEC);
        assert_eq!(a.quota.burst(), 10);
        let Limit::Limited(b) = d.resolve([("b", "x")]).unwrap().rules[0].limit else {
            panic!("limited")
        };
        assert_eq!((b.unit, b.burst), (Unit::Week, 7));
        assert!(
            !b.burst_set,
            "no burst written: inherited from requests_per_unit"
        );
        let Limit::Limited(c) = d.resolve([("c", "x")]).unwrap().rules[0].limit else {
            panic!("limited")
        };
        assert!(c.quota.is_ban());
    }

    /// `delay` is read as milliseconds or seconds, bounded, and refused where it means nothing.
    #[test]
    fn a_delay_is_a_bounded_duration_on_a_limit_that_admits() {
        let s = set(r"
domain: test-domain
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 10, burst: 5, delay: 250ms}
  - key: b
    rate_limit: {unit: second, requests_per_unit: 10, delay: 1s}
  - key: c
    rate_limit: {unit: second, requests_per_unit: 10}
");
        let d = s.domain("test-domain").unwrap();
        let delay = |k: &str| match d.resolve([(k, "x")]).unwrap().rules[0].limit {
            Limit::Limited(r) => r.max_delay_nanos,
            Limit::Unlimited => panic!("limited"),
        };
        assert_eq!(delay("a"), 250_000_000);
        assert_eq!(delay("b"), NANOS_PER_SEC);
        assert_eq!(delay("c"), 0, "no delay written: refused at once");
        let p = problems(
            r"
domain: test-domain
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 1, delay: 250}
  - key: b
    rate_limit: {unit: second, requests_per_unit: 1, delay: 0ms}
  - key: c
    rate_limit: {unit: second, requests_per_unit: 1, delay: 61s}
  - key: d
    rate_limit: {unit: second, requests_per_unit: 0, delay: 1s}
  - key: e
    rate_limit: {unlimited: true, delay: 1s}
  - key: f
    rate_limit: {unit: second, requests_per_unit: 1, delay: 99999999999999999999ms}
  - key: g
    rate_limit: {unit: second, requests_per_unit: 1, delay: -5ms}
",
        );
        exactly_these(
            &p,
            &[
                r#"descriptors[0].rate_limit.delay: expected a duration such as 250ms or 1s, found "250""#,
                "descriptors[1].rate_limit.delay: must be more than 0",
                "descriptors[2].rate_limit.delay: must be at most 60s",
                "descriptors[3].rate_limit.delay: a rule of 0 requests admits nothing",
                "descriptors[4].rate_limit.delay: should not specify rate limit delay when unlimited",
                "descriptors[5].rate_limit.delay: \"99999999999999999999ms\" is too long a delay",
                r#"descriptors[6].rate_limit.delay: expected a duration such as 250ms or 1s, found "-5ms""#,
            ],
        );
    }

    /// The reference's schema with our additions (the fixture the fuzz targets decide against)
    /// compiles to what each field means.
    #[test]
    fn accepts_the_whole_reference_schema() {
        let s = set(include_str!("../../tests/fixtures/reference-schema.yaml"));
        let d = s.domain("test-domain").unwrap();
        let one = |entries: &[(&str, &str)]| {
            let r = d
                .resolve(entries.iter().copied())
                .unwrap_or_else(|| panic!("{entries:?} matches no rule"));
            assert_eq!(r.rules.len(), 1, "{entries:?}");
            (Rule::clone(&r.rules[0]), r.cost, r.metadata.cloned())
        };
        let rate = |rule: &Rule| match rule.limit {
            Limit::Limited(rate) => rate,
            Limit::Unlimited => panic!("{} is unlimited", rule.stats_key),
        };
        let per = |rule: &Rule| {
            let r = rate(rule);
            (r.requests_per_unit, r.unit, r.unit_multiplier, r.burst)
        };
        // Every flag off unless written.
        let flags = |rule: &Rule| {
            (
                rule.shadow_mode,
                rule.quota_mode,
                rule.detailed_metric,
                rule.value_to_metric,
            )
        };

        let (category, _, _) = one(&[("category", "account")]);
        assert_eq!(per(&category), (4, Unit::Minute, 1, 4));
        assert_eq!(category.replaces, ["bkthomps", "fake_name"]);
        assert_eq!(category.name, None);
        assert_eq!(category.stats_key, "test-domain.category_account");
        assert_eq!(category.path, "descriptors[0]");
        assert!(d.resolve([("category", "other")]).is_none());
        assert_eq!(flags(&category), (false, false, false, false));

        // A nested descriptor: its own limit and name, its parent's limit one level up.
        let (foo, _, _) = one(&[("foo", "x")]);
        assert_eq!(per(&foo), (2, Unit::Minute, 1, 2));
        let (bar, _, _) = one(&[("foo", "x"), ("bar", "bkthomps")]);
        assert_eq!(per(&bar), (1, Unit::Minute, 1, 1));
        assert_eq!(bar.name.as_deref(), Some("bkthomps"));
        assert_eq!(bar.stats_key, "test-domain.foo.bar_bkthomps");
        assert_eq!(bar.levels, ["foo", "bar_bkthomps"]);
        assert_eq!(bar.path, "descriptors[1].descriptors[0]");
        assert!(d.resolve([("foo", "x"), ("bar", "other")]).is_none());
        let (baz, _, _) = one(&[("foo", "x"), ("baz", "shady")]);
        assert_eq!(per(&baz), (3, Unit::Minute, 1, 3));
        assert_eq!(flags(&baz), (true, false, false, true));

        let (unspec, _, _) = one(&[("unspec", "x")]);
        assert_eq!(per(&unspec), (2, Unit::Minute, 1, 2));
        assert_eq!(flags(&unspec), (false, false, true, false));

        let (service, _, metadata) = one(&[("service", "service_1")]);
        assert_eq!(per(&service), (1, Unit::Minute, 1, 1));
        assert_eq!(flags(&service), (false, true, false, false));
        assert_eq!(
            metadata.map(serde_json::Value::Object),
            Some(serde_json::json!({
                "service_with_quota": {"name": "service_1"},
                "n": 3,
                "flags": [true, null, "7"],
            }))
        );

        // `burst` below the rate; a cost node under a key-only node draws from it.
        let (acct, cost, metadata) = one(&[("acct", "a")]);
        let acct_rate = rate(&acct);
        assert_eq!(per(&acct), (10, Unit::Minute, 1, 4));
        assert!(acct_rate.burst_set);
        assert_eq!(
            (acct_rate.quota.interval(), acct_rate.quota.burst()),
            (6 * NANOS_PER_SEC, 4)
        );
        assert_eq!(cost, 1);
        assert_eq!(metadata.unwrap()["level"], "acct");
        let (route, cost, metadata) = one(&[("acct", "a"), ("route", "r")]);
        assert_eq!((route.id, cost), (acct.id, 2));
        assert_eq!(metadata.unwrap()["level"], "route");
        let costs: Vec<_> = d
            .costs()
            .map(|c| (c.stats_key.as_str(), c.cost, c.of.as_str()))
            .collect();
        assert_eq!(costs, [("test-domain.acct.route", 2, "test-domain.acct")]);

        // The extremes of a rate: 4e9 a second is one every nanosecond (rounded up); one per
        // 100 years is a period past a double's exact integers.
        let (fast, _, _) = one(&[("fast", "x")]);
        let q = rate(&fast).quota;
        assert_eq!(
            (q.period(), q.interval(), q.burst()),
            (NANOS_PER_SEC, 1, 4_000_000_000)
        );
        let (slow, _, _) = one(&[("slow", "abc")]);
        assert_eq!(per(&slow), (1, Unit::Year, 100, 1));
        let century = 100 * 365 * 86_400 * NANOS_PER_SEC;
        assert_eq!(
            (rate(&slow).quota.period(), rate(&slow).quota.interval()),
            (century, century)
        );
        // `share_threshold`: every value the wildcard matches shares one counter.
        let key = |v: &str| {
            let r = d.resolve([("slow", v)]).unwrap();
            r.key(&r.rules[0])
        };
        assert_eq!(key("abc"), key("axyz"));
        assert!(d.resolve([("slow", "bcd")]).is_none());

        let (banned, _, _) = one(&[("banned", "x")]);
        assert_eq!(per(&banned), (0, Unit::Day, 1, 0));
        assert!(rate(&banned).quota.is_ban());
        let (unlimited, _, _) = one(&[("unlimited", "x")]);
        assert_eq!(unlimited.limit, Limit::Unlimited);
        // A descriptor without a limit whitelists: no rule applies.
        assert!(d.resolve([("whitelisted", "x")]).is_none());

        assert_eq!(
            s.summary().to_string(),
            "1 files, 1 domains, 11 rules (9 limited, 1 bans, 1 unlimited), 1 cost node"
        );
    }

    #[test]
    fn every_problem_is_reported_with_position_and_path() {
        let p = problems(
            r#"domain: test-domain
descriptors:
  - key: a
    rate_limit: {unit: minutes, requests_per_unit: 5}
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 5}
  - value: v
  - key: b
    ratelimit: {}
  - key: c
    rate_limit: {unlimited: true, unit: second}
  - key: d
    rate_limit: {name: me, unit: second, requests_per_unit: 1, replaces: [{name: me}, {name: ""}]}
  - key: e
    rate_limit: {unit: second, requests_per_unit: -1, burst: 0}
  - key: f
    value: plain
    share_threshold: true
  - key: g
    rate_limit: {name: "a\"b", unit: second, requests_per_unit: 1}
"#,
        );
        let expect = [
            r#"bad.yaml:4:24: descriptors[0].rate_limit.unit: invalid rate limit unit "minutes""#,
            "bad.yaml:5:5: descriptors[1]: duplicate descriptor `a` (already at descriptors[0])",
            "bad.yaml:7:5: descriptors[2]: descriptor has empty key",
            "bad.yaml:9:5: descriptors[3].ratelimit: unknown field `ratelimit`",
            "bad.yaml:11:41: descriptors[4].rate_limit.unit: should not specify rate limit unit when unlimited",
            "descriptors[5].rate_limit.replaces[0].name: replaces should not contain name of same descriptor",
            "descriptors[5].rate_limit.replaces[1].name: should not have an empty replaces entry",
            "descriptors[6].rate_limit.requests_per_unit: expected a whole number",
            "descriptors[6].rate_limit.burst: must be between 1 and",
            "descriptors[7].share_threshold: share_threshold needs a value with a `*` wildcard",
            "descriptors[8].rate_limit.name: name must not contain '\"'",
        ];
        exactly_these(&p, &expect);
    }

    #[test]
    fn rate_limits_ids_are_stable_and_tied_to_the_entry_name() {
        let id = |text: &str| {
            let s = set(text);
            let d = s.domain("test-domain").unwrap();
            let r = d.resolve([("k", "v")]).unwrap();
            r.rules.iter().map(|r| r.id).collect::<Vec<_>>()
        };
        let a = id(
            "domain: test-domain\ndescriptors:\n  - key: k\n    rate_limits:\n      - {name: a, unit: second, requests_per_unit: 1}\n      - {name: b, unit: day, requests_per_unit: 9}\n",
        );
        // Reordered and re-rated: each name keeps its identity (its counter survives a reload).
        let b = id(
            "domain: test-domain\ndescriptors:\n  - key: k\n    rate_limits:\n      - {name: b, unit: day, requests_per_unit: 5}\n      - {name: a, unit: second, requests_per_unit: 2}\n",
        );
        assert_eq!((a[0], a[1]), (b[1], b[0]));
        // A lone `rate_limit` has an identity distinct from any entry's, even one of its name.
        let single = id(
            "domain: test-domain\ndescriptors:\n  - key: k\n    rate_limit: {name: a, unit: second, requests_per_unit: 1}\n",
        );
        assert!(!a.contains(&single[0]));
    }

    #[test]
    fn rate_limits_and_cost_problems_are_positioned() {
        let p = problems(
            r"domain: test-domain
descriptors:
  - key: both
    rate_limit: {unit: second, requests_per_unit: 1}
    rate_limits: [{unit: second, requests_per_unit: 1}]
  - key: empty
    rate_limits: []
  - key: unnamed
    rate_limits:
      - {name: a, unit: second, requests_per_unit: 1}
      - {unit: day, requests_per_unit: 1}
  - key: twice
    rate_limits:
      - {name: a, unit: second, requests_per_unit: 1}
      - {name: a, unit: day, requests_per_unit: 1}
  - key: user
    rate_limits:
      - {name: s, unit: second, requests_per_unit: 10, burst: 20}
      - {name: d, unit: day, requests_per_unit: 100, burst: 15}
    descriptors:
      - key: zero
        cost: 0
      - key: big
        cost: 16
      - key: own
        cost: 2
        rate_limit: {unit: second, requests_per_unit: 1}
  - key: orphan
    cost: 3
  - key: bad
    rate_limits: {unit: second}
",
        );
        let expect = [
            "bad.yaml:5:18: descriptors[0].rate_limits: rate_limit and rate_limits cannot both be given",
            "bad.yaml:7:18: descriptors[1].rate_limits: rate_limits must not be empty",
            "bad.yaml:11:9: descriptors[2].rate_limits[1]: each of several rate_limits needs a name",
            "bad.yaml:15:16: descriptors[3].rate_limits[1].name: duplicate rate_limits name \"a\" (already at descriptors[3].rate_limits[0])",
            "bad.yaml:22:15: descriptors[4].descriptors[0].cost: must be between 1 and",
            "bad.yaml:24:15: descriptors[4].descriptors[1].cost: cost 16 is above the burst 15 of test-domain.user, so such a request could never pass",
            "bad.yaml:26:15: descriptors[4].descriptors[2].cost: cost is for a node without a limit of its own",
            "bad.yaml:29:11: descriptors[5].cost: cost needs an ancestor descriptor with a rate_limit",
            "bad.yaml:31:18: descriptors[6].rate_limits: expected a list, found a map",
        ];
        exactly_these(&p, &expect);
    }

    #[test]
    fn bad_metadata_is_a_positioned_problem() {
        let p = problems(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    metadata: {x: .inf, y: 1e999, z: {w: 1, w: 2}, [1]: v}\n",
        );
        let text: Vec<String> = p.iter().map(ToString::to_string).collect();
        assert!(
            text.iter()
                .any(|t| t
                    .contains("descriptors[0].metadata.y: metadata number 1e999 is not finite")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.contains("descriptors[0].metadata.z.w: metadata key `w` is given twice")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.contains("metadata keys must be text, found a list")),
            "{text:?}"
        );
        // `.inf` is not a decimal number: it stays text.
        assert_eq!(p.len(), 3, "{text:?}");
        let p = problems("domain: d\ndescriptors:\n  - key: a\n    metadata: [1]\n");
        assert!(p[0].message.contains("expected a map"), "{p:?}");
    }
}
