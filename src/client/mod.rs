//! The client half: what a service links to ask sluice before it does work. It owns the call
//! ([`RateLimitClient`]: `ShouldRateLimit` with a per-call deadline), the typed [`Answer`], the
//! stated [`FailurePolicy`] for when sluice does not answer, waiting for a slot instead of taking
//! a refusal ([`acquire`]), the jittered [`backoff`], the tower
//! [`layer`], the [`adaptive`] concurrency limit for a service's own downstream calls, and the
//! [`quota`] enforcer of Rate Limit Quota Service assignments (the local token buckets that
//! decide with no round trip, as Envoy's quota filter does). It does not decide what a request
//! is worth, count for the server or know policies: it speaks the generated [`crate::pb`] types only,
//! never the server, the decision internals or the stores (the layer check holds it to that),
//! so a service linking it depends on the API, not on sluice's insides. It is behind the
//! `client` cargo feature so the server build does not grow.

pub mod acquire;
pub mod adaptive;
pub mod backoff;
pub mod layer;
pub mod quota;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::pb::rate_limit_response::Code;
use crate::pb::rate_limit_service_client::RateLimitServiceClient;
use crate::pb::{RateLimitDescriptor, RateLimitRequest, RateLimitResponse, rate_limit_descriptor};

pub use acquire::{AcquireError, Acquired};
pub use backoff::{Backoff, Jitter};
pub use layer::{RateLimit, RateLimitLayer, Refusal};
pub use quota::{Bucket, Quota, QuotaBuilder};

/// The default per-call deadline: a quarter of Envoy's default 20 ms for its whole call to a
/// rate-limit service; a call that takes longer than this is better treated as a failure than
/// waited for.
pub const DEFAULT_DEADLINE: Duration = Duration::from_millis(5);

/// The wait reported for an `OVER_LIMIT` answer that names no `duration_until_reset` (sluice
/// always names one; other rate-limit services may not).
pub const UNSTATED_WAIT: Duration = Duration::from_secs(1);

/// What sluice (or the failure policy, when sluice did not answer) says about a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Go ahead; the request was charged.
    Allowed,
    /// Do not; asking again earlier than `wait` is refused again. From the server this is the
    /// longest `duration_until_reset` of the refused descriptors (whole seconds rounded up, as
    /// sluice reports it); from a fail-closed policy, the policy's wait; from a [`Quota`], the
    /// time until its bucket's next token, or the report interval under `DENY_ALL` (sluice may
    /// lift a ban at any report).
    Refused {
        /// The least time to wait before asking again.
        wait: Duration,
    },
}

impl Answer {
    /// Whether the request may go ahead.
    pub fn is_allowed(&self) -> bool {
        matches!(self, Answer::Allowed)
    }
}

/// What to answer when sluice does not: the choice Envoy makes with `failure_mode_deny`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Allow the request. For limits that protect a downstream which survives a short overload,
    /// or is guarded elsewhere too: a rate-limit outage should not become an outage of the
    /// service. The default, as Envoy's.
    Open,
    /// Refuse the request, asking the caller to wait `wait`. For limits where overload costs
    /// more than refusal (a paid third-party API, a downstream that falls over).
    Closed {
        /// The wait a refusal under this policy reports.
        wait: Duration,
    },
}

impl FailurePolicy {
    /// The metric label of this policy.
    fn label(&self) -> &'static str {
        match self {
            FailurePolicy::Open => "open",
            FailurePolicy::Closed { .. } => "closed",
        }
    }

    /// The answer this policy gives when sluice does not.
    fn answer(&self) -> Answer {
        match *self {
            FailurePolicy::Open => Answer::Allowed,
            FailurePolicy::Closed { wait } => Answer::Refused { wait },
        }
    }
}

/// Why a call to sluice gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No answer within the deadline (sluice slow, stalled, or not reachable in time).
    #[error("no answer from sluice within the {0:?} deadline")]
    Deadline(Duration),
    /// The call ended with a gRPC error (sluice unreachable: `UNAVAILABLE`; bad input:
    /// `INVALID_ARGUMENT`; its backend down and configured to say so: `UNAVAILABLE`).
    #[error("sluice answered with an error: {0}")]
    Status(#[from] tonic::Status),
    /// The answer's overall code was neither `OK` nor `OVER_LIMIT` (sluice never sends
    /// `UNKNOWN`; Envoy would read it as OK, this client treats it as a failure).
    #[error("sluice answered overall code {0}, neither OK nor OVER_LIMIT")]
    UnknownCode(i32),
    /// The address does not parse as a URI.
    #[error("invalid sluice address {address:?}: {source}")]
    Address {
        /// The address as given.
        address: String,
        /// The parser's reason.
        source: tonic::transport::Error,
    },
}

impl ClientError {
    /// The metric label of this failure (a fixed set).
    pub fn reason(&self) -> &'static str {
        match self {
            ClientError::Deadline(_) => "deadline",
            ClientError::Status(s) if s.code() == tonic::Code::Unavailable => "unavailable",
            ClientError::Status(_) => "status",
            ClientError::UnknownCode(_) => "unknown_code",
            ClientError::Address { .. } => "address",
        }
    }
}

/// One descriptor: `(key, value)` entries in order, as a route would produce them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    entries: Vec<(String, String)>,
}

impl Descriptor {
    /// A descriptor of the given entries.
    pub fn new<K, V>(entries: impl IntoIterator<Item = (K, V)>) -> Self
    where
        K: Into<String>,
        V: Into<String>,
    {
        Self {
            entries: entries
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }

    /// This descriptor with one more entry.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.entries.push((key.into(), value.into()));
        self
    }

    /// The entries.
    pub fn entries(&self) -> &[(String, String)] {
        &self.entries
    }

    fn to_pb(&self) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: self
                .entries
                .iter()
                .map(|(key, value)| rate_limit_descriptor::Entry {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
            ..RateLimitDescriptor::default()
        }
    }
}

/// A client of one domain of a sluice server, over the generated gRPC stub. Cheap to clone;
/// clones share the channel and the failure count.
///
/// Every failure (deadline, transport, an error status, an answer that is neither `OK` nor
/// `OVER_LIMIT`) is counted in `sluice_client_failures_total{reason, policy}` and in
/// [`failures`](Self::failures), and logged: a warning when the client starts failing, debug
/// lines while it keeps failing, an info line when sluice answers again (a warning per failure
/// would flood the log of a busy service exactly when sluice is down).
#[derive(Clone, Debug)]
pub struct RateLimitClient {
    stub: RateLimitServiceClient<Channel>,
    domain: Arc<str>,
    deadline: Duration,
    policy: FailurePolicy,
    health: Arc<Health>,
}

/// Failures seen, shared by the clones of a client.
#[derive(Debug, Default)]
struct Health {
    /// Calls that got no answer. Relaxed: a statistic, read on its own.
    failures: AtomicU64,
    /// Whether the last call failed, to log the transitions only. Relaxed: a hint for logging;
    /// a race costs at most one extra or missing line.
    failing: AtomicBool,
}

impl RateLimitClient {
    /// A client over `channel` asking about `domain`, with the default deadline and failing
    /// open.
    pub fn new(channel: Channel, domain: impl Into<String>) -> Self {
        Self {
            stub: RateLimitServiceClient::new(channel),
            domain: domain.into().into(),
            deadline: DEFAULT_DEADLINE,
            policy: FailurePolicy::Open,
            health: Arc::default(),
        }
    }

    /// A client of the server at `address` (e.g. `http://127.0.0.1:8081`) that connects on its
    /// first call, and reconnects as needed.
    pub fn connect_lazy(address: &str, domain: impl Into<String>) -> Result<Self, ClientError> {
        let endpoint =
            Endpoint::from_shared(address.to_string()).map_err(|source| ClientError::Address {
                address: address.to_string(),
                source,
            })?;
        Ok(Self::new(endpoint.connect_lazy(), domain))
    }

    /// This client with another per-call deadline (sent to the server as `grpc-timeout` too).
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// This client with another failure policy.
    pub fn with_failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The domain asked about.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// The per-call deadline.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The failure policy.
    pub fn failure_policy(&self) -> FailurePolicy {
        self.policy
    }

    /// How many calls of this client and its clones got no answer.
    pub fn failures(&self) -> u64 {
        self.health.failures.load(Ordering::Relaxed)
    }

    /// Asks whether one request (cost 1) with these descriptors may go ahead; when sluice does
    /// not answer, the failure policy answers (and the failure is counted and logged).
    pub async fn check(&self, descriptors: &[Descriptor]) -> Answer {
        self.check_hits(descriptors, 1).await
    }

    /// As [`check`](Self::check), for a request that costs `hits`.
    pub async fn check_hits(&self, descriptors: &[Descriptor], hits: u32) -> Answer {
        match self.try_check(descriptors, hits).await {
            Ok(answer) => {
                self.answered();
                answer
            }
            Err(error) => self.failed(&error),
        }
    }

    /// Notes an answer: logs that sluice answers again after failures.
    fn answered(&self) {
        // Load first: the common case (not failing) writes nothing.
        if self.health.failing.load(Ordering::Relaxed)
            && self.health.failing.swap(false, Ordering::Relaxed)
        {
            tracing::info!(domain = %self.domain, "sluice answers again");
        }
    }

    /// Asks sluice, without the failure policy: the server's answer, or why there was none
    /// (not counted or logged here: the caller has the error).
    pub async fn try_check(
        &self,
        descriptors: &[Descriptor],
        hits: u32,
    ) -> Result<Answer, ClientError> {
        self.ask(descriptors, hits, self.deadline).await
    }

    /// One call with its own `deadline`, sent as `grpc-timeout` too (a server that delays
    /// holds an answer no longer than that, less its margin).
    async fn ask(
        &self,
        descriptors: &[Descriptor],
        hits: u32,
        deadline: Duration,
    ) -> Result<Answer, ClientError> {
        let mut request = tonic::Request::new(RateLimitRequest {
            domain: self.domain.to_string(),
            descriptors: descriptors.iter().map(Descriptor::to_pb).collect(),
            hits_addend: hits,
        });
        request.set_timeout(deadline);
        // The stub needs `&mut`; a clone of it is a clone of the channel handle.
        let mut stub = self.stub.clone();
        let response = tokio::time::timeout(deadline, stub.should_rate_limit(request))
            .await
            .map_err(|_| ClientError::Deadline(deadline))?
            .map_err(|status| call_error(status, deadline))?;
        answer(&response.into_inner())
    }

    /// Counts and logs a failure, and answers as the policy says.
    fn failed(&self, error: &ClientError) -> Answer {
        self.health.failures.fetch_add(1, Ordering::Relaxed);
        ::metrics::counter!(
            "sluice_client_failures_total",
            "reason" => error.reason(),
            "policy" => self.policy.label(),
        )
        .increment(1);
        let policy = self.policy.label();
        if self.health.failing.swap(true, Ordering::Relaxed) {
            tracing::debug!(domain = %self.domain, %error, policy, "sluice call failed");
        } else {
            tracing::warn!(domain = %self.domain, %error, policy, "sluice call failed; the failure policy answers until it answers again");
        }
        self.policy.answer()
    }
}

/// The error of a call with `deadline` that ended with `status`: tonic's channel enforces the
/// `grpc-timeout` it sends too, and reports it as `CANCELLED` caused by `TimeoutExpired`; that
/// is the deadline, whichever timer fired first.
fn call_error(status: tonic::Status, deadline: Duration) -> ClientError {
    let mut cause = std::error::Error::source(&status);
    while let Some(error) = cause {
        if error.is::<tonic::TimeoutExpired>() {
            return ClientError::Deadline(deadline);
        }
        cause = error.source();
    }
    ClientError::Status(status)
}

/// The typed answer of a response: `OK` → allowed; `OVER_LIMIT` → refused for the longest
/// `duration_until_reset` among the refused descriptors.
fn answer(response: &RateLimitResponse) -> Result<Answer, ClientError> {
    match Code::try_from(response.overall_code) {
        Ok(Code::Ok) => Ok(Answer::Allowed),
        Ok(Code::OverLimit) => {
            let wait = response
                .statuses
                .iter()
                .filter(|s| s.code == Code::OverLimit as i32)
                .filter_map(|s| s.duration_until_reset.as_ref())
                .map(duration)
                .max()
                .unwrap_or(UNSTATED_WAIT);
            Ok(Answer::Refused { wait })
        }
        _ => Err(ClientError::UnknownCode(response.overall_code)),
    }
}

/// A protobuf duration as a `Duration`, negative parts read as zero.
fn duration(d: &prost_types::Duration) -> Duration {
    let seconds = u64::try_from(d.seconds).unwrap_or(0);
    let nanos = u32::try_from(d.nanos).unwrap_or(0).min(999_999_999);
    Duration::new(seconds, nanos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::rate_limit_response::DescriptorStatus;

    fn status(code: Code, wait: Option<(i64, i32)>) -> DescriptorStatus {
        DescriptorStatus {
            code: code as i32,
            duration_until_reset: wait
                .map(|(seconds, nanos)| prost_types::Duration { seconds, nanos }),
            ..DescriptorStatus::default()
        }
    }

    #[test]
    fn a_refusal_waits_the_longest_wait_of_the_refused_descriptors() {
        let response = RateLimitResponse {
            overall_code: Code::OverLimit as i32,
            statuses: vec![
                // An admitted descriptor's reset time (until its bucket is full) is not a wait.
                status(Code::Ok, Some((60, 0))),
                status(Code::OverLimit, Some((2, 0))),
                status(Code::OverLimit, Some((3, 500_000_000))),
            ],
            ..RateLimitResponse::default()
        };
        assert_eq!(
            answer(&response).unwrap(),
            Answer::Refused {
                wait: Duration::from_millis(3_500)
            }
        );
    }

    #[test]
    fn odd_answers_are_read_safely() {
        let unstated = RateLimitResponse {
            overall_code: Code::OverLimit as i32,
            statuses: vec![status(Code::OverLimit, None)],
            ..RateLimitResponse::default()
        };
        assert_eq!(
            answer(&unstated).unwrap(),
            Answer::Refused {
                wait: UNSTATED_WAIT
            }
        );
        let negative = RateLimitResponse {
            overall_code: Code::OverLimit as i32,
            statuses: vec![status(Code::OverLimit, Some((-5, -1)))],
            ..RateLimitResponse::default()
        };
        assert_eq!(
            answer(&negative).unwrap(),
            Answer::Refused {
                wait: Duration::ZERO
            }
        );
        let unknown = RateLimitResponse::default();
        assert!(matches!(answer(&unknown), Err(ClientError::UnknownCode(0))));
        let ok = RateLimitResponse {
            overall_code: Code::Ok as i32,
            statuses: vec![status(Code::OverLimit, Some((1, 0)))],
            ..RateLimitResponse::default()
        };
        // Global shadow mode keeps a status's OVER_LIMIT under an overall OK: allowed.
        assert_eq!(answer(&ok).unwrap(), Answer::Allowed);
    }

    #[test]
    fn descriptors_keep_their_entries_in_order() {
        let d = Descriptor::new([("tenant", "acme")]).with("path", "/jobs");
        let pb = d.to_pb();
        let keys: Vec<_> = pb.entries.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, ["tenant", "path"]);
        assert_eq!(pb.entries[1].value, "/jobs");
    }
}
