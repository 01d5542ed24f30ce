//! Why a backend could not decide, or could not be set up: [`BackendError`], its metric
//! [`ErrorKind`], and [`ConnectError`] for Redis settings and connections. Plain values below
//! every backend, so the stores, the seam and the metrics share them without importing one
//! another. No variant carries a secret; [`BackendError`]'s `Display` carries no Redis text.

use std::path::PathBuf;
use std::time::Duration;

/// What kind of failure kept Redis from deciding, for metrics and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// No answer within the deadline.
    Timeout,
    /// Not connected, or the connection failed.
    Connection,
    /// The circuit breaker is open.
    BreakerOpen,
    /// Redis answered with an error, or with something the script never returns.
    Redis,
}

impl ErrorKind {
    /// Every kind, in the order metrics list them.
    pub const ALL: [Self; 4] = [
        Self::Timeout,
        Self::Connection,
        Self::BreakerOpen,
        Self::Redis,
    ];

    /// The metric label.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Connection => "connection",
            Self::BreakerOpen => "breaker_open",
            Self::Redis => "redis",
        }
    }

    /// Position in [`ErrorKind::ALL`].
    #[must_use]
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// Why a backend could not decide.
///
/// Its `Display` is in the product's words, for a client's status details: no Redis error text,
/// script source or line number. [`BackendError::detail`] adds what Redis said, for the log.
#[derive(Clone, Debug, thiserror::Error)]
pub enum BackendError {
    /// No answer within the deadline.
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    /// No connection has been established yet.
    #[error("redis is not connected yet")]
    NotConnected,
    /// The connection failed or was dropped.
    #[error("the connection to redis failed")]
    Connection(#[source] ::redis::RedisError),
    /// The circuit breaker is open after repeated failures.
    #[error("redis circuit breaker is open")]
    BreakerOpen,
    /// More calls wait for Redis than the queue holds: Redis is too slow for the load.
    #[error("more calls wait for redis than sluice queues")]
    QueueFull,
    /// Redis answered with an error.
    #[error("redis refused the rate-limit call")]
    Redis(#[source] ::redis::RedisError),
    /// Redis answered with something the script never returns.
    #[error("redis answered the rate-limit call with an unexpected reply")]
    Reply(String),
    /// The connection cannot be set up: a malformed URL, contradicting settings, or a
    /// certificate, key or password file that cannot be used.
    #[error("{0}")]
    Setup(#[source] ConnectError),
}

impl BackendError {
    /// The error with what Redis said, for the log (never for a client).
    #[must_use]
    pub fn detail(&self) -> String {
        match self {
            Self::Connection(e) | Self::Redis(e) => format!("{self}: {e}"),
            Self::Reply(what) => format!("{self}: {what}"),
            _ => self.to_string(),
        }
    }

    /// Whether the error is about the data of a call (a key of the wrong type, a script that
    /// failed on what it read), not about Redis being reachable: Redis answered. Such an error
    /// is no reason to open the circuit breaker for every other key.
    #[must_use]
    pub fn is_data_error(&self) -> bool {
        match self {
            Self::Redis(e) => {
                e.code() == Some("WRONGTYPE")
                    || e.detail().is_some_and(|d| d.contains("user_script"))
                    || e.to_string().contains("user_script")
            }
            _ => false,
        }
    }

    /// Its kind, for metrics.
    #[must_use]
    pub const fn kind(&self) -> ErrorKind {
        match self {
            Self::Timeout(_) | Self::QueueFull => ErrorKind::Timeout,
            Self::NotConnected | Self::Connection(_) | Self::Setup(_) => ErrorKind::Connection,
            Self::BreakerOpen => ErrorKind::BreakerOpen,
            Self::Redis(_) | Self::Reply(_) => ErrorKind::Redis,
        }
    }
}

/// Why a connection cannot be set up or opened. No variant carries a secret.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ConnectError {
    /// A certificate, key or password file that cannot be used.
    #[error("redis.{setting} {}: {reason}", path.display())]
    File {
        /// The setting naming the file (`tls.ca_file`, `password_file`, ...).
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it cannot be used (never its contents).
        reason: String,
    },
    /// Settings that contradict each other or the URLs.
    #[error("{0}")]
    Invalid(String),
    /// Redis refused the user name and password (redis-rs keeps the server's `WRONGPASS`
    /// text to itself).
    #[error(
        "redis refused the login as user {user:?} ({source}): wrong password, or the user is \
         unknown or disabled"
    )]
    Login {
        /// The user logged in as (`default` when none was given).
        user: String,
        /// redis-rs's error.
        source: redis::RedisError,
    },
    /// Redis (or the network, or the TLS handshake) refused the connection.
    #[error("{0}")]
    Redis(#[from] redis::RedisError),
}
