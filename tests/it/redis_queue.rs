//! The queue of calls in front of one Redis node when Redis stops answering (`SIGSTOP`) under
//! load: bounded, so a call past it fails at once for `on_backend_error` to answer; and a call
//! whose caller stopped waiting charges nothing once Redis answers again when it was still
//! queued (dropped) or answered late (given back), leaving at most the calls in flight; and
//! calls that go on coming while Redis stays paused are answered at once, unsent, so they
//! charge nothing either.

use std::sync::Arc;
use std::time::Duration;

use sluice::limiter::gcra::NANOS_PER_SEC;
use sluice::limiter::{
    BackendError, Charge, Mode, MonotonicClock, Op, Quota, RedisConfig, RedisStore, RedisTime,
};

use crate::helpers::redis::{RedisProcess, config};
use crate::helpers::{eventually, redis_missing};

/// Calls fired at once while Redis is paused: more than the queue holds.
const CALLS: usize = 3_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_nobody_waits_for_charge_nothing_when_redis_resumes() {
    if redis_missing("calls_nobody_waits_for_charge_nothing_when_redis_resumes") {
        return;
    }
    let redis = RedisProcess::start();
    let store = connected(config(&redis.url()), Duration::from_millis(100));
    // A million a day: T = 86.4 ms, so what the calls could charge does not come back on its
    // own while the test waits (a hundred tokens in ten seconds).
    let quota = Quota::new(86_400 * NANOS_PER_SEC, 1_000_000, 1_000_000).unwrap();
    let op = move |cost| Op {
        key: 7,
        quota,
        cost,
        charge: Charge::Ask,
        mode: Mode::Enforce,
    };
    let remaining = move |store: Arc<RedisStore>| async move {
        store
            .count_batch(&[op(0)])
            .await
            .ok()
            .map(|b| b.outcomes[0].remaining)
    };
    assert!(
        eventually(Duration::from_secs(10), || {
            let s = Arc::clone(&store);
            async move { remaining(s).await == Some(1_000_000) }
        })
        .await,
        "redis never answered"
    );

    redis.pause();
    let calls: Vec<_> = (0..CALLS)
        .map(|_| {
            let s = Arc::clone(&store);
            tokio::spawn(async move { s.count_batch(&[op(1)]).await })
        })
        .collect();
    let (mut full, mut timed_out) = (0, 0);
    for call in calls {
        match call.await.unwrap() {
            Err(BackendError::QueueFull) => full += 1,
            Err(BackendError::Timeout(_)) => timed_out += 1,
            other => panic!("a call to a paused redis answered {other:?}"),
        }
    }
    assert!(full > 0, "the queue never filled: {timed_out} timed out");
    redis.resume();

    // Nothing still queued is sent, and what Redis answers after its caller left is given back.
    // Only the calls in flight when Redis stopped, which the connection gave up on at its own
    // deadline, may still be carried out when it resumes: at most four calls of 128 requests.
    // Without the drop and the give-back, more than a thousand were charged here.
    let in_flight = 4 * 128;
    assert!(
        eventually(Duration::from_secs(10), || {
            let s = Arc::clone(&store);
            async move {
                remaining(s)
                    .await
                    .is_some_and(|r| r >= 1_000_000 - in_flight)
            }
        })
        .await,
        "after resuming, {:?} left of 1,000,000 ({full} refused at the queue, {timed_out} timed out)",
        remaining(Arc::clone(&store)).await
    );
}

/// Calls that keep coming while Redis stays paused: once a call has timed out the connection
/// sends nothing more until Redis answers a probe, so what Redis charges when it resumes is still
/// at most the calls in flight when it stopped, however long the pause. Without that, each call
/// sent behind the unanswered ones waited in Redis's socket and was charged on resuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_during_a_long_pause_charge_nothing_when_redis_resumes() {
    if redis_missing("calls_during_a_long_pause_charge_nothing_when_redis_resumes") {
        return;
    }
    let redis = RedisProcess::start();
    // A million a day: the lean script, in coalesced calls of at most 128 requests, four out at
    // once.
    let quota = Quota::new(86_400 * NANOS_PER_SEC, 1_000_000, 1_000_000).unwrap();
    let pause = LongPause::new(config(&redis.url()), quota).await;
    redis.pause();
    pause.call_while_paused().await;
    redis.resume();
    pause.charged_at_most(4 * 128).await;
}

/// The same for a rule the exact script decides (a million a year: its period is past what a
/// double holds), whose requests are sent one call each, beside the coalescer: the connection
/// is stalled for them in the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_calls_during_a_long_pause_charge_nothing_when_redis_resumes() {
    if redis_missing("exact_calls_during_a_long_pause_charge_nothing_when_redis_resumes") {
        return;
    }
    let redis = RedisProcess::start();
    let quota = Quota::new(365 * 86_400 * NANOS_PER_SEC, 1_000_000, 1_000_000).unwrap();
    let pause = LongPause::new(config(&redis.url()), quota).await;
    redis.pause();
    pause.call_while_paused().await;
    redis.resume();
    pause.charged_at_most(EXACT_IN_FLIGHT).await;
}

/// The calls of one request each that may be out when Redis stops answering, before the first
/// of them reaches its deadline: those of the first ten rounds (100 ms, five deadlines).
const EXACT_IN_FLIGHT: u64 = 100;

/// A store connecting in the background, its calls given `timeout`. A slow Redis never trips its
/// breaker: every call waits for its deadline.
fn connected(mut settings: RedisConfig, timeout: Duration) -> Arc<RedisStore> {
    settings.timeout = timeout;
    settings.breaker_failures = 0;
    let store =
        RedisStore::new(settings, Arc::new(MonotonicClock::new()), RedisTime::Server).unwrap();
    let connecting = Arc::clone(&store);
    tokio::spawn(async move { connecting.connect().await });
    store
}

/// A connected store whose calls have a 20-ms deadline and no breaker, and a counter of a
/// million tokens under `quota`, full.
struct LongPause {
    store: Arc<RedisStore>,
    quota: Quota,
}

impl LongPause {
    async fn new(settings: RedisConfig, quota: Quota) -> Self {
        let store = connected(settings, Duration::from_millis(20));
        let pause = Self { store, quota };
        assert!(
            eventually(Duration::from_secs(10), || pause.remaining_is(1_000_000)).await,
            "redis never answered"
        );
        pause
    }

    fn op(&self, cost: u64) -> Op {
        Op {
            key: 8,
            quota: self.quota,
            cost,
            charge: Charge::Ask,
            mode: Mode::Enforce,
        }
    }

    async fn remaining(&self) -> Option<u64> {
        self.store
            .count_batch(&[self.op(0)])
            .await
            .ok()
            .map(|b| b.outcomes[0].remaining)
    }

    async fn remaining_is(&self, n: u64) -> bool {
        self.remaining().await == Some(n)
    }

    /// Ten calls every 10 ms for 2 s, Redis paused: a hundred deadlines of the connection's.
    /// Every call fails (the test's `on_backend_error` would answer it).
    async fn call_while_paused(&self) {
        let mut calls = Vec::new();
        for _ in 0..200 {
            for _ in 0..10 {
                let s = Arc::clone(&self.store);
                let op = self.op(1);
                calls.push(tokio::spawn(async move { s.count_batch(&[op]).await }));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for call in calls {
            match call.await.unwrap() {
                Err(BackendError::QueueFull | BackendError::Timeout(_)) => {}
                other => panic!("a call to a paused redis answered {other:?}"),
            }
        }
    }

    /// Once Redis answers again, at most `in_flight` of the calls made while it was paused were
    /// charged, however long it is waited for.
    async fn charged_at_most(&self, in_flight: u64) {
        let settled = eventually(Duration::from_secs(10), || async {
            self.remaining()
                .await
                .is_some_and(|r| r >= 1_000_000 - in_flight)
        })
        .await;
        // What was left in Redis's sockets is carried out as it resumes: a second look finds it.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let left = self.remaining().await;
        assert!(
            settled && left.is_some_and(|r| r >= 1_000_000 - in_flight),
            "after resuming, {left:?} left of 1,000,000 after 2,000 calls answered otherwise"
        );
    }
}
