//! The fleet: this node's parts of the rules its streams watch, renewed in the rules' fleet
//! tables so that the sluice nodes behind one Service hand out one budget. Each rule's part is
//! renewed every tick with the node's demand for it and lives a TTL unrenewed; a rule no stream
//! watches any more is given up at the next tick, and every rule at stop. A rule whose part the
//! table has not told (it cannot answer) is divided as if this node held the part `unknown`
//! says, or not assigned until told (as `on_backend_error` has it); a part once told is kept
//! while the table is away, until [`ShareTable::demands`] finds it stale.
//!
//! Transport-free and runtime-free: time is the crate's [`Clock`], the tables are a
//! [`FleetTable`] (Redis's is `limiter::redis::fleet`, which batches a tick's rules into a few
//! script calls), and the server's loop calls [`Rounds::tick`] every [`tick_interval`] and
//! [`Rounds::stop`] at shutdown.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::{RuleDemand, ShareTable, tick_interval};
use crate::limiter::BackendError;
use crate::limiter::clock::Clock;
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::fleet::{FleetAsk, Millionths, RuleRenewal};

/// Where the fleet's parts are kept: one entry per node in each rule's table.
pub trait FleetTable: Send + Sync {
    /// Renews this node's entry in the table of each of `rules` with its demand, to live
    /// `lifetime` unrenewed: each rule's part, in order, in millionths of the rule, or why it
    /// was not renewed.
    fn renew<'a>(
        &'a self,
        rules: &'a [RuleDemand],
        lifetime: Duration,
    ) -> BoxFuture<'a, Vec<Result<Millionths, BackendError>>>;

    /// Gives up this node's entry in the table of each of `rules`. An entry not given up lapses
    /// within its lifetime.
    fn leave<'a>(&'a self, rules: &'a [RuleDemand]) -> BoxFuture<'a, ()>;
}

/// The rules as the Redis fleet tables are told of them.
fn renewals(rules: &[RuleDemand]) -> Vec<RuleRenewal> {
    rules
        .iter()
        .map(|r| RuleRenewal {
            counter: r.counter,
            quota: r.quota,
            demand: r.tokens,
        })
        .collect()
}

impl FleetTable for RedisStore {
    fn renew<'a>(
        &'a self,
        rules: &'a [RuleDemand],
        lifetime: Duration,
    ) -> BoxFuture<'a, Vec<Result<Millionths, BackendError>>> {
        Box::pin(async move {
            self.parts_call(&renewals(rules), FleetAsk::Renew { lifetime })
                .await
        })
    }

    fn leave<'a>(&'a self, rules: &'a [RuleDemand]) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let _ = self.parts_call(&renewals(rules), FleetAsk::Leave).await;
        })
    }
}

/// This node's parts of `table`'s rules, kept in a [`FleetTable`].
#[derive(Clone)]
pub struct Fleet {
    table: Arc<ShareTable>,
    store: Arc<dyn FleetTable>,
    clock: Arc<dyn Clock>,
    /// The part of a rule assumed before the table has told this node its own (`None`: assign
    /// nothing until it has).
    unknown: Arc<dyn Fn() -> Option<f64> + Send + Sync>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").finish_non_exhaustive()
    }
}

impl Fleet {
    /// The fleet of `table`'s rules kept in `store`, at `clock`'s time, assuming `unknown()` of a
    /// rule whose part the table has not told.
    pub fn new(
        table: Arc<ShareTable>,
        store: Arc<dyn FleetTable>,
        clock: Arc<dyn Clock>,
        unknown: Arc<dyn Fn() -> Option<f64> + Send + Sync>,
    ) -> Self {
        table.set_unknown_part(unknown());
        Self {
            table,
            store,
            clock,
            unknown,
        }
    }

    /// How often [`Rounds::tick`] is due.
    #[must_use]
    pub fn tick_interval(&self) -> Duration {
        tick_interval(self.table.settings().assignment_ttl)
    }

    /// Renews each of `rules` with its demand, and records the part each is told, as of when
    /// the renewal was sent (its entry lives a TTL from no earlier than that). A stream asks
    /// this of the rules its new buckets join before their first assignment.
    pub async fn renew(&self, rules: &[RuleDemand]) {
        if rules.is_empty() {
            return;
        }
        self.table.set_unknown_part((self.unknown)());
        let sent = self.clock.now();
        let lifetime = self.table.settings().assignment_ttl;
        let answers = self.store.renew(rules, lifetime).await;
        for (rule, answer) in rules.iter().zip(answers) {
            match answer {
                Ok(part) => self.table.set_part(rule.counter, u64::from(part), sent),
                // The store's metrics count it. The part is unconfirmed: no assignment of the
                // rule is sent until a renewal succeeds, and the part is dropped once three
                // quarters of a TTL old (`ShareTable::demands`).
                Err(e) => {
                    tracing::debug!(error = %e, "a quota part was not renewed");
                    self.table.set_unconfirmed(rule.counter);
                }
            }
        }
    }

    /// The rounds of renewals, from none held.
    #[must_use]
    pub fn rounds(&self) -> Rounds {
        Rounds {
            fleet: self.clone(),
            held: Vec::new(),
        }
    }
}

/// The fleet's rounds: the rules renewed at the last tick, to be given up once no stream
/// watches them.
#[derive(Debug)]
pub struct Rounds {
    fleet: Fleet,
    held: Vec<RuleDemand>,
}

impl Rounds {
    /// One tick: gives up the rules no stream watches any more, then renews every watched rule.
    pub async fn tick(&mut self) {
        let fleet = &self.fleet;
        let rules = fleet.table.demands(fleet.clock.now());
        let watched: std::collections::HashSet<u128> = rules.iter().map(|r| r.counter).collect();
        let gone: Vec<RuleDemand> = self
            .held
            .iter()
            .filter(|h| !watched.contains(&h.counter))
            .copied()
            .collect();
        if !gone.is_empty() {
            fleet.store.leave(&gone).await;
        }
        fleet.renew(&rules).await;
        self.held = rules;
    }

    /// Gives up every rule held.
    pub async fn stop(self) {
        if !self.held.is_empty() {
            self.fleet.store.leave(&self.held).await;
        }
    }

    /// The rules held, by counter.
    #[must_use]
    pub fn held(&self) -> Vec<u128> {
        self.held.iter().map(|r| r.counter).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;
    use crate::limiter::clock::ManualClock;
    use crate::policy::PolicyHandle;
    use crate::rlqs::{Report, RlqsSettings};

    const SEC: u64 = 1_000_000_000;

    /// A fleet table in memory: the part it tells each rule, the rules it fails, and what it
    /// was asked.
    #[derive(Default)]
    struct Tables {
        parts: Mutex<HashMap<u128, Millionths>>,
        failing: Mutex<Vec<u128>>,
        renewed: Mutex<Vec<Vec<u128>>>,
        left: Mutex<Vec<u128>>,
    }

    impl FleetTable for Tables {
        fn renew<'a>(
            &'a self,
            rules: &'a [RuleDemand],
            _lifetime: Duration,
        ) -> BoxFuture<'a, Vec<Result<Millionths, BackendError>>> {
            let parts = self.parts.lock().unwrap();
            let failing = self.failing.lock().unwrap();
            self.renewed
                .lock()
                .unwrap()
                .push(rules.iter().map(|r| r.counter).collect());
            let answers = rules
                .iter()
                .map(|r| {
                    if failing.contains(&r.counter) {
                        Err(BackendError::NotConnected)
                    } else {
                        Ok(parts.get(&r.counter).copied().unwrap_or(1_000_000))
                    }
                })
                .collect();
            Box::pin(std::future::ready(answers))
        }

        fn leave<'a>(&'a self, rules: &'a [RuleDemand]) -> BoxFuture<'a, ()> {
            self.left
                .lock()
                .unwrap()
                .extend(rules.iter().map(|r| r.counter));
            Box::pin(std::future::ready(()))
        }
    }

    fn table() -> Arc<ShareTable> {
        let set = crate::policy::load_str(&[(
            "d.yaml",
            "domain: d
descriptors:
  - key: tenant
    rate_limits:
      - {unit: second, requests_per_unit: 100}
",
        )])
        .expect("policy");
        let settings = RlqsSettings {
            assignment_ttl: Duration::from_secs(4),
            max_buckets_per_stream: 100,
            max_streams: 10,
            max_streams_per_connection: 10,
            max_streams_per_peer: 10,
        };
        Arc::new(ShareTable::new(settings, PolicyHandle::new(set)))
    }

    fn report(tenant: &str) -> Report {
        Report {
            bucket: crate::rlqs::key::flat(&[("tenant".to_string(), tenant.to_string())].into()),
            elapsed_ns: SEC,
            requests: 50,
        }
    }

    /// A token bucket's rate, or none.
    fn rate(actions: &[crate::rlqs::Action]) -> Option<f64> {
        actions.iter().find_map(|a| match a.kind {
            crate::rlqs::ActionKind::Assign(crate::rlqs::Strategy::TokenBucket(b)) => {
                Some(b.rate())
            }
            _ => None,
        })
    }

    /// A table, its fleet table in memory, a manual clock, and the fleet's rounds over them.
    fn setup() -> (Arc<ShareTable>, Arc<Tables>, Arc<ManualClock>, Rounds) {
        let (table, tables, clock) = (table(), Arc::new(Tables::default()), Arc::default());
        let store: Arc<dyn FleetTable> = Arc::clone(&tables) as Arc<dyn FleetTable>;
        let at: Arc<dyn Clock> = Arc::clone(&clock) as Arc<dyn Clock>;
        let unknown: Arc<dyn Fn() -> Option<f64> + Send + Sync> = Arc::new(|| None);
        let rounds = Fleet::new(Arc::clone(&table), store, at, unknown).rounds();
        (table, tables, clock, rounds)
    }

    /// Runs a future that never waits (the fake table answers at once).
    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        use std::task::{Context, Poll, Waker};
        let mut f = std::pin::pin!(f);
        let mut cx = Context::from_waker(Waker::noop());
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(out) => out,
            Poll::Pending => panic!("the fake fleet table never waits"),
        }
    }

    #[test]
    fn a_tick_renews_every_watched_rule_and_sets_its_part() {
        let (table, tables, clock, mut rounds) = setup();
        let mut watcher = table.open("d".into()).unwrap();
        // Before the table has told a part, nothing is assigned (`unknown` is none).
        assert_eq!(rate(&watcher.report(0, vec![report("a")])), None);
        let counter = {
            block_on(rounds.tick());
            let held = rounds.held();
            assert_eq!(held.len(), 1, "one rule watched");
            held[0]
        };
        tables.parts.lock().unwrap().insert(counter, 250_000);
        clock.advance(SEC);
        block_on(rounds.tick());
        assert_eq!(
            tables.renewed.lock().unwrap().len(),
            2,
            "one renewal a tick"
        );
        let actions = watcher.tick(clock.now());
        let assigned =
            rate(&actions).or_else(|| rate(&watcher.report(clock.now(), vec![report("a")])));
        assert!(
            assigned.is_some_and(|r| r <= 25.0 && r > 0.0),
            "a quarter of the rule's 100/s: {assigned:?}"
        );
    }

    #[test]
    fn a_failed_renewal_leaves_the_part_unconfirmed() {
        let (table, tables, clock, mut rounds) = setup();
        let mut streams = Vec::new();
        // What a new stream watching tenant `a` is assigned now.
        let mut join = |now| {
            let mut w = table.open("d".into()).unwrap();
            let r = rate(&w.report(now, vec![report("a")]));
            streams.push(w);
            r
        };
        join(0);
        block_on(rounds.tick());
        let counter = rounds.held()[0];
        assert!(join(0).is_some(), "told: the whole rule");
        tables.failing.lock().unwrap().push(counter);
        clock.advance(SEC);
        block_on(rounds.tick());
        assert_eq!(join(clock.now()), None, "unconfirmed: nothing is sent");
        tables.failing.lock().unwrap().clear();
        clock.advance(SEC);
        block_on(rounds.tick());
        assert!(
            join(clock.now()).is_some(),
            "confirmed again by the next renewal"
        );
    }

    #[test]
    fn a_rule_no_longer_watched_is_given_up_and_all_at_stop() {
        let (table, tables, clock, mut rounds) = setup();
        let mut one = table.open("d".into()).unwrap();
        let mut two = table.open("d".into()).unwrap();
        one.report(0, vec![report("a")]);
        two.report(0, vec![report("b")]);
        block_on(rounds.tick());
        let held = rounds.held();
        assert_eq!(held.len(), 2);
        assert!(tables.left.lock().unwrap().is_empty());
        drop(one);
        clock.advance(SEC);
        block_on(rounds.tick());
        let left = tables.left.lock().unwrap().clone();
        assert_eq!(left.len(), 1, "the rule of the stream gone: {left:?}");
        let kept = rounds.held();
        assert_eq!(kept.len(), 1);
        assert!(!left.contains(&kept[0]));
        block_on(rounds.stop());
        let left = tables.left.lock().unwrap().clone();
        assert_eq!(left.len(), 2, "every rule given up at stop");
        assert!(left.contains(&kept[0]));
        drop(two);
    }

    #[test]
    fn the_tick_is_a_quarter_of_the_ttl_within_bounds() {
        assert_eq!(
            tick_interval(Duration::from_secs(2)),
            Duration::from_millis(500)
        );
        assert_eq!(
            tick_interval(Duration::from_secs(60)),
            Duration::from_secs(1)
        );
        assert_eq!(
            tick_interval(Duration::from_millis(8)),
            Duration::from_millis(10)
        );
    }
}
