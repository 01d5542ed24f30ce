//! This node's parts of RLQS rules, kept in the rules' fleet tables in Redis: the table's key,
//! `fleet.lua`'s arguments and reply, and the batching of a tick's renewals (or leaves) into
//! script calls of at most [`RULES_PER_CALL`] rules. Which rules are renewed, and when, is the
//! quota service's (`crate::rlqs`); the division of a rule is `fleet.lua`'s.
//!
//! On a single Redis (or the master Sentinel names) a batch is any [`RULES_PER_CALL`] rules, and
//! the calls go one after another, so that a tick's renewals never hold Redis for longer than
//! one call at a time. On Redis Cluster a script's keys share a hash slot: the rules are grouped
//! by slot (each fleet table is in its counter's), each group cut into calls of at most
//! [`RULES_PER_CALL`], and [`CLUSTER_CALLS_AT_ONCE`] calls are out at once.

use std::sync::LazyLock;
use std::time::Duration;

use futures_util::StreamExt;
use redis::{Script, Value};

use crate::limiter::error::BackendError;
use crate::limiter::figures::Purpose;
use crate::limiter::gcra::Quota;
use crate::limiter::key::Key;
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::connect::RedisConn;
use crate::limiter::redis::share::beside;
use crate::limiter::redis::slot::group_by_slot;

/// `fleet.lua`, loaded once per process.
static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(super::scripts::FLEET));

/// Most rules in one script call. Each costs Redis a table read, a write and an expiry: at this
/// many a call holds Redis for a fraction of the default 10 ms deadline (`redis.timeout_ms`;
/// BENCHMARKS.md states its time), and a request counted meanwhile waits behind one call at
/// most, while 10,000 rules are 50 calls.
pub const RULES_PER_CALL: usize = 200;

/// Script calls out at once on Redis Cluster, each to the node of its slot.
pub const CLUSTER_CALLS_AT_ONCE: usize = 64;

/// The fleet table of the RLQS rule counted at `counter`: beside it in its cluster slot as the
/// share table is (`share::table_key`), apart from it, so that nodes handing a rule to Envoys
/// never divide it with nodes that lease it.
#[must_use]
pub fn fleet_table_key(counter: &str) -> String {
    beside(counter, "quotas")
}

/// One rule as a renewal tells its fleet table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RuleRenewal {
    /// The rule's counter.
    pub counter: Key,
    /// The rule's quota (its rate is what the table divides).
    pub quota: Quota,
    /// What this node's streams ask of the rule, in the counter's tokens per second.
    pub demand: f64,
}

/// What a fleet call does with this node's entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FleetAsk {
    /// Renew them for `lifetime`, with each rule's demand.
    Renew {
        /// How long an entry lives unrenewed.
        lifetime: Duration,
    },
    /// Give them up.
    Leave,
}

/// A rule's part as its fleet table told it: millionths of the rule's rate.
pub type Millionths = u32;

/// `fleet.lua`'s answer for one rule: `-1` when its entry was not written.
const NOT_WRITTEN: i64 = -1;

/// Reads `fleet.lua`'s reply to a call of `n` rules: each rule's part (or why it has none), and
/// the tables repaired.
fn parse_fleet(
    reply: &[Value],
    n: usize,
) -> Result<(Vec<Result<Millionths, BackendError>>, u64), BackendError> {
    let bad = || BackendError::Reply(format!("a fleet reply of {} values for {n}", reply.len()));
    if reply.len() != n + 1 {
        return Err(bad());
    }
    let repairs = match reply[n] {
        Value::Int(r) => u64::try_from(r).map_err(|_| bad())?,
        _ => return Err(bad()),
    };
    let parts = reply[..n]
        .iter()
        .map(|v| match *v {
            Value::Int(NOT_WRITTEN) => Ok(Err(BackendError::Reply(
                "a fleet table entry was not written".into(),
            ))),
            Value::Int(p) => u32::try_from(p)
                .ok()
                .filter(|p| *p <= 1_000_000)
                .map(Ok)
                .ok_or_else(bad),
            _ => Err(bad()),
        })
        .collect::<Result<_, _>>()?;
    Ok((parts, repairs))
}

/// `fleet.lua`'s arguments for `rules` (all of them, or those at `idx`): the time, the verb, the
/// holder, the lifetime, and each rule's T and demand when renewing.
fn fleet_args(
    time: Option<u64>,
    holder: &str,
    ask: FleetAsk,
    rules: impl Iterator<Item = RuleRenewal>,
) -> Vec<String> {
    let time = time.map(|n| n.to_string()).unwrap_or_default();
    match ask {
        FleetAsk::Leave => vec![time, "leave".into(), holder.into(), "1".into()],
        FleetAsk::Renew { lifetime } => {
            let ms = u64::try_from(lifetime.as_millis())
                .unwrap_or(u64::MAX)
                .max(1);
            let mut args = vec![time, "renew".into(), holder.into(), ms.to_string()];
            for rule in rules {
                // Precision intended: thousandths of a token per second, as the table keeps
                // them; a demand held at all is at least one, so that a slow rule's part is not
                // rounded away.
                let demand = ((rule.demand.max(0.0) * 1_000.0).ceil().min(1e15) as u64).max(1);
                args.push(rule.quota.interval().to_string());
                args.push(demand.to_string());
            }
            args
        }
    }
}

/// The calls `keys` go in: on a cluster grouped by hash slot, then each group (or, on a single
/// node, all of them) cut into calls of at most [`RULES_PER_CALL`]; each call the indices of its
/// rules.
fn batches(keys: &[String], cluster: bool) -> Vec<Vec<usize>> {
    let groups = if cluster {
        group_by_slot(keys)
            .into_iter()
            .map(|(_, idx)| idx)
            .collect()
    } else {
        vec![(0..keys.len()).collect::<Vec<_>>()]
    };
    groups
        .iter()
        .flat_map(|idx| idx.chunks(RULES_PER_CALL).map(<[usize]>::to_vec))
        .collect()
}

impl RedisStore {
    /// Renews (or gives up, as `ask` says) this node's entry in the fleet table of each of
    /// `rules`, at Redis time (or the store's clock with `RedisTime::Clock`), in calls of at most
    /// [`RULES_PER_CALL`] rules: each rule's part, in order, or the error of its call (or of its
    /// entry). A leave answers a part of 0.
    pub async fn parts_call(
        &self,
        rules: &[RuleRenewal],
        ask: FleetAsk,
    ) -> Vec<Result<Millionths, BackendError>> {
        if rules.is_empty() {
            return Vec::new();
        }
        let cluster = match self.conn.load().as_deref() {
            Some(RedisConn::Cluster(_)) => true,
            Some(RedisConn::Single(_)) => false,
            None => return vec![Err(BackendError::NotConnected); rules.len()],
        };
        let keys: Vec<String> = rules
            .iter()
            .map(|r| fleet_table_key(&self.key(r.counter)))
            .collect();
        let time = self.time_arg(self.clock.now());
        let calls = batches(&keys, cluster).into_iter().map(|idx| {
            let keys: Vec<String> = idx.iter().map(|&i| keys[i].clone()).collect();
            let args = fleet_args(time, &self.quota_holder, ask, idx.iter().map(|&i| rules[i]));
            async move {
                let n = idx.len();
                let reply = self
                    .script_call(&SCRIPT, &keys, &args, Purpose::Quota, |r| {
                        parse_fleet(r, n).map(|parsed| (parsed, false))
                    })
                    .await;
                (idx, reply)
            }
        });
        let at_once = if cluster { CLUSTER_CALLS_AT_ONCE } else { 1 };
        let replies: Vec<_> = futures_util::stream::iter(calls)
            .buffer_unordered(at_once)
            .collect()
            .await;
        let mut answers: Vec<Result<Millionths, BackendError>> =
            vec![Err(BackendError::NotConnected); rules.len()];
        for (idx, reply) in replies {
            match reply {
                Ok((parts, repairs)) => {
                    self.stats.repaired(repairs);
                    for (i, part) in idx.into_iter().zip(parts) {
                        answers[i] = part;
                    }
                }
                Err(e) => {
                    for i in idx {
                        answers[i] = Err(e.clone());
                    }
                }
            }
        }
        answers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fleet_table_is_beside_its_counter() {
        assert_eq!(fleet_table_key("{app}:00ff"), "{app}:00ff:quotas");
        assert_eq!(fleet_table_key("sluice:00ff"), "{sluice:00ff}:quotas");
    }

    #[test]
    fn a_reply_is_a_part_per_rule_and_the_repairs() {
        let ints = |v: &[i64]| v.iter().map(|&i| Value::Int(i)).collect::<Vec<_>>();
        let (parts, repairs) = parse_fleet(&ints(&[250_000, -1, 1_000_000, 2]), 3).unwrap();
        assert_eq!(repairs, 2);
        assert_eq!(parts[0].as_ref().ok(), Some(&250_000));
        assert!(parts[1].is_err(), "an entry not written is no part");
        assert_eq!(parts[2].as_ref().ok(), Some(&1_000_000));
        for bad in [&[0][..], &[1_000_001, 0], &[-2, 0], &[0, -1], &[0, 0, 0]] {
            assert!(parse_fleet(&ints(bad), 1).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_single_node_cuts_calls_by_size_and_a_cluster_by_slot_too() {
        let keys: Vec<String> = (0..450).map(|i| format!("{{t{}}}:x", i % 3)).collect();
        let single = batches(&keys, false);
        assert_eq!(
            single.iter().map(Vec::len).collect::<Vec<_>>(),
            [RULES_PER_CALL, RULES_PER_CALL, 450 - 2 * RULES_PER_CALL]
        );
        let cluster = batches(&keys, true);
        assert_eq!(cluster.len(), 3, "150 rules in each of three slots");
        for call in &cluster {
            assert!(call.len() <= RULES_PER_CALL);
            let tag = &keys[call[0]];
            assert!(call.iter().all(|&i| keys[i] == *tag), "one slot per call");
        }
        let all: usize = cluster.iter().map(Vec::len).sum();
        assert_eq!(all, keys.len(), "every rule once");
    }

    #[test]
    fn a_renewal_states_each_rules_interval_and_demand() {
        let q = Quota::new(1_000_000_000, 100, 100).unwrap();
        let rule = |demand| RuleRenewal {
            counter: 1,
            quota: q,
            demand,
        };
        let ask = FleetAsk::Renew {
            lifetime: Duration::from_secs(2),
        };
        let args = fleet_args(None, "me", ask, [rule(1.5), rule(0.0)].into_iter());
        assert_eq!(
            args,
            [
                "", "renew", "me", "2000", "10000000", "1500", "10000000", "1"
            ]
        );
        let args = fleet_args(Some(7), "me", FleetAsk::Leave, [rule(1.0)].into_iter());
        assert_eq!(args, ["7", "leave", "me", "1"]);
    }
}
