//! A domain's compiled tree, and matching a request descriptor's entries against it as
//! envoyproxy/ratelimit does: one level per entry; an exact value beats a wildcard (the first in
//! file order), which beats a key-only rule; no backtracking; a limit applies only when the node
//! reached by the last entry has one, or is a cost node (ours), drawing from its nearest limited
//! ancestor. Matching borrows the request's strings and allocates nothing; the counter key is
//! built in the same walk (the pattern, not the value, at `share_threshold` levels). A cost
//! node's key holds only the levels down to that ancestor, so that rarer case walks twice.

use std::collections::HashMap;
use std::sync::Arc;

use super::rule::{Cost, Metadata, Rule};

/// The hash map of the policy tables: foldhash, seeded per map. Every request looks up its
/// domain and each entry's key and value here, and SipHash (std's default) cost more than the
/// rest of the match; the tables hold only operator-written names, so a request cannot grow them.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
use crate::limiter::{Key, KeyBuilder};

/// The most entries [`Domain::order`] tries before it gives up on a bucket: its search is depth
/// first, and a tree that names the same keys at many levels could make it long.
const MAX_ORDER_STEPS: usize = 4_096;

/// One level of the tree: sibling descriptors grouped by key.
#[derive(Clone, Debug, Default)]
pub(crate) struct Level {
    pub(crate) groups: FastMap<Box<str>, Group>,
}

/// The descriptors of one level that share a key.
#[derive(Clone, Debug, Default)]
pub(crate) struct Group {
    /// Exact values → node.
    pub(crate) exact: FastMap<Box<str>, usize>,
    /// Wildcard patterns in file order.
    pub(crate) wildcards: Vec<(Pattern, usize)>,
    /// The key-only descriptor (any value).
    pub(crate) any: Option<usize>,
}

impl Group {
    fn find(&self, value: &str) -> Option<usize> {
        self.exact
            .get(value)
            .copied()
            .or_else(|| {
                self.wildcards
                    .iter()
                    .find(|(p, _)| p.matches(value))
                    .map(|(_, id)| *id)
            })
            .or(self.any)
    }
}

/// One compiled descriptor.
#[derive(Clone, Debug)]
pub(crate) struct TreeNode {
    pub(crate) children: Level,
    /// `rate_limit`, or each entry of `rate_limits`; empty for none.
    pub(crate) rules: Box<[Arc<Rule>]>,
    /// Set for a cost node (which then has no rules).
    pub(crate) cost: Option<Cost>,
    pub(crate) share_threshold: bool,
    /// `metadata`, `None` when absent or empty.
    pub(crate) metadata: Option<Metadata>,
}

/// A value pattern with `*` (zero or more characters) anywhere, any number of times.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Pattern {
    /// The text between the stars; at least two parts.
    parts: Vec<Box<str>>,
}

impl Pattern {
    pub(crate) fn new(pattern: &str) -> Self {
        Self {
            parts: pattern.split('*').map(Into::into).collect(),
        }
    }

    pub(crate) fn matches(&self, value: &str) -> bool {
        let Some((first, rest)) = self.parts.split_first() else {
            return false;
        };
        let Some(mut tail) = value.strip_prefix(&**first) else {
            return false;
        };
        let Some((last, middle)) = rest.split_last() else {
            return tail.is_empty();
        };
        // Leftmost match of each middle part leaves the most room for the rest.
        for part in middle {
            match tail.find(&**part) {
                Some(i) => tail = &tail[i + part.len()..],
                None => return false,
            }
        }
        tail.len() >= last.len() && tail.ends_with(&**last)
    }
}

/// A descriptor's matched rules and the request values their counters are keyed by.
#[derive(Clone)]
pub struct Resolved<'p> {
    /// The rules the descriptor is charged on, all or nothing: the node's own (`rate_limit`,
    /// or each of `rate_limits`), or for a cost node its ancestor's. Never empty.
    pub rules: &'p [Arc<Rule>],
    /// Tokens per hit: 1, or a cost node's `cost`.
    pub cost: u64,
    /// The `metadata` of the node the last entry reached (for a cost node its own, not its
    /// ancestor's), for the response's dynamic metadata.
    pub metadata: Option<&'p Metadata>,
    /// The request values of the levels down to the node holding `rules`.
    values: KeyBuilder,
}

impl std::fmt::Debug for Resolved<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolved")
            .field("rules", &self.rules)
            .field("cost", &self.cost)
            .field("metadata", &self.metadata)
            .finish_non_exhaustive()
    }
}

impl<'p> Resolved<'p> {
    /// The counter of `rule` (one of [`Self::rules`]) for this request.
    #[must_use]
    pub fn key(&self, rule: &Rule) -> Key {
        let mut key = self.values.clone();
        key.part(&rule.id.to_le_bytes());
        key.finish()
    }

    /// The counter of `rule`, reusing the walk's key state instead of copying it: for the
    /// last rule counted, so the common one-rule case copies nothing.
    #[must_use]
    pub fn into_key(self, rule: &Rule) -> Key {
        let mut key = self.values;
        key.part(&rule.id.to_le_bytes());
        key.finish()
    }
}

/// One domain's compiled descriptor tree.
#[derive(Clone, Debug)]
pub struct Domain {
    pub(super) name: String,
    /// The files it was loaded from: one, or several with merged domains, in load order.
    pub(super) files: Vec<String>,
    pub(super) root: Level,
    pub(super) nodes: Vec<TreeNode>,
}

impl Domain {
    /// The domain name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The (first) file it was loaded from.
    #[must_use]
    pub fn file(&self) -> &str {
        self.files.first().map_or("", String::as_str)
    }

    /// Every file it was loaded from, in load order: one, unless domains are merged.
    #[must_use]
    pub fn files(&self) -> &[String] {
        &self.files
    }

    /// Every rule of the domain, in file order; each entry of a `rate_limits` is one.
    pub fn rules(&self) -> impl Iterator<Item = &Rule> {
        self.nodes
            .iter()
            .flat_map(|n| n.rules.iter().map(Arc::as_ref))
    }

    /// Every cost node of the domain, in file order.
    pub fn costs(&self) -> impl Iterator<Item = &Cost> {
        self.nodes.iter().filter_map(|n| n.cost.as_ref())
    }
}

impl Domain {
    /// Matches a descriptor's entries (key, value), in order. `None` when no rule applies: an
    /// entry finds no descriptor, the request is deeper than the tree, or the node reached has
    /// no limit and is no cost node (a whitelist).
    pub fn resolve<'e, I>(&self, entries: I) -> Option<Resolved<'_>>
    where
        I: IntoIterator<Item = (&'e str, &'e str)> + Clone,
    {
        let mut level = &self.root;
        let mut reached: Option<&TreeNode> = None;
        // The deepest node with rules walked, and how many entries led to it.
        let mut limited: Option<(&TreeNode, usize)> = None;
        let mut depth = 0;
        let mut key = KeyBuilder::new(0);
        for (k, v) in entries.clone() {
            let node = &self.nodes[level.groups.get(k)?.find(v)?];
            key.part(if node.share_threshold {
                b""
            } else {
                v.as_bytes()
            });
            depth += 1;
            if !node.rules.is_empty() {
                limited = Some((node, depth));
            }
            level = &node.children;
            reached = Some(node);
        }
        let node = reached?;
        if !node.rules.is_empty() {
            return Some(Resolved {
                rules: &node.rules,
                cost: 1,
                metadata: node.metadata.as_ref(),
                values: key,
            });
        }
        let cost = node.cost.as_ref()?.cost;
        let (ancestor, depth) = limited?;
        let mut key = KeyBuilder::new(0);
        let mut level = &self.root;
        for (k, v) in entries.into_iter().take(depth) {
            let node = &self.nodes[level.groups.get(k)?.find(v)?];
            key.part(if node.share_threshold {
                b""
            } else {
                v.as_bytes()
            });
            level = &node.children;
        }
        Some(Resolved {
            rules: &ancestor.rules,
            cost,
            metadata: node.metadata.as_ref(),
            values: key,
        })
    }

    /// Orders an unordered set of entries (an RLQS bucket id) as a descriptor would carry them:
    /// depth first from the root, at each level trying, in key order, each entry whose key the
    /// level names and whose value finds a descriptor there, until every entry is placed. The
    /// first order found wins; `None` when none places them all (no descriptor of these entries
    /// would match) or the search passes 4,096 tries. The order found is then matched by
    /// [`Self::resolve`], so a bucket matches exactly the rule that descriptor would.
    #[must_use]
    pub fn order<'e>(&self, entries: &[(&'e str, &'e str)]) -> Option<Vec<(&'e str, &'e str)>> {
        let mut left: Vec<(&str, &str)> = entries.to_vec();
        left.sort_unstable();
        let mut placed = Vec::with_capacity(left.len());
        let mut steps = MAX_ORDER_STEPS;
        self.place(&self.root, &mut left, &mut placed, &mut steps)
            .then_some(placed)
    }

    /// Places the entries `left` from `level` down, onto `placed`; whether all were.
    fn place<'e>(
        &self,
        level: &Level,
        left: &mut Vec<(&'e str, &'e str)>,
        placed: &mut Vec<(&'e str, &'e str)>,
        steps: &mut usize,
    ) -> bool {
        if left.is_empty() {
            return true;
        }
        for i in 0..left.len() {
            let Some(rest) = steps.checked_sub(1) else {
                return false;
            };
            *steps = rest;
            let (k, v) = left[i];
            let Some(node) = level.groups.get(k).and_then(|g| g.find(v)) else {
                continue;
            };
            let entry = left.remove(i);
            placed.push(entry);
            if self.place(&self.nodes[node].children, left, placed, steps) {
                return true;
            }
            placed.pop();
            left.insert(i, entry);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{rpu, set};
    use crate::policy::{Metadata, PolicySet};

    #[test]
    fn unordered_entries_are_ordered_as_the_tree_names_their_keys() {
        let set = set("domain: d
descriptors:
  - key: user
    descriptors:
      - key: route
        value: search
        rate_limit: {unit: second, requests_per_unit: 7}
  - key: route
    rate_limit: {unit: second, requests_per_unit: 9}
");
        let d = set.domain("d").unwrap();
        assert_eq!(
            d.order(&[("route", "search"), ("user", "a")]),
            Some(vec![("user", "a"), ("route", "search")]),
            "`route` is tried first at the top, but then `user` finds no place below it"
        );
        assert_eq!(
            d.order(&[("route", "search")]),
            Some(vec![("route", "search")])
        );
        assert_eq!(
            d.order(&[("user", "a"), ("route", "search")]),
            d.order(&[("route", "search"), ("user", "a")]),
            "the order given does not matter"
        );
        assert_eq!(d.order(&[("user", "a")]), Some(vec![("user", "a")]));
        assert_eq!(d.order(&[("user", "a"), ("other", "x")]), None);
        assert_eq!(d.order(&[]), Some(vec![]));
    }

    #[test]
    fn wildcards_anywhere() {
        let p = Pattern::new("foo*bar*baz");
        assert!(p.matches("foobarbaz"));
        assert!(p.matches("foo-bar-x-baz"));
        assert!(!p.matches("foobaz"));
        assert!(!p.matches("xfoobarbaz"));
        assert!(Pattern::new("bar*b").matches("barb"));
        assert!(!Pattern::new("bar*b").matches("bar"));
        assert!(Pattern::new("*").matches(""));
        assert!(Pattern::new("/api/*/action").matches("/api/v1/action"));
        assert!(!Pattern::new("/api/*/action").matches("/api/v1/actions"));
        assert!(Pattern::new("a*a").matches("aa"));
        assert!(!Pattern::new("a*a").matches("a"));
    }

    /// envoyproxy/ratelimit's `test/config/basic_config.yaml`, re-typed.
    const BASIC: &str = r"
domain: test-domain
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 5}
      - key: subkey1
        value: subvalue1
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key2
    value: value2
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: key2
    value: value3
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: key4
    rate_limit: {name: key4_rate_limit, unit: day, requests_per_unit: 1}
  - key: key5
    value: value5
    rate_limit: {unit: day, requests_per_unit: 15}
    descriptors:
      - key: subkey5
        value: subvalue5
        rate_limit: {unit: day, requests_per_unit: 25}
  - key: key6
    rate_limit: {unlimited: true}
  - key: key7
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 70}
";

    const SEVERAL: &str = r"
domain: test-domain
descriptors:
  - key: user
    rate_limits:
      - {name: per_second, unit: second, requests_per_unit: 10, burst: 20}
      - {name: per_day, unit: day, requests_per_unit: 1000}
    descriptors:
      - key: route
        value: search
        cost: 10
      - key: route
        value: item
        cost: 1
      - key: route
        value: own
        rate_limit: {unit: minute, requests_per_unit: 5}
  - key: one
    rate_limits:
      - {unit: minute, requests_per_unit: 7}
";

    #[test]
    fn matching_follows_the_reference() {
        let s = set(BASIC);
        // Exact beats key-only, at any depth.
        assert_eq!(rpu(&s, &[("key1", "value1"), ("subkey1", "x")]), Some(5));
        assert_eq!(
            rpu(&s, &[("key1", "value1"), ("subkey1", "subvalue1")]),
            Some(10)
        );
        assert_eq!(rpu(&s, &[("key2", "anything")]), Some(20));
        assert_eq!(rpu(&s, &[("key2", "value2")]), Some(30));
        // A node with no rate_limit whitelists.
        assert_eq!(rpu(&s, &[("key2", "value3")]), None);
        assert_eq!(rpu(&s, &[("key1", "value1")]), None);
        // Fewer entries reach an intermediate node with its own limit.
        assert_eq!(rpu(&s, &[("key5", "value5")]), Some(15));
        assert_eq!(
            rpu(&s, &[("key5", "value5"), ("subkey5", "subvalue5")]),
            Some(25)
        );
        // Deeper than the tree, or no backtracking to a key-only sibling: no limit.
        assert_eq!(rpu(&s, &[("key3", "x"), ("extra", "y")]), None);
        assert_eq!(rpu(&s, &[("key1", "value1"), ("nope", "x")]), None);
        assert_eq!(rpu(&s, &[("unknown", "x")]), None);
        assert_eq!(rpu(&s, &[]), None);
        assert_eq!(rpu(&s, &[("key6", "x")]), Some(u32::MAX));
        assert_eq!(
            s.summary().to_string(),
            "1 files, 1 domains, 10 rules (9 limited, 0 bans, 1 unlimited)"
        );
    }

    #[test]
    fn wildcards_in_file_order_then_key_only() {
        let s = set(r"
domain: test-domain
descriptors:
  - key: path
    value: /api/*/admin
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: /api/*
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    value: /api/v1/admin
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: nested
    value: val1
    descriptors:
      - key: wild
        value: goo*
        rate_limit: {unit: minute, requests_per_unit: 5}
");
        assert_eq!(rpu(&s, &[("path", "/api/v1/admin")]), Some(3));
        assert_eq!(rpu(&s, &[("path", "/api/v2/admin")]), Some(1));
        assert_eq!(rpu(&s, &[("path", "/api/v2/users")]), Some(2));
        assert_eq!(rpu(&s, &[("path", "/static")]), Some(4));
        assert_eq!(rpu(&s, &[("nested", "val1"), ("wild", "goose")]), Some(5));
        assert_eq!(rpu(&s, &[("nested", "val1"), ("wild", "duck")]), None);
    }

    #[test]
    fn counters_are_per_value_unless_share_threshold() {
        let s = set(r"
domain: test-domain
descriptors:
  - key: ip
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: other
    value: files/*
    rate_limit: {unit: hour, requests_per_unit: 10}
");
        let d = s.domain("test-domain").unwrap();
        let key = |k: &str, v: &str| d.resolve([(k, v)]).map(|r| r.key(&r.rules[0])).unwrap();
        assert_ne!(key("ip", "1.1.1.1"), key("ip", "2.2.2.2"));
        assert_eq!(key("files", "files/a"), key("files", "files/b"));
        assert_ne!(key("other", "files/a"), key("other", "files/b"));
        assert_ne!(key("files", "files/a"), key("other", "files/a"));
    }

    #[test]
    fn rate_limits_are_rules_of_their_own() {
        let s = set(SEVERAL);
        let d = s.domain("test-domain").unwrap();
        let r = d.resolve([("user", "u1")]).unwrap();
        assert_eq!(r.cost, 1);
        let names: Vec<_> = r.rules.iter().map(|r| r.name.as_deref().unwrap()).collect();
        assert_eq!(names, ["per_second", "per_day"]);
        // Distinct identities, counters and labels; one stats key, told apart by the name.
        assert_ne!(r.rules[0].id, r.rules[1].id);
        assert_ne!(r.key(&r.rules[0]), r.key(&r.rules[1]));
        assert_eq!(r.rules[0].stats_key, "test-domain.user");
        assert_eq!(r.rules[1].qualified_key(), "test-domain.user[per_day]");
        assert_eq!(r.rules[0].path, "descriptors[0].rate_limits[0]");
        // The key handed over last is the same as a copied one.
        assert_eq!(r.key(&r.rules[1]), r.clone().into_key(&r.rules[1]));
        // A single entry needs no name and its stats key stays plain.
        let one = d.resolve([("one", "x")]).unwrap();
        assert_eq!(one.rules.len(), 1);
        assert_eq!(one.rules[0].qualified_key(), "test-domain.one");
        // The summary counts each entry, and the cost nodes apart.
        assert_eq!(
            s.summary().to_string(),
            "1 files, 1 domains, 4 rules (4 limited, 0 bans, 0 unlimited), 2 cost nodes"
        );
    }

    #[test]
    fn cost_nodes_draw_from_the_ancestors_counters() {
        let s = set(SEVERAL);
        let d = s.domain("test-domain").unwrap();
        let user = d.resolve([("user", "u1")]).unwrap();
        let search = d.resolve([("user", "u1"), ("route", "search")]).unwrap();
        let item = d.resolve([("user", "u1"), ("route", "item")]).unwrap();
        assert_eq!((search.cost, item.cost), (10, 1));
        for r in [&search, &item] {
            assert!(std::ptr::eq(r.rules, user.rules));
            for rule in r.rules {
                assert_eq!(r.key(rule), user.key(rule));
            }
        }
        // Another user has counters of its own.
        let other = d.resolve([("user", "u2"), ("route", "search")]).unwrap();
        assert_ne!(other.key(&other.rules[0]), user.key(&user.rules[0]));
        // A node with its own limit under the user is a rule of its own, not a cost node.
        let own = d.resolve([("user", "u1"), ("route", "own")]).unwrap();
        assert_eq!((own.rules.len(), own.cost), (1, 1));
        // Deeper than the cost node, or a route with no node: not limited, as in the reference.
        assert!(
            d.resolve([("user", "u1"), ("route", "search"), ("x", "y")])
                .is_none()
        );
        assert!(d.resolve([("user", "u1"), ("route", "other")]).is_none());
        let costs: Vec<_> = d
            .costs()
            .map(|c| (c.stats_key.as_str(), c.cost, c.of.as_str()))
            .collect();
        assert_eq!(
            costs,
            [
                ("test-domain.user.route_search", 10, "test-domain.user"),
                ("test-domain.user.route_item", 1, "test-domain.user"),
            ]
        );
    }

    #[test]
    fn a_cost_node_under_a_key_only_node_with_share_threshold_above() {
        // The ancestor's key is built from its levels only: the wildcard level above shares.
        let s = set(r"
domain: test-domain
descriptors:
  - key: path
    value: /api/*
    share_threshold: true
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 100}
        descriptors:
          - key: route
            cost: 5
");
        let d = s.domain("test-domain").unwrap();
        let a = d
            .resolve([("path", "/api/a"), ("user", "u"), ("route", "r1")])
            .unwrap();
        let b = d.resolve([("path", "/api/b"), ("user", "u")]).unwrap();
        assert_eq!(a.cost, 5);
        assert_eq!(a.key(&a.rules[0]), b.key(&b.rules[0]));
    }

    fn metadata_of(set: &PolicySet, domain: &str, entries: &[(&str, &str)]) -> Option<Metadata> {
        set.domain(domain)
            .expect("domain")
            .resolve(entries.iter().copied())
            .and_then(|r| r.metadata.cloned())
    }

    #[test]
    fn metadata_is_kept_typed_as_written_on_the_matched_node() {
        let s = set(r#"
domain: test-domain
descriptors:
  - key: service
    value: one
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata:
      service_with_quota: {name: "service_1"}
      n: 3
      big: 18446744073709551615
      f: -2.5e1
      flags: [true, False, null, ~, yes, "7"]
      0.5: half
  - key: acct
    rate_limit: {unit: minute, requests_per_unit: 10}
    metadata: {level: acct}
    descriptors:
      - key: route
        cost: 2
        metadata: {level: route}
      - key: plain
        cost: 1
  - key: empty
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {}
  - key: whitelisted
    metadata: {never: returned}
"#);
        let m = metadata_of(&s, "test-domain", &[("service", "one")]).unwrap();
        assert_eq!(
            serde_json::Value::Object(m),
            serde_json::json!({
                "service_with_quota": {"name": "service_1"},
                "n": 3,
                "big": 18_446_744_073_709_551_615_u64,
                "f": -25.0,
                "flags": [true, false, null, null, "yes", "7"],
                "0.5": "half",
            })
        );
        // A request that stops at the limited node gets its metadata; a cost node its own, or
        // none (not its ancestor's).
        let level =
            |e: &[(&str, &str)]| metadata_of(&s, "test-domain", e).map(|m| m["level"].clone());
        assert_eq!(level(&[("acct", "a")]), Some("acct".into()));
        assert_eq!(
            level(&[("acct", "a"), ("route", "r")]),
            Some("route".into())
        );
        assert_eq!(level(&[("acct", "a"), ("plain", "p")]), None);
        assert_eq!(metadata_of(&s, "test-domain", &[("empty", "x")]), None);
        // No rule applies: no match, so nothing to return.
        assert!(
            s.domain("test-domain")
                .unwrap()
                .resolve([("whitelisted", "x")])
                .is_none()
        );
    }

    #[test]
    fn nested_rules_and_the_depth_rule() {
        let s = set(r"
domain: test-domain
descriptors:
  - key: nested
    value: a
    rate_limit: {unit: hour, requests_per_unit: 5}
    descriptors:
      - key: sub
        rate_limit: {unit: hour, requests_per_unit: 2}
");
        assert_eq!(rpu(&s, &[("nested", "a")]), Some(5));
        assert_eq!(rpu(&s, &[("nested", "a"), ("sub", "x")]), Some(2));
        assert_eq!(rpu(&s, &[("nested", "b")]), None);
        // Deeper than the tree: no limit.
        assert_eq!(
            rpu(&s, &[("nested", "a"), ("sub", "x"), ("more", "y")]),
            None
        );
        // No backtracking: a miss below an exact match does not fall back to a key-only sibling.
        assert_eq!(rpu(&s, &[("nested", "a"), ("other", "x")]), None);
    }

    #[test]
    fn wildcards_beat_key_only() {
        let s = set(r"
domain: test-domain
descriptors:
  - key: path
    value: /api/*/export
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: path
    rate_limit: {unit: hour, requests_per_unit: 10}
");
        assert_eq!(rpu(&s, &[("path", "/api/v2/export")]), Some(1));
        assert_eq!(rpu(&s, &[("path", "/api/v2/users")]), Some(10));
    }
}
