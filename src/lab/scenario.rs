//! The built-in scenarios of `sluice replay --scenario`, each with its own policy: the essay's
//! fixed-window boundary, its midnight stampede, a retry storm, a token budget charged after
//! each response, and the stampede against a rule that refuses and one that delays.
//!
//! `boundary`, `stampede`, `tokens` and `delay` are fixed traces. `retry-storm` is a closed loop: refused clients
//! come back after the `Retry-After` each algorithm gives (GCRA's from the real decision),
//! once in lockstep and once with a random jitter added, so each algorithm runs alone with
//! its own clients.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::decision::Request;
use crate::limiter::gcra::NANOS_PER_SEC;
use crate::policy::{PolicyError, PolicySet, load_str};

use super::replay::{Algorithm, Lab, ReplayError, Report};
use super::trace::{Event, Usage};

const MS: u64 = 1_000_000;

/// A built-in scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// 100 per minute; 100 requests at 59.9 s, 100 at 60.1 s.
    Boundary,
    /// 5,000 per minute; 2,500 requests over the last second of a minute, 2,300 over the
    /// first second of the next; one rule with the inherited burst, one with a burst of 100.
    Stampede,
    /// 3,000 clients over the last 10 s of a minute against 1,000 per minute; refused clients
    /// retry after `Retry-After`, in lockstep or with up to 30 s of jitter.
    RetryStorm,
    /// 6,000 tokens per minute for one tenant; a call a second from 30 s to 210 s, each of 500
    /// to 1,500 tokens reported 1 to 4 s after it arrives, checked with a cost of 0.
    Tokens,
    /// The stampede's arrivals against 5,000 per minute with a burst of 100, once refusing what
    /// does not fit and once delaying it up to 2 s (GCRA with the rule's delay).
    Delay,
}

/// The `boundary` policy.
pub const BOUNDARY_POLICY: &str = "\
# The essay's fixed-window example: 100 per minute.
domain: boundary
descriptors:
  - key: client
    rate_limit:
      unit: minute
      requests_per_unit: 100
";

/// The `stampede` policy.
pub const STAMPEDE_POLICY: &str = "\
# The essay's incident: 5,000 per minute, once with the inherited burst and once with a chosen one.
domain: stampede
descriptors:
  - key: burst
    value: inherited
    rate_limit:
      name: inherited_burst
      unit: minute
      requests_per_unit: 5000
  - key: burst
    value: chosen
    rate_limit:
      name: chosen_burst
      unit: minute
      requests_per_unit: 5000
      burst: 100
";

/// The `retry-storm` policy.
pub const RETRY_STORM_POLICY: &str = "\
# 1,000 per minute, for clients that retry in lockstep and for clients that add jitter.
domain: retry
descriptors:
  - key: clients
    value: lockstep
    rate_limit:
      name: lockstep
      unit: minute
      requests_per_unit: 1000
  - key: clients
    value: jittered
    rate_limit:
      name: jittered
      unit: minute
      requests_per_unit: 1000
";

/// The `tokens` policy.
pub const TOKENS_POLICY: &str = "\
# A token budget: 6,000 tokens per minute for each tenant, charged when each response ends.
domain: ai
descriptors:
  - key: tenant
    rate_limit:
      name: tokens_per_minute
      unit: minute
      requests_per_unit: 6000
";

/// The `delay` policy.
pub const DELAY_POLICY: &str = "\
# The stampede against one rule that refuses what does not fit and one that delays it: 5,000 per
# minute with a burst of 100, the second holding a request up to 2 s for its slot.
domain: delay
descriptors:
  - key: rule
    value: refusing
    rate_limit:
      name: refusing
      unit: minute
      requests_per_unit: 5000
      burst: 100
  - key: rule
    value: delaying
    rate_limit:
      name: delaying
      unit: minute
      requests_per_unit: 5000
      burst: 100
      delay: 2s
";

/// Calls of the `tokens` scenario, one a second from [`TOKENS_START_SECONDS`].
pub const TOKEN_CALLS: u64 = 180;
/// When the `tokens` scenario's first call arrives, in seconds: mid-window, so that a fixed
/// window's boundary falls inside the run.
pub const TOKENS_START_SECONDS: u64 = 30;

/// Clients of the retry storm, per group.
pub const STORM_CLIENTS: u64 = 3_000;
/// Most attempts a storm client makes.
pub const STORM_ATTEMPTS: u32 = 10;
/// Most seconds of jitter a jittered client adds.
pub const STORM_JITTER_SECONDS: u64 = 30;

impl Scenario {
    /// The scenario's policy file: (name, YAML).
    #[must_use]
    pub const fn policy(self) -> (&'static str, &'static str) {
        match self {
            Self::Boundary => ("boundary.yaml", BOUNDARY_POLICY),
            Self::Stampede => ("stampede.yaml", STAMPEDE_POLICY),
            Self::RetryStorm => ("retry-storm.yaml", RETRY_STORM_POLICY),
            Self::Tokens => ("tokens.yaml", TOKENS_POLICY),
            Self::Delay => ("delay.yaml", DELAY_POLICY),
        }
    }

    /// The scenario's policy, compiled.
    ///
    /// # Errors
    ///
    /// None in practice: the built-in policies are valid (a unit test loads each).
    pub fn policies(self) -> Result<PolicySet, PolicyError> {
        let (name, text) = self.policy();
        load_str(&[(name, text)])
    }

    /// The command line that runs it, for titles.
    #[must_use]
    pub const fn command(self) -> &'static str {
        match self {
            Self::Boundary => "sluice replay --scenario boundary",
            Self::Stampede => "sluice replay --scenario stampede",
            Self::RetryStorm => "sluice replay --scenario retry-storm",
            Self::Tokens => "sluice replay --scenario tokens",
            Self::Delay => "sluice replay --scenario delay",
        }
    }

    /// The algorithms it is replayed with: a token budget with GCRA and the reference's fixed
    /// window, `delay` with GCRA and each rule's delay, the others with all four.
    #[must_use]
    pub const fn algorithms(self) -> &'static [Algorithm] {
        match self {
            Self::Tokens => &Algorithm::TOKENS,
            Self::Delay => &Algorithm::DELAY,
            _ => &Algorithm::ALL,
        }
    }

    /// The fixed trace of `boundary`, `stampede` and `tokens`; `None` for the closed-loop retry
    /// storm.
    #[must_use]
    pub fn trace(self) -> Option<Vec<Event>> {
        let at = |t: u64, domain: &str, key: &str, value: &str| Event {
            t,
            request: Request::from_entries(domain, &[&[(key, value)]]),
            usage: None,
        };
        match self {
            Self::Boundary => Some(
                (0..200)
                    .map(|i| {
                        let t = if i < 100 { 59_900 * MS } else { 60_100 * MS };
                        at(t, "boundary", "client", "a")
                    })
                    .collect(),
            ),
            Self::Stampede | Self::Delay => {
                // Evenly over [59 s, 60 s) and [60 s, 61 s), each arrival sent to both rules.
                let spread =
                    |start: u64, n: u64| (0..n).map(move |i| start + i * NANOS_PER_SEC / n);
                let times =
                    spread(59 * NANOS_PER_SEC, 2_500).chain(spread(60 * NANOS_PER_SEC, 2_300));
                let (domain, key, values) = if self == Self::Stampede {
                    ("stampede", "burst", ["inherited", "chosen"])
                } else {
                    ("delay", "rule", ["refusing", "delaying"])
                };
                Some(
                    times
                        .flat_map(|t| values.map(|v| at(t, domain, key, v)))
                        .collect(),
                )
            }
            Self::RetryStorm => None,
            Self::Tokens => Some(
                (0..TOKEN_CALLS)
                    .map(|i| Event {
                        t: (TOKENS_START_SECONDS + i) * NANOS_PER_SEC,
                        request: Request::from_entries("ai", &[&[("tenant", "a")]]),
                        usage: Some(Usage {
                            tokens: 500 + splitmix(i) % 1_001,
                            duration: NANOS_PER_SEC + splitmix(i | 1 << 32) % 3_000 * MS,
                        }),
                    })
                    .collect(),
            ),
        }
    }
}

/// Runs a scenario through every algorithm.
///
/// # Errors
///
/// [`ReplayError`], which a built-in scenario never causes.
pub fn run(scenario: Scenario, lab: impl Fn(&[Algorithm]) -> Lab) -> Result<Report, ReplayError> {
    if let Some(trace) = scenario.trace() {
        let mut lab = lab(scenario.algorithms());
        for e in &trace {
            match e.usage {
                Some(usage) => lab.offer_usage(e.t, &e.request, usage)?,
                None => lab.offer(e.t, &e.request)?,
            };
        }
        return lab.finish();
    }
    let mut report = Report::default();
    for a in Algorithm::ALL {
        let mut lab = lab(&[a]);
        storm(&mut lab)?;
        report.merge(lab.finish()?);
    }
    Ok(report)
}

/// The retry storm on one lab: both client groups arrive evenly over [50 s, 60 s); a refused
/// client comes back `Retry-After` seconds later (plus a jitter in [0, 30 s) for the jittered
/// group), at most [`STORM_ATTEMPTS`] times in all.
fn storm(lab: &mut Lab) -> Result<(), ReplayError> {
    let groups = ["lockstep", "jittered"];
    let requests: Vec<Request> = groups
        .iter()
        .map(|g| Request::from_entries("retry", &[&[("clients", g)]]))
        .collect();
    // (time, client, group, attempt), earliest first.
    let mut queue = BinaryHeap::new();
    for c in 0..STORM_CLIENTS {
        let t = 50 * NANOS_PER_SEC + c * 10 * NANOS_PER_SEC / STORM_CLIENTS;
        for g in 0..groups.len() {
            queue.push(Reverse((t, c, g, 1u32)));
        }
    }
    while let Some(Reverse((t, client, group, attempt))) = queue.pop() {
        let verdicts = lab.offer(t, &requests[group])?;
        let Some(v) = verdicts.first() else { continue };
        if v.admitted || attempt >= STORM_ATTEMPTS {
            continue;
        }
        let jitter = if group == 1 {
            splitmix(client << 8 | u64::from(attempt)) % (STORM_JITTER_SECONDS * NANOS_PER_SEC)
        } else {
            0
        };
        let back = t + v.retry_after.max(1) * NANOS_PER_SEC + jitter;
        queue.push(Reverse((back, client, group, attempt + 1)));
    }
    Ok(())
}

/// A fixed, well-mixed pseudo-random number for `x` (SplitMix64), so runs repeat exactly.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_policies_load_and_traces_hold_what_the_essay_says() {
        for s in [
            Scenario::Boundary,
            Scenario::Stampede,
            Scenario::RetryStorm,
            Scenario::Tokens,
            Scenario::Delay,
        ] {
            let set = s.policies().unwrap();
            assert_eq!(set.summary().files, 1, "{s:?}");
        }
        let boundary = Scenario::Boundary.trace().unwrap();
        assert_eq!(boundary.len(), 200);
        assert_eq!((boundary[0].t, boundary[199].t), (59_900 * MS, 60_100 * MS));
        // 2500 + 2300 arrivals, each sent to both rules.
        let stampede = Scenario::Stampede.trace().unwrap();
        assert_eq!(stampede.len(), 2 * 4_800);
        assert_eq!(stampede[0].t, 59 * NANOS_PER_SEC);
        assert_eq!(stampede[2 * 2_500].t, 60 * NANOS_PER_SEC);
        assert!(
            stampede.windows(2).all(|w| w[0].t <= w[1].t),
            "in time order"
        );
        assert!(Scenario::RetryStorm.trace().is_none());
        // The delay scenario is the stampede's arrivals, sent to its own two rules.
        let delay = Scenario::Delay.trace().unwrap();
        assert_eq!(delay.len(), stampede.len());
        assert!(delay.iter().zip(&stampede).all(|(d, s)| d.t == s.t));
        assert_eq!(delay[1].request.domain, "delay");
        let tokens = Scenario::Tokens.trace().unwrap();
        assert_eq!(tokens.len(), 180);
        assert!(tokens.iter().all(
            |e| e.usage.is_some_and(|u| (500..=1_500).contains(&u.tokens)
                && (NANOS_PER_SEC..4 * NANOS_PER_SEC).contains(&u.duration))
        ));
        assert_ne!(splitmix(1), splitmix(2));
    }
}
