//! Redis Sentinel: asking the sentinels which master they name and confirming it with `ROLE`
//! (`Sentinels`); `connect` follows a failover with it, with no restart. A failed script call is
//! never sent again (neither here nor by the connection manager), so a request is charged at most
//! once; a failover can only lose charges the old master had not yet replicated.
//!
//! Not done: subscribing to `+switch-master` (the first failed call triggers the same check), and
//! replicas for reads (every decision writes).

use std::sync::Mutex;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, RedisError, Value};
use tokio::sync::Notify;

use crate::limiter::error::BackendError;
use crate::limiter::redis::config::{RedisConfig, SentinelConfig};
use crate::limiter::redis::redact::redact;

/// Why no master could be found through the sentinels. No message carries a credential.
#[derive(Debug, thiserror::Error)]
pub enum SentinelError {
    /// Every sentinel failed to answer.
    #[error("no sentinel answered for master {master:?} (asked {sentinels}): {errors}")]
    NoneAnswered {
        /// The master's name.
        master: String,
        /// The sentinels asked, credentials redacted.
        sentinels: String,
        /// What went wrong with each.
        errors: String,
    },
    /// The sentinels that answered know no master of that name.
    #[error(
        "the sentinels know no master named {master:?} (asked {sentinels}{unanswered}); check \
         redis.sentinel.master_name against their `sentinel monitor` lines"
    )]
    UnknownMaster {
        /// The master's name.
        master: String,
        /// The sentinels asked, credentials redacted.
        sentinels: String,
        /// Those that did not answer at all, if any.
        unanswered: String,
    },
    /// The sentinels named a master, but none of the named addresses is a reachable master.
    #[error("the sentinels name a master {master:?}, but it cannot be used: {errors}")]
    MasterUnusable {
        /// The master's name.
        master: String,
        /// Each named address and what went wrong with it.
        errors: String,
    },
}

/// A master's address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Addr {
    host: String,
    port: u16,
}

impl std::fmt::Display for Addr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// What a check of the sentinels found.
pub(super) enum Found {
    /// The master in use is still the one they name.
    Same,
    /// Another master, connected and confirmed.
    New(Addr, ConnectionManager),
}

/// The sentinels of one master, and the master in use.
///
/// Finding the master: the sentinels are asked in order, each with the connect timeout,
/// `SENTINEL get-master-addr-by-name`; the first address that answers `ROLE` as a master is used
/// (a sentinel's view can be stale, so its word alone is not enough). The connection to it is a
/// connection manager, as on a single node, so coalescing and the lean script work unchanged.
pub(super) struct Sentinels {
    pub(super) master_name: String,
    /// Each sentinel: its URL for messages (redacted) and a client for it.
    sentinels: Vec<(String, Client)>,
    /// The master's connection settings (credentials, database, TLS) from `redis.url`; its
    /// address is replaced by the one the sentinels name.
    master: ConnectionInfo,
    /// One short exchange (a sentinel's answer, a master's role): the connect timeout for both
    /// connecting and answering.
    probe: AsyncConnectionConfig,
    manager: ConnectionManagerConfig,
    current: Mutex<Option<Addr>>,
    /// Woken by a failed call: time to ask the sentinels again.
    pub(super) wake: Notify,
}

impl Sentinels {
    /// The sentinels of `sentinel`, and `master`: the master's connection settings
    /// (credentials, database, scheme), whose address the sentinels will name.
    pub(super) fn new(
        config: &RedisConfig,
        sentinel: &SentinelConfig,
        master: ConnectionInfo,
    ) -> Result<Self, BackendError> {
        let bad = BackendError::Connection;
        let mut sentinels = Vec::with_capacity(sentinel.urls.len());
        for url in &sentinel.urls {
            let mut info =
                redis::IntoConnectionInfo::into_connection_info(url.as_str()).map_err(bad)?;
            if let (Some(password), None) = (&sentinel.password, info.redis_settings().password()) {
                let settings = info.redis_settings().clone().set_password(password);
                info = info.set_redis_settings(settings);
            }
            sentinels.push((redact(url), Client::open(info).map_err(bad)?));
        }
        Ok(Self {
            master_name: sentinel.master_name.clone(),
            sentinels,
            master,
            probe: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(config.connect_timeout))
                .set_response_timeout(Some(config.connect_timeout)),
            manager: ConnectionManagerConfig::new()
                .set_connection_timeout(Some(config.connect_timeout))
                .set_response_timeout(Some(config.timeout))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_secs(1)),
            current: Mutex::new(None),
            wake: Notify::new(),
        })
    }

    /// The master the sentinels name, connected: the first connection of the store.
    pub(super) async fn connect(&self) -> Result<ConnectionManager, RedisError> {
        match self.find(None).await {
            Ok(Found::New(addr, conn)) => {
                tracing::info!(master = %addr, name = %self.master_name, "redis sentinel: master found");
                *self.lock() = Some(addr);
                Ok(conn)
            }
            // With no master in use there is none to be the same as.
            Ok(Found::Same) => Err(RedisError::from(std::io::Error::other(
                "redis sentinel: no master found",
            ))),
            Err(e) => Err(RedisError::from(std::io::Error::other(e))),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Option<Addr>> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Asks the sentinels in order; the first named address that confirms it is a master wins.
    /// `current` is the master in use: named again and still a master, it is kept.
    pub(super) async fn find(&self, current: Option<&Addr>) -> Result<Found, SentinelError> {
        let mut unanswered = Vec::new();
        let mut tried: Vec<(Addr, String)> = Vec::new();
        let mut answered = false;
        for (url, client) in &self.sentinels {
            let addr = match self.ask(client).await {
                Ok(Some(addr)) => addr,
                Ok(None) => {
                    answered = true;
                    continue;
                }
                Err(e) => {
                    unanswered.push(format!("{url}: {e}"));
                    continue;
                }
            };
            answered = true;
            if tried.iter().any(|(a, _)| *a == addr) {
                continue;
            }
            match self.confirm(&addr).await {
                Ok(()) if current == Some(&addr) => return Ok(Found::Same),
                Ok(()) => match ConnectionManager::new_with_config(
                    self.client(&addr).map_err(|e| self.unusable(&addr, &e))?,
                    self.manager.clone(),
                )
                .await
                {
                    Ok(conn) => return Ok(Found::New(addr, conn)),
                    Err(e) => tried.push((addr, e.to_string())),
                },
                Err(why) => tried.push((addr, why)),
            }
        }
        let sentinels = self
            .sentinels
            .iter()
            .map(|(url, _)| url.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        if !tried.is_empty() {
            return Err(SentinelError::MasterUnusable {
                master: self.master_name.clone(),
                errors: tried
                    .iter()
                    .map(|(a, why)| format!("{a}: {why}"))
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        if answered {
            return Err(SentinelError::UnknownMaster {
                master: self.master_name.clone(),
                sentinels,
                unanswered: if unanswered.is_empty() {
                    String::new()
                } else {
                    format!("; no answer from {}", unanswered.join("; "))
                },
            });
        }
        Err(SentinelError::NoneAnswered {
            master: self.master_name.clone(),
            sentinels,
            errors: unanswered.join("; "),
        })
    }

    fn unusable(&self, addr: &Addr, e: &RedisError) -> SentinelError {
        SentinelError::MasterUnusable {
            master: self.master_name.clone(),
            errors: format!("{addr}: {e}"),
        }
    }

    /// One sentinel's answer: the master's address, or `None` when it knows no such master.
    async fn ask(&self, sentinel: &Client) -> Result<Option<Addr>, RedisError> {
        let mut conn = sentinel
            .get_multiplexed_async_connection_with_config(&self.probe)
            .await?;
        let reply: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.master_name)
            .query_async(&mut conn)
            .await?;
        Ok(reply.map(|(host, port)| Addr { host, port }))
    }

    /// A client for the master at `addr`, with `redis.url`'s credentials, database and TLS.
    fn client(&self, addr: &Addr) -> Result<Client, RedisError> {
        let at = match self.master.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host: addr.host.clone(),
                port: addr.port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(addr.host.clone(), addr.port),
        };
        Client::open(self.master.clone().set_addr(at))
    }

    /// Whether `addr` answers `ROLE` as a master; why not otherwise.
    async fn confirm(&self, addr: &Addr) -> Result<(), String> {
        let client = self.client(addr).map_err(|e| e.to_string())?;
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&self.probe)
            .await
            .map_err(|e| e.to_string())?;
        let reply: Value = redis::cmd("ROLE")
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        match role(&reply) {
            Some("master") => Ok(()),
            Some(other) => Err(format!(
                "it reports role {other:?}, not master (the sentinels' view is stale)"
            )),
            None => Err("it gave an unexpected answer to ROLE".into()),
        }
    }

    /// Whether a failed call calls for asking the sentinels again.
    pub(super) fn wakes(e: &BackendError) -> bool {
        match e {
            BackendError::Timeout(_)
            | BackendError::QueueFull
            | BackendError::Connection(_)
            | BackendError::BreakerOpen => true,
            BackendError::Redis(e) => {
                e.code() == Some("READONLY") || e.to_string().contains("READONLY")
            }
            BackendError::NotConnected | BackendError::Reply(_) | BackendError::Setup(_) => false,
        }
    }
}

/// The role in a `ROLE` reply (`master`, `slave`, `sentinel`).
fn role(reply: &Value) -> Option<&str> {
    let Value::Array(items) = reply else {
        return None;
    };
    match items.first()? {
        Value::BulkString(b) => std::str::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s.as_str()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_read_from_the_reply() {
        let reply = Value::Array(vec![
            Value::BulkString(b"master".to_vec()),
            Value::Int(42),
            Value::Array(vec![]),
        ]);
        assert_eq!(role(&reply), Some("master"));
        let reply = Value::Array(vec![Value::BulkString(b"slave".to_vec())]);
        assert_eq!(role(&reply), Some("slave"));
        assert_eq!(role(&Value::Nil), None);
        assert_eq!(role(&Value::Array(vec![])), None);
    }

    #[test]
    fn failures_a_failover_explains_wake_the_follower() {
        let readonly = RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
            "replica",
        ));
        assert!(Sentinels::wakes(&BackendError::Redis(readonly)));
        assert!(Sentinels::wakes(&BackendError::BreakerOpen));
        assert!(Sentinels::wakes(&BackendError::Timeout(
            Duration::from_millis(1)
        )));
        let script = RedisError::from((redis::ErrorKind::Client, "bad script"));
        assert!(!Sentinels::wakes(&BackendError::Redis(script)));
        assert!(!Sentinels::wakes(&BackendError::Reply("x".into())));
    }

    #[test]
    fn debug_hides_the_sentinel_password() {
        let c = SentinelConfig {
            master_name: "m".into(),
            urls: vec!["redis://u:urlsecret@10.0.0.1:26379".into()],
            password: Some("topsecret".into()),
        };
        let text = format!("{c:?}");
        assert!(
            !text.contains("urlsecret") && !text.contains("topsecret"),
            "{text}"
        );
        assert!(text.contains("10.0.0.1:26379"), "{text}");
        assert_eq!(
            Addr {
                host: "::1".into(),
                port: 1
            }
            .to_string(),
            "[::1]:1"
        );
    }
}
