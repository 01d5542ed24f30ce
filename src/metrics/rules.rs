//! The per-rule counters: `total_hits`, `over_limit`, `near_limit`, `within_limit`,
//! `shadow_mode` and the spend counters, one set per rule and label values. Labels of rules come
//! from configuration; request values appear only for rules with `detailed_metric` or
//! `value_to_metric` (and as unknown domains), under a cap on such series past which they count
//! as `_other`, so a client rotating values cannot grow memory. The cap counts every series ever
//! made: those of rules a reload removed stay exposed by the recorder, so their places are not
//! given back. Label values are sanitised as the reference sanitises its stat names
//! ([`sanitize`]), so the series match its Prometheus mapping's.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};

use dashmap::DashMap;
use metrics::Counter;

use crate::limiter::key::KeyHash;
use crate::metrics::names::{
    DOMAIN_NOT_FOUND, NEAR_LIMIT, OVER_LIMIT, SHADOW_MODE, SPEND_OVER_LIMIT, SPEND_RECORDED,
    TOTAL_HITS, WITHIN_LIMIT,
};
use crate::policy::{PolicySet, Rule};

/// One counted descriptor of a decided request, for the per-rule counters.
#[derive(Clone, Copy, Debug)]
pub struct RuleHit<'a> {
    /// The request's domain.
    pub domain: &'a str,
    /// The rule that counted it.
    pub rule: &'a Rule,
    /// The descriptor's first two entries (key, value), for request-valued labels.
    pub values: [Option<(&'a str, &'a str)>; 2],
    /// How many entries the descriptor has.
    pub depth: usize,
    /// Its cost.
    pub hits: u64,
    /// Whether it reports spend already made, recorded whatever the outcome.
    pub spent: bool,
    /// Whether the backend found it over its limit (whatever shadow mode answered).
    pub denied: bool,
    /// Requests left after it.
    pub remaining: u64,
    /// The rule's burst.
    pub burst: u64,
}

/// The label value that stands for every request value past the series cap.
pub const OTHER: &str = "_other";

/// Near limit starts above this fraction of the bucket by default, as in envoyproxy/ratelimit
/// (`metrics.near_limit_ratio`).
pub const DEFAULT_NEAR_LIMIT_RATIO: f64 = 0.8;

/// The counters of one rule (one label set).
#[derive(Clone, Debug)]
struct RuleCounters {
    total: Counter,
    over: Counter,
    near: Counter,
    within: Counter,
    shadow: Counter,
    spent: Counter,
    spent_over: Counter,
}

impl RuleCounters {
    fn new(domain: &str, key1: &str, key2: &str) -> Self {
        let labels = [
            ("domain", sanitize(domain)),
            ("key1", sanitize(key1)),
            ("key2", sanitize(key2)),
        ];
        Self {
            total: metrics::counter!(TOTAL_HITS, &labels),
            over: metrics::counter!(OVER_LIMIT, &labels),
            near: metrics::counter!(NEAR_LIMIT, &labels),
            within: metrics::counter!(WITHIN_LIMIT, &labels),
            shadow: metrics::counter!(SHADOW_MODE, &labels),
            spent: metrics::counter!(SPEND_RECORDED, &labels),
            spent_over: metrics::counter!(SPEND_OVER_LIMIT, &labels),
        }
    }
}

/// The counters of every rule, and the cap on request-valued series.
#[derive(Debug)]
pub(super) struct RuleSeries {
    /// Rule identity (already a hash, so not hashed again) → counters of rules whose labels
    /// come from configuration alone.
    rules: DashMap<u128, RuleCounters, KeyHash>,
    /// Label key → counters of request-valued series (`detailed_metric`, `value_to_metric`,
    /// unknown domains), at most `max_series` of them.
    detailed: DashMap<(u128, String, String), RuleCounters>,
    /// Unknown domain → its `domain_not_found` counter, within the same cap.
    unknown_domains: DashMap<String, Counter>,
    /// Request-valued series created so far.
    series: AtomicUsize,
    max_series: usize,
    /// The fraction of a bucket above which an admitted hit is near the limit.
    pub(super) near_limit_ratio: f64,
}

impl RuleSeries {
    /// No series yet; at most `max_series` request-valued ones.
    pub(super) fn new(max_series: usize) -> Self {
        Self {
            rules: DashMap::default(),
            detailed: DashMap::new(),
            unknown_domains: DashMap::new(),
            series: AtomicUsize::new(0),
            max_series,
            near_limit_ratio: DEFAULT_NEAR_LIMIT_RATIO,
        }
    }

    /// Counts one descriptor a rule counted.
    pub(super) fn hit(&self, hit: &RuleHit<'_>) {
        let record = |c: &RuleCounters| {
            c.total.increment(hit.hits);
            if hit.spent {
                c.spent.increment(hit.hits);
                if hit.denied {
                    c.spent_over.increment(hit.hits);
                }
            }
            if hit.denied {
                c.over.increment(hit.hits);
                if hit.rule.shadow_mode {
                    c.shadow.increment(hit.hits);
                }
                return;
            }
            c.within.increment(hit.hits);
            // Truncation intended: the floor of that fraction of the bucket.
            let threshold = (hit.burst as f64 * self.near_limit_ratio) as u64;
            let used = hit.burst.saturating_sub(hit.remaining);
            if used > threshold {
                c.near.increment(hit.hits.min(used - threshold));
            }
        };
        if hit.rule.detailed_metric || hit.rule.value_to_metric {
            let (key1, key2) = detailed_labels(hit);
            self.with_detailed(hit.rule.id, hit.domain, &key1, &key2, record);
        } else {
            self.with_rule(hit.rule, hit.domain, record);
        }
    }

    /// Counts the descriptors of a request for a domain no policy defines.
    pub(super) fn domain_not_found(&self, domain: &str, descriptors: u64) {
        if let Some(c) = self.unknown_domains.get(domain) {
            return c.increment(descriptors);
        }
        let label = if self.reserve_series() { domain } else { OTHER };
        let c = self
            .unknown_domains
            .entry(label.to_string())
            .or_insert_with(|| metrics::counter!(DOMAIN_NOT_FOUND, "domain" => sanitize(label)));
        c.increment(descriptors);
    }

    /// Forgets the counter handles of rules that `set` no longer has, after a reload swapped
    /// it in, so that reloads that rename rules do not grow the maps. The series already
    /// exposed stay exposed, as Prometheus counters do; a rule that comes back continues its.
    pub(super) fn keep_rules_of(&self, set: &PolicySet) {
        let kept: HashSet<u128> = set
            .domains()
            .into_iter()
            .flat_map(|d| d.rules().map(|r| r.id))
            .collect();
        self.rules.retain(|id, _| kept.contains(id));
        self.detailed.retain(|(id, _, _), _| kept.contains(id));
    }

    fn with_rule(&self, rule: &Rule, domain: &str, f: impl FnOnce(&RuleCounters)) {
        if let Some(c) = self.rules.get(&rule.id) {
            return f(&c);
        }
        let (key1, key2) = rule_labels(rule);
        let c = RuleCounters::new(domain, &key1, &key2);
        f(&c);
        self.rules.insert(rule.id, c);
    }

    fn with_detailed(
        &self,
        id: u128,
        domain: &str,
        key1: &str,
        key2: &str,
        f: impl FnOnce(&RuleCounters),
    ) {
        let key = (id, key1.to_string(), key2.to_string());
        if let Some(c) = self.detailed.get(&key) {
            return f(&c);
        }
        if !self.reserve_series() {
            let other = (id, OTHER.to_string(), String::new());
            let c = self
                .detailed
                .entry(other)
                .or_insert_with(|| RuleCounters::new(domain, OTHER, ""));
            return f(&c);
        }
        let c = RuleCounters::new(domain, key1, key2);
        f(&c);
        self.detailed.insert(key, c);
    }

    /// The counters held: of rules labelled from configuration, and request-valued.
    #[cfg(test)]
    pub(super) fn counted(&self) -> (usize, usize) {
        (self.rules.len(), self.detailed.len())
    }

    /// Takes one of the `max_series` request-valued series; false when they are all taken.
    fn reserve_series(&self) -> bool {
        // Relaxed: the count only bounds memory; no other data is ordered by it.
        self.series
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max_series).then_some(n + 1)
            })
            .is_ok()
    }
}

/// `key1`/`key2` of a rule from configuration: the first two levels of its stats key
/// (`key_value` for exact or wildcard levels, `key` for key-only ones).
fn rule_labels(rule: &Rule) -> (String, String) {
    let level = |i: usize| rule.levels.get(i).cloned().unwrap_or_default();
    entry_labels(rule, (level(0), level(1)))
}

/// One of several limits of a node (`rate_limits`) shares its levels with its siblings, so its
/// name, in brackets, goes on its last label (`key2`, or `key1` when that is empty) to keep the
/// series apart: `key1="user", key2="route_search[per_day]"`.
fn entry_labels(rule: &Rule, (mut key1, mut key2): (String, String)) -> (String, String) {
    if let Some(name) = &rule.entry {
        let last = if key2.is_empty() {
            &mut key1
        } else {
            &mut key2
        };
        last.push_str(&format!("[{name}]"));
    }
    (key1, key2)
}

/// `key1`/`key2` showing request values: every level's with `detailed_metric`, the rule's own
/// (last) level's with `value_to_metric`.
fn detailed_labels(hit: &RuleHit<'_>) -> (String, String) {
    let value = |i: usize| {
        hit.values[i]
            .map(|(k, v)| format!("{k}_{v}"))
            .unwrap_or_default()
    };
    if hit.rule.detailed_metric {
        return entry_labels(hit.rule, (value(0), value(1)));
    }
    let level = |i: usize| hit.rule.levels.get(i).cloned().unwrap_or_default();
    let (mut key1, mut key2) = (level(0), level(1));
    match hit.depth {
        1 => key1 = value(0),
        2 => key2 = value(1),
        _ => {}
    }
    entry_labels(hit.rule, (key1, key2))
}

/// A label value as envoyproxy/ratelimit's `SanitizeStatName` leaves a stat name: `:` and `|`
/// become `_`, then the dots of every IPv4 address in it (four runs of 1 to 3 ASCII digits
/// joined by dots, found left to right as Go's regexp finds `\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}`)
/// become `_`: `masked_remote_address_0.0.0.0/0` → `masked_remote_address_0_0_0_0/0`.
#[must_use]
pub fn sanitize(value: &str) -> String {
    let mut out: Vec<u8> = value
        .bytes()
        .map(|b| if b == b':' || b == b'|' { b'_' } else { b })
        .collect();
    let digits = |s: &[u8], at: usize| s[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    let mut i = 0;
    while i < out.len() {
        // An address starting at i: three runs of 1 to 3 digits each followed by a dot (a
        // shorter prefix of a run would be followed by a digit), then the greedy last run.
        let mut at = i;
        let mut dots = [0; 3];
        let mut found = true;
        for dot in &mut dots {
            let n = digits(&out, at);
            if !(1..=3).contains(&n) || out.get(at + n) != Some(&b'.') {
                found = false;
                break;
            }
            *dot = at + n;
            at += n + 1;
        }
        let last = if found { digits(&out, at).min(3) } else { 0 };
        if last == 0 {
            i += 1;
            continue;
        }
        for dot in dots {
            out[dot] = b'_';
        }
        i = at + last;
    }
    // Only ASCII bytes were replaced by ASCII bytes: still UTF-8.
    String::from_utf8(out).unwrap_or_else(|_| value.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::policy::{PolicyError, PolicyHandle, load_str};

    /// A policy of domain `name`: rule `k` with labels from configuration, rule `d` with
    /// `detailed_metric`.
    fn policy(name: &str) -> String {
        format!(
            "domain: {name}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n  - key: d\n    detailed_metric: true\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
        )
    }

    /// One hit on every rule of `domain`, its descriptor's first value `value`.
    fn hit(series: &RuleSeries, set: &PolicySet, domain: &str, value: &str) {
        for rule in set.domain(domain).unwrap().rules() {
            series.hit(&RuleHit {
                domain,
                rule,
                values: [Some(("k", value)), None],
                depth: 1,
                hits: 1,
                spent: false,
                denied: false,
                remaining: 1,
                burst: 2,
            });
        }
    }

    /// A cap of `cap` series, with one hit on domain `a`'s rules (value `v1`): a series taken
    /// if the cap allows.
    fn one_series_taken(cap: usize) -> (RuleSeries, PolicySet) {
        let series = RuleSeries::new(cap);
        let set = load_str(&[("a.yaml", &policy("a"))]).unwrap();
        hit(&series, &set, "a", "v1");
        (series, set)
    }

    /// The request-valued series of `series`, as (key1, key2), sorted.
    fn detailed(series: &RuleSeries) -> Vec<(String, String)> {
        let mut out: Vec<_> = series
            .detailed
            .iter()
            .map(|e| (e.key().1.clone(), e.key().2.clone()))
            .collect();
        out.sort();
        out
    }

    #[test]
    fn label_values_are_sanitised_as_the_references_stat_names() {
        for (value, sanitised) in [
            (
                "masked_remote_address_0.0.0.0/0",
                "masked_remote_address_0_0_0_0/0",
            ),
            (
                "masked_remote_address_invert:192.0.2.0/24",
                "masked_remote_address_invert_192_0_2_0/24",
            ),
            ("header_x-user-id_one", "header_x-user-id_one"),
            ("a|b:c", "a_b_c"),
            // Go's leftmost match: the first digit of a four-digit run cannot start one.
            ("1234.5.6.7", "1234_5_6_7"),
            ("v1.2.3", "v1.2.3"),
            ("1.2.3.4.5.6.7.8", "1_2_3_4.5_6_7_8"),
            ("10.0.0.1234", "10_0_0_1234"),
            ("ip_10.1.2.3,x", "ip_10_1_2_3,x"),
            ("ünï.1.2.3.4", "ünï.1_2_3_4"),
            ("", ""),
        ] {
            assert_eq!(sanitize(value), sanitised, "{value}");
        }
    }

    #[test]
    fn request_values_get_series_up_to_the_cap_then_count_as_other() {
        let (series, set) = one_series_taken(2);
        hit(&series, &set, "a", "v2");
        assert_eq!(series.series.load(Ordering::Relaxed), 2, "at the cap");
        assert_eq!(
            detailed(&series),
            [
                ("k_v1".into(), String::new()),
                ("k_v2".into(), String::new())
            ]
        );
        hit(&series, &set, "a", "v3");
        hit(&series, &set, "a", "v4");
        assert_eq!(
            series.series.load(Ordering::Relaxed),
            2,
            "past the cap: no new series"
        );
        assert_eq!(
            detailed(&series),
            [
                (OTHER.into(), String::new()),
                ("k_v1".into(), String::new()),
                ("k_v2".into(), String::new())
            ],
            "the first two kept, the rest under _other"
        );
        hit(&series, &set, "a", "v1");
        assert_eq!(
            detailed(&series).len(),
            3,
            "a value that has a series keeps it"
        );
        assert_eq!(
            series.rules.len(),
            1,
            "labels from configuration: never capped"
        );
    }

    #[test]
    fn unknown_domains_share_the_cap() {
        let (series, set) = one_series_taken(2);
        series.domain_not_found("x", 1);
        series.domain_not_found("y", 3);
        series.domain_not_found("x", 1);
        let mut domains: Vec<String> = series
            .unknown_domains
            .iter()
            .map(|e| e.key().clone())
            .collect();
        domains.sort();
        assert_eq!(
            domains,
            ["_other", "x"],
            "one place left: x; y counts as _other"
        );
        hit(&series, &set, "a", "v2");
        assert_eq!(
            detailed(&series),
            [
                (OTHER.into(), String::new()),
                ("k_v1".into(), String::new())
            ]
        );
        assert_eq!(series.series.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_cap_of_zero_counts_every_request_value_as_other() {
        let (series, _) = one_series_taken(0);
        series.domain_not_found("x", 1);
        assert_eq!(detailed(&series), [(OTHER.into(), String::new())]);
        assert_eq!(series.unknown_domains.len(), 1);
        assert!(series.unknown_domains.contains_key(OTHER));
        assert_eq!(series.series.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_reload_forgets_the_rules_it_removed() {
        let series = RuleSeries::new(10);
        let before = load_str(&[("a.yaml", &policy("a")), ("b.yaml", &policy("b"))]).unwrap();
        hit(&series, &before, "a", "v");
        hit(&series, &before, "b", "v");
        assert_eq!((series.rules.len(), series.detailed.len()), (2, 2));
        let after = load_str(&[("a.yaml", &policy("a"))]).unwrap();
        series.keep_rules_of(&after);
        assert_eq!((series.rules.len(), series.detailed.len()), (1, 1));
        hit(&series, &after, "a", "v");
        assert_eq!((series.rules.len(), series.detailed.len()), (1, 1));
        // The removed rule's series is still exposed: its place under the cap is not given back.
        assert_eq!(series.series.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn swapping_policies_in_forgets_the_rules_they_removed() {
        let metrics = Metrics::install(10);
        let before = load_str(&[("a.yaml", &policy("a")), ("b.yaml", &policy("b"))]).unwrap();
        hit(&metrics.rules, &before, "a", "v");
        hit(&metrics.rules, &before, "b", "v");
        let handle = PolicyHandle::new(before);
        assert_eq!(metrics.rules.counted(), (2, 2));
        // A failed load keeps the running policies and their series.
        let failed = metrics.swap_policies(&handle, Err(PolicyError::Invalid(Vec::new())));
        assert!(failed.is_err());
        assert_eq!(metrics.rules.counted(), (2, 2));
        let after = load_str(&[("a.yaml", &policy("a"))]).unwrap();
        let (summary, old) = metrics.swap_policies(&handle, Ok(after)).unwrap();
        assert_eq!((old.domains().len(), summary), (2, handle.load().summary()));
        assert_eq!(
            metrics.rules.counted(),
            (1, 1),
            "domain b's two rules forgotten"
        );
    }
}
