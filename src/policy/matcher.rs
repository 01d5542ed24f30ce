//! Matching a request descriptor's entries against a domain's compiled tree, as
//! envoyproxy/ratelimit does: one level per entry; an exact value beats a wildcard (the first in
//! file order), which beats a key-only rule; no backtracking; a limit applies only when the node
//! reached by the last entry has one, or is a cost node (ours), drawing from its nearest limited
//! ancestor. Matching borrows the request's strings and allocates nothing; the counter key is
//! built in the same walk (the pattern, not the value, at `share_threshold` levels). A cost
//! node's key holds only the levels down to that ancestor, so that rarer case walks twice.

use std::collections::HashMap;
use std::sync::Arc;

use super::rule::{Cost, Metadata, Rule};
use super::set::Domain;

/// The hash map of the policy tables: foldhash, seeded per map. Every request looks up its
/// domain and each entry's key and value here, and SipHash (std's default) cost more than the
/// rest of the match; the tables hold only operator-written names, so a request cannot grow them.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
use crate::limiter::{Key, KeyBuilder};

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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
