//! The raw policy model: the YAML tree read into plain structs, field by field, with every
//! unknown field, duplicate field and wrongly typed value reported (and reading carried on, so
//! one load reports all of a file's problems). No semantics live here; `compile` does those.
//!
//! The schema is envoyproxy/ratelimit's, unchanged, plus `burst` and `unit_multiplier` inside
//! `rate_limit`, and on a descriptor `rate_limits` (a list of `rate_limit` blocks) and `cost`.

use super::Problem;
use super::yaml::{Node, Pos, Value};

/// A value with the position it was read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spanned<T> {
    /// The value.
    pub value: T,
    /// Where it was written.
    pub pos: Pos,
}

/// One policy file: a domain and its descriptor tree.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RawPolicy {
    /// `domain`.
    pub domain: Option<Spanned<String>>,
    /// `descriptors`.
    pub descriptors: Vec<RawDescriptor>,
}

/// One descriptor node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RawDescriptor {
    /// Where in the file it sits, e.g. `descriptors[2].descriptors[0]`.
    pub path: String,
    /// Where it starts.
    pub pos: Pos,
    /// `key`.
    pub key: Option<Spanned<String>>,
    /// `value`: exact, or a pattern with `*`; absent or empty means any value.
    pub value: Option<Spanned<String>>,
    /// `rate_limit`.
    pub rate_limit: Option<RawRateLimit>,
    /// `rate_limits` (ours): several limits on one node, each with its own counter; the
    /// position is the list's.
    pub rate_limits: Option<Spanned<Vec<RawRateLimit>>>,
    /// `cost` (ours): tokens drawn per hit from the nearest limited ancestor's bucket.
    pub cost: Option<Spanned<u64>>,
    /// `descriptors`: the next entry of the request.
    pub descriptors: Vec<RawDescriptor>,
    /// `shadow_mode`.
    pub shadow_mode: bool,
    /// `detailed_metric`.
    pub detailed_metric: bool,
    /// `value_to_metric`.
    pub value_to_metric: bool,
    /// `share_threshold`.
    pub share_threshold: Option<Spanned<bool>>,
    /// `quota_mode`.
    pub quota_mode: bool,
    /// `metadata`: any map, kept as written.
    pub metadata: Option<Node>,
}

/// A `rate_limit` block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawRateLimit {
    /// Path of the block, e.g. `descriptors[0].rate_limit`.
    pub path: String,
    /// Where it starts.
    pub pos: Pos,
    /// `unit`.
    pub unit: Option<Spanned<String>>,
    /// `requests_per_unit`.
    pub requests_per_unit: Option<Spanned<u64>>,
    /// `unlimited`.
    pub unlimited: bool,
    /// `name`.
    pub name: Option<Spanned<String>>,
    /// `replaces[].name`.
    pub replaces: Vec<Spanned<String>>,
    /// `burst` (ours).
    pub burst: Option<Spanned<u64>>,
    /// `unit_multiplier` (ours).
    pub unit_multiplier: Option<Spanned<u64>>,
    /// `delay` (ours): the longest a request may be held for its slot, e.g. `250ms`.
    pub delay: Option<Spanned<String>>,
}

/// Reads nodes into the raw model, collecting problems.
pub(super) struct Reader<'a> {
    /// The file name used in problems.
    pub file: &'a str,
    /// Problems found so far.
    pub problems: &'a mut Vec<Problem>,
}

impl Reader<'_> {
    fn problem(&mut self, pos: Pos, path: &str, message: String) {
        self.problems.push(Problem {
            file: self.file.to_string(),
            pos: Some(pos),
            path: path.to_string(),
            message,
        });
    }

    /// Reads a whole file's document.
    pub fn policy(&mut self, doc: &Node) -> RawPolicy {
        let mut policy = RawPolicy::default();
        let Some(fields) = self.map(doc, "") else {
            return policy;
        };
        for (name, value, path) in self.fields(fields, "", &["domain", "descriptors"]) {
            match name {
                "domain" => policy.domain = self.string(value, &path),
                _ => policy.descriptors = self.descriptors(value, ""),
            }
        }
        policy
    }

    fn descriptors(&mut self, node: &Node, parent: &str) -> Vec<RawDescriptor> {
        let path = join(parent, "descriptors");
        if node.is_null() {
            return Vec::new();
        }
        let Value::Seq(items) = &node.value else {
            self.problem(
                node.pos,
                &path,
                format!("expected a list, found {}", node.kind()),
            );
            return Vec::new();
        };
        items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| self.descriptor(item, format!("{path}[{i}]")))
            .collect()
    }

    fn descriptor(&mut self, node: &Node, path: String) -> Option<RawDescriptor> {
        const FIELDS: &[&str] = &[
            "key",
            "value",
            "rate_limit",
            "rate_limits",
            "cost",
            "descriptors",
            "shadow_mode",
            "detailed_metric",
            "value_to_metric",
            "share_threshold",
            "quota_mode",
            "metadata",
        ];
        let fields = self.map(node, &path)?;
        let mut d = RawDescriptor {
            pos: node.pos,
            ..RawDescriptor::default()
        };
        for (name, value, field_path) in self.fields(fields, &path, FIELDS) {
            match name {
                "key" => d.key = self.string(value, &field_path),
                "value" => d.value = self.string(value, &field_path),
                "rate_limit" => d.rate_limit = self.rate_limit(value, field_path),
                "rate_limits" => d.rate_limits = self.rate_limits(value, &field_path),
                "cost" => d.cost = self.uint(value, &field_path),
                "descriptors" => d.descriptors = self.descriptors(value, &path),
                "shadow_mode" => d.shadow_mode = self.flag(value, &field_path),
                "detailed_metric" => d.detailed_metric = self.flag(value, &field_path),
                "value_to_metric" => d.value_to_metric = self.flag(value, &field_path),
                "share_threshold" => {
                    d.share_threshold = self.bool(value, &field_path).map(|b| Spanned {
                        value: b,
                        pos: value.pos,
                    });
                }
                "quota_mode" => d.quota_mode = self.flag(value, &field_path),
                _ => {
                    if !value.is_null() && self.map(value, &field_path).is_some() {
                        d.metadata = Some(value.clone());
                    }
                }
            }
        }
        d.path = path;
        Some(d)
    }

    fn rate_limit(&mut self, node: &Node, path: String) -> Option<RawRateLimit> {
        const FIELDS: &[&str] = &[
            "unit",
            "requests_per_unit",
            "unlimited",
            "name",
            "replaces",
            "burst",
            "unit_multiplier",
            "delay",
        ];
        let fields = self.map(node, &path)?;
        let mut r = RawRateLimit {
            pos: node.pos,
            ..RawRateLimit::default()
        };
        for (name, value, field_path) in self.fields(fields, &path, FIELDS) {
            match name {
                "unit" => r.unit = self.string(value, &field_path),
                "requests_per_unit" => r.requests_per_unit = self.uint(value, &field_path),
                "unlimited" => r.unlimited = self.flag(value, &field_path),
                "name" => r.name = self.string(value, &field_path),
                "replaces" => r.replaces = self.replaces(value, &field_path),
                "burst" => r.burst = self.uint(value, &field_path),
                "delay" => r.delay = self.string(value, &field_path),
                _ => r.unit_multiplier = self.uint(value, &field_path),
            }
        }
        r.path = path;
        Some(r)
    }

    fn rate_limits(&mut self, node: &Node, path: &str) -> Option<Spanned<Vec<RawRateLimit>>> {
        if node.is_null() {
            return Some(Spanned {
                value: Vec::new(),
                pos: node.pos,
            });
        }
        let Value::Seq(items) = &node.value else {
            self.problem(
                node.pos,
                path,
                format!("expected a list, found {}", node.kind()),
            );
            return None;
        };
        let value = items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| self.rate_limit(item, format!("{path}[{i}]")))
            .collect();
        Some(Spanned {
            value,
            pos: node.pos,
        })
    }

    fn replaces(&mut self, node: &Node, path: &str) -> Vec<Spanned<String>> {
        if node.is_null() {
            return Vec::new();
        }
        let Value::Seq(items) = &node.value else {
            self.problem(
                node.pos,
                path,
                format!("expected a list, found {}", node.kind()),
            );
            return Vec::new();
        };
        let mut names = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let item_path = format!("{path}[{i}]");
            let Some(fields) = self.map(item, &item_path) else {
                continue;
            };
            let mut name = None;
            for (_, value, field_path) in self.fields(fields, &item_path, &["name"]) {
                name = self.string(value, &field_path);
            }
            match name {
                Some(n) => names.push(n),
                None => self.problem(
                    item.pos,
                    &item_path,
                    "should not have an empty replaces entry".to_string(),
                ),
            }
        }
        names
    }

    /// The entries of a map node, or a problem.
    fn map<'n>(&mut self, node: &'n Node, path: &str) -> Option<&'n [(Node, Node)]> {
        match &node.value {
            Value::Map(entries) => Some(entries),
            _ => {
                let at = if path.is_empty() { "file" } else { path };
                self.problem(
                    node.pos,
                    at,
                    format!("expected a map, found {}", node.kind()),
                );
                None
            }
        }
    }

    /// The known fields of a map, each once, with unknown and repeated fields reported.
    fn fields<'n>(
        &mut self,
        entries: &'n [(Node, Node)],
        path: &str,
        known: &[&'static str],
    ) -> Vec<(&'static str, &'n Node, String)> {
        let mut seen: Vec<(&'static str, &'n Node, String)> = Vec::new();
        for (k, v) in entries {
            let Value::Scalar { text, .. } = &k.value else {
                self.problem(
                    k.pos,
                    path,
                    format!("field names must be text, found {}", k.kind()),
                );
                continue;
            };
            let field_path = join(path, text);
            let Some(name) = known.iter().find(|n| **n == text.as_str()) else {
                self.problem(
                    k.pos,
                    &field_path,
                    format!(
                        "unknown field `{text}` (expected one of: {})",
                        known.join(", ")
                    ),
                );
                continue;
            };
            if seen.iter().any(|(n, _, _)| n == name) {
                self.problem(k.pos, &field_path, format!("field `{text}` is given twice"));
                continue;
            }
            seen.push((name, v, field_path));
        }
        seen
    }

    fn string(&mut self, node: &Node, path: &str) -> Option<Spanned<String>> {
        match &node.value {
            _ if node.is_null() => None,
            Value::Scalar { text, .. } => Some(Spanned {
                value: text.clone(),
                pos: node.pos,
            }),
            _ => {
                self.problem(
                    node.pos,
                    path,
                    format!("expected text, found {}", node.kind()),
                );
                None
            }
        }
    }

    fn bool(&mut self, node: &Node, path: &str) -> Option<bool> {
        match &node.value {
            Value::Scalar { text, plain: true } => match text.as_str() {
                "true" | "True" | "TRUE" => return Some(true),
                "false" | "False" | "FALSE" => return Some(false),
                _ => {}
            },
            _ if node.is_null() => return None,
            _ => {}
        }
        self.problem(
            node.pos,
            path,
            format!("expected true or false, found {}", show(node)),
        );
        None
    }

    fn flag(&mut self, node: &Node, path: &str) -> bool {
        self.bool(node, path).unwrap_or(false)
    }

    fn uint(&mut self, node: &Node, path: &str) -> Option<Spanned<u64>> {
        if let Value::Scalar { text, plain: true } = &node.value {
            let digits = text.strip_prefix('+').unwrap_or(text);
            if !digits.is_empty()
                && digits.bytes().all(|b| b.is_ascii_digit())
                && let Ok(n) = digits.parse::<u64>()
            {
                return Some(Spanned {
                    value: n,
                    pos: node.pos,
                });
            }
        }
        self.problem(
            node.pos,
            path,
            format!("expected a whole number ≥ 0, found {}", show(node)),
        );
        None
    }
}

fn show(node: &Node) -> String {
    match &node.value {
        Value::Scalar { text, .. } if !node.is_null() => format!("{text:?}"),
        _ => node.kind().to_string(),
    }
}

fn join(parent: &str, field: &str) -> String {
    if parent.is_empty() {
        field.to_string()
    } else {
        format!("{parent}.{field}")
    }
}

#[cfg(test)]
mod tests {
    use crate::policy::testing::problems;

    #[test]
    fn file_level_problems() {
        assert!(problems("")[0].message.contains("file is empty"));
        assert!(
            problems("descriptors: []")[0]
                .message
                .contains("missing domain")
        );
        assert!(problems("domain: ''")[0].message.contains("empty domain"));
        assert!(problems("domain: [a]")[0].message.contains("expected text"));
        assert!(problems("- a\n- b")[0].message.contains("expected a map"));
        assert!(
            problems("domain: a\n---\ndomain: b")[0]
                .message
                .contains("one YAML document")
        );
        let p = problems("domain: a\ndescriptors: [\n");
        assert!(p[0].message.contains("invalid YAML"), "{p:?}");
        assert!(p[0].pos.is_some());
        let p = problems("domain: a\ndomain: b\n");
        assert!(p[0].message.contains("given twice"), "{p:?}");
    }
}
