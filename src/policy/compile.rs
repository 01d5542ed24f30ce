//! Validation and compilation: raw model → [`Domain`] with the lookup tables matching needs.
//!
//! Every semantic check of a policy file (README, "Policies") lives here and every problem is collected, so an
//! operator fixes a file in one pass. The output is immutable; matching never parses, allocates
//! or compiles anything.

use std::collections::HashMap;
use std::sync::Arc;

use super::matcher::{Group, Level, Pattern, TreeNode};
use super::model::{RawDescriptor, RawPolicy, RawRateLimit, Spanned};
use super::yaml::Pos;
use super::{Domain, Limit, Problem, Rate, Rule, Unit};
use crate::limiter::gcra::NANOS_PER_SEC;
use crate::limiter::{KeyBuilder, Quota, QuotaError};

/// The largest `unit_multiplier` accepted (a multiple of a unit beyond this is better written
/// in a larger unit).
const MAX_UNIT_MULTIPLIER: u64 = 1_000_000;

/// Compiles one file's raw policy, appending problems. Returns `None` when the file has errors.
pub(super) fn compile(file: &str, raw: RawPolicy, problems: &mut Vec<Problem>) -> Option<Domain> {
    let before = problems.len();
    let mut c = Compiler {
        file,
        problems,
        nodes: Vec::new(),
    };
    let name = match raw.domain {
        Some(d) if !d.value.is_empty() => d.value,
        Some(d) => {
            c.problem(
                Some(d.pos),
                "domain",
                "config file cannot have empty domain".into(),
            );
            String::new()
        }
        None => {
            // Unless the model already reported a `domain` that is not text.
            if !c
                .problems
                .iter()
                .any(|p| p.file == file && p.path == "domain")
            {
                c.problem(
                    Some(Pos { line: 1, col: 1 }),
                    "domain",
                    "missing domain".into(),
                );
            }
            String::new()
        }
    };
    let root = c.level(&name, &raw.descriptors, &[]);
    let nodes = c.nodes;
    (problems.len() == before).then(|| Domain {
        name,
        file: file.to_string(),
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
    fn problem(&mut self, pos: Option<Pos>, path: &str, message: String) {
        self.problems.push(Problem {
            file: self.file.to_string(),
            pos,
            path: path.to_string(),
            message,
        });
    }

    /// Compiles sibling descriptors into one level of the tree.
    fn level(&mut self, domain: &str, raws: &[RawDescriptor], parents: &[Step]) -> Level {
        let mut level = Level::default();
        let mut seen: HashMap<(String, Option<String>), String> = HashMap::new();
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
            if let Some(first) = seen.get(&(key.clone(), value.clone())) {
                let shown = match &value {
                    Some(v) => format!("{key}: {v}"),
                    None => key.clone(),
                };
                self.problem(
                    Some(raw.pos),
                    &raw.path,
                    format!("duplicate descriptor `{shown}` (already at {first})"),
                );
                continue;
            }
            seen.insert((key.clone(), value.clone()), raw.path.clone());
            let mut steps = parents.to_vec();
            steps.push(Step {
                key: key.clone(),
                value: value.clone(),
            });
            let id = self.node(domain, raw, &steps);
            let group = level
                .groups
                .entry(key.into())
                .or_insert_with(Group::default);
            match value {
                Some(v) if v.contains('*') => group.wildcards.push((Pattern::new(&v), id)),
                Some(v) => {
                    group.exact.insert(v.into(), id);
                }
                None => group.any = Some(id),
            }
        }
        level
    }

    /// Compiles one descriptor and its children; returns its node index.
    fn node(&mut self, domain: &str, raw: &RawDescriptor, steps: &[Step]) -> usize {
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
        let rule = raw
            .rate_limit
            .as_ref()
            .and_then(|r| self.rule(domain, raw, r, steps));
        let index = self.nodes.len();
        self.nodes.push(TreeNode {
            children: Level::default(),
            rule: rule.map(Arc::new),
            share_threshold,
        });
        let children = self.level(domain, &raw.descriptors, steps);
        self.nodes[index].children = children;
        index
    }

    fn rule(
        &mut self,
        domain: &str,
        raw: &RawDescriptor,
        r: &RawRateLimit,
        steps: &[Step],
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
        let stats_key = format!("{domain}.{}", levels.join("."));
        Some(Rule {
            id: id.finish(),
            path: raw.path.clone(),
            stats_key,
            levels,
            limit,
            name,
            replaces,
            shadow_mode: raw.shadow_mode,
            quota_mode: raw.quota_mode,
            detailed_metric: raw.detailed_metric,
            value_to_metric: raw.value_to_metric,
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
        let period = unit.seconds() * multiplier * NANOS_PER_SEC;
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
