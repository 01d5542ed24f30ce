//! Takes and renewals: the calls that fill a lease, sent in the background and counted in
//! flight so that closing waits for them. A take asks `lease.lua` for a slice of a hot counter's
//! tokens; a renewal asks `share.lua` for a contended counter's share; a give-back returns
//! unused tokens. What a reply does to the lease is the ledger's; here the call is started, sent
//! and its figures counted.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use redis::Script;

use super::{LeasedStore, lock};
use crate::limiter::batch::Op;
use crate::limiter::error::BackendError;
use crate::limiter::figures::Purpose;
use crate::limiter::gcra::Quota;
use crate::limiter::key::Key;
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::call::{LeaseAsk, lease_args, parse_lease};
use crate::limiter::redis::lease::decide::RequestCounter;
use crate::limiter::redis::lease::ledger::Lease;
use crate::limiter::redis::share::{ShareRenewal, ShareReply};
use crate::limiter::share::{Demand, Grant};

/// `lease.lua`, loaded once per process.
static SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(crate::limiter::redis::scripts::LEASE));

impl LeasedStore {
    /// Starts a take for every hot counter of `ops` that has no lease, or one running low, and
    /// a renewal for a shared one that is due; counts a shared counter's hits as demand unless
    /// the caller did (`counted`).
    pub(super) fn start_takes(
        self: &Arc<Self>,
        ops: &[Op],
        counters: &[RequestCounter],
        (now, counted): (u64, bool),
    ) {
        for c in counters {
            if c.rate < self.config.min_rate {
                continue;
            }
            let Some(op) = ops.iter().find(|op| op.key == c.key) else {
                continue;
            };
            let lease = match &c.lease {
                Some(l) => Arc::clone(l),
                None => Arc::clone(
                    &self
                        .leases
                        .entry(c.key)
                        .or_insert_with(|| Arc::new(Mutex::new(Lease::new(op.quota)))),
                ),
            };
            let mut l = lock(&lease);
            l.follow_rule(op.quota, now);
            l.expire(now, self.config.max_age_nanos());
            if let Some(share) = l.share.as_mut() {
                if !counted {
                    let hits = ops.iter().filter(|o| o.key == c.key && !o.is_refund());
                    share.demand.hit(hits.map(|o| o.cost).sum());
                }
                self.start_renewal(c.key, &mut l, now);
                continue;
            }
            let low = l.low_water(self.config.low_water);
            if l.unused() <= low {
                let ask = self.config.slice(&op.quota, c.rate);
                self.start_take(c.key, &mut l, (ask, c.rate), now);
            }
        }
    }

    /// Sends a take of `ask` tokens for `key`, used at `rate` hits a second here, in the
    /// background, unless leasing is closed or the lease says not now
    /// ([`Lease::begin_take`]).
    pub(super) fn start_take(
        self: &Arc<Self>,
        key: Key,
        lease: &mut Lease,
        (ask, rate): (u64, u64),
        now: u64,
    ) {
        if self.closed.load(Ordering::SeqCst) || !lease.begin_take(ask, now) {
            return;
        }
        let quota = lease.quota;
        self.spawn_call(move |this| async move { this.take(key, quota, (ask, rate), now).await });
    }

    /// Sends the renewal of `key`'s share in the background when it is due, unless leasing is
    /// closed or the lease says not now ([`Lease::begin_renewal`]).
    pub(super) fn start_renewal(self: &Arc<Self>, key: Key, lease: &mut Lease, now: u64) {
        if self.closed.load(Ordering::SeqCst) {
            return;
        }
        let Some((demand, held)) = lease.begin_renewal(now) else {
            return;
        };
        let quota = lease.quota;
        self.spawn_call(move |this| async move {
            this.renew(key, quota, (demand, held), now).await;
        });
    }

    /// Runs the call `call` makes of this store in the background, counted in `in_flight`
    /// until it ends (so that closing waits for it).
    fn spawn_call<F>(self: &Arc<Self>, call: impl FnOnce(Arc<Self>) -> F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let this = Arc::clone(self);
        let call = call(Arc::clone(self));
        tokio::spawn(async move {
            call.await;
            this.in_flight.fetch_sub(1, Ordering::SeqCst);
        });
    }

    /// The renewal of one share, as a [`ShareRenewal`] of this node.
    pub(super) fn renewal(&self, demand: f64, held: u64, leave: bool) -> ShareRenewal<'_> {
        ShareRenewal {
            holder: &self.node,
            demand,
            held,
            period: Duration::from_nanos(self.config.renewal_period()),
            lifetime: self.config.max_age,
            horizon: self.config.horizon(),
            leave,
        }
    }

    /// One renewal: this node's demand sent, its share and the share's tokens for the next
    /// period received. A counter no longer contended goes back to slices; a failed renewal
    /// drops the share too, so that the next request meets the failure on the exact path (and
    /// the local fallback, which keeps the share in the book).
    async fn renew(&self, key: Key, quota: Quota, (demand, held): (f64, u64), sent: u64) {
        let renewal = self.renewal(demand, held, false);
        let result = self.redis.share_call(key, &quota, &renewal, sent).await;
        let Some(lease) = self.leases.get(&key).map(|l| Arc::clone(&l)) else {
            if let Ok(r) = result {
                self.give_back(key, &quota, r.granted).await;
            }
            return;
        };
        let received = self.clock.now();
        let mut l = lock(&lease);
        let r: ShareReply = match result {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "share renewal failed");
                l.renewal_failed(received.saturating_add(self.config.max_age_nanos()));
                return;
            }
        };
        self.stats.share_renewals.fetch_add(1, Ordering::Relaxed);
        let period = self.config.renewal_period();
        if l.renewed(quota, &r, period, (sent, received)) && r.millionths > 0 {
            let share = quota.portion(r.millionths, r.burst);
            self.book.hold(key, Grant { quota, share });
        } else {
            // No longer shared; or nothing granted yet (the others hold the rate until they
            // renew): local mode counts this node at rate/N, not at a ban.
            self.book.release(key);
        }
        self.count_granted(r.granted);
    }

    /// One take: charges up to `ask` tokens in Redis and adds what was granted to the lease;
    /// a counter that proves contended gets a share.
    async fn take(&self, key: Key, quota: Quota, (ask, rate): (u64, u64), sent: u64) {
        let result = self
            .redis
            .lease_call(
                key,
                &quota,
                LeaseAsk::Take(self.config.horizon()),
                ask,
                sent,
            )
            .await;
        let Some(lease) = self.leases.get(&key).map(|l| Arc::clone(&l)) else {
            // The lease was dropped meanwhile (never while a take is in flight); give back.
            if let Ok((granted, _, _)) = result {
                self.give_back(key, &quota, granted).await;
            }
            return;
        };
        let received = self.clock.now();
        let mut l = lock(&lease);
        match result {
            Ok((granted, debt, wait)) => {
                self.count_granted(granted);
                if l.taken(quota, ask, (granted, debt, wait), (sent, received)) {
                    // Its demand measured over the time its hits were counted, which may be
                    // part of a second: never that count taken for a rate.
                    let demand = match self.heat.seen(key, received) {
                        Some((hits, since)) => Demand::counted(hits, since),
                        // Precision intended: a rate.
                        None => Demand::new(rate as f64, received),
                    };
                    l.hold_share(demand, received, debt);
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "lease take failed");
                l.take_failed(self.clock.now().saturating_add(self.config.max_age_nanos()));
            }
        }
    }

    /// Counts a slice a take or renewal was granted.
    fn count_granted(&self, granted: u64) {
        if granted > 0 {
            self.stats.slices.fetch_add(1, Ordering::Relaxed);
            self.stats
                .tokens_taken
                .fetch_add(granted, Ordering::Relaxed);
        }
    }

    /// Gives `n` unused tokens of `key` back to the shared bucket.
    pub(super) async fn give_back(&self, key: Key, quota: &Quota, n: u64) {
        if n == 0 {
            return;
        }
        let now = self.clock.now();
        match self
            .redis
            .lease_call(key, quota, LeaseAsk::Give, n, now)
            .await
        {
            Ok(_) => {
                self.stats.tokens_returned.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                // Lost, not over-admitted: the shared bucket refills them at its own pace.
                tracing::debug!(error = %e, tokens = n, "lease give-back failed");
            }
        }
    }
}

impl RedisStore {
    /// One `lease.lua` call on `key`: take up to `n` tokens (some of them reserved ahead, see
    /// `lease.lua`), or give `n` back. `now` is the decision time with
    /// [`RedisTime::Clock`](crate::limiter::redis::RedisTime::Clock). Returns (granted, debt
    /// after, wait until one token can be reserved when none was granted), in tokens and
    /// nanoseconds.
    async fn lease_call(
        &self,
        key: Key,
        quota: &Quota,
        ask: LeaseAsk,
        n: u64,
        now: u64,
    ) -> Result<(u64, u64, u64), BackendError> {
        let args = lease_args(quota, ask, n, self.time_arg(now));
        let purpose = match ask {
            LeaseAsk::Take(_) => Purpose::Take,
            LeaseAsk::Give => Purpose::Give,
        };
        let r = self
            .script_call(&SCRIPT, &[self.key(key)], &args, purpose, |v| {
                parse_lease(v).map(|r| (r, r.repaired))
            })
            .await?;
        Ok((r.granted, r.debt, r.wait))
    }
}
