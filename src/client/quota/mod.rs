//! The enforcer of Rate Limit Quota Service assignments ([`Quota`]): what Envoy's
//! `rate_limit_quota` filter does, for a Rust service. It owns one `StreamRateLimitQuotas`
//! stream per domain (reports of each bucket's usage at an interval, assignments back), the
//! table of buckets with the assignment in force for each, and the local decision
//! ([`Quota::check`]: synchronous, one bucket mutex, no round trip). It does not decide what a
//! bucket is worth: the server does, and the enforcer holds it to that until the assignment's
//! TTL; the stated fallbacks answer when there is none (`bucket` keeps the per-bucket values).
//! It speaks the generated [`crate::pb`] types only, like the rest of the client half.

mod bucket;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use prost::Message;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use super::{Answer, Backoff, ClientError, FailurePolicy};
use crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use crate::pb::envoy::r#type::v3::RateLimitUnit;
use crate::pb::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use crate::pb::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use crate::pb::rate_limit_strategy::{self, BlanketRule};
use crate::pb::{BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports};

pub use bucket::{Assignment, Strategy, TokenBucket};
use bucket::{Fallback, Fallbacks, State, Usage};

/// The default report interval: Envoy's usual 1 s, well inside sluice's default 10 s TTL, so a
/// lost report does not expire an assignment.
pub const DEFAULT_REPORT_INTERVAL: Duration = Duration::from_secs(1);

/// The default cap on buckets tracked: sluice's default `rlqs.max_buckets_per_stream`, past
/// which the server would abandon them anyway.
pub const DEFAULT_MAX_BUCKETS: usize = 1_000;

/// The default time after which a bucket not checked is forgotten.
pub const DEFAULT_IDLE: Duration = Duration::from_secs(60);

/// The default time a stream has to open (sluice answers the first message at once; a server
/// that does not within this is taken as down).
pub const DEFAULT_OPEN_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest report message sent, encoded: a report of many buckets is split into messages
/// of at most this size, well under sluice's default `requests.max_request_bytes` (1 MiB).
const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// The largest bucket tracked, its entries' keys and values together: a report of a bucket
/// larger than a message could hold would end every stream that carried it.
const MAX_BUCKET_BYTES: usize = 8 * 1024;

/// Report messages awaiting the transport; past it a report round stops and what it did not
/// take stays counted for the next one.
const QUEUE: usize = 4;

/// One bucket: its entries, an unordered map (ordered by key here, so that equal maps are
/// equal), as Envoy's `BucketId`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bucket {
    entries: BTreeMap<String, String>,
}

impl Bucket {
    /// A bucket of the given entries (a later entry of the same key replaces an earlier one).
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

    /// This bucket with one more entry.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.entries.insert(key.into(), value.into());
        self
    }

    /// The entries, by key.
    pub fn entries(&self) -> &BTreeMap<String, String> {
        &self.entries
    }

    /// Whether it can be reported: not empty (sluice refuses a report of an empty bucket) and
    /// at most [`MAX_BUCKET_BYTES`].
    fn reportable(&self) -> bool {
        !self.entries.is_empty()
            && self
                .entries
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
                <= MAX_BUCKET_BYTES
    }

    fn to_pb(&self) -> BucketId {
        BucketId {
            bucket: self.entries.clone(),
        }
    }
}

impl From<BTreeMap<String, String>> for Bucket {
    fn from(entries: BTreeMap<String, String>) -> Self {
        Self { entries }
    }
}

impl From<HashMap<String, String>> for Bucket {
    fn from(entries: HashMap<String, String>) -> Self {
        Self {
            entries: entries.into_iter().collect(),
        }
    }
}

/// How a [`Quota`] is set up; [`Quota::builder`] starts one.
#[derive(Debug)]
pub struct QuotaBuilder {
    domain: String,
    report_interval: Duration,
    unassigned: Answer,
    failure: FailurePolicy,
    max_buckets: usize,
    idle: Duration,
    open_timeout: Duration,
    backoff: Backoff,
}

impl QuotaBuilder {
    /// Reports every `interval` (at least 1 ms). Default [`DEFAULT_REPORT_INTERVAL`].
    pub fn with_report_interval(mut self, interval: Duration) -> Self {
        self.report_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Answers `answer` for a bucket that has no assignment yet while the stream is up (Envoy's
    /// `no_assignment_behavior`). Default [`Answer::Allowed`].
    pub fn with_unassigned(mut self, answer: Answer) -> Self {
        self.unassigned = answer;
        self
    }

    /// Answers as `policy` says once a bucket's assignment has expired, and for a bucket with
    /// none while the stream is down. Default [`FailurePolicy::Open`].
    pub fn with_failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.failure = policy;
        self
    }

    /// Tracks at most `max` buckets (at least 1). Default [`DEFAULT_MAX_BUCKETS`].
    pub fn with_max_buckets(mut self, max: usize) -> Self {
        self.max_buckets = max.max(1);
        self
    }

    /// Forgets a bucket not checked for `idle` (once its usage is reported). Default
    /// [`DEFAULT_IDLE`].
    pub fn with_idle(mut self, idle: Duration) -> Self {
        self.idle = idle;
        self
    }

    /// Takes the stream as down when it does not open within `timeout`. Default
    /// [`DEFAULT_OPEN_TIMEOUT`].
    pub fn with_open_timeout(mut self, timeout: Duration) -> Self {
        self.open_timeout = timeout;
        self
    }

    /// Waits between reconnections as `backoff` says. Default: from 100 ms, doubling to 5 s,
    /// spread upward by up to half.
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Starts the enforcer over `channel`: its stream task is spawned on the current Tokio
    /// runtime (so this must be called within one) and runs until the last clone of the
    /// [`Quota`] is dropped.
    pub fn start(self, channel: Channel) -> Quota {
        let shared = Arc::new(Shared {
            domain: self.domain,
            buckets: DashMap::new(),
            tracked: AtomicUsize::new(0),
            max_buckets: self.max_buckets,
            fallbacks: Fallbacks {
                unassigned: self.unassigned,
                failure: self.failure,
                deny_wait: self.report_interval,
            },
            report_interval: self.report_interval,
            idle: self.idle,
            up: AtomicBool::new(true),
            untracked: AtomicU64::new(0),
            warned_full: AtomicBool::new(false),
            reconnects: AtomicU64::new(0),
            fresh: Notify::new(),
        });
        let stop = CancellationToken::new();
        let task = Stream {
            shared: Arc::clone(&shared),
            stub: RateLimitQuotaServiceClient::new(channel),
            backoff: self.backoff,
            open_timeout: self.open_timeout,
        };
        tokio::spawn(task.run(stop.clone()));
        Quota {
            shared,
            _stop: Arc::new(stop.drop_guard()),
        }
    }

    /// Starts the enforcer against the server at `address` (e.g. `http://127.0.0.1:8081`),
    /// connecting on the stream's first attempt and reconnecting as needed.
    ///
    /// # Errors
    ///
    /// [`ClientError::Address`] when `address` does not parse as a URI.
    pub fn connect_lazy(self, address: &str) -> Result<Quota, ClientError> {
        let endpoint =
            Endpoint::from_shared(address.to_string()).map_err(|source| ClientError::Address {
                address: address.to_string(),
                source,
            })?;
        Ok(self.start(endpoint.connect_lazy()))
    }
}

/// The enforcer of one domain's quota assignments: a service asks it about each request with
/// [`check`](Self::check), which answers from the bucket's assignment with no round trip, and
/// a background task reports usage to sluice and takes its assignments. Cheap to clone; the
/// clones share the table and the stream, which ends when the last one is dropped.
///
/// What answers a check:
///
/// 1. an assignment in force (received and not past its TTL): `ALLOW_ALL` allows, `DENY_ALL`
///    refuses (with the report interval as the wait: sluice may lift it at any report), a
///    token bucket allows while it holds a token, else refuses until the next one. It holds
///    while the stream is down too, until its TTL;
/// 2. else, for a bucket that has had none yet while the stream is up: the *unassigned*
///    answer ([`QuotaBuilder::with_unassigned`], allow by default);
/// 3. else (its assignment expired, or the stream is down): the [`FailurePolicy`] (open by
///    default).
///
/// A bucket past the cap on tracked buckets is not tracked (not reported, never assigned): it
/// gets the unassigned answer, or the failure policy while the stream is down, and is counted
/// in [`untracked`](Self::untracked); a warning is logged once. So is an empty bucket, or one
/// whose keys and values add up to more than 8 KiB (a report of it would end the stream).
///
/// Checks answered with no assignment in force are counted in
/// `sluice_client_quota_fallbacks_total{reason}` (`unassigned`, `expired`, `down`,
/// `untracked`), and streams that fail in `sluice_client_quota_stream_failures_total`, in the
/// service's metrics recorder.
///
/// ```no_run
/// # fn main() -> Result<(), sluice::client::ClientError> {
/// # let _runtime = tokio::runtime::Runtime::new().unwrap();
/// # let _guard = _runtime.enter();
/// use std::time::Duration;
/// use sluice::client::{Answer, Bucket, FailurePolicy, Quota};
///
/// // config/policies/edge.yaml: 600 a minute per API key, for buckets {generic_key, api_key}.
/// let quota = Quota::builder("edge")
///     .with_failure_policy(FailurePolicy::Closed { wait: Duration::from_secs(1) })
///     .connect_lazy("http://127.0.0.1:8081")?;
/// // For each request: local, synchronous, no round trip.
/// let bucket = Bucket::new([("generic_key", "api"), ("api_key", "k1")]);
/// match quota.check(&bucket) {
///     Answer::Allowed => { /* serve it */ }
///     Answer::Refused { wait } => { /* 429, with Retry-After of at least `wait` */ }
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Quota {
    shared: Arc<Shared>,
    /// Stops the stream task when the last clone is dropped.
    _stop: Arc<tokio_util::sync::DropGuard>,
}

impl Quota {
    /// A builder of an enforcer of `domain`, with the defaults.
    pub fn builder(domain: impl Into<String>) -> QuotaBuilder {
        QuotaBuilder {
            domain: domain.into(),
            report_interval: DEFAULT_REPORT_INTERVAL,
            unassigned: Answer::Allowed,
            failure: FailurePolicy::Open,
            max_buckets: DEFAULT_MAX_BUCKETS,
            idle: DEFAULT_IDLE,
            open_timeout: DEFAULT_OPEN_TIMEOUT,
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
        }
    }

    /// Whether one request of `bucket` may go ahead, counted in the bucket's next report.
    /// Synchronous and local: a lookup, the bucket's mutex, no I/O. A bucket seen for the
    /// first time is reported at once, so its assignment comes within a round trip.
    pub fn check(&self, bucket: &Bucket) -> Answer {
        let now = Instant::now();
        // Relaxed: a hint of the stream's state; a check racing a reconnect may answer by the
        // state just before it.
        let up = self.shared.up.load(Ordering::Relaxed);
        let (answer, fallback) = match self.shared.buckets.get(bucket) {
            Some(slot) => lock(&slot).check(now, up, &self.shared.fallbacks),
            None => self.shared.track(bucket, now, up),
        };
        if let Some(fallback) = fallback {
            ::metrics::counter!(
                "sluice_client_quota_fallbacks_total",
                "reason" => fallback.label(),
            )
            .increment(1);
        }
        answer
    }

    /// The assignment in force for `bucket`, if any.
    pub fn assignment(&self, bucket: &Bucket) -> Option<Assignment> {
        let slot = self.shared.buckets.get(bucket)?;
        lock(&slot).assignment(Instant::now())
    }

    /// The domain.
    pub fn domain(&self) -> &str {
        &self.shared.domain
    }

    /// Buckets tracked now.
    pub fn buckets(&self) -> usize {
        self.shared.tracked.load(Ordering::Relaxed)
    }

    /// Checks of buckets not tracked: the table was full, or the bucket was empty or over 8 KiB.
    pub fn untracked(&self) -> u64 {
        self.shared.untracked.load(Ordering::Relaxed)
    }

    /// Whether the stream is up (or not yet known to be down).
    pub fn is_connected(&self) -> bool {
        self.shared.up.load(Ordering::Relaxed)
    }

    /// Streams opened after the first.
    pub fn reconnects(&self) -> u64 {
        self.shared.reconnects.load(Ordering::Relaxed)
    }
}

/// A bucket's slot in the table.
#[derive(Debug)]
struct Slot(Mutex<State>);

fn lock(slot: &Slot) -> MutexGuard<'_, State> {
    // A panic under this lock cannot leave the state half-written in a way that matters more
    // than losing the bucket's decisions: go on with it.
    slot.0.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the enforcer's clones and its stream task share.
#[derive(Debug)]
struct Shared {
    domain: String,
    buckets: DashMap<Bucket, Slot>,
    /// Buckets in the table, kept beside it so the cap is enforced without counting shards.
    /// Relaxed: the count is its own value, published through nothing else.
    tracked: AtomicUsize,
    max_buckets: usize,
    fallbacks: Fallbacks,
    report_interval: Duration,
    idle: Duration,
    /// Whether the stream is up or not yet known to be down. Relaxed: a hint read on its own.
    up: AtomicBool,
    /// Relaxed: statistics, read on their own.
    untracked: AtomicU64,
    warned_full: AtomicBool,
    reconnects: AtomicU64,
    /// Woken when a bucket is first tracked, to report it at once.
    fresh: Notify,
}

impl Shared {
    /// Answers the first check of a bucket not in the table, tracking it when there is room
    /// and it can be reported.
    fn track(&self, bucket: &Bucket, now: Instant, up: bool) -> (Answer, Option<Fallback>) {
        let untracked = if up {
            self.fallbacks.unassigned
        } else {
            self.fallbacks.failure.answer()
        };
        let untracked = (untracked, Some(Fallback::Untracked));
        if !bucket.reportable() {
            self.untracked.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(domain = %self.domain, "an empty or oversized quota bucket is not tracked");
            return untracked;
        }
        let reserved = self
            .tracked
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max_buckets).then_some(n + 1)
            })
            .is_ok();
        if !reserved {
            self.untracked.fetch_add(1, Ordering::Relaxed);
            if !self.warned_full.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    domain = %self.domain,
                    max = self.max_buckets,
                    "the quota enforcer tracks its most buckets; new ones get the unassigned answer"
                );
            }
            return untracked;
        }
        let answer = match self.buckets.entry(bucket.clone()) {
            Entry::Occupied(slot) => {
                // Another check tracked it first.
                self.tracked.fetch_sub(1, Ordering::Relaxed);
                lock(slot.get()).check(now, up, &self.fallbacks)
            }
            Entry::Vacant(place) => {
                let mut state = State::new(now);
                let checked = state.check(now, up, &self.fallbacks);
                place.insert(Slot(Mutex::new(state)));
                checked
            }
        };
        self.fresh.notify_one();
        answer
    }

    /// Takes the usage of the buckets due at `now` (all of them when `all`), as report
    /// messages of at most [`MAX_MESSAGE_BYTES`] and at most `room` of them; each with the
    /// usages it took, to give back should it not be delivered.
    fn reports(&self, now: Instant, all: bool, room: usize) -> Vec<(Vec<BucketQuotaUsage>, Taken)> {
        let min_span = if all {
            Duration::ZERO
        } else {
            self.report_interval / 2
        };
        let mut out: Vec<(Vec<BucketQuotaUsage>, Taken)> = Vec::new();
        let mut size = 0;
        for entry in &self.buckets {
            let mut state = lock(entry.value());
            if !state.due(now, min_span) {
                continue;
            }
            let id = entry.key().to_pb();
            let len = id.encoded_len() + 32;
            if out.is_empty() || size + len > MAX_MESSAGE_BYTES {
                if out.len() == room {
                    break;
                }
                out.push((Vec::new(), Vec::new()));
                size = 0;
            }
            size += len;
            let usage = state.take_usage(now);
            drop(state);
            let Some((message, taken)) = out.last_mut() else {
                break;
            };
            message.push(BucketQuotaUsage {
                bucket_id: Some(id),
                time_elapsed: prost_types::Duration::try_from(usage.elapsed).ok(),
                num_requests_allowed: usage.allowed,
                num_requests_denied: usage.denied,
            });
            taken.push((entry.key().clone(), usage));
        }
        out
    }

    /// Gives back the usage of a report that was never delivered.
    fn give_back(&self, taken: Taken) {
        for (bucket, usage) in taken {
            if let Some(slot) = self.buckets.get(&bucket) {
                lock(&slot).give_back(usage);
            }
        }
    }

    /// Forgets the buckets idle at `now`.
    fn forget_idle(&self, now: Instant) {
        self.buckets.retain(|_, slot| {
            let keep = !lock(slot).idle(now, self.idle);
            if !keep {
                self.tracked.fetch_sub(1, Ordering::Relaxed);
            }
            keep
        });
    }

    /// Applies one response's actions at `now`; the longest TTL among its assignments.
    fn apply(&self, response: RateLimitQuotaResponse, now: Instant) -> Option<Duration> {
        let mut longest = None;
        for action in response.bucket_action {
            let Some(id) = action.bucket_id else {
                tracing::debug!(domain = %self.domain, "a quota action without a bucket_id; ignored");
                continue;
            };
            let bucket = Bucket::from(id.bucket);
            match action.bucket_action {
                Some(Action::QuotaAssignmentAction(assignment)) => {
                    let Some((strategy, ttl)) = assignment_of(&assignment) else {
                        tracing::debug!(domain = %self.domain, ?bucket, "a malformed quota assignment; ignored");
                        continue;
                    };
                    // A bucket not tracked (forgotten, or never seen) is not taken on here: it
                    // is tracked again, and reported, at its next check.
                    if let Some(slot) = self.buckets.get(&bucket) {
                        lock(&slot).assign(strategy, ttl, now);
                    }
                    longest = longest.max(Some(ttl));
                }
                Some(Action::AbandonAction(_)) => {
                    if self.buckets.remove(&bucket).is_some() {
                        self.tracked.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                None => {
                    tracing::debug!(domain = %self.domain, ?bucket, "a quota action of no kind; ignored");
                }
            }
        }
        longest
    }
}

/// The buckets and usages a report message took.
type Taken = Vec<(Bucket, Usage)>;

/// An assignment's strategy and TTL, or `None` when it is malformed: no strategy, no positive
/// TTL, a token bucket without a capacity or with a fill interval under a second (which Envoy
/// would enforce as no limit), or a rate per unit of unknown unit. `tokens_per_fill` unset is 1, as Envoy reads it; `requests_per_time_unit` is a
/// token bucket of that many tokens filled once per unit (a month is 30 days, a year 365).
fn assignment_of(action: &QuotaAssignmentAction) -> Option<(Strategy, Duration)> {
    let ttl = action
        .assignment_time_to_live
        .and_then(|d| Duration::try_from(d).ok())
        .filter(|d| !d.is_zero())?;
    let strategy = match action.rate_limit_strategy.as_ref()?.strategy.as_ref()? {
        rate_limit_strategy::Strategy::BlanketRule(rule) => match BlanketRule::try_from(*rule) {
            Ok(BlanketRule::AllowAll) => Strategy::AllowAll,
            Ok(BlanketRule::DenyAll) => Strategy::DenyAll,
            Err(_) => return None,
        },
        rate_limit_strategy::Strategy::TokenBucket(b) => {
            // Under a second, Envoy divides by zero whole seconds and enforces no limit.
            let fill_interval = b
                .fill_interval
                .and_then(|d| Duration::try_from(d).ok())
                .filter(|d| d.as_secs() >= 1)?;
            Strategy::TokenBucket(TokenBucket {
                max_tokens: (b.max_tokens > 0).then_some(b.max_tokens)?,
                tokens_per_fill: b.tokens_per_fill.unwrap_or(1).max(1),
                fill_interval,
            })
        }
        rate_limit_strategy::Strategy::RequestsPerTimeUnit(r) => {
            const DAY: u64 = 24 * 3600;
            let seconds = match RateLimitUnit::try_from(r.time_unit).ok()? {
                RateLimitUnit::Second => 1,
                RateLimitUnit::Minute => 60,
                RateLimitUnit::Hour => 3600,
                RateLimitUnit::Day => DAY,
                RateLimitUnit::Month => 30 * DAY,
                RateLimitUnit::Year => 365 * DAY,
                RateLimitUnit::Unknown => return None,
            };
            if r.requests_per_time_unit == 0 {
                Strategy::DenyAll
            } else {
                let n = u32::try_from(r.requests_per_time_unit).unwrap_or(u32::MAX);
                Strategy::TokenBucket(TokenBucket {
                    max_tokens: n,
                    tokens_per_fill: n,
                    fill_interval: Duration::from_secs(seconds),
                })
            }
        }
    };
    Some((strategy, ttl))
}

/// Why a stream ended.
enum Ended {
    /// The enforcer was dropped.
    Stopped,
    /// The stream could not be opened, or broke; with why.
    Failed(String),
}

/// The stream task: opens the stream, reports, applies, and reopens it with backoff.
struct Stream {
    shared: Arc<Shared>,
    stub: RateLimitQuotaServiceClient<Channel>,
    backoff: Backoff,
    open_timeout: Duration,
}

impl Stream {
    async fn run(mut self, stop: CancellationToken) {
        let mut opened = false;
        loop {
            let why = match self.stream(&stop, &mut opened).await {
                Ended::Stopped => return,
                Ended::Failed(why) => why,
            };
            let domain = &self.shared.domain;
            ::metrics::counter!("sluice_client_quota_stream_failures_total").increment(1);
            if self.shared.up.swap(false, Ordering::Relaxed) {
                tracing::warn!(%domain, error = %why, "the quota stream to sluice is down; assignments hold until their TTL, then the failure policy answers");
            } else {
                tracing::debug!(%domain, error = %why, "the quota stream to sluice is still down");
            }
            let wait = self.backoff.after_failure();
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One stream, from its opening to its end.
    async fn stream(&mut self, stop: &CancellationToken, opened: &mut bool) -> Ended {
        let (tx, rx) = mpsc::channel(QUEUE);
        // The first message names the domain and carries every bucket's usage so far (what was
        // counted while the stream was down, too).
        let mut first = self.shared.reports(Instant::now(), true, 1);
        let (usages, taken) = first.pop().unwrap_or_default();
        let message = RateLimitQuotaUsageReports {
            domain: self.shared.domain.clone(),
            bucket_quota_usages: usages,
        };
        if tx.try_send(message).is_err() {
            self.shared.give_back(taken);
            return Ended::Failed("the report queue refused the first message".into());
        }
        let mut stub = self.stub.clone();
        let opening = tokio::select! {
            () = stop.cancelled() => return Ended::Stopped,
            opening = tokio::time::timeout(
                self.open_timeout,
                stub.stream_rate_limit_quotas(ReceiverStream::new(rx)),
            ) => opening,
        };
        let mut inbound = match opening {
            Ok(Ok(response)) => response.into_inner(),
            Ok(Err(status)) => {
                // Refused before it was taken: the first report was not counted by the server.
                self.shared.give_back(taken);
                return Ended::Failed(status.to_string());
            }
            Err(_) => {
                self.shared.give_back(taken);
                return Ended::Failed(format!(
                    "the stream did not open within {:?}",
                    self.open_timeout
                ));
            }
        };
        if !self.shared.up.swap(true, Ordering::Relaxed) {
            tracing::info!(domain = %self.shared.domain, "the quota stream to sluice is up again");
        }
        if *opened {
            self.shared.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        *opened = true;
        self.backoff.reset();
        // The buckets that did not fit in the first message (not those in it: reported again
        // at once, with nothing counted over a moment, they would read as no demand).
        self.send(&tx, false);
        let period = self.shared.report_interval;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // When sluice last sent anything, and the longest TTL it has assigned on this stream: a
        // stream that is open but silent for longer than that, while buckets are reported on
        // it, has stopped renewing them (sluice renews at half the TTL) and is reopened.
        let (mut heard, mut longest_ttl) = (Instant::now(), None::<Duration>);
        loop {
            tokio::select! {
                () = stop.cancelled() => return Ended::Stopped,
                _ = tick.tick() => {
                    let now = Instant::now();
                    if let Some(ttl) = longest_ttl
                        && now.saturating_duration_since(heard) > ttl
                        && self.shared.tracked.load(Ordering::Relaxed) > 0
                    {
                        return Ended::Failed(format!("sluice sent nothing on the stream for {ttl:?}, the longest TTL it assigned"));
                    }
                    self.shared.forget_idle(now);
                    self.send(&tx, false);
                }
                () = self.shared.fresh.notified() => self.send(&tx, false),
                message = inbound.message() => match message {
                    Ok(Some(response)) => {
                        heard = Instant::now();
                        longest_ttl = longest_ttl.max(self.shared.apply(response, heard));
                    }
                    Ok(None) => return Ended::Failed("sluice ended the stream".into()),
                    Err(status) => return Ended::Failed(status.to_string()),
                },
            }
        }
    }

    /// Sends a report round: the buckets due (all when `all`), in as many messages as the
    /// queue has room for; what does not fit stays counted for the next round.
    fn send(&self, tx: &mpsc::Sender<RateLimitQuotaUsageReports>, all: bool) {
        let room = tx.capacity();
        for (usages, taken) in self.shared.reports(Instant::now(), all, room) {
            if usages.is_empty() {
                continue;
            }
            let message = RateLimitQuotaUsageReports {
                domain: String::new(),
                bucket_quota_usages: usages,
            };
            if tx.try_send(message).is_err() {
                self.shared.give_back(taken);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::RateLimitStrategy;

    fn action(strategy: rate_limit_strategy::Strategy, ttl: i64) -> QuotaAssignmentAction {
        QuotaAssignmentAction {
            assignment_time_to_live: Some(prost_types::Duration {
                seconds: ttl,
                nanos: 0,
            }),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(strategy),
            }),
        }
    }

    #[test]
    fn assignments_are_read_as_envoy_reads_them_and_malformed_ones_refused() {
        use rate_limit_strategy::{RequestsPerTimeUnit, Strategy as Pb};
        let second = Some(prost_types::Duration {
            seconds: 1,
            nanos: 0,
        });
        let bucket = |max_tokens, tokens_per_fill, fill_interval| {
            Pb::TokenBucket(crate::pb::TokenBucket {
                max_tokens,
                tokens_per_fill,
                fill_interval,
                name: String::new(),
            })
        };
        assert_eq!(
            assignment_of(&action(Pb::BlanketRule(BlanketRule::DenyAll.into()), 10)),
            Some((Strategy::DenyAll, Duration::from_secs(10)))
        );
        assert_eq!(
            assignment_of(&action(bucket(5, None, second), 3)),
            Some((
                Strategy::TokenBucket(TokenBucket {
                    max_tokens: 5,
                    tokens_per_fill: 1,
                    fill_interval: Duration::from_secs(1),
                }),
                Duration::from_secs(3)
            ))
        );
        let per_minute = Pb::RequestsPerTimeUnit(RequestsPerTimeUnit {
            requests_per_time_unit: 60,
            time_unit: RateLimitUnit::Minute.into(),
        });
        match assignment_of(&action(per_minute, 3)) {
            Some((Strategy::TokenBucket(b), _)) => assert_eq!(b.rate(), 1.0),
            other => panic!("{other:?}"),
        }
        // The rate over the interval's whole seconds: 5 per 2.9 s is 5 per 2 s.
        let truncated = bucket(
            5,
            Some(5),
            Some(prost_types::Duration {
                seconds: 2,
                nanos: 900_000_000,
            }),
        );
        match assignment_of(&action(truncated, 3)) {
            Some((Strategy::TokenBucket(b), _)) => assert_eq!(b.rate(), 2.5),
            other => panic!("{other:?}"),
        }
        for malformed in [
            action(bucket(0, Some(1), second), 3),
            action(bucket(5, Some(1), None), 3),
            action(
                bucket(
                    5,
                    Some(1),
                    Some(prost_types::Duration {
                        seconds: 0,
                        nanos: 500_000_000,
                    }),
                ),
                3,
            ),
            action(Pb::BlanketRule(7), 3),
            action(Pb::BlanketRule(0), 0),
            action(Pb::BlanketRule(0), -1),
            QuotaAssignmentAction {
                rate_limit_strategy: None,
                ..action(Pb::BlanketRule(0), 3)
            },
        ] {
            assert_eq!(assignment_of(&malformed), None, "{malformed:?}");
        }
    }
}
