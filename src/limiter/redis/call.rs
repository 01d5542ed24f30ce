//! One Redis call, assembled in one place: the kinds of call the backend sends (a request
//! counted by a GCRA script, a lease's take or give-back, a share's renewal), each kind's
//! arguments, the reading of its reply, and what carries a call to the coalescing loop. The
//! store, the coalescer and leasing build and read their calls here, and none of them imports
//! another for it. Sending a count (connections, deadlines, the breaker) is the store's; a
//! leasing script's call (`lease.lua`, `share.lua`) is sent by [`RedisStore::script_call`],
//! here, under the same breaker, deadline and stall gate. Nothing else here does I/O.

use std::time::Duration;

use redis::{RedisError, Script, ScriptInvocation, Value};
use tokio::sync::oneshot;

use crate::limiter::batch::{Batch, Charge, Mode, Op};
use crate::limiter::error::{BackendError, ErrorKind};
use crate::limiter::figures::Purpose;
use crate::limiter::gcra::{CounterOutcome, Quota};
use crate::limiter::key::Key;
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::config::RedisTime;
use crate::limiter::redis::connect::RedisConn;

/// A call waiting for the next round trip to a single node (the coalescer's queue).
pub(super) enum Call {
    /// A request for the lean script, sent with the others waiting.
    Count(CountCall),
    /// A `lease.lua` call, sent beside the next one.
    Lease(LeaseCall),
}

impl Call {
    /// Whether its caller stopped waiting for the answer.
    pub(super) fn abandoned(&self) -> bool {
        match self {
            Self::Count(c) => c.reply.is_closed(),
            Self::Lease(l) => l.reply.is_closed(),
        }
    }

    /// Answers its caller with `error`, unsent.
    pub(super) fn fail(self, error: BackendError) {
        // A caller that stopped waiting is answered by nobody.
        match self {
            Self::Count(c) => {
                let _ = c.reply.send(Err(error));
            }
            Self::Lease(l) => {
                let _ = l.reply.send(Err(error));
            }
        }
    }
}

/// A request waiting for a lean-script call.
pub(super) struct CountCall {
    pub(super) ops: Vec<Op>,
    /// The decision time, when the store decides at its own clock (tests); requests with
    /// different times never share a call.
    pub(super) now: Option<u64>,
    pub(super) reply: oneshot::Sender<Result<Batch, BackendError>>,
}

/// A `lease.lua` call (`EVALSHA`, built whole) waiting for a round trip.
pub(super) struct LeaseCall {
    pub(super) cmd: redis::Cmd,
    /// Its script, loaded again when Redis answers `NOSCRIPT`.
    pub(super) script: &'static Script,
    /// What its round trip is for, when it goes first.
    pub(super) purpose: Purpose,
    pub(super) reply: oneshot::Sender<Result<Value, BackendError>>,
}

/// The Redis key of counter `key` under `prefix`.
pub(super) fn redis_key(prefix: &str, key: Key) -> String {
    format!("{prefix}{key:032x}")
}

/// One script call over `ops[idx]` alone, at `now` (Redis `TIME` for `None`): `gcra_lean.lua`
/// (`lean`) when they [`fits_lean`], else `gcra.lua` (`exact`). Returns the call and whether
/// it is the lean one, for [`read_count`].
pub(super) fn count_call<'s>(
    lean: &'s Script,
    exact: &'s Script,
    prefix: &str,
    (ops, idx): (&[Op], &[usize]),
    whole: bool,
    now: Option<u64>,
) -> (ScriptInvocation<'s>, bool) {
    let picked = || idx.iter().map(|&i| &ops[i]);
    let is_lean = fits_lean(picked());
    let mut call = if is_lean { lean } else { exact }.prepare_invoke();
    call.arg(now.map(|n| n.to_string()).unwrap_or_default());
    for op in picked() {
        call.key(redis_key(prefix, op.key));
    }
    if is_lean {
        let mut args = Vec::with_capacity(lean_len(idx.len()));
        lean_args(&mut args, picked(), whole);
        call.arg(1).arg(args);
    } else {
        exact_args(&mut call, picked(), whole);
    }
    (call, is_lean)
}

/// Reads the reply to a [`count_call`] of `n` ops: the decision, and the counters it repaired.
pub(super) fn read_count(lean: bool, reply: Value, n: usize) -> Result<(Batch, u64), BackendError> {
    match (lean, reply) {
        (true, Value::BulkString(reply)) => {
            let (mut answers, repairs) = parse_lean(&reply, &[n])?;
            let answer = answers
                .pop()
                .ok_or_else(|| BackendError::Reply("an empty reply".into()))?;
            Ok((answer, repairs))
        }
        (false, Value::Array(reply)) => parse_exact(&reply, n),
        (_, reply) => Err(BackendError::Reply(format!("{reply:?}"))),
    }
}

/// The lean script's call over `batch`, its requests decided one after the other, each whole;
/// each request's op count is pushed to `sizes`, for [`parse_lean`].
pub(super) fn lean_batch<'s>(
    lean: &'s Script,
    prefix: &str,
    batch: &[CountCall],
    sizes: &mut Vec<usize>,
) -> ScriptInvocation<'s> {
    let mut call = lean.prepare_invoke();
    let mut args = Vec::with_capacity(batch.iter().map(|p| lean_len(p.ops.len())).sum());
    for p in batch {
        for op in &p.ops {
            call.key(redis_key(prefix, op.key));
        }
        lean_args(&mut args, p.ops.iter(), true);
        sizes.push(p.ops.len());
    }
    call.arg(batch[0].now.map(|n| n.to_string()).unwrap_or_default())
        .arg(batch.len())
        .arg(args);
    call
}

/// What `lease.lua` is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LeaseAsk {
    /// Take, reserving at most this far (ns) past the tolerance.
    Take(u64),
    /// Give back.
    Give,
}

/// `lease.lua`'s arguments: the decision time (empty for Redis `TIME`), the verb, T, B·T, the
/// tokens, and how far past the tolerance a take may reserve.
pub(super) type LeaseArgs = (String, &'static str, u64, u64, u64, u64);

/// The arguments of `ask` for `n` tokens of a counter of `quota`, at `now` (Redis `TIME` for
/// `None`).
pub(super) fn lease_args(quota: &Quota, ask: LeaseAsk, n: u64, now: Option<u64>) -> LeaseArgs {
    let (verb, horizon) = match ask {
        LeaseAsk::Take(h) => ("take", h),
        LeaseAsk::Give => ("give", 0),
    };
    let time = now.map(|n| n.to_string()).unwrap_or_default();
    (time, verb, quota.interval(), quota.tolerance(), n, horizon)
}

/// `script` on `keys` with `args` as one `EVALSHA` command, to ride in a pipeline.
pub(super) fn evalsha<A: redis::ToRedisArgs>(
    script: &Script,
    keys: &[String],
    args: &A,
) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash())
        .arg(keys.len())
        .arg(keys)
        .arg(args);
    cmd
}

/// `lease.lua`'s answer, in tokens and nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LeaseReply {
    /// Tokens taken or given back.
    pub(super) granted: u64,
    /// The counter's debt after the call.
    pub(super) debt: u64,
    /// When a take got nothing: the wait until one token can be reserved.
    pub(super) wait: u64,
    /// The counter held no TAT and was repaired.
    pub(super) repaired: bool,
}

/// Reads `lease.lua`'s reply: `{granted, debt, wait}`, and a fourth value 1 when the counter
/// held no TAT and was repaired.
pub(super) fn parse_lease(reply: &[Value]) -> Result<LeaseReply, BackendError> {
    let bad = || BackendError::Reply(format!("{reply:?}"));
    let (values, repaired) = match reply {
        [g, d, w] => ([g, d, w], false),
        [g, d, w, one] if reply_u64(one) == Some(1) => ([g, d, w], true),
        _ => return Err(bad()),
    };
    match values.map(reply_u64) {
        [Some(granted), Some(debt), Some(wait)] => Ok(LeaseReply {
            granted,
            debt,
            wait,
            repaired,
        }),
        _ => Err(bad()),
    }
}

/// Whether Redis refused a script call because it does not hold the script (after a restart or
/// a `SCRIPT FLUSH`): the call did not run.
pub(super) fn no_script(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// Below this many nanoseconds (2^52, about 52 days) a debt, and every sum the lean script forms
/// from it, is an integer a double holds exactly.
pub(super) const LEAN_LIMIT: u64 = 1 << 52;

/// Below this every integer is a double, exactly: the bound on the lean script's arguments.
pub(super) const EXACT_DOUBLE: u64 = 1 << 53;

/// Whether `gcra_lean.lua` decides these ops exactly: every counter's debt cap plus `T` (the
/// most debt it may carry, [`Quota::debt_cap`], and one request more) is below 2^52 ns, and its
/// period and cost are below 2^53, so that every argument is exact as a double. The rest (a
/// period of more than about ten days, whose four periods of debt pass 2^52 ns; a period of
/// over 104 days for a ban; a cost of 2^53) go to the pair arithmetic of `gcra.lua`. A request
/// that may wait for its slot (`max_delay` above 0, at most a minute) is admitted at it by
/// either script; its delay is part of the debt cap.
pub fn fits_lean<'a>(ops: impl IntoIterator<Item = &'a Op>) -> bool {
    ops.into_iter().all(|op| {
        (op.quota.is_ban() || op.quota.debt_cap().saturating_add(op.quota.interval()) < LEAN_LIMIT)
            && op.quota.period() < EXACT_DOUBLE
            && op.cost < EXACT_DOUBLE
    })
}

/// The bytes of a request of `n` ops in [`lean_args`].
pub(super) const fn lean_len(n: usize) -> usize {
    8 * (2 + 7 * n)
}

/// Appends one request of `ops` to the lean script's arguments (its `ARGV[3]`): `whole`, the
/// op count, then seven per op (T, B·T, B, cost, kind, period, max delay), each a
/// little-endian double.
/// Every value is an integer below 2^53 for ops that [`fits_lean`], so each converts exactly.
pub(super) fn lean_args<'a>(
    out: &mut Vec<u8>,
    ops: impl ExactSizeIterator<Item = &'a Op>,
    whole: bool,
) {
    let mut put = |v: u64| out.extend_from_slice(&(v as f64).to_le_bytes());
    put(u64::from(whole));
    put(ops.len() as u64);
    for op in ops {
        put(op.quota.interval());
        put(op.quota.tolerance());
        put(op.quota.burst());
        put(op.cost);
        put(kind_code(op));
        put(op.quota.period());
        put(op.quota.max_delay());
    }
}

/// Appends one request of `ops` to `gcra.lua`'s arguments: `whole`, then seven per op (T,
/// B·T, B, cost, kind, period, max delay) in decimal.
pub(super) fn exact_args<'a>(
    call: &mut redis::ScriptInvocation<'_>,
    ops: impl IntoIterator<Item = &'a Op>,
    whole: bool,
) {
    call.arg(if whole { "1" } else { "0" });
    for op in ops {
        call.arg(op.quota.interval())
            .arg(op.quota.tolerance())
            .arg(op.quota.burst())
            .arg(op.cost)
            .arg(kind_code(op))
            .arg(op.quota.period())
            .arg(op.quota.max_delay());
    }
}

/// An op's kind in the scripts' arguments: 0 enforce, 1 shadow, 2 quota; plus 4 for a refund,
/// or 8 for spend recorded.
fn kind_code(op: &Op) -> u64 {
    let mode = match op.mode {
        Mode::Enforce => 0,
        Mode::Shadow => 1,
        Mode::Quota => 2,
    };
    mode + match op.charge {
        Charge::Ask => 0,
        Charge::Refund => 4,
        Charge::Spent => 8,
    }
}

/// Reads `gcra.lua`'s reply: `{blocked, now, then per op: admitted, remaining, wait}`, then
/// the counters it repaired when there were any (else 0).
fn parse_exact(reply: &[Value], n: usize) -> Result<(Batch, u64), BackendError> {
    let bad = || BackendError::Reply(format!("{reply:?}"));
    let repairs = match reply.len().checked_sub(2 + 3 * n) {
        Some(0) => 0,
        Some(1) => reply_u64(&reply[2 + 3 * n]).ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    let blocked = reply_u64(&reply[0]).ok_or_else(bad)? == 1;
    let outcomes = outcomes(&reply[2..], n).ok_or_else(bad)?;
    Ok((Batch { blocked, outcomes }, repairs))
}

/// Reads `gcra_lean.lua`'s reply to a batch of requests of `sizes` ops each: little-endian
/// doubles, per request `blocked, then per op: admitted, remaining, wait`, each an integer below
/// 2^53; then, when the call repaired counters, how many (else 0).
pub(super) fn parse_lean(reply: &[u8], sizes: &[usize]) -> Result<(Vec<Batch>, u64), BackendError> {
    let values = sizes.iter().map(|n| 1 + 3 * n).sum::<usize>();
    let bad = |what: &str| {
        BackendError::Reply(format!(
            "{what} in a reply of {} bytes for {values} values",
            reply.len()
        ))
    };
    let repaired = match reply.len().checked_sub(8 * values) {
        Some(0) => false,
        Some(8) => true,
        _ => return Err(bad("a wrong length")),
    };
    let mut doubles = reply.chunks_exact(8).map(|b| {
        let x = f64::from_le_bytes(<[u8; 8]>::try_from(b).ok()?);
        // Every value is an integer in 0..2^53, which a double holds exactly.
        (x >= 0.0 && x < EXACT_DOUBLE as f64 && x.fract() == 0.0).then_some(x as u64)
    });
    let mut next = || {
        doubles
            .next()
            .flatten()
            .ok_or_else(|| bad("a value not an integer"))
    };
    let mut out = Vec::with_capacity(sizes.len());
    for &n in sizes {
        let blocked = next()? == 1;
        let mut outcomes = Vec::with_capacity(n);
        for _ in 0..n {
            outcomes.push(CounterOutcome {
                admitted: next()? == 1,
                remaining: next()?,
                wait: next()?,
                ..CounterOutcome::NONE
            });
        }
        out.push(Batch { blocked, outcomes });
    }
    let repairs = if repaired { next()? } else { 0 };
    Ok((out, repairs))
}

/// `n` outcomes from `admitted, remaining, wait` triples.
fn outcomes(values: &[Value], n: usize) -> Option<Vec<CounterOutcome>> {
    (0..n)
        .map(|k| {
            Some(CounterOutcome {
                admitted: reply_u64(&values[3 * k])? == 1,
                remaining: reply_u64(&values[3 * k + 1])?,
                wait: reply_u64(&values[3 * k + 2])?,
                ..CounterOutcome::NONE
            })
        })
        .collect()
}

/// A non-negative integer reply value (Lua numbers arrive as integers, strings as bulk strings).
pub(super) fn reply_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// A failed call as the backend reports it: a timeout, a connection failure, or Redis's own
/// error.
pub(super) fn classify(e: RedisError, timeout: Duration) -> BackendError {
    if e.is_timeout() {
        BackendError::Timeout(timeout)
    } else if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
        BackendError::Connection(e)
    } else {
        BackendError::Redis(e)
    }
}

impl RedisStore {
    /// The time a leasing script is given: `now` with [`RedisTime::Clock`], else none (Redis
    /// `TIME`).
    pub(super) fn time_arg(&self, now: u64) -> Option<u64> {
        match self.time {
            RedisTime::Server => None,
            RedisTime::Clock => Some(now),
        }
    }

    /// One call of a leasing script (`lease.lua`, `share.lua`) on `keys` with `args`, its reply
    /// read by `parse` into a value and whether a key was repaired: on a single node beside the
    /// next coalesced call, in its round trip; on a cluster alone. The breaker, the deadline,
    /// the stall gate (on a single node) and the failure counts apply as to every call.
    pub(super) async fn script_call<A, R>(
        &self,
        script: &'static Script,
        keys: &[String],
        args: &A,
        purpose: Purpose,
        parse: impl FnOnce(&[Value]) -> Result<(R, bool), BackendError>,
    ) -> Result<R, BackendError>
    where
        A: redis::ToRedisArgs,
    {
        if !self.breaker.allow() {
            self.stats.error(ErrorKind::BreakerOpen);
            return Err(BackendError::BreakerOpen);
        }
        let Some(conn) = self.conn.load_full() else {
            return Err(BackendError::NotConnected);
        };
        let timeout = self.config.timeout;
        let sent = async {
            match &*conn {
                RedisConn::Single(_) => {
                    // Beside the next coalesced call, in its round trip (`coalesce`).
                    let (reply, answer) = tokio::sync::oneshot::channel();
                    let call = LeaseCall {
                        cmd: evalsha(script, keys, args),
                        script,
                        purpose,
                        reply,
                    };
                    self.enqueue(Call::Lease(call))?;
                    match answer.await.map_err(|_| BackendError::NotConnected)?? {
                        Value::Array(values) => Ok(values),
                        other => Err(BackendError::Reply(format!("{other:?}"))),
                    }
                }
                RedisConn::Cluster(c) => {
                    let _trip = self.stats.round_trip(purpose);
                    let mut invocation = script.prepare_invoke();
                    for k in keys {
                        invocation.key(k);
                    }
                    invocation
                        .arg(args)
                        .invoke_async(&mut c.clone())
                        .await
                        .map_err(|e| classify(e, timeout))
                }
            }
        };
        let reply: Result<Vec<Value>, BackendError> =
            match tokio::time::timeout(timeout, sent).await {
                Ok(r) => r,
                Err(_) => Err(BackendError::Timeout(timeout)),
            };
        match reply.and_then(|r| parse(&r)) {
            Ok((r, repaired)) => {
                self.stats.repaired(u64::from(repaired));
                self.breaker.success();
                self.set_answering(true);
                Ok(r)
            }
            Err(e) => {
                self.set_answering(false);
                self.failed(&e, self.clock.now());
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::gcra::Quota;

    const SEC: u64 = 1_000_000_000;

    fn op(period: u64, burst: u64, cost: u64, mode: Mode, refund: bool) -> Op {
        Op {
            key: 7,
            quota: Quota::new(period, burst, burst).unwrap(),
            cost,
            charge: if refund { Charge::Refund } else { Charge::Ask },
            mode,
        }
    }

    #[test]
    fn the_lean_reply_is_read_as_exact_doubles_per_request() {
        let doubles = |v: &[f64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let big = (EXACT_DOUBLE - 1) as f64;
        let reply = doubles(&[1.0, 1.0, 4.0, 250.0, 0.0, 7.0, big, 0.0, 0.0, 3.0, 0.0]);
        let (got, repairs) = parse_lean(&reply, &[2, 1]).unwrap();
        assert_eq!(repairs, 0);
        let outcome = |admitted, remaining, wait| CounterOutcome {
            admitted,
            remaining,
            wait,
            ..CounterOutcome::NONE
        };
        assert_eq!(
            got,
            vec![
                Batch {
                    blocked: true,
                    outcomes: vec![outcome(true, 4, 250), outcome(false, 7, EXACT_DOUBLE - 1)]
                },
                Batch {
                    blocked: false,
                    outcomes: vec![outcome(false, 3, 0)]
                },
            ]
        );
        // One more value: the counters the call repaired.
        let mut repaired = reply.clone();
        repaired.extend(doubles(&[2.0]));
        assert_eq!(parse_lean(&repaired, &[2, 1]).unwrap(), (got, 2));
        // A reply of another length, a negative, fractional or inexact value: an error naming the
        // problem (in the log's detail), never a guess.
        assert!(parse_lean(&reply[..80], &[2, 1]).is_err());
        repaired.extend(doubles(&[0.0]));
        assert!(parse_lean(&repaired, &[2, 1]).is_err());
        for bad in [-1.0, 0.5, EXACT_DOUBLE as f64, f64::NAN, f64::INFINITY] {
            let reply = doubles(&[0.0, 1.0, bad, 0.0]);
            let err = parse_lean(&reply, &[1]).unwrap_err().detail();
            assert!(err.contains("not an integer"), "{bad}: {err}");
        }
    }

    #[test]
    fn the_lean_arguments_are_exact_doubles_in_order() {
        let ops = [
            op(SEC, 10, 1, Mode::Enforce, false),
            op(60 * SEC, 3, 2, Mode::Quota, true),
            op(3_600 * SEC, 5, 0, Mode::Shadow, false),
        ];
        let ops = [
            ops[0],
            Op {
                quota: ops[1].quota.with_max_delay(15 * SEC),
                ..ops[1]
            },
            ops[2],
        ];
        assert!(fits_lean(&ops));
        let mut out = Vec::new();
        lean_args(&mut out, [&ops[2], &ops[1]].into_iter(), false);
        assert_eq!(out.len(), lean_len(2));
        let values: Vec<f64> = out
            .chunks(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let (a, b) = (&ops[2].quota, &ops[1].quota);
        let expected: Vec<f64> = [
            0,
            2,
            a.interval(),
            a.tolerance(),
            5,
            0,
            1,
            a.period(),
            0,
            b.interval(),
            b.tolerance(),
            3,
            2,
            2 + 4,
            b.period(),
            15 * SEC,
        ]
        .iter()
        .map(|v| *v as f64)
        .collect();
        assert_eq!(values, expected);
    }

    #[test]
    fn what_a_double_cannot_hold_goes_to_the_exact_script() {
        let fits = |o: Op| fits_lean([&o]);
        assert!(fits(op(SEC, 10, 1, Mode::Enforce, false)));
        // A year's period is above 2^53 ns even when the bucket is small: a burst of 1 of a
        // billion a year (T of 31.5 ms) fits the tolerance bound, not the period's.
        let yearly = Op {
            quota: Quota::new(365 * 86_400 * SEC, 1_000_000_000, 1).unwrap(),
            ..op(SEC, 10, 1, Mode::Enforce, false)
        };
        assert!(yearly.quota.tolerance() + yearly.quota.interval() < LEAN_LIMIT);
        assert!(!fits(yearly));
        assert!(!fits(Op {
            quota: Quota::ban(365 * 86_400 * SEC),
            ..yearly
        }));
        // A week's bucket: with four weeks of debt it stays below 2^52 ns. A 30-day one is
        // within the bound, but its four periods of debt (120 days) are not.
        assert!(fits(op(
            7 * 86_400 * SEC,
            1_000_000,
            1,
            Mode::Enforce,
            false
        )));
        let monthly = op(30 * 86_400 * SEC, 1_000_000, 1, Mode::Enforce, false);
        assert!(monthly.quota.tolerance() + monthly.quota.interval() < LEAN_LIMIT);
        assert!(!fits(monthly));
        // A cost of 2^53 (a client's hits_addend) is not a double.
        assert!(!fits(op(SEC, 10, 1 << 53, Mode::Enforce, false)));
        assert!(fits(op(SEC, 10, (1 << 53) - 1, Mode::Enforce, false)));
        // A tolerance of 60 days, its period below 2^53: the pair arithmetic all the same.
        assert!(!fits(op(60 * 86_400 * SEC, 10, 1, Mode::Enforce, false)));
        // A delay of a minute is part of the debt cap, well within the bound.
        let waits = op(SEC, 10, 1, Mode::Enforce, false);
        assert!(fits(Op {
            quota: waits.quota.with_max_delay(60 * SEC),
            ..waits
        }));
    }

    #[test]
    fn the_lease_reply_is_three_integers_and_maybe_a_repair() {
        let ints = |v: &[i64]| v.iter().map(|i| Value::Int(*i)).collect::<Vec<_>>();
        assert_eq!(
            parse_lease(&ints(&[3, 40, 0])).unwrap(),
            LeaseReply {
                granted: 3,
                debt: 40,
                wait: 0,
                repaired: false
            }
        );
        assert!(parse_lease(&ints(&[0, 40, 7, 1])).unwrap().repaired);
        assert!(parse_lease(&ints(&[0, 40, 7, 2])).is_err());
        assert!(parse_lease(&ints(&[0, -1, 7])).is_err());
        assert!(parse_lease(&ints(&[0, 40])).is_err());
    }
}
