//! A simulated Envoy on a quota stream, as Envoy's `rate_limit_quota` filter speaks RLQS
//! (`source/extensions/filters/http/rate_limit_quota/global_client_impl.cc` and its bucket
//! cache): a new bucket is reported at once, with its first request and a `time_elapsed` of 0;
//! every bucket is reported each time the test calls [`Envoy::report_all`] (Envoy's
//! `reporting_interval` timer), with `time_elapsed` in whole seconds, truncated; a token bucket
//! is enforced at `tokens_per_fill` over the interval's whole seconds (under a second: no
//! limit), starting full; and a token bucket replaces the one in force only when `max_tokens`,
//! `tokens_per_fill` or the interval's `nanos` differ. Until its first assignment a bucket
//! allows every request (`no_assignment_behavior: ALLOW_ALL`).

use std::collections::BTreeMap;
use std::time::Duration;

use sluice::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use sluice::pb::rate_limit_quota_response::bucket_action::BucketAction as Kind;
use sluice::pb::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use sluice::pb::rate_limit_strategy::{BlanketRule, Strategy};
use sluice::pb::{BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports, TokenBucket};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Streaming;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;

/// A bucket's entries, ordered.
pub type Entries = BTreeMap<String, String>;

/// The rate Envoy enforces for a token bucket: `tokens_per_fill` over the interval's whole
/// seconds (`absl::ToInt64Seconds`); an interval under a second divides by zero, no limit.
pub fn envoy_rate(b: &TokenBucket) -> f64 {
    let seconds = b.fill_interval.map_or(0, |d| d.seconds);
    let tokens = f64::from(b.tokens_per_fill.unwrap_or(1));
    if seconds <= 0 {
        f64::INFINITY
    } else {
        tokens / seconds as f64
    }
}

/// Envoy's `protoTokenBucketsEq`: the interval's seconds are not compared.
fn same_for_envoy(a: &TokenBucket, b: &TokenBucket) -> bool {
    a.max_tokens == b.max_tokens
        && a.tokens_per_fill.unwrap_or(0) == b.tokens_per_fill.unwrap_or(0)
        && a.fill_interval.map_or(0, |d| d.nanos) == b.fill_interval.map_or(0, |d| d.nanos)
}

/// Envoy's `AtomicTokenBucketImpl`: continuous fill at a rate, up to a capacity; starts full.
#[derive(Clone, Debug)]
struct Limiter {
    /// The token bucket it was made from.
    spec: TokenBucket,
    tokens: f64,
    at: Instant,
}

impl Limiter {
    fn new(spec: TokenBucket, now: Instant) -> Self {
        Self {
            tokens: f64::from(spec.max_tokens),
            spec,
            at: now,
        }
    }

    fn take(&mut self, now: Instant) -> bool {
        let rate = envoy_rate(&self.spec);
        let grown = rate * now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + grown).min(f64::from(self.spec.max_tokens));
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// What a bucket enforces.
#[derive(Clone, Debug)]
enum InForce {
    Nothing,
    Blanket(BlanketRule),
    Tokens(Limiter),
}

#[derive(Debug)]
struct Cached {
    allowed: u64,
    denied: u64,
    last_report: Instant,
    /// The token bucket of the last action received, as Envoy caches it (`cached_action`).
    last_token_bucket: Option<TokenBucket>,
    in_force: InForce,
    /// When the bucket was created, and when its first assignment came.
    created: Instant,
    first_assigned: Option<Duration>,
}

/// One simulated Envoy with its stream.
pub struct Envoy {
    domain: String,
    tx: mpsc::Sender<RateLimitQuotaUsageReports>,
    answers: Streaming<RateLimitQuotaResponse>,
    buckets: BTreeMap<Entries, Cached>,
    /// Token buckets received that Envoy did not put in force although their rate or capacity
    /// differs from the one in force.
    pub ignored: Vec<(TokenBucket, TokenBucket)>,
    /// Every token bucket put in force, with when (for sums over Envoys).
    pub history: Vec<(Instant, Entries, TokenBucket)>,
    /// Every assignment received, with when and its `assignment_time_to_live`: Envoy holds the
    /// assignment in force until that long after the last one it received.
    pub received: Vec<(Instant, Entries, Duration)>,
}

/// A bucket's entries from pairs.
pub fn entries(pairs: &[(&str, &str)]) -> Entries {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect()
}

impl Envoy {
    /// Opens the stream, as Envoy does, on the first request of its first bucket: the first
    /// message is that bucket's immediate report.
    pub async fn open(grpc: std::net::SocketAddr, domain: &str, first: &Entries) -> Self {
        let mut client = RateLimitQuotaServiceClient::connect(format!("http://{grpc}"))
            .await
            .expect("connect");
        let (tx, rx) = mpsc::channel(64);
        let now = Instant::now();
        let mut buckets = BTreeMap::new();
        buckets.insert(first.clone(), Cached::new(now));
        let message = report(domain, first, buckets.get_mut(first).expect("created"), now);
        tx.send(message).await.expect("queued");
        let answers = client
            .stream_rate_limit_quotas(ReceiverStream::new(rx))
            .await
            .expect("the stream is accepted")
            .into_inner();
        Self {
            domain: domain.to_string(),
            tx,
            answers,
            buckets,
            ignored: Vec::new(),
            history: Vec::new(),
            received: Vec::new(),
        }
    }

    /// One request for `bucket` at `now`: a new bucket is created (its request allowed, as no
    /// assignment allows all) and reported at once; a known one is answered by what is in
    /// force. Whether it was allowed.
    pub async fn request(&mut self, bucket: &Entries) -> bool {
        let now = Instant::now();
        let Some(cached) = self.buckets.get_mut(bucket) else {
            let mut cached = Cached::new(now);
            let message = report(&self.domain, bucket, &mut cached, now);
            self.buckets.insert(bucket.clone(), cached);
            self.tx.send(message).await.expect("stream open");
            return true;
        };
        let allowed = match &mut cached.in_force {
            InForce::Nothing => true,
            InForce::Blanket(rule) => *rule == BlanketRule::AllowAll,
            InForce::Tokens(limiter) => limiter.take(now),
        };
        if allowed {
            cached.allowed += 1;
        } else {
            cached.denied += 1;
        }
        allowed
    }

    /// `n` requests for `bucket`; how many were allowed.
    pub async fn requests(&mut self, bucket: &Entries, n: u64) -> u64 {
        let mut allowed = 0;
        for _ in 0..n {
            allowed += u64::from(self.request(bucket).await);
        }
        allowed
    }

    /// Envoy's report timer: one message reporting every bucket.
    pub async fn report_all(&mut self) {
        let now = Instant::now();
        let mut message = RateLimitQuotaUsageReports {
            domain: self.domain.clone(),
            bucket_quota_usages: Vec::new(),
        };
        for (bucket, cached) in &mut self.buckets {
            let one = report(&self.domain, bucket, cached, now);
            message.bucket_quota_usages.extend(one.bucket_quota_usages);
        }
        if !message.bucket_quota_usages.is_empty() {
            self.tx.send(message).await.expect("stream open");
        }
    }

    /// Applies the answers that arrive within `wait`; whether any did.
    pub async fn receive(&mut self, wait: Duration) -> bool {
        let until = Instant::now() + wait;
        let mut any = false;
        while let Ok(answer) = tokio::time::timeout_at(until, self.answers.message()).await {
            let answer = answer.expect("no error").expect("the stream is open");
            self.apply(answer);
            any = true;
        }
        any
    }

    /// Applies one answer's actions as Envoy's `onQuotaResponseImpl` does.
    fn apply(&mut self, answer: RateLimitQuotaResponse) {
        let now = Instant::now();
        for action in answer.bucket_action {
            let bucket: Entries = action
                .bucket_id
                .expect("bucket_id")
                .bucket
                .into_iter()
                .collect();
            let Some(cached) = self.buckets.get_mut(&bucket) else {
                continue;
            };
            match action.bucket_action.expect("an action") {
                Kind::AbandonAction(_) => {
                    self.buckets.remove(&bucket);
                }
                Kind::QuotaAssignmentAction(a) => {
                    cached.first_assigned.get_or_insert(now - cached.created);
                    let ttl = a
                        .assignment_time_to_live
                        .and_then(|d| Duration::try_from(d).ok())
                        .unwrap_or_default();
                    self.received.push((now, bucket.clone(), ttl));
                    match a.rate_limit_strategy.and_then(|s| s.strategy) {
                        Some(Strategy::BlanketRule(rule)) => {
                            cached.in_force = InForce::Blanket(
                                BlanketRule::try_from(rule).expect("a blanket rule"),
                            );
                            cached.last_token_bucket = None;
                        }
                        Some(Strategy::TokenBucket(b)) => {
                            let kept = match (&cached.in_force, &cached.last_token_bucket) {
                                (InForce::Tokens(_), Some(last)) => same_for_envoy(&b, last),
                                _ => false,
                            };
                            if kept {
                                if let InForce::Tokens(l) = &cached.in_force
                                    && (envoy_rate(&l.spec) != envoy_rate(&b)
                                        || l.spec.max_tokens != b.max_tokens)
                                {
                                    self.ignored.push((l.spec.clone(), b.clone()));
                                }
                            } else {
                                cached.in_force = InForce::Tokens(Limiter::new(b.clone(), now));
                                self.history.push((now, bucket.clone(), b.clone()));
                            }
                            cached.last_token_bucket = Some(b);
                        }
                        other => panic!("a strategy Envoy enforces expected: {other:?}"),
                    }
                }
            }
        }
    }

    /// The token bucket in force for `bucket`, as Envoy enforces it.
    pub fn token_bucket(&self, bucket: &Entries) -> Option<TokenBucket> {
        match &self.buckets.get(bucket)?.in_force {
            InForce::Tokens(l) => Some(l.spec.clone()),
            _ => None,
        }
    }

    /// The rate of the token bucket `bucket` holds in force at `t`, as Envoy reads it: none
    /// before its first, or once the TTL of the last assignment received by then has passed.
    pub fn rate_at(&self, bucket: &Entries, t: Instant) -> f64 {
        let live = self
            .received
            .iter()
            .rfind(|(at, b, _)| b == bucket && *at <= t)
            .is_some_and(|(at, _, ttl)| t < *at + *ttl);
        if !live {
            return 0.0;
        }
        self.history
            .iter()
            .rfind(|(at, b, _)| b == bucket && *at <= t)
            .map_or(0.0, |(_, _, tb)| envoy_rate(tb))
    }

    /// The rate Envoy enforces for `bucket` (none without a token bucket in force).
    pub fn rate(&self, bucket: &Entries) -> Option<f64> {
        self.token_bucket(bucket).map(|b| envoy_rate(&b))
    }

    /// How long after its creation `bucket` got its first assignment.
    pub fn first_assigned(&self, bucket: &Entries) -> Option<Duration> {
        self.buckets.get(bucket)?.first_assigned
    }

    /// Waits up to `wait` for `bucket`'s first assignment; how long after its creation it came.
    pub async fn first_assignment(&mut self, bucket: &Entries, wait: Duration) -> Duration {
        let until = Instant::now() + wait;
        while self.first_assigned(bucket).is_none() && Instant::now() < until {
            self.receive(Duration::from_millis(5)).await;
        }
        self.first_assigned(bucket).expect("an assignment in time")
    }
}

impl Cached {
    fn new(now: Instant) -> Self {
        Self {
            // The request that created the bucket, allowed (no assignment allows all).
            allowed: 1,
            denied: 0,
            last_report: now,
            last_token_bucket: None,
            in_force: InForce::Nothing,
            created: now,
            first_assigned: None,
        }
    }
}

/// One bucket's report at `now`, as Envoy's `getUsageFromBucket` builds it: the counts since its
/// last report, reset, and the time since then in whole seconds, truncated.
fn report(
    domain: &str,
    bucket: &Entries,
    cached: &mut Cached,
    now: Instant,
) -> RateLimitQuotaUsageReports {
    let elapsed = now.saturating_duration_since(cached.last_report);
    cached.last_report = now;
    let usage = BucketQuotaUsage {
        bucket_id: Some(BucketId {
            bucket: bucket.clone().into_iter().collect(),
        }),
        time_elapsed: Some(prost_types::Duration {
            seconds: i64::try_from(elapsed.as_secs()).unwrap_or(i64::MAX),
            nanos: 0,
        }),
        num_requests_allowed: std::mem::take(&mut cached.allowed),
        num_requests_denied: std::mem::take(&mut cached.denied),
    };
    RateLimitQuotaUsageReports {
        domain: domain.to_string(),
        bucket_quota_usages: vec![usage],
    }
}
