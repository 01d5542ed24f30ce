//! A node's share of a contended counter, kept in Redis: the share table's key, `share.lua`'s
//! arguments and reply, and [`RedisStore::share_call`], one renewal. Which counters are shared and
//! when they are renewed is leasing's; the division of the rate is `share.lua`'s (the same rule
//! as `limiter::share::divide`).

use std::sync::LazyLock;
use std::time::Duration;

use redis::{Script, Value};

use crate::limiter::error::BackendError;
use crate::limiter::figures::Purpose;
use crate::limiter::gcra::Quota;
use crate::limiter::key::Key;
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::call::reply_u64;

/// `share.lua`, loaded once per process.
static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(super::scripts::SHARE));

/// What one renewal tells Redis.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShareRenewal<'a> {
    /// The holder's id in the share table (a node's, or a stream's).
    pub holder: &'a str,
    /// Hits offered per second on the holder, admitted and refused, smoothed.
    pub demand: f64,
    /// Tokens the holder holds due and unused (reserved ones not yet due are not counted).
    pub held: u64,
    /// P, the time until the next renewal: the share's tokens are for that long.
    pub period: Duration,
    /// How long the holder's entry lives unrenewed (L).
    pub lifetime: Duration,
    /// How far past the tolerance the take may reserve (ns).
    pub horizon: u64,
    /// Give the share up instead of renewing it.
    pub leave: bool,
}

/// `share.lua`'s answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShareReply {
    /// Tokens taken from the counter for the next period.
    pub granted: u64,
    /// The counter's debt after the call (ns).
    pub debt: u64,
    /// When tokens were wanted and none could be reserved: the wait until one can (ns).
    pub wait: u64,
    /// The holder's part of the rate, in millionths.
    pub millionths: u64,
    /// The holder's part of the burst, in tokens.
    pub burst: u64,
    /// The demand of every live holder, this one included, in hits per second.
    pub demand: f64,
    /// Whether the counter is still shared: false after a leave, or when demand fell below the
    /// rate with no reservation standing (the holder's entry is then gone).
    pub shared: bool,
}

/// The share table of the counter stored at `counter`, in the same cluster slot: the counter's
/// own hash tag when it has one, else the whole counter key as the tag. A counter key with a `}`
/// and no tag (a `redis.key_prefix` such as `a}b`) cannot be a tag: its table is then beside it
/// by name only, which a single Redis takes, and a cluster refuses (the renewal fails, and the
/// counter stays in slices).
#[must_use]
pub fn table_key(counter: &str) -> String {
    beside(counter, "shares")
}

/// `counter` with `:suffix`, in the counter's cluster slot (see [`table_key`]).
pub(super) fn beside(counter: &str, suffix: &str) -> String {
    let tagged = counter
        .find('{')
        .and_then(|open| counter[open + 1..].find('}'))
        .is_some_and(|len| len > 0);
    if tagged || counter.contains('}') {
        format!("{counter}:{suffix}")
    } else {
        format!("{{{counter}}}:{suffix}")
    }
}

/// Reads `share.lua`'s reply: seven integers, and an eighth, 1, when a key was repaired.
fn parse_share(reply: &[Value]) -> Result<(ShareReply, bool), BackendError> {
    let bad = || BackendError::Reply(format!("{reply:?}"));
    let repaired = match reply.len() {
        7 => false,
        8 if reply_u64(&reply[7]) == Some(1) => true,
        _ => return Err(bad()),
    };
    let v: Vec<u64> = reply[..7]
        .iter()
        .map(reply_u64)
        .collect::<Option<_>>()
        .ok_or_else(bad)?;
    if v[3] > 1_000_000 || v[6] > 1 {
        return Err(bad());
    }
    Ok((
        ShareReply {
            granted: v[0],
            debt: v[1],
            wait: v[2],
            millionths: v[3],
            burst: v[4],
            // Precision intended: thousandths of a hit per second.
            demand: v[5] as f64 / 1_000.0,
            shared: v[6] == 1,
        },
        repaired,
    ))
}

impl RedisStore {
    /// One renewal of `renewal.holder`'s share of counter `key` under `quota`, at `now` (the
    /// decision time with `RedisTime::Clock`): its demand recorded, its share of the rate and
    /// burst worked out, and the share's tokens for the next period taken, as `share.lua` says.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot answer.
    pub async fn share_call(
        &self,
        key: Key,
        quota: &Quota,
        renewal: &ShareRenewal<'_>,
        now: u64,
    ) -> Result<ShareReply, BackendError> {
        let counter = self.key(key);
        let table = table_key(&counter);
        let keys = [counter, table];
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        // Precision intended: thousandths of a hit per second, as the table keeps them.
        let demand = (renewal.demand.max(0.0) * 1_000.0).min(1e15) as u64;
        let args = (
            self.time_arg(now)
                .map(|n| n.to_string())
                .unwrap_or_default(),
            "share",
            quota.interval(),
            quota.tolerance(),
            renewal.horizon,
            renewal.holder,
            demand,
            renewal.held,
            nanos(renewal.period).max(1),
            (nanos(renewal.lifetime) / 1_000_000).max(1),
            if renewal.leave { "leave" } else { "" },
        );
        self.script_call(&SCRIPT, &keys, &args, Purpose::Renew, parse_share)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(v: &[i64]) -> Vec<Value> {
        v.iter().map(|&i| Value::Int(i)).collect()
    }

    #[test]
    fn the_table_is_in_its_counters_slot() {
        assert_eq!(table_key("sluice:00ff"), "{sluice:00ff}:shares");
        assert_eq!(table_key("{app}:00ff"), "{app}:00ff:shares");
        assert_eq!(table_key("a{b"), "{a{b}:shares");
        assert_eq!(
            table_key("a{}b"),
            "a{}b:shares",
            "an empty tag is no tag, and no tag holds `}}`"
        );
    }

    #[test]
    fn the_reply_is_seven_integers_and_maybe_a_repair() {
        let (r, repaired) = parse_share(&ints(&[3, 40, 0, 250_000, 50, 1_500_000, 1])).unwrap();
        assert!(!repaired);
        assert_eq!(
            (r.granted, r.millionths, r.burst, r.shared),
            (3, 250_000, 50, true)
        );
        assert!((r.demand - 1_500.0).abs() < 1e-9);
        assert!(parse_share(&ints(&[0, 0, 0, 0, 0, 0, 0, 1])).unwrap().1);
        for bad in [
            &[0, 0, 0, 0, 0, 0][..],
            &[0, 0, 0, 1_000_001, 0, 0, 1],
            &[0, 0, 0, 0, 0, 0, 2],
            &[0, -1, 0, 0, 0, 0, 1],
            &[0, 0, 0, 0, 0, 0, 1, 2],
        ] {
            assert!(parse_share(&ints(bad)).is_err(), "{bad:?}");
        }
    }
}
