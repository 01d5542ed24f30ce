//! The quota benchmark's generator (`benches/load/quota.py --generator rust`): many Envoys, each
//! on a Rate Limit Quota Service stream of its own, reporting their buckets every interval. The
//! Python generator (Envoy's generated stubs on asyncio gRPC) tops out near 26,000 bucket
//! reports a second on one core; this one sends the same messages through the crate's generated
//! tonic client at 100,000 a second on one.
//!
//! It sends exactly what `quota.py` sends: `--streams` streams, `--per-connection` of them on
//! each HTTP/2 connection (a channel per connection), each reporting `--buckets` buckets
//! (`{tenant: t<i>}`, or `{tenant: s<stream>-t<i>}` with `--distinct`) every `--interval`
//! seconds, each usage `num_requests_allowed = 5 × interval` over `time_elapsed = interval`,
//! the domain on a stream's first message only. Streams start 50 at a time, 50 ms apart, as
//! `quota.py`'s do, and each then reports on a phase of its own, spread over the interval, as
//! Envoys that started apart do (not in step, which would let HTTP/2 pack a connection's
//! streams into fewer writes than Envoys cause). Every answer is read, and each bucket keeps the rate of its latest
//! assignment (`tokens_per_fill / fill_interval`, 0 for any other strategy).
//!
//! `quota.py` keeps the server, its counters and the reload; it drives this process over
//! stdin and stdout, one command a line, each answered with one line:
//!
//! - (on start, once every stream is opened) `ready <streams>`
//! - `status` → `status assigned <streams holding a rate for every bucket> failed <n> sent <messages>`
//! - `share` → `share <median rate over every stream's buckets> <rates held>`
//! - `mark <rate>` → `marked`: from now, each stream is timed until every one of its buckets
//!   holds a rate at most `<rate>` (the reload follows the answer)
//! - `wait <seconds>` → waits until every stream is timed, at most `<seconds>` after the mark,
//!   then `done <timed> <streams> median <s> p99 <s> all <s> share <median rate> failed <n>
//!   codes <code>=<n>,...` (`codes -` when none failed)
//!
//! End of stdin ends the generator. Stream errors go to stderr, the first few in full.
//!
//! ```sh
//! cargo build --release --example rlqsgen
//! target/release/examples/rlqsgen --addr 127.0.0.1:8081 --streams 10000 --per-connection 100
//! ```
//!
//! One thread (tokio's current-thread runtime): `quota.py` pins it to one core, and the state
//! behind its mutexes is only ever contended by the thread that reads stdin.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::stream;
use sluice::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use sluice::pb::rate_limit_quota_response::bucket_action::BucketAction as Kind;
use sluice::pb::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use sluice::pb::rate_limit_strategy::Strategy;
use sluice::pb::{BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports};
use tokio::sync::mpsc;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

/// Requests a second each bucket reports (`quota.py`'s `DEMAND`).
const DEMAND: f64 = 5.0;

/// Streams opened at once, and the pause between such batches (as `quota.py` spreads them).
const BATCH: usize = 50;
const BATCH_PAUSE: Duration = Duration::from_millis(50);

/// Stream errors printed in full; the rest are only counted.
const ERRORS_SHOWN: u64 = 5;

#[derive(Debug, Clone)]
struct Args {
    addr: String,
    streams: usize,
    buckets: usize,
    interval: f64,
    per_connection: usize,
    distinct: bool,
    domain: String,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: "127.0.0.1:8081".into(),
        streams: 1000,
        buckets: 10,
        interval: 1.0,
        per_connection: 1,
        distinct: false,
        domain: "quota".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--bench" => continue, // passed by `cargo bench`; nothing to do with it
            "--distinct" => {
                args.distinct = true;
                continue;
            }
            _ => {}
        }
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--addr" => args.addr = value,
            "--streams" => args.streams = value.parse().map_err(|e| bad(&e))?,
            "--buckets" => args.buckets = value.parse().map_err(|e| bad(&e))?,
            "--interval" => args.interval = value.parse().map_err(|e| bad(&e))?,
            "--per-connection" => args.per_connection = value.parse().map_err(|e| bad(&e))?,
            "--domain" => args.domain = value,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if args.streams == 0 || args.buckets == 0 || args.per_connection == 0 {
        return Err("streams, buckets and per-connection must be positive".into());
    }
    if !(args.interval > 0.0 && args.interval.is_finite()) {
        return Err("--interval must be a positive number of seconds".into());
    }
    Ok(args)
}

/// One stream's view, as `quota.py`'s `Envoy` keeps it.
struct Envoy {
    /// The latest assigned rate of each bucket, by index; NaN until the first assignment.
    rates: Vec<f64>,
    /// Buckets holding a rate.
    held: usize,
    /// Since the mark, when every bucket first held a rate at most the mark's.
    updated: Option<Duration>,
    error: Option<Code>,
}

/// The reload's mark: the rate every bucket must come down to, and when it was set.
#[derive(Clone, Copy)]
struct Mark {
    rate: f64,
    at: Instant,
}

struct Shared {
    envoys: Vec<Mutex<Envoy>>,
    mark: Mutex<Option<Mark>>,
    /// Messages sent, over every stream (a count only: Relaxed).
    sent: AtomicU64,
    /// Streams ended with an error (a count only: Relaxed).
    errors: AtomicU64,
}

/// A lock that a panicked holder does not make unusable: the state is plain values.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    fn fail(&self, stream: usize, code: Code, message: &str) {
        lock(&self.envoys[stream]).error = Some(code);
        if self.errors.fetch_add(1, Ordering::Relaxed) < ERRORS_SHOWN {
            eprintln!("rlqsgen: stream {stream}: {code:?}: {message}");
        }
    }

    /// Every rate held, over every stream's buckets, in order.
    fn rates(&self) -> Vec<f64> {
        let mut all: Vec<f64> = self
            .envoys
            .iter()
            .flat_map(|e| lock(e).rates.clone())
            .filter(|r| !r.is_nan())
            .collect();
        all.sort_by(f64::total_cmp);
        all
    }
}

/// The element at quantile `q` of `sorted`, as `quota.py` picks it.
fn pick(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((q * sorted.len() as f64) as usize).min(sorted.len() - 1)]
}

/// A usage report of every one of `names`, over `interval`.
fn reports(domain: &str, names: &[String], interval: f64) -> RateLimitQuotaUsageReports {
    let nanos = (interval * 1e9) as i64;
    RateLimitQuotaUsageReports {
        domain: domain.into(),
        bucket_quota_usages: names
            .iter()
            .map(|name| BucketQuotaUsage {
                bucket_id: Some(BucketId {
                    bucket: BTreeMap::from([("tenant".to_string(), name.clone())]),
                }),
                time_elapsed: Some(prost_types::Duration {
                    seconds: nanos / 1_000_000_000,
                    nanos: (nanos % 1_000_000_000) as i32,
                }),
                num_requests_allowed: (DEMAND * interval) as u64,
                num_requests_denied: 0,
            })
            .collect(),
    }
}

/// An assignment's rate in requests a second (`quota.py`'s `rate()`).
fn rate(strategy: Option<&Strategy>) -> f64 {
    let Some(Strategy::TokenBucket(b)) = strategy else {
        return 0.0;
    };
    let interval = b
        .fill_interval
        .map_or(0.0, |d| d.seconds as f64 + f64::from(d.nanos) / 1e9);
    if interval > 0.0 {
        f64::from(b.tokens_per_fill.unwrap_or(0)) / interval
    } else {
        0.0
    }
}

/// One stream, reporting until the process ends.
async fn envoy(
    mut client: RateLimitQuotaServiceClient<Channel>,
    shared: Arc<Shared>,
    stream: usize,
    prefix: String,
    args: Arc<Args>,
) {
    let names: Vec<String> = (0..args.buckets).map(|b| format!("{prefix}t{b}")).collect();
    let first = reports(&args.domain, &names, args.interval);
    let next = reports("", &names, args.interval);
    // The first report goes at once; the next ones on a phase of the stream's own, spread over
    // the interval (golden-ratio steps), as Envoys that started apart report out of step.
    let period = Duration::from_secs_f64(args.interval);
    let phase = period.mul_f64((stream as f64 * 0.618_033_988_75).fract());
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period + phase, period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let counter = shared.clone();
    let requests = stream::unfold(
        (ticks, Some(first), next, counter),
        |(mut ticks, first, next, counter)| async move {
            if first.is_none() {
                ticks.tick().await;
            }
            let message = first.unwrap_or_else(|| next.clone());
            counter.sent.fetch_add(1, Ordering::Relaxed);
            Some((message, (ticks, None, next, counter)))
        },
    );
    let mut answers = match client.stream_rate_limit_quotas(requests).await {
        Ok(response) => response.into_inner(),
        Err(status) => return shared.fail(stream, status.code(), status.message()),
    };
    loop {
        match answers.message().await {
            Ok(Some(answer)) => take(&shared, stream, &prefix, answer),
            Ok(None) => return, // ended without an error, as quota.py's does: never timed
            Err(status) => return shared.fail(stream, status.code(), status.message()),
        }
    }
}

/// One answer's assignments into `stream`'s rates, and the stream timed when they all came
/// down to the mark.
fn take(shared: &Shared, stream: usize, prefix: &str, answer: RateLimitQuotaResponse) {
    let mark = *lock(&shared.mark);
    let mut envoy = lock(&shared.envoys[stream]);
    for action in answer.bucket_action {
        let Some(Kind::QuotaAssignmentAction(assignment)) = action.bucket_action else {
            continue;
        };
        let index = action
            .bucket_id
            .as_ref()
            .and_then(|id| id.bucket.get("tenant"))
            .and_then(|name| name.strip_prefix(prefix)?.strip_prefix('t')?.parse().ok())
            .filter(|&i: &usize| i < envoy.rates.len());
        let Some(index) = index else { continue };
        let r = rate(
            assignment
                .rate_limit_strategy
                .as_ref()
                .and_then(|s| s.strategy.as_ref()),
        );
        if envoy.rates[index].is_nan() {
            envoy.held += 1;
        }
        envoy.rates[index] = r;
    }
    if let Some(mark) = mark
        && envoy.updated.is_none()
        && envoy.held == envoy.rates.len()
        && envoy.rates.iter().all(|&r| r <= mark.rate)
    {
        envoy.updated = Some(mark.at.elapsed());
    }
}

/// One command from `quota.py`, answered on stdout.
async fn command(shared: &Shared, line: &str) -> Result<(), String> {
    let mut words = line.split_whitespace();
    match (words.next(), words.next()) {
        (Some("status"), None) => {
            let (mut assigned, mut failed) = (0, 0);
            for e in &shared.envoys {
                let e = lock(e);
                assigned += usize::from(e.held == e.rates.len());
                failed += usize::from(e.error.is_some());
            }
            let sent = shared.sent.load(Ordering::Relaxed);
            println!("status assigned {assigned} failed {failed} sent {sent}");
        }
        (Some("share"), None) => {
            let rates = shared.rates();
            println!("share {} {}", pick(&rates, 0.5), rates.len());
        }
        (Some("mark"), Some(rate)) => {
            let rate = rate.parse().map_err(|e| format!("mark {rate}: {e}"))?;
            *lock(&shared.mark) = Some(Mark {
                rate,
                at: Instant::now(),
            });
            println!("marked");
        }
        (Some("wait"), Some(seconds)) => {
            let seconds: f64 = seconds
                .parse()
                .map_err(|e| format!("wait {seconds}: {e}"))?;
            let at = lock(&shared.mark).ok_or("wait before mark")?.at;
            let deadline = at + Duration::from_secs_f64(seconds);
            while Instant::now() < deadline
                && !shared.envoys.iter().all(|e| lock(e).updated.is_some())
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let mut done = Vec::new();
            let mut codes = BTreeMap::<String, usize>::new();
            for e in &shared.envoys {
                let e = lock(e);
                done.extend(e.updated.map(|d| d.as_secs_f64()));
                if let Some(code) = e.error {
                    *codes.entry(format!("{code:?}")).or_default() += 1;
                }
            }
            done.sort_by(f64::total_cmp);
            let failed: usize = codes.values().sum();
            let codes = if codes.is_empty() {
                "-".to_string()
            } else {
                let each: Vec<String> = codes.iter().map(|(c, n)| format!("{c}={n}")).collect();
                each.join(",")
            };
            println!(
                "done {} {} median {:.3} p99 {:.3} all {:.3} share {} failed {failed} codes {codes}",
                done.len(),
                shared.envoys.len(),
                pick(&done, 0.5),
                pick(&done, 0.99),
                done.last().copied().unwrap_or(0.0),
                pick(&shared.rates(), 0.5),
            );
        }
        _ => return Err(format!("unknown command {line:?}")),
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Arc::new(parse_args().map_err(|e| format!("rlqsgen: {e}"))?);
    let shared = Arc::new(Shared {
        envoys: (0..args.streams)
            .map(|_| {
                Mutex::new(Envoy {
                    rates: vec![f64::NAN; args.buckets],
                    held: 0,
                    updated: None,
                    error: None,
                })
            })
            .collect(),
        mark: Mutex::new(None),
        sent: AtomicU64::new(0),
        errors: AtomicU64::new(0),
    });

    // Commands come from a thread of their own: tokio's stdin is not in the crate's features.
    let (lines, mut commands) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if lines.send(line).is_err() {
                break;
            }
        }
    });

    let endpoint = Endpoint::from_shared(format!("http://{}", args.addr))?;
    let mut client = RateLimitQuotaServiceClient::new(endpoint.connect().await?);
    for stream in 0..args.streams {
        if stream > 0 && stream % args.per_connection == 0 {
            client = RateLimitQuotaServiceClient::new(endpoint.connect().await?);
        }
        let prefix = if args.distinct {
            format!("s{stream}-")
        } else {
            String::new()
        };
        tokio::spawn(envoy(
            client.clone(),
            shared.clone(),
            stream,
            prefix,
            args.clone(),
        ));
        if stream % BATCH == BATCH - 1 {
            tokio::time::sleep(BATCH_PAUSE).await;
        }
    }
    println!("ready {}", args.streams);

    while let Some(line) = commands.recv().await {
        if let Err(e) = command(&shared, &line).await {
            eprintln!("rlqsgen: {e}");
            println!("error {e}");
        }
    }
    Ok(())
}
