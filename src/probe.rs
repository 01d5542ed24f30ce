//! `sluice probe`: load and watch a running rate-limit service (sluice, envoyproxy/ratelimit,
//! Limitador) with real `ShouldRateLimit` calls, paced at a fixed rate by a bounded number of
//! workers, for a bounded time and count. It shows a live progress line, then reports a
//! per-second timeline of OK and OVER_LIMIT (by wall-clock second, so refusals that cluster at
//! the top of each period show), call latency p50/p99/max, and the rate-limit headers the
//! service asked Envoy to add.
//!
//! A gRPC client only: the server never imports it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tonic::transport::Endpoint;

use crate::pb::rate_limit_response::Code;
use crate::pb::rate_limit_service_client::RateLimitServiceClient;
use crate::pb::{RateLimitDescriptor, RateLimitRequest, RateLimitResponse, rate_limit_descriptor};

/// The most calls one run makes, whatever the flags say.
pub const MAX_CALLS: u64 = 10_000_000;

/// What to send, how fast, and for how long.
#[derive(Clone, Debug)]
pub struct ProbeConfig {
    /// `http://host:port`.
    pub endpoint: String,
    /// The request sent on every call.
    pub request: RateLimitRequest,
    /// Calls per second over all workers.
    pub rate: u32,
    /// Workers, each with at most one call in flight.
    pub concurrency: u32,
    /// How long to run.
    pub duration: Duration,
    /// Most calls.
    pub calls: u64,
    /// Per-call timeout.
    pub timeout: Duration,
    /// Show a live progress line on stderr.
    pub progress: bool,
}

impl ProbeConfig {
    /// A probe of `addr` (`HOST:PORT` or an `http://` URL) asking about `descriptors` (each
    /// `key=value[,key=value…]`) in `domain`: one hit per call, 100 calls a second from 4
    /// workers for 10 s, a 1 s timeout per call, no progress line.
    ///
    /// # Errors
    ///
    /// [`ProbeError::Descriptor`] naming the first descriptor that does not parse.
    pub fn new(addr: &str, domain: &str, descriptors: &[String]) -> Result<Self, ProbeError> {
        let descriptors = descriptors
            .iter()
            .map(|d| parse_descriptor(d))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            endpoint: endpoint(addr),
            request: RateLimitRequest {
                domain: domain.to_string(),
                descriptors,
                hits_addend: 0,
            },
            rate: 100,
            concurrency: 4,
            duration: Duration::from_secs(10),
            calls: 1_000,
            timeout: Duration::from_secs(1),
            progress: false,
        })
    }

    /// With `hits_addend` on every call (0: the server's default of 1).
    #[must_use]
    pub fn hits_addend(mut self, hits_addend: u32) -> Self {
        self.request.hits_addend = hits_addend;
        self
    }

    /// Paced at `rate` calls per second by `concurrency` workers for `duration`: as many calls
    /// as fit in it, or `most` when fewer.
    #[must_use]
    pub fn paced(
        mut self,
        rate: u32,
        concurrency: u32,
        duration: Duration,
        most: Option<u64>,
    ) -> Self {
        let by_time = (f64::from(rate) * duration.as_secs_f64()).ceil() as u64;
        self.rate = rate;
        self.concurrency = concurrency;
        self.duration = duration;
        self.calls = most.map_or(by_time, |n| n.min(by_time));
        self
    }

    /// With `timeout` on each call (and on connecting).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// With or without the live progress line on standard error.
    #[must_use]
    pub fn progress(mut self, progress: bool) -> Self {
        self.progress = progress;
        self
    }
}

/// Why a probe could not run.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// A `--descriptor` is not `key=value[,key=value…]`.
    #[error("descriptor {0:?}: expected key=value[,key=value…] with non-empty keys")]
    Descriptor(String),
    /// The address is not a URI.
    #[error("address {addr:?}: {source}")]
    Address {
        /// As given.
        addr: String,
        /// Why.
        source: tonic::transport::Error,
    },
    /// The service cannot be reached.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// As given.
        addr: String,
        /// Why.
        source: tonic::transport::Error,
    },
}

/// A descriptor from `key=value[,key=value…]`.
///
/// # Errors
///
/// [`ProbeError::Descriptor`] when an entry has no `=` or an empty key.
fn parse_descriptor(text: &str) -> Result<RateLimitDescriptor, ProbeError> {
    let entries = text
        .split(',')
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok(rate_limit_descriptor::Entry {
                key: k.trim().to_string(),
                value: v.to_string(),
            }),
            _ => Err(ProbeError::Descriptor(text.to_string())),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(RateLimitDescriptor {
        entries,
        ..RateLimitDescriptor::default()
    })
}

/// `HOST:PORT` as an `http://` URL; URLs pass unchanged.
fn endpoint(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

/// One wall-clock second of the timeline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Second {
    /// The second the calls were sent in, Unix time.
    pub unix_second: u64,
    /// Answered OK.
    pub ok: u64,
    /// Answered OVER_LIMIT.
    pub over_limit: u64,
    /// Failed (gRPC error, timeout, or an UNKNOWN code).
    pub error: u64,
}

/// A response header the service asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HeaderSeen {
    /// How many answers carried it.
    pub count: u64,
    /// The value on the earliest call that carried it.
    pub first: String,
    /// The value on the latest call that carried it.
    pub last: String,
    /// The calls `first` and `last` came from (call numbers, in schedule order).
    #[serde(skip)]
    span: (u64, u64),
}

impl HeaderSeen {
    /// Adds `value`, seen on call `call`.
    fn add(&mut self, call: u64, value: &str) {
        if self.count == 0 || call < self.span.0 {
            self.first = value.to_string();
            self.span.0 = call;
        }
        if self.count == 0 || call >= self.span.1 {
            self.last = value.to_string();
            self.span.1 = call;
        }
        self.count += 1;
    }

    /// Adds what another worker saw.
    fn merge(&mut self, other: Self) {
        if other.count == 0 {
            return;
        }
        if self.count == 0 || other.span.0 < self.span.0 {
            self.first = other.first;
            self.span.0 = other.span.0;
        }
        if self.count == 0 || other.span.1 >= self.span.1 {
            self.last = other.last;
            self.span.1 = other.span.1;
        }
        self.count += other.count;
    }
}

/// Latency in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Latency {
    /// Median.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Slowest.
    pub max_us: u64,
}

/// What a probe saw.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProbeReport {
    /// Calls made.
    pub calls: u64,
    /// Answered OK.
    pub ok: u64,
    /// Answered OVER_LIMIT.
    pub over_limit: u64,
    /// Failed.
    pub errors: u64,
    /// The first error message, if any.
    pub first_error: Option<String>,
    /// Seconds the run took.
    pub elapsed_seconds: f64,
    /// Latency of answered calls.
    pub latency: Latency,
    /// Per second, in time order.
    pub timeline: Vec<Second>,
    /// `response_headers_to_add`, by name.
    pub headers: BTreeMap<String, HeaderSeen>,
}

/// One worker's records.
#[derive(Default)]
struct Records {
    seconds: BTreeMap<u64, Second>,
    latencies_us: Vec<u32>,
    headers: BTreeMap<String, HeaderSeen>,
    first_error: Option<String>,
}

impl Records {
    fn record(
        &mut self,
        call: u64,
        sent: SystemTime,
        took: Duration,
        answer: Result<RateLimitResponse, String>,
    ) {
        let unix_second = sent.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let s = self.seconds.entry(unix_second).or_insert(Second {
            unix_second,
            ..Second::default()
        });
        match answer {
            Ok(resp) => {
                self.latencies_us
                    .push(u32::try_from(took.as_micros()).unwrap_or(u32::MAX));
                match Code::try_from(resp.overall_code) {
                    Ok(Code::Ok) => s.ok += 1,
                    Ok(Code::OverLimit) => s.over_limit += 1,
                    _ => {
                        s.error += 1;
                        self.first_error
                            .get_or_insert_with(|| format!("overall code {}", resp.overall_code));
                    }
                }
                for h in resp.response_headers_to_add {
                    self.headers.entry(h.key).or_default().add(call, &h.value);
                }
            }
            Err(e) => {
                s.error += 1;
                self.first_error.get_or_insert(e);
            }
        }
    }

    fn merge(&mut self, other: Self) {
        for (k, v) in other.seconds {
            let s = self.seconds.entry(k).or_insert(Second {
                unix_second: k,
                ..Second::default()
            });
            s.ok += v.ok;
            s.over_limit += v.over_limit;
            s.error += v.error;
        }
        self.latencies_us.extend(other.latencies_us);
        for (k, v) in other.headers {
            self.headers.entry(k).or_default().merge(v);
        }
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

/// Live counts for the progress line.
#[derive(Default)]
struct Live {
    ok: AtomicU64,
    over: AtomicU64,
    error: AtomicU64,
}

/// Runs a probe.
///
/// # Errors
///
/// [`ProbeError`] when the address is invalid or the service cannot be reached at all.
pub async fn run(config: ProbeConfig) -> Result<ProbeReport, ProbeError> {
    let channel = Endpoint::from_shared(config.endpoint.clone())
        .map_err(|source| ProbeError::Address {
            addr: config.endpoint.clone(),
            source,
        })?
        .connect_timeout(config.timeout)
        .timeout(config.timeout)
        .connect()
        .await
        .map_err(|source| ProbeError::Connect {
            addr: config.endpoint.clone(),
            source,
        })?;
    let start = Instant::now();
    let deadline = tokio::time::Instant::from_std(start) + config.duration;
    // Call i is due at start + i / rate; a shared counter hands out the indices.
    let next = Arc::new(AtomicU64::new(0));
    let live = Arc::new(Live::default());
    let calls = config.calls.min(MAX_CALLS);
    let interval_ns = 1_000_000_000 / u64::from(config.rate.max(1));
    let mut workers = Vec::new();
    for _ in 0..config.concurrency.max(1) {
        let (next, live) = (Arc::clone(&next), Arc::clone(&live));
        let mut client = RateLimitServiceClient::new(channel.clone());
        let request = config.request.clone();
        workers.push(tokio::spawn(async move {
            let mut records = Records::default();
            loop {
                // Relaxed: the counter only hands out distinct indices.
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= calls {
                    break;
                }
                let due = tokio::time::Instant::from_std(start)
                    + Duration::from_nanos(i.saturating_mul(interval_ns));
                if due >= deadline {
                    break;
                }
                tokio::time::sleep_until(due).await;
                let (sent, began) = (SystemTime::now(), Instant::now());
                let answer = client
                    .should_rate_limit(request.clone())
                    .await
                    .map(tonic::Response::into_inner)
                    .map_err(|s| format!("{:?}: {}", s.code(), s.message()));
                let took = began.elapsed();
                // Relaxed: progress display only.
                let counter = match &answer {
                    Ok(r) if r.overall_code == Code::Ok as i32 => &live.ok,
                    Ok(r) if r.overall_code == Code::OverLimit as i32 => &live.over,
                    _ => &live.error,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                records.record(i, sent, took, answer);
            }
            records
        }));
    }
    let ticker = config.progress.then(|| {
        let live = Arc::clone(&live);
        let tty = std::io::stderr().is_terminal();
        tokio::spawn(async move {
            let every = Duration::from_millis(if tty { 250 } else { 5_000 });
            loop {
                tokio::time::sleep(every).await;
                let line = format!(
                    "probe: {:.0}s  ok {}  over_limit {}  errors {}",
                    start.elapsed().as_secs_f64(),
                    live.ok.load(Ordering::Relaxed),
                    live.over.load(Ordering::Relaxed),
                    live.error.load(Ordering::Relaxed)
                );
                if tty {
                    eprint!("\r\x1b[2K{line}");
                } else {
                    eprintln!("{line}");
                }
            }
        })
    });
    let mut all = Records::default();
    for w in workers {
        if let Ok(records) = w.await {
            all.merge(records);
        }
    }
    if let Some(t) = ticker {
        t.abort();
        if std::io::stderr().is_terminal() {
            eprintln!();
        }
    }
    Ok(report(all, start.elapsed()))
}

fn report(mut all: Records, elapsed: Duration) -> ProbeReport {
    all.latencies_us.sort_unstable();
    let pick = |q: f64| -> u64 {
        let n = all.latencies_us.len();
        if n == 0 {
            return 0;
        }
        // Nearest rank: the smallest value with at least q of the samples at or below it.
        let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
        u64::from(all.latencies_us[rank - 1])
    };
    let timeline: Vec<Second> = all.seconds.into_values().collect();
    let sum = |f: fn(&Second) -> u64| timeline.iter().map(f).sum::<u64>();
    ProbeReport {
        ok: sum(|s| s.ok),
        over_limit: sum(|s| s.over_limit),
        errors: sum(|s| s.error),
        calls: sum(|s| s.ok + s.over_limit + s.error),
        first_error: all.first_error,
        elapsed_seconds: elapsed.as_secs_f64(),
        latency: Latency {
            p50_us: pick(0.50),
            p99_us: pick(0.99),
            max_us: pick(1.0),
        },
        timeline,
        headers: all.headers,
    }
}

impl ProbeReport {
    /// The human form: the timeline (UTC time of day), latency, headers.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<10} {:>8} {:>11} {:>7}",
            "utc", "ok", "over_limit", "error"
        );
        for s in &self.timeline {
            let d = s.unix_second % 86_400;
            let _ = writeln!(
                out,
                "{:02}:{:02}:{:02}   {:>8} {:>11} {:>7}",
                d / 3_600,
                d / 60 % 60,
                d % 60,
                s.ok,
                s.over_limit,
                s.error
            );
        }
        let _ = writeln!(
            out,
            "calls {} in {:.1}s: ok {}, over_limit {}, errors {}",
            self.calls, self.elapsed_seconds, self.ok, self.over_limit, self.errors
        );
        if let Some(e) = &self.first_error {
            let _ = writeln!(out, "first error: {e}");
        }
        let ms = |us: u64| us as f64 / 1_000.0;
        let _ = writeln!(
            out,
            "latency: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
            ms(self.latency.p50_us),
            ms(self.latency.p99_us),
            ms(self.latency.max_us)
        );
        if self.headers.is_empty() {
            let _ = writeln!(out, "rate-limit headers: none");
        } else {
            let _ = writeln!(out, "rate-limit headers:");
            for (name, seen) in &self.headers {
                let _ = write!(out, "  {name}: {} ({}×)", seen.first, seen.count);
                if seen.last != seen.first {
                    let _ = write!(out, " … last {}", seen.last);
                }
                out.push('\n');
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_parse_and_bad_ones_are_refused() {
        let d = parse_descriptor("generic_key=api,api_key=k1").unwrap();
        let pairs: Vec<(&str, &str)> = d
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect();
        assert_eq!(pairs, [("generic_key", "api"), ("api_key", "k1")]);
        assert_eq!(parse_descriptor("k=").unwrap().entries[0].value, "");
        for bad in ["k", "=v", "a=b,", ""] {
            assert!(parse_descriptor(bad).is_err(), "{bad:?}");
        }
        assert_eq!(endpoint("127.0.0.1:8081"), "http://127.0.0.1:8081");
        assert_eq!(endpoint("http://[::1]:1"), "http://[::1]:1");
    }

    #[test]
    fn a_config_from_the_command_lines_strings() {
        let c = ProbeConfig::new("127.0.0.1:8081", "acme", &["a=1".into(), "b=2,c=3".into()])
            .unwrap()
            .paced(100, 2, Duration::from_millis(2_500), None);
        assert_eq!(c.endpoint, "http://127.0.0.1:8081");
        assert_eq!(c.request.domain, "acme");
        assert_eq!(c.request.descriptors.len(), 2);
        assert_eq!((c.rate, c.concurrency, c.calls), (100, 2, 250));
        let c = c.paced(100, 2, Duration::from_secs(1), Some(30));
        assert_eq!(c.calls, 30, "the fewer of the two");
        let err = ProbeConfig::new("x:1", "acme", &["a=1".into(), "=v".into()]).unwrap_err();
        assert!(err.to_string().contains("\"=v\""), "{err}");
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let r = Records {
            latencies_us: (1..=100).rev().collect(),
            ..Records::default()
        };
        let report = report(r, Duration::from_secs(1));
        assert_eq!(
            (
                report.latency.p50_us,
                report.latency.p99_us,
                report.latency.max_us
            ),
            (50, 99, 100)
        );
    }
}
