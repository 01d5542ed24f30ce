//! Heartbeats: each node records itself in one sorted set in Redis (`{prefix}nodes`, member its
//! random id, score the Redis-time millisecond its entry expires), drops the expired entries and
//! counts the rest, in one small script per beat: the fleet size N that degraded local mode divides
//! each budget by. An entry lives three intervals, so a node is counted until it has missed three
//! beats; one that stops cleanly removes itself at once. The score is an expiry instant, so nodes
//! with different intervals can share the set; in Redis Cluster it is one key in one slot.

use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use redis::Script;

use crate::limiter::error::BackendError;
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::call::classify;
use crate::limiter::redis::connect::RedisConn;

/// `KEYS[1]` the set, `ARGV[1]` this node's id, `ARGV[2]` an entry's lifetime in ms. Returns the
/// live nodes, this one included.
const BEAT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local life = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + life, ARGV[1])
if redis.call('PTTL', KEYS[1]) < life then
  redis.call('PEXPIRE', KEYS[1], life)
end
return redis.call('ZCARD', KEYS[1])
";

/// One node's heartbeat.
#[derive(Debug, Clone)]
pub struct Heartbeat {
    id: String,
    interval: Duration,
    script: Script,
}

impl Heartbeat {
    /// A heartbeat every `interval` (at least 1 ms) under a random id.
    #[must_use]
    pub fn new(interval: Duration) -> Self {
        Self {
            id: random_id(),
            interval: interval.max(Duration::from_millis(1)),
            script: Script::new(BEAT),
        }
    }

    /// This node's id in the set.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// How long an entry lives without a new beat: three intervals, in milliseconds.
    fn lifetime_ms(&self) -> u64 {
        u64::try_from(self.interval.as_millis().saturating_mul(3))
            .unwrap_or(u64::MAX)
            .max(1)
    }
}

/// 128 random bits in hex, from the standard library's randomly seeded hasher, the process id
/// and the time: unique enough to tell the nodes of one fleet apart.
pub(super) fn random_id() -> String {
    let seed = std::collections::hash_map::RandomState::new();
    let mut a = seed.build_hasher();
    a.write_u32(std::process::id());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    a.write_u128(nanos);
    let first = a.finish();
    let mut b = seed.build_hasher();
    b.write_u64(first);
    format!("{first:016x}{:016x}", b.finish())
}

impl RedisStore {
    /// The set every node of this key prefix beats in.
    fn fleet_key(&self) -> String {
        format!("{}nodes", self.config.key_prefix)
    }

    /// One beat: records this node and returns the live nodes, itself included.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis is not connected or does not answer within the call
    /// deadline (or the interval, when that is longer).
    pub async fn beat(&self, hb: &Heartbeat) -> Result<u64, BackendError> {
        let mut call = hb.script.prepare_invoke();
        call.key(self.fleet_key()).arg(&hb.id).arg(hb.lifetime_ms());
        self.fleet_call(hb, call).await
    }

    /// Removes this node from the set (at shutdown), so the others stop counting it at once.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot be reached; the entry then expires by itself.
    pub async fn leave_fleet(&self, hb: &Heartbeat) -> Result<(), BackendError> {
        let key = self.fleet_key();
        let Some(conn) = self.conn.load_full() else {
            return Err(BackendError::NotConnected);
        };
        let deadline = self.config.timeout.max(hb.interval);
        let mut cmd = redis::cmd("ZREM");
        cmd.arg(key).arg(&hb.id);
        let call = async {
            match &*conn {
                RedisConn::Single(c) => cmd.query_async::<u64>(&mut c.clone()).await,
                RedisConn::Cluster(c) => cmd.query_async::<u64>(&mut c.clone()).await,
            }
        };
        match tokio::time::timeout(deadline, call).await {
            Ok(r) => r.map(|_| ()).map_err(|e| classify(e, deadline)),
            Err(_) => Err(BackendError::Timeout(deadline)),
        }
    }

    async fn fleet_call(
        &self,
        hb: &Heartbeat,
        call: redis::ScriptInvocation<'_>,
    ) -> Result<u64, BackendError> {
        let Some(conn) = self.conn.load_full() else {
            return Err(BackendError::NotConnected);
        };
        let deadline = self.config.timeout.max(hb.interval);
        let run = async {
            match &*conn {
                RedisConn::Single(c) => call.invoke_async::<u64>(&mut c.clone()).await,
                RedisConn::Cluster(c) => call.invoke_async::<u64>(&mut c.clone()).await,
            }
        };
        match tokio::time::timeout(deadline, run).await {
            Ok(r) => r.map_err(|e| classify(e, deadline)),
            Err(_) => Err(BackendError::Timeout(deadline)),
        }
    }

    /// Beats every interval, telling `seen` the live nodes after each beat Redis answered,
    /// until `stop` resolves; then removes this node from the set. A failed beat changes
    /// nothing: the last count stands (it is the fleet "seen before the outage").
    pub async fn heartbeat(
        &self,
        hb: &Heartbeat,
        seen: impl Fn(u64) + Send,
        stop: impl Future<Output = ()> + Send,
    ) {
        let mut tick = tokio::time::interval(hb.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(stop);
        let mut failing = false;
        loop {
            tokio::select! {
                () = &mut stop => break,
                _ = tick.tick() => match self.beat(hb).await {
                    Ok(live) => {
                        if failing {
                            tracing::info!(live, "heartbeat answered again");
                        }
                        failing = false;
                        seen(live);
                    }
                    Err(e) => {
                        if !failing {
                            tracing::debug!(error = %e, "heartbeat failed; keeping the last fleet size");
                        }
                        failing = true;
                    }
                },
            }
        }
        if let Err(e) = self.leave_fleet(hb).await {
            tracing::debug!(error = %e, "could not leave the fleet; the entry will expire");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_differ_and_entries_live_three_intervals() {
        let a = Heartbeat::new(Duration::from_millis(200));
        let b = Heartbeat::new(Duration::from_millis(200));
        assert_ne!(a.id(), b.id());
        assert_eq!(a.id().len(), 32);
        assert_eq!(a.lifetime_ms(), 600);
        assert_eq!(Heartbeat::new(Duration::ZERO).lifetime_ms(), 3);
    }
}
