//! The GCRA correctness properties of `docs/gcra-properties.md` that apply to one node
//! (P1–P14, P16 and refunds), checked against the in-memory store with explicit integer-nanosecond
//! time: every `now` is an argument (or a [`ManualClock`]), nothing sleeps. Only the limiter:
//! policies, the decider and the wire are `decision`'s unit tests' and `service.rs`'s.
//!
//! `T` is always `quota.interval()` and `B` is `quota.burst()`, the values the implementation
//! uses. Case counts and schedule lengths are bounded so the file runs in seconds in debug.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

use futures_util::FutureExt;
use proptest::prelude::*;
use sluice::limiter::gcra::{CounterOutcome, NANOS_PER_SEC, decide, record, refund};
use sluice::limiter::{Backend, Batch, Charge, Clock, ManualClock, MemoryStore, Mode, Op, Quota};

const SEC: u64 = NANOS_PER_SEC;
const DAY: u64 = 86_400 * SEC;
const KEY: u128 = 0x5eed;
const CASES: u32 = 256;

// ---------------------------------------------------------------------------------------------
// Generators and helpers
// ---------------------------------------------------------------------------------------------

/// A quota with burst in `1..=max_burst`: round periods (1 s, 1 min, 1 h) with R up to 1000,
/// arbitrary periods from 1 ms to 1 h (P/R is then rarely exact and T is rounded up), tiny
/// periods where T is a few nanoseconds, and the classic R = 3 per second.
fn quota(max_burst: u64) -> impl Strategy<Value = Quota> {
    prop_oneof![
        (
            prop_oneof![Just(SEC), Just(60 * SEC), Just(3600 * SEC)],
            1u64..=1000,
            1..=max_burst
        ),
        (1_000_000u64..=3600 * SEC, 1u64..=1000, 1..=max_burst),
        (1u64..=64, 1u64..=64, 1..=max_burst),
        (Just(SEC), Just(3u64), 1..=max_burst),
    ]
    .prop_map(|(p, r, b)| Quota::new(p, r, b).expect("generated rates are valid"))
}

/// A start instant: anywhere in the first ~13 days of a monotonic clock.
fn start() -> impl Strategy<Value = u64> {
    0u64..(1 << 50)
}

/// Raw material for one request of a schedule: (gap kind, gap randomness, cost randomness).
type RawStep = (u8, u64, u64);

fn raw_steps(max: usize) -> impl Strategy<Value = Vec<RawStep>> {
    prop::collection::vec((0u8..6, any::<u64>(), any::<u64>()), 1..=max)
}

/// A gap before a request, scaled to the quota: none, below T, about T, up to B·T, up to 2·B·T,
/// or a long idle of up to 3·B·T.
fn gap(q: &Quota, kind: u8, raw: u64) -> u64 {
    let (t, bt) = (q.interval(), q.tolerance());
    match kind {
        0 => 0,
        1 => raw % t,
        2 => t - 1 + raw % 3,
        3 => raw % (bt + 1),
        4 => raw % (2 * bt + 1),
        _ => raw % (3 * bt + 1),
    }
}

/// A cost ≥ 1: mostly 1, otherwise anything up to B + 2 (so sometimes impossible).
fn cost(q: &Quota, raw: u64) -> u64 {
    if raw.is_multiple_of(4) {
        1 + (raw / 4) % (q.burst() + 2)
    } else {
        1
    }
}

/// Turns raw steps into (time, cost) requests with non-decreasing times from `t0`.
fn schedule(q: &Quota, t0: u64, raw: &[RawStep]) -> Vec<(u64, u64)> {
    let mut t = t0;
    raw.iter()
        .map(|&(kind, g, c)| {
            t += gap(q, kind, g);
            (t, cost(q, c))
        })
        .collect()
}

/// Runs requests on one key of `store`, returning each with its outcome.
fn run(
    store: &MemoryStore,
    key: u128,
    q: &Quota,
    reqs: &[(u64, u64)],
) -> Vec<(u64, u64, CounterOutcome)> {
    reqs.iter()
        .map(|&(t, c)| (t, c, store.count(key, q, t, c)))
        .collect()
}

/// P2: for every window `[s, e]` whose ends are admission instants, the admitted cost in it is at
/// most `B + floor((e − s)/T)`. Windows ending between admission instants add nothing, so these
/// are all the windows that matter. `adm` is (time, cost) in time order.
fn assert_window_bound(q: &Quota, adm: &[(u64, u64)]) -> Result<(), TestCaseError> {
    let (b, t) = (q.burst(), q.interval());
    for i in 0..adm.len() {
        if i > 0 && adm[i - 1].0 == adm[i].0 {
            continue; // the window starting at this instant was checked from its first admission
        }
        let s = adm[i].0;
        let mut sum = 0u64;
        for &(e, c) in &adm[i..] {
            sum += c;
            let bound = b + (e - s) / t;
            prop_assert!(
                sum <= bound,
                "admitted {} in [{}, {}] (W = {}), above B + floor(W/T) = {} (B = {}, T = {})",
                sum,
                s,
                e,
                e - s,
                bound,
                b,
                t
            );
        }
    }
    Ok(())
}

/// Unit requests admitted at `t` until the first denial (which is not charged).
fn drain(store: &MemoryStore, key: u128, q: &Quota, t: u64) -> u64 {
    let mut n = 0;
    while store.count(key, q, t, 1).admitted {
        n += 1;
        assert!(
            n <= q.burst(),
            "more than B = {} unit requests at one instant",
            q.burst()
        );
    }
    n
}

/// A TAT at or before `now` means a full bucket, like an absent key: compare TATs modulo that.
fn live(tat: u64, now: u64) -> u64 {
    tat.max(now)
}

fn op(key: u128, quota: Quota, cost: u64, mode: Mode, charge: Charge) -> Op {
    Op {
        key,
        quota,
        cost,
        charge,
        mode,
    }
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// P1: B unit requests at one instant are admitted and the (B+1)-th is denied, on a fresh
    /// key and on one idle for B·T since its last admission; cost B fits a full bucket, B+1 not.
    #[test]
    fn p1_instantaneous_burst(
        q in quota(40),
        t0 in start(),
        raw in raw_steps(30),
        extra in 0u64..1000,
    ) {
        let store = MemoryStore::new();
        let (b, bt) = (q.burst(), q.tolerance());

        // Fresh key.
        for i in 0..b {
            prop_assert!(store.count(1, &q, t0, 1).admitted, "unit {} of B = {} denied", i + 1, b);
        }
        prop_assert!(!store.count(1, &q, t0, 1).admitted, "unit B + 1 admitted");
        prop_assert!(!store.count(2, &q, t0, b + 1).admitted, "cost B + 1 admitted");
        prop_assert!(store.count(2, &q, t0, b).admitted, "cost B denied on a fresh key");

        // A key with history, idle for at least B·T after its last admission.
        let out = run(&store, 3, &q, &schedule(&q, t0, &raw));
        let last_admitted = out.iter().rev().find(|(_, _, o)| o.admitted).map_or(t0, |(t, _, _)| *t);
        let last_request = out.last().map_or(t0, |(t, _, _)| *t);
        let t = (last_admitted + bt + extra).max(last_request);
        prop_assert_eq!(drain(&store, 3, &q, t), b);
        prop_assert!(!store.count(4, &q, t, b + 1).admitted);
        prop_assert!(store.count(4, &q, t, b).admitted);
    }

    /// P2, the guarantee: whatever the schedule and costs (including costs above B), the admitted
    /// cost in any window [s, s+W] is at most B + floor(W/T).
    #[test]
    fn p2_window_bound(q in quota(20), t0 in start(), raw in raw_steps(200)) {
        let store = MemoryStore::new();
        let out = run(&store, KEY, &q, &schedule(&q, t0, &raw));
        let adm: Vec<(u64, u64)> =
            out.iter().filter(|(_, _, o)| o.admitted).map(|&(t, c, _)| (t, c)).collect();
        assert_window_bound(&q, &adm)?;
    }

    /// P2 with a delay (`delay`): a request admitted at a slot still ahead counts at its slot.
    /// Whatever the schedule, costs and delay, no hold exceeds the delay, slots never go
    /// backwards, and the admitted cost in any window of slots is at most B + floor(W/T).
    #[test]
    fn p2_window_bound_counts_delayed_requests_at_their_slots(
        q in quota(20),
        t0 in start(),
        raw in raw_steps(200),
        delay_intervals in 0u64..=40,
        extra in 0u64..1_000,
    ) {
        let max_delay = delay_intervals * q.interval() + extra;
        let delayed = q.with_max_delay(max_delay);
        let store = MemoryStore::new();
        let out = run(&store, KEY, &delayed, &schedule(&q, t0, &raw));
        let mut slots: Vec<(u64, u64)> = Vec::new();
        for &(t, c, o) in &out {
            if !o.admitted {
                prop_assert_eq!(o.hold, 0);
                continue;
            }
            prop_assert!(o.hold <= max_delay, "held {} past the delay {}", o.hold, max_delay);
            prop_assert_eq!(o.hold, o.wait.saturating_sub(q.tolerance()));
            let slot = t + o.hold;
            if let Some(&(last, _)) = slots.last() {
                prop_assert!(slot >= last, "slot {} before {}", slot, last);
            }
            slots.push((slot, c));
        }
        assert_window_bound(&q, &slots)?;
    }

    /// P2 is tight (so the check above is not vacuous): B at s, then one every T, gives exactly
    /// B + k in [s, s + k·T], and the next request inside that window is denied.
    #[test]
    fn p2_bound_is_tight(q in quota(20), t0 in start(), k in 0u64..50) {
        let store = MemoryStore::new();
        let t = q.interval();
        prop_assert_eq!(drain(&store, KEY, &q, t0), q.burst());
        for i in 1..=k {
            prop_assert!(store.count(KEY, &q, t0 + i * t, 1).admitted, "paced request {} denied", i);
            prop_assert!(!store.count(KEY, &q, t0 + i * t, 1).admitted);
        }
        // Nothing more fits before the next emission instant.
        prop_assert!(!store.count(KEY, &q, t0 + (k + 1) * t - 1, 1).admitted);
    }

    /// P3: the fixed-window boundary attack. B requests at k·P − 1 ns and B more at k·P admit at
    /// most B in all (B ≤ R, T ≥ 5 µs), after any history; on a fresh key exactly B.
    #[test]
    fn p3_no_boundary_doubling(
        p in 1_000_000u64..=3600 * SEC,
        r in 1u64..=200,
        b_raw in any::<u64>(),
        k in 1u64..1000,
        prefix in prop::collection::vec((0u8..6, any::<u64>(), any::<u64>()), 0..20),
    ) {
        let q = Quota::new(p, r, 1 + b_raw % r).expect("valid");
        let b = q.burst();
        let edge = k * p;
        let store = MemoryStore::new();
        // Optional history, all before the attack.
        let hist = schedule(&q, 0, &prefix);
        if hist.last().is_none_or(|(t, _)| *t < edge - 1) {
            let _ = run(&store, KEY, &q, &hist);
        }
        let fresh = prefix.is_empty() || store.tat(KEY) < edge;
        let mut admitted = 0;
        for t in [edge - 1, edge] {
            for _ in 0..b {
                admitted += u64::from(store.count(KEY, &q, t, 1).admitted);
            }
        }
        prop_assert!(admitted <= b, "{} of 2B admitted across the boundary {} (B = {})", admitted, edge, b);
        if fresh {
            prop_assert_eq!(admitted, b);
        }
    }

    /// P4: T is P/R rounded up, so a greedy client (retrying exactly when told) gets at most
    /// R + B − 1 in every half-open window of length P, at any offset; with B ≤ R never 2R.
    #[test]
    fn p4_rounded_interval_per_period_bound(
        p in prop_oneof![Just(SEC), Just(60 * SEC), 1_000_000u64..=3600 * SEC, 1u64..=5000],
        r in 1u64..=300,
        b_raw in any::<u64>(),
        t0 in start(),
    ) {
        let q = Quota::new(p, r, 1 + b_raw % r).expect("valid");
        let b = q.burst();
        prop_assert_eq!(q.interval(), p.div_ceil(r));
        prop_assert_eq!(q.tolerance(), b * p.div_ceil(r));
        let store = MemoryStore::new();
        let times = greedy(&store, &q, t0, t0 + 3 * p);
        // Every window starting at an admission instant (the worst offsets).
        let mut hi = 0;
        for lo in 0..times.len() {
            while hi < times.len() && times[hi] < times[lo] + p {
                hi += 1;
            }
            let n = (hi - lo) as u64;
            prop_assert!(n < r + b, "{} admitted in [{}, +P) > R + B − 1 = {}", n, times[lo], r + b - 1);
            prop_assert!(n < 2 * r);
        }
    }

    /// P5: from exactly exhausted at s, after idling d, exactly min(B, floor(d/T)) unit requests
    /// fit at s + d and the next is denied; in general, with debt c·T left at s,
    /// C(s + d) = B − ceil(max(0, c·T − d)/T).
    #[test]
    fn p5_idle_refill(q in quota(30), s in start(), d_raw in any::<u64>(), c_raw in any::<u64>()) {
        let (b, t, bt) = (q.burst(), q.interval(), q.tolerance());
        let d = d_raw % (3 * bt + 1);

        let exhausted = MemoryStore::new();
        prop_assert!(exhausted.count(KEY, &q, s, b).admitted);
        prop_assert_eq!(drain(&exhausted, KEY, &q, s + d), b.min(d / t));

        let c = c_raw % (b + 1);
        let partial = MemoryStore::new();
        if c > 0 {
            prop_assert!(partial.count(KEY, &q, s, c).admitted);
        }
        prop_assert_eq!(drain(&partial, KEY, &q, s + d), b - (c * t).saturating_sub(d).div_ceil(t));
    }

    /// P6 (no under-delivery, B ≥ 2): a backlogged client — after a response with remaining 0 it
    /// asks again within (B−1)·T, otherwise within T — is never short-changed while it waits:
    /// for every window [s, e] from an arrival to a denied arrival, at least floor(W/T) were
    /// admitted (which implies the bound floor(W/T) − 1 of P6), and P2 still caps it from above.
    ///
    /// Windows end at a denial because only then is the client known to be waiting; a client that
    /// idles up to (B−1)·T without asking banks its tokens instead of losing them.
    #[test]
    fn p6_sustained_rate(
        q in quota(20).prop_filter("B ≥ 2", |q| q.burst() >= 2),
        t0 in start(),
        gaps in prop::collection::vec(any::<u64>(), 1..=200),
    ) {
        let (b, t) = (q.burst(), q.interval());
        let store = MemoryStore::new();
        let mut log: Vec<(u64, bool)> = Vec::new();
        for _ in 0..b {
            prop_assert!(store.count(KEY, &q, t0, 1).admitted);
            log.push((t0, true));
        }
        let mut now = t0;
        let mut remaining = 0;
        for g in gaps {
            now += if remaining == 0 { g % ((b - 1) * t + 1) } else { g % (t + 1) };
            let o = store.count(KEY, &q, now, 1);
            remaining = o.remaining;
            log.push((now, o.admitted));
        }
        for i in 0..log.len() {
            if i > 0 && log[i - 1].0 == log[i].0 {
                continue;
            }
            let s = log[i].0;
            let mut n = 0u64;
            for &(e, admitted) in &log[i..] {
                n += u64::from(admitted);
                if !admitted {
                    prop_assert!(
                        n >= (e - s) / t,
                        "only {} admitted in [{}, {}] (W = {}) to a backlogged client, T = {}, B = {}",
                        n, s, e, e - s, t, b
                    );
                }
            }
        }
        let adm: Vec<(u64, u64)> = log.iter().filter(|(_, a)| *a).map(|&(t, _)| (t, 1)).collect();
        assert_window_bound(&q, &adm)?;
    }

    /// P7: a cost-n request at t is admitted iff n unit requests at t would all be, and leaves the
    /// same TAT, max(TAT, t) + n·T; a denied one leaves the TAT as it was (no partial admission).
    #[test]
    fn p7_cost_weighted_equivalence(
        q in quota(20),
        t0 in start(),
        raw in raw_steps(40),
        dt in 0u64..(1 << 40),
        n_raw in any::<u64>(),
    ) {
        let (weighted, units) = (MemoryStore::new(), MemoryStore::new());
        let hist = schedule(&q, t0, &raw);
        let _ = run(&weighted, KEY, &q, &hist);
        let _ = run(&units, KEY, &q, &hist);
        prop_assert_eq!(weighted.tat(KEY), units.tat(KEY));
        let before = weighted.tat(KEY);
        let t = hist.last().map_or(t0, |(t, _)| *t) + dt % (2 * q.tolerance() + 1);
        let n = 1 + n_raw % (q.burst() + 2);

        let o = weighted.count(KEY, &q, t, n);
        let all = (0..n).all(|_| units.count(KEY, &q, t, 1).admitted);
        prop_assert_eq!(o.admitted, all, "cost {} vs {} units", n, n);
        if o.admitted {
            prop_assert_eq!(o.tat, before.max(t) + n * q.interval());
            prop_assert_eq!(weighted.tat(KEY), o.tat);
            prop_assert_eq!(units.tat(KEY), o.tat);
        } else {
            prop_assert_eq!(weighted.tat(KEY), before);
        }
    }

    /// P8: a cost above B is always denied, whatever the state, changes nothing, and does not
    /// affect the requests that follow (compared with a twin store that never saw it). Its wait is
    /// the documented "until the bucket is full" and its remaining what a check would say.
    #[test]
    fn p8_impossible_cost(
        q in quota(20),
        t0 in start(),
        raw in raw_steps(100),
        big in prop::collection::vec(any::<u64>(), 100),
    ) {
        let (store, twin) = (MemoryStore::new(), MemoryStore::new());
        for (i, &(t, c)) in schedule(&q, t0, &raw).iter().enumerate() {
            let n = match big[i] % 3 {
                0 => q.burst() + 1 + big[i] % 1000,
                1 => u64::MAX - big[i] % 1000,
                _ => u64::from(u32::MAX),
            }
            .max(q.burst() + 1);
            let tat = store.tat(KEY);
            let o = store.count(KEY, &q, t, n);
            prop_assert!(!o.admitted, "impossible cost {} admitted (B = {})", n, q.burst());
            prop_assert_eq!(store.tat(KEY), tat);
            prop_assert_eq!(o.wait, tat.saturating_sub(t));
            prop_assert_eq!(o.remaining, q.remaining(tat, t));
            prop_assert_eq!(store.count(KEY, &q, t, c), twin.count(KEY, &q, t, c));
        }
    }

    /// P9: denials are free. After exhaustion at s, any flood of denied requests in [s, s+T) leaves
    /// the TAT unchanged: still denied at s + T − 1 and admitted at exactly s + T.
    #[test]
    fn p9_denials_are_free(
        q in quota(20),
        s in start(),
        flood in prop::collection::vec((any::<u64>(), any::<u64>()), 0..500),
    ) {
        let t = q.interval();
        let store = MemoryStore::new();
        prop_assert_eq!(drain(&store, KEY, &q, s), q.burst());
        let tat = store.tat(KEY);
        let mut times: Vec<(u64, u64)> =
            flood.iter().map(|&(a, c)| (s + a % t, 1 + c % (q.burst() + 3))).collect();
        times.sort_unstable();
        for (at, c) in times {
            prop_assert!(!store.count(KEY, &q, at, c).admitted, "cost {} admitted at s + {}", c, at - s);
        }
        prop_assert_eq!(store.tat(KEY), tat);
        prop_assert!(!store.count(KEY, &q, s + t - 1, 1).admitted);
        prop_assert!(store.count(KEY, &q, s + t, 1).admitted);
    }

    /// P10: a denied request's wait is exact — denied at t + wait − 1, admitted at t + wait. An
    /// admitted request's wait is TAT − t, after which (P11, reset_after) the key answers every
    /// possible request exactly as a fresh key does.
    #[test]
    fn p10_wait_is_exact(
        q in quota(20),
        t0 in start(),
        raw in raw_steps(60),
        dt in any::<u64>(),
        n_raw in any::<u64>(),
    ) {
        let store = MemoryStore::new();
        let hist = schedule(&q, t0, &raw);
        let _ = run(&store, KEY, &q, &hist);
        let t = hist.last().map_or(t0, |(t, _)| *t) + dt % (q.tolerance() + 1);
        let n = 1 + n_raw % q.burst();
        let o = store.count(KEY, &q, t, n);
        if o.admitted {
            prop_assert_eq!(o.wait, o.tat - t);
            let at = t + o.wait;
            for c in 0..=q.burst() + 1 {
                let mut aged = decide(&q, store.tat(KEY), at, c);
                let fresh = decide(&q, 0, at, c);
                aged.tat = if aged.admitted { aged.tat } else { 0 };
                prop_assert_eq!(aged, fresh, "cost {} at reset_after differs from a fresh key", c);
            }
        } else {
            prop_assert!(o.wait >= 1);
            prop_assert!(!store.count(KEY, &q, t + o.wait - 1, n).admitted, "admitted before the wait");
            prop_assert!(store.count(KEY, &q, t + o.wait, n).admitted, "denied after the wait");
        }
    }

    /// P11: sweeping every key whose TAT ≤ now before every request changes no decision, remaining
    /// or wait, on any schedule over several keys with different quotas.
    #[test]
    fn p11_eviction_is_invisible(
        qs in prop::collection::vec(quota(10), 3),
        t0 in start(),
        raw in prop::collection::vec((0usize..3, 0u8..6, any::<u64>(), any::<u64>()), 1..=200),
    ) {
        let (kept, swept) = (MemoryStore::new(), MemoryStore::new());
        let mut now = t0;
        for (k, kind, g, c) in raw {
            let q = &qs[k];
            now += gap(q, kind, g);
            let cost = if c % 7 == 0 { 0 } else { cost(q, c) };
            let _ = swept.sweep(now);
            let (a, b) = (kept.count(k as u128, q, now, cost), swept.count(k as u128, q, now, cost));
            prop_assert_eq!(a.admitted, b.admitted, "decision differs at {} on key {}", now, k);
            prop_assert_eq!(a.remaining, b.remaining);
            prop_assert_eq!(a.wait, b.wait);
            if a.admitted {
                prop_assert_eq!(live(a.tat, now), live(b.tat, now));
            }
            for key in 0..3u128 {
                prop_assert_eq!(live(kept.tat(key), now), live(swept.tat(key), now));
            }
            prop_assert!(swept.len() <= kept.len());
        }
    }

    /// P12: remaining never exceeds B; after an admitted request of cost ≥ 1 it is at most B − 1
    /// and equals floor((B·T − (TAT − now))/T); a denied unit request reports 0 and a denied
    /// cost n ≤ B reports fewer than n (the tokens available now). A cost-0 check is
    /// admitted, reports the same formula and consumes nothing.
    #[test]
    fn p12_remaining(q in quota(30), t0 in start(), raw in raw_steps(200)) {
        let (b, t, bt) = (q.burst(), q.interval(), q.tolerance());
        let store = MemoryStore::new();
        for (i, (now, c)) in schedule(&q, t0, &raw).into_iter().enumerate() {
            let c = if i % 5 == 4 { 0 } else { c };
            let before = store.tat(KEY);
            let o = store.count(KEY, &q, now, c);
            prop_assert!(o.remaining <= b, "remaining {} above B = {}", o.remaining, b);
            if o.admitted {
                prop_assert_eq!(store.tat(KEY).max(now), o.tat);
                prop_assert!(o.tat - now <= bt);
                prop_assert_eq!(o.remaining, (bt - (o.tat - now)) / t);
                if c == 0 {
                    prop_assert_eq!(o.tat, before.max(now));
                } else {
                    prop_assert!(o.remaining < b);
                }
            } else {
                prop_assert!(c >= 1, "a check-only request was denied");
                prop_assert_eq!(store.tat(KEY), before);
                prop_assert_eq!(o.tat, before, "a denial must report the TAT it left unchanged");
                prop_assert_eq!(o.remaining, (bt - before.saturating_sub(now)) / t);
                if c <= b {
                    prop_assert!(o.remaining < c);
                }
                if c == 1 {
                    prop_assert_eq!(o.remaining, 0);
                }
            }
        }
    }

    /// P14: a request's ops are decided all or nothing against a model of the documented rules
    /// (refunds and recorded spend first and always; blocked iff an Enforce op is denied or every Quota op is; a
    /// blocked request charges nothing; an admitted one charges exactly its admitted ops). In
    /// particular a denied Enforce op leaves every other key's TAT as it was, and denied Shadow
    /// ops never block. Driven through the memory [`Backend`] on a [`ManualClock`].
    #[test]
    fn p14_multi_descriptor_atomicity(
        qs in prop::collection::vec(quota(6), 3),
        t0 in start(),
        prefix in prop::collection::vec((0usize..3, 0u8..6, any::<u64>(), 0u64..4), 0..30),
        ops_raw in prop::collection::vec((0usize..3, 0u64..8, 0u8..3, 0u8..8), 1..=5),
        dt in any::<u64>(),
    ) {
        let clock = Arc::new(ManualClock::new(t0));
        let store = Arc::new(MemoryStore::new());
        let backend = Backend::Memory { store: store.clone(), clock: clock.clone() };
        for (k, kind, g, c) in prefix {
            clock.advance(gap(&qs[k], kind, g));
            let _ = store.count(k as u128, &qs[k], clock.now(), c);
        }
        clock.advance(dt % (qs[0].tolerance() + 1));
        let now = clock.now();
        let ops: Vec<Op> = ops_raw
            .iter()
            .map(|&(k, c, m, r)| {
                let mode = [Mode::Enforce, Mode::Shadow, Mode::Quota][usize::from(m)];
                let charge = match r {
                    0 => Charge::Refund,
                    1 => Charge::Spent,
                    _ => Charge::Ask,
                };
                // Spend may pass the burst; a request's cost at most just past it.
                let cost = if r == 1 { c * 3 } else { c.min(qs[k].burst() + 1) };
                op(k as u128, qs[k], cost, mode, charge)
            })
            .collect();

        // The model: refunds and spend first, in order; then each charge against the TATs left
        // by them and the earlier charges of the same request.
        let none = CounterOutcome { admitted: false, tat: 0, remaining: 0, wait: 0, hold: 0 };
        let mut expected = vec![none; ops.len()];
        let mut tats: Vec<u64> = (0..3u128).map(|k| store.tat(k)).collect();
        for (i, o) in ops.iter().enumerate().filter(|(_, o)| o.unconditional()) {
            let tat = tats[o.key as usize];
            expected[i] = if o.is_refund() {
                refund(&o.quota, tat, now, o.cost)
            } else {
                record(&o.quota, tat, now, o.cost)
            };
            tats[o.key as usize] = expected[i].tat;
        }
        let after_refunds = tats.clone();
        let mut seen = vec![0; ops.len()];
        for (i, o) in ops.iter().enumerate().filter(|(_, o)| !o.unconditional()) {
            seen[i] = tats[o.key as usize];
            expected[i] = decide(&o.quota, seen[i], now, o.cost);
            if expected[i].admitted {
                tats[o.key as usize] = expected[i].tat;
            }
        }
        let charges = || ops.iter().zip(&expected).filter(|(o, _)| !o.is_refund());
        let enforce_denied = charges().any(|(o, e)| o.mode == Mode::Enforce && !e.admitted);
        let quota_ops = charges().filter(|(o, _)| o.mode == Mode::Quota).count();
        let quota_denied = charges().filter(|(o, e)| o.mode == Mode::Quota && !e.admitted).count();
        let blocked = enforce_denied || (quota_ops > 0 && quota_denied == quota_ops);
        if blocked {
            // An op that fitted reports the state it found, uncharged.
            for (i, o) in ops.iter().enumerate() {
                if !o.unconditional() && expected[i].admitted {
                    expected[i] = decide(&o.quota, seen[i], now, 0);
                }
            }
        }

        let Batch { blocked: got_blocked, outcomes } = backend
            .count(&ops)
            .now_or_never()
            .expect("the memory backend never waits")
            .expect("the memory backend always decides");
        prop_assert_eq!(got_blocked, blocked, "ops {:?}", ops);
        for (i, (got, want)) in outcomes.iter().zip(&expected).enumerate() {
            prop_assert_eq!(
                (got.admitted, got.remaining, got.wait),
                (want.admitted, want.remaining, want.wait),
                "op {} of {:?}", i, ops
            );
            prop_assert_eq!(live(got.tat, now), live(want.tat, now), "op {} of {:?}", i, ops);
        }
        for k in 0..3 {
            let tat = store.tat(k as u128);
            if blocked {
                // Nothing charged: every key is as the refunds and spend left it.
                prop_assert_eq!(
                    live(tat, now), live(after_refunds[k], now), "key {} charged by a blocked request", k
                );
            } else {
                prop_assert_eq!(live(tat, now), live(tats[k], now), "key {}", k);
            }
        }
        if !enforce_denied && quota_ops == 0 {
            prop_assert!(!got_blocked, "only shadow ops were denied, yet blocked");
        }
    }

    /// P16: huge costs (u64::MAX, u32::MAX) with a 1-day interval, at clock readings up to 2^62,
    /// never overflow or panic and are denied without changing anything; a refund of u64::MAX
    /// just empties the debt. A cost of exactly B = u32::MAX fits a fresh key.
    #[test]
    fn p16_overflow_edges(
        b in prop_oneof![1u64..=1000, Just(53_375u64)],
        now in 0u64..=(1 << 62),
        prior in 0u64..=1000,
    ) {
        let q = Quota::new(DAY, 1, b).expect("B·T within 2^62");
        prop_assert_eq!(q.interval(), DAY);
        let store = MemoryStore::new();
        let charged = store.count(KEY, &q, now, prior.min(b)).admitted;
        prop_assert!(charged);
        let tat = store.tat(KEY);
        for cost in [u64::MAX, u64::MAX - 1, u64::from(u32::MAX), u64::MAX / DAY + 1, b + 1] {
            let o = store.count(KEY, &q, now, cost);
            prop_assert!(!o.admitted, "cost {} admitted", cost);
            prop_assert_eq!(store.tat(KEY), tat);
            let later = decide(&q, tat, now + DAY, cost);
            prop_assert!(!later.admitted);
            let r = refund(&q, tat, now, cost);
            prop_assert_eq!(r.tat, now);
            prop_assert_eq!(r.remaining, b);
        }
        let wide = Quota::new(DAY, u64::from(u32::MAX), u64::from(u32::MAX)).expect("valid");
        let o = decide(&wide, 0, now, u64::from(u32::MAX));
        prop_assert!(o.admitted);
        prop_assert_eq!(o.tat, now + wide.tolerance());
        prop_assert!(!decide(&wide, o.tat, now, 1).admitted);
        prop_assert!(!decide(&wide, 0, now, u64::MAX).admitted);
    }

    /// Refunds: TAT = max(now, TAT − n·T), never below now; a charge followed by an equal refund
    /// at the same instant restores the exact prior remaining. Refund ops go through a batch.
    #[test]
    fn refund_bounds_and_inverse(
        q in quota(20),
        t0 in start(),
        raw in raw_steps(60),
        dt in any::<u64>(),
        n_raw in any::<u64>(),
        big in any::<bool>(),
    ) {
        let store = MemoryStore::new();
        let hist = schedule(&q, t0, &raw);
        let _ = run(&store, KEY, &q, &hist);
        let now = hist.last().map_or(t0, |(t, _)| *t) + dt % (2 * q.tolerance() + 1);
        let n = if big { u64::MAX - n_raw % 3 } else { n_raw % (q.burst() + 3) };

        // Charge n then refund n at the same instant: the remaining is back where it was.
        let prior = decide(&q, store.tat(KEY), now, 0).remaining;
        let charge = store.count(KEY, &q, now, n);
        if charge.admitted {
            let back = store.count_batch(&[op(KEY, q, n, Mode::Enforce, Charge::Refund)], now);
            prop_assert!(!back.blocked);
            prop_assert_eq!(back.outcomes[0].remaining, prior);
            prop_assert_eq!(decide(&q, store.tat(KEY), now, 0).remaining, prior);
        }

        // Any refund: never below now, exactly TAT − n·T otherwise.
        let tat = store.tat(KEY);
        let r = store.count_batch(&[op(KEY, q, n, Mode::Enforce, Charge::Refund)], now);
        let got = r.outcomes[0];
        prop_assert!(got.admitted && !r.blocked);
        prop_assert!(got.tat >= now);
        prop_assert_eq!(got.tat, tat.saturating_sub(n.saturating_mul(q.interval())).max(now));
        prop_assert_eq!(live(store.tat(KEY), now), got.tat);
        prop_assert_eq!(got.remaining, q.remaining(got.tat, now));
    }
}

/// One event of a schedule of spend reported after the work, at `at` ns.
#[derive(Clone, Copy, Debug)]
enum Usage {
    /// A check of cost 0 before request `id`'s work.
    Check { id: usize },
    /// Request `id`'s spend, reported when its work is done.
    Report { id: usize, cost: u64 },
}

/// Runs a schedule of checks and reports against one key through the memory store, as Envoy
/// sends them: a check (`hits_addend: 0`) at each arrival, and, for a request it admitted, the
/// spend reported (`Charge::Spent`) `busy` ns later. `rogue` requests report whether or not their
/// check passed. Returns each event's time, whether it was an admitted check, and the spend it
/// recorded in ns of the key's TAT.
fn run_usage(
    q: &Quota,
    t0: u64,
    requests: &[(u64, u64, u64, bool)],
) -> Vec<(u64, Usage, bool, u64)> {
    let store = MemoryStore::new();
    let mut events: Vec<(u64, Usage, bool)> = Vec::new();
    let mut at = t0;
    for (id, &(gap, busy, cost, rogue)) in requests.iter().enumerate() {
        at += gap;
        events.push((at, Usage::Check { id }, rogue));
        events.push((at + busy, Usage::Report { id, cost }, rogue));
    }
    // Reports before checks at one instant: what is done is recorded before what asks.
    events.sort_by_key(|(t, e, _)| (*t, matches!(e, Usage::Check { .. })));
    let mut admitted = vec![false; requests.len()];
    let mut out = Vec::with_capacity(events.len());
    for (now, event, rogue) in events {
        let before = store.tat(KEY).max(now);
        match event {
            Usage::Check { id } => {
                let ask = op(KEY, *q, 0, Mode::Enforce, Charge::Ask);
                admitted[id] = !store.count_batch(&[ask], now).blocked;
                out.push((now, event, admitted[id], 0));
            }
            Usage::Report { id, cost } => {
                if !admitted[id] && !rogue {
                    continue;
                }
                let spent = op(KEY, *q, cost, Mode::Enforce, Charge::Spent);
                store.count_batch(&[spent], now);
                let after = store.tat(KEY);
                assert!(
                    after.saturating_sub(now) <= q.debt_cap(),
                    "debt past the cap"
                );
                out.push((now, event, false, after.max(now) - before));
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Spend reported after the work: in every span [t_i, t_j] of a schedule, the spend
    /// recorded is at most `B·T + W + F·T` ns, where F is the spend reported, up to t_j, after
    /// the last admitted check (by requests in flight when the budget ran out); and, whatever
    /// the clients (rogue reports without an admitted check included), at most
    /// `W + debt_cap`. No arithmetic wraps, however large the costs.
    #[test]
    fn spend_recorded_stays_within_the_stated_bound(
        q in quota(50),
        t0 in start(),
        raw in prop::collection::vec(
            (0u8..6, any::<u64>(), 0u8..4, any::<u64>(), 0u8..16), 1..=40
        ),
    ) {
        let (t, bt) = (q.interval(), q.tolerance());
        let requests: Vec<(u64, u64, u64, bool)> = raw
            .iter()
            .map(|&(kind, g, busy_kind, c, rogue)| {
                let cost = match c % 8 {
                    0 => c,                       // anything, up to u64::MAX
                    1 => 0,
                    _ => 1 + c % (3 * q.burst()), // up to three buckets
                };
                let busy = gap(&q, busy_kind, g.rotate_left(17));
                (gap(&q, kind, g), busy, cost, rogue == 0)
            })
            .collect();
        let honest = requests.iter().all(|r| !r.3);
        let events = run_usage(&q, t0, &requests);
        for j in 0..events.len() {
            let end = events[j].0;
            // F: the spend reported after the last admitted check, up to event j.
            let last_check = (0..=j).rev().find(|&k| events[k].2);
            let in_flight: u128 = events[last_check.map_or(0, |k| k + 1)..=j]
                .iter()
                .map(|e| match e.1 {
                    Usage::Report { cost, .. } => u128::from(cost) * u128::from(t),
                    Usage::Check { .. } => 0,
                })
                .sum();
            let mut recorded: u128 = 0;
            for i in (0..=j).rev() {
                recorded += u128::from(events[i].3);
                let w = u128::from(end - events[i].0);
                prop_assert!(
                    recorded <= w + u128::from(q.debt_cap()),
                    "events {}..={}: {} ns recorded in {} ns", i, j, recorded, w
                );
                if honest {
                    prop_assert!(
                        recorded <= u128::from(bt) + w + in_flight,
                        "events {}..={}: {} ns recorded in {} ns, {} in flight",
                        i, j, recorded, w, in_flight
                    );
                }
            }
        }
    }
}

/// The recipe of Envoy Gateway's `UsageRateLimit` and AI Gateway's token limits on one key: a
/// check of cost 0 before each request, its cost reported after. "A budget of N against a cost
/// of C allows N/C + 1 calls", and the next admission comes when the debt is repaid.
#[test]
fn a_budget_of_n_against_cost_c_allows_n_over_c_plus_one_calls() {
    let store = MemoryStore::new();
    let check = |q: &Quota, now: u64| {
        !store
            .count_batch(&[op(KEY, *q, 0, Mode::Enforce, Charge::Ask)], now)
            .blocked
    };
    let spend = |q: &Quota, cost: u64, now: u64| {
        store.count_batch(&[op(KEY, *q, cost, Mode::Enforce, Charge::Spent)], now)
    };
    // 1,000 tokens a minute, 800-token answers: two calls, then 36 s of debt.
    let q = Quota::new(60 * SEC, 1_000, 1_000).expect("valid");
    let t0 = 10 * SEC;
    let calls = (0..6)
        .take_while(|_| check(&q, t0) && !spend(&q, 800, t0).outcomes.is_empty())
        .count();
    assert_eq!(calls, 2);
    let refused = store.count_batch(&[op(KEY, q, 0, Mode::Enforce, Charge::Ask)], t0);
    assert_eq!(refused.outcomes[0].wait, 36 * SEC);
    assert!(!check(&q, t0 + 36 * SEC - 1));
    assert!(check(&q, t0 + 36 * SEC));
}

/// Admits unit requests as greedily as the limiter allows from `t0` until `end`, retrying each
/// denial exactly at `now + wait` (which P10 says is exact), and returns the admission instants.
fn greedy(store: &MemoryStore, q: &Quota, t0: u64, end: u64) -> Vec<u64> {
    let mut times = Vec::new();
    let mut now = t0;
    while now < end {
        let o = store.count(KEY, q, now, 1);
        if o.admitted {
            times.push(now);
            assert!(times.len() as u64 <= 3 * q.burst() + 3 * (end - t0) / q.interval() + 3);
        } else {
            assert!(o.wait >= 1, "a denial at {now} said to retry now");
            now += o.wait;
        }
    }
    times
}

/// P4 with the numbers of `docs/gcra-properties.md`: R = 3 per second has T = 333 333 334 ns (rounded up, not the
/// truncated 333 333 333), and a greedy client gets exactly R + B − 1 in [0, 1 s) — a truncated T
/// would give R + B.
#[test]
fn p4_three_per_second() {
    for b in 1..=5 {
        let q = Quota::new(SEC, 3, b).expect("valid");
        assert_eq!(q.interval(), 333_333_334);
        let store = MemoryStore::new();
        let times = greedy(&store, &q, 0, SEC);
        assert_eq!(times.len() as u64, 3 + b - 1, "B = {b}: {times:?}");
        // At the truncated third emission instant, 999 999 999 ns, nothing more fits.
        assert!(!store.count(KEY, &q, 3 * 333_333_333, 1).admitted);
    }
}

/// P6 caveat: with B = 1 lateness accumulates. Arrivals every 0.7·T are admitted only every
/// 1.4·T, one in two (about 71 % of the nominal rate).
#[test]
fn p6_burst_one_caveat() {
    let q = Quota::new(SEC, 1000, 1).expect("valid"); // T = 1 ms
    let store = MemoryStore::new();
    let gap = 7 * q.interval() / 10;
    let admitted: Vec<bool> = (0..100)
        .map(|i| store.count(KEY, &q, i * gap, 1).admitted)
        .collect();
    let n = admitted.iter().filter(|a| **a).count() as u64;
    assert_eq!(n, 50);
    assert!(admitted.iter().step_by(2).all(|a| *a));
    let span = 99 * gap;
    assert!(
        n < span / q.interval() - 1,
        "B = 1 unexpectedly kept up with the rate"
    );
}

/// P9 with the flood size of `docs/gcra-properties.md`: 10⁴ denied requests just after exhaustion do not delay the next
/// admission at exactly s + T.
#[test]
fn p9_ten_thousand_denials() {
    let q = Quota::new(60 * SEC, 10, 4).expect("valid"); // T = 6 s
    let s = 42 * SEC;
    let store = MemoryStore::new();
    assert!(store.count(KEY, &q, s, 4).admitted);
    let tat = store.tat(KEY);
    for i in 0..10_000u64 {
        let t = s + i * (q.interval() / 10_000);
        assert!(!store.count(KEY, &q, t, 1 + i % 5).admitted);
    }
    assert_eq!(store.tat(KEY), tat);
    assert!(!store.count(KEY, &q, s + q.interval() - 1, 1).admitted);
    assert!(store.count(KEY, &q, s + q.interval(), 1).admitted);
}

const THREADS: u64 = 4;
const ATTEMPTS: u64 = 1000;

/// P13: K threads hammering one key at one instant get exactly B admissions — no lost CAS
/// update, no over-admission — and the TAT is exactly now + B·T. With mixed costs the admitted
/// cost never exceeds B and the TAT accounts for every admitted unit.
#[test]
fn p13_threads_on_one_key() {
    let now = 7 * SEC + 3;
    for (p, r, b) in [
        (SEC, 10, 1),
        (SEC, 3, 7),
        (60 * SEC, 100, 100),
        (SEC, 1000, 999),
    ] {
        let q = Quota::new(p, r, b).expect("valid");
        let store = MemoryStore::new();
        let admitted = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..THREADS {
                s.spawn(|| {
                    for _ in 0..ATTEMPTS {
                        if store.count(KEY, &q, now, 1).admitted {
                            // Relaxed: a counter read after the scope joins the threads.
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.load(Ordering::Relaxed), b, "B = {b}");
        assert_eq!(store.tat(KEY), now + b * q.interval());

        let store = MemoryStore::new();
        let cost = AtomicU64::new(0);
        std::thread::scope(|s| {
            for k in 1..=THREADS {
                let (store, cost, q) = (&store, &cost, &q);
                s.spawn(move || {
                    for _ in 0..ATTEMPTS {
                        if store.count(KEY, q, now, k).admitted {
                            cost.fetch_add(k, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        let cost = cost.load(Ordering::Relaxed);
        assert!(cost <= b, "admitted cost {cost} > B = {b}");
        assert_eq!(
            store.tat(KEY),
            now + cost * q.interval(),
            "B = {b}: a charge was lost"
        );
    }
}

/// P13 through batches: K threads, released together, send two Enforce ops on two keys (half of
/// them in the opposite order) at one instant. They get exactly min(B1, B2) admissions and both
/// keys are charged exactly that many times — all or nothing under contention, including the undo
/// of a half-committed batch. Many short rounds with small buckets keep the threads racing for
/// the last cells, where a commit can fail half way.
#[test]
fn p13_threads_on_a_batch() {
    let now = 11 * SEC;
    let mut runs = vec![(250, 251, 1, ATTEMPTS), (100, 100, 1, ATTEMPTS)];
    for (b1, b2) in [(1, 1), (1, 2), (2, 1), (3, 5), (5, 3), (8, 8)] {
        runs.push((b1, b2, 150, 20));
    }
    for (b1, b2, rounds, attempts) in runs {
        let q1 = Quota::new(SEC, 7, b1).expect("valid");
        let q2 = Quota::new(60 * SEC, 1000, b2).expect("valid");
        for round in 0..rounds {
            let store = MemoryStore::new();
            let admitted = AtomicU64::new(0);
            let start = Barrier::new(THREADS as usize);
            std::thread::scope(|s| {
                for k in 0..THREADS {
                    let (store, admitted, start) = (&store, &admitted, &start);
                    s.spawn(move || {
                        let mut ops = [
                            op(1, q1, 1, Mode::Enforce, Charge::Ask),
                            op(2, q2, 1, Mode::Enforce, Charge::Ask),
                        ];
                        if k % 2 == 1 {
                            ops.reverse();
                        }
                        start.wait();
                        for _ in 0..attempts {
                            let batch = store.count_batch(&ops, now);
                            assert_eq!(batch.blocked, !batch.outcomes.iter().all(|o| o.admitted));
                            if !batch.blocked {
                                admitted.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    });
                }
            });
            let n = admitted.load(Ordering::Relaxed);
            let at = format!("B1 = {b1}, B2 = {b2}, round {round}");
            assert_eq!(n, b1.min(b2), "{at}");
            assert_eq!(
                store.tat(1),
                now + n * q1.interval(),
                "key 1 charged unequally, {at}"
            );
            assert_eq!(
                store.tat(2),
                now + n * q2.interval(),
                "key 2 charged unequally, {at}"
            );
        }
    }
}

/// P16: `requests_per_unit: 0` is a ban. Every request is denied, cost 0 included, nothing is
/// written, the wait is the period, and an Enforce ban op blocks its batch (a Shadow one does
/// not).
#[test]
fn p16_zero_requests_is_a_ban() {
    for (p, burst) in [(SEC, 0), (60 * SEC, 1), (DAY, 1000)] {
        let q = Quota::new(p, 0, burst).expect("a ban is a valid quota");
        assert!(q.is_ban());
        let store = MemoryStore::new();
        for now in [0, 1, SEC, 1 << 62] {
            for cost in [0, 1, 2, u64::from(u32::MAX), u64::MAX] {
                let o = store.count(KEY, &q, now, cost);
                assert!(!o.admitted, "ban admitted cost {cost} at {now}");
                assert_eq!((o.remaining, o.wait), (0, p));
            }
        }
        assert!(store.is_empty());
        let ok = Quota::new(SEC, 10, 10).expect("valid");
        let enforce = store.count_batch(
            &[
                op(1, ok, 1, Mode::Enforce, Charge::Ask),
                op(2, q, 0, Mode::Enforce, Charge::Ask),
            ],
            5,
        );
        assert!(enforce.blocked);
        assert_eq!(store.tat(1), 0);
        let shadow = store.count_batch(
            &[
                op(1, ok, 1, Mode::Enforce, Charge::Ask),
                op(2, q, 1, Mode::Shadow, Charge::Ask),
            ],
            5,
        );
        assert!(!shadow.blocked);
        assert!(!shadow.outcomes[1].admitted);
        assert_eq!(store.tat(1), 5 + ok.interval());
    }
}

/// A batch that charges one key and then fails on another must not, when it undoes the first
/// charge, take back debt another request has added on top (found by mutation testing: an undo
/// by "refund at the batch's own time" admitted two requests at one instant with B = 1). The
/// interleaving is forced through the batch's clock, which the store reads at known points:
/// - call 1, the plan (time 0): both keys fit;
/// - calls 2 and 3, the charge of k1, a new key (time 0): k1 moves to T;
/// - call 4, the charge of k2, still absent, outside any lock: here, before answering, k2 is
///   filled by another request at time 0 and k1 charged by a third at time T (building on
///   ours: T → 2T);
/// - call 5, k2 found present and full (time 0): denied, so the batch undoes k1 (call 6,
///   time T, read after the third request's write).
///
/// The third request's charge must survive: one more request at T is refused.
#[test]
fn p13_undo_never_cancels_a_concurrent_charge() {
    let q = Quota::new(SEC, 1_000_000, 1).unwrap(); // T = 1 µs, B = 1
    let t = q.interval();
    let (k1, k2) = (11u128, 22u128);
    let store = MemoryStore::new();
    let calls = AtomicU64::new(0);
    let clock = || {
        let n = calls.fetch_add(1, Ordering::Relaxed) + 1;
        if n == 4 {
            assert!(
                !store
                    .count_batch(&[op(k2, q, 1, Mode::Enforce, Charge::Ask)], 0)
                    .blocked
            );
            assert!(
                !store
                    .count_batch(&[op(k1, q, 1, Mode::Enforce, Charge::Ask)], t)
                    .blocked
            );
        }
        if n <= 5 { 0 } else { t }
    };
    let batch = store.count_batch_with(
        &[
            op(k1, q, 1, Mode::Enforce, Charge::Ask),
            op(k2, q, 1, Mode::Enforce, Charge::Ask),
        ],
        &clock,
    );
    assert!(
        calls.load(Ordering::Relaxed) >= 6,
        "the interleaving happened"
    );
    assert!(batch.blocked, "k2 was taken meanwhile");
    // Still refused at T: the third request's charge was not taken back.
    assert!(
        store
            .count_batch(&[op(k1, q, 1, Mode::Enforce, Charge::Ask)], t)
            .blocked
    );
    assert!(store.tat(k1) >= 2 * t);
}
