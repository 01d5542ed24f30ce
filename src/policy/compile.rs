//! Validation and compilation: raw model → [`Domain`] with the lookup tables matching needs.
//!
//! Every semantic check of a policy file (README, "Policies") lives here and every problem is
//! collected, so an operator fixes a file in one pass. The output is immutable; matching never
//! parses, allocates or compiles anything.

use std::collections::HashMap;
use std::sync::Arc;

use super::Problem;
use super::matcher::{Level, Pattern, TreeNode};
use super::model::{RawDescriptor, RawPolicy, RawRateLimit, Spanned};
use super::rule::{Cost, Limit, Metadata, Rate, Rule, Unit};
use super::set::Domain;
use super::yaml::{Node, Pos, Value};
use crate::limiter::gcra::NANOS_PER_SEC;
use crate::limiter::{KeyBuilder, Quota, QuotaError};

/// The largest `unit_multiplier` accepted (a multiple of a unit beyond this is better written
/// in a larger unit).
const MAX_UNIT_MULTIPLIER: u64 = 1_000_000;

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
