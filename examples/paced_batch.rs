//! A batch job calling a third-party API that bills per call, paced by sluice: `acquire` waits
//! for each call's slot instead of taking a refusal, so the API sees a smooth 20 calls a second
//! and the job pays for no refused or retried calls.
//!
//! The job states its smoothed rate ([`RATE_PER_SECOND`]) and the rule says the same, with a
//! delay, so that a call that does not fit now is held by sluice until its slot:
//!
//! ```yaml
//! domain: vendor
//! descriptors:
//!   - key: api
//!     value: geocoder
//!     rate_limit: {unit: second, requests_per_unit: 20, burst: 1, delay: 1s}
//! ```
//!
//! Several workers share the job. Each asks `acquire` for one call, waiting at most
//! [`MAX_WAIT`]: against the delaying rule every answer is `OK` (some of them late, at their
//! slot) and the job counts no refusal; against the same rule without `delay` the calls that do
//! not fit are refused, and a refusal whose wait is past `MAX_WAIT` leaves its item for the next
//! run. The job fails closed when sluice does not answer: an unguarded call costs money.
//!
//! Run a server with that policy, then:
//! `cargo run --features client --example paced_batch -- http://127.0.0.1:8081 100`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sluice::client::{AcquireError, Descriptor, FailurePolicy, RateLimitClient};
use tokio::sync::Mutex;

/// The job's stated smoothed rate: the API's contract, and the policy's `requests_per_unit`.
pub const RATE_PER_SECOND: u32 = 20;

/// Workers calling the API at once.
pub const WORKERS: usize = 4;

/// The longest a call may wait for its slot.
pub const MAX_WAIT: Duration = Duration::from_secs(1);

/// What a run did.
#[derive(Debug, Default)]
pub struct Run {
    /// Calls made to the API (each one billed).
    pub billed: u64,
    /// Refusals taken from sluice (each one a wait, or an item left for the next run).
    pub refusals: u64,
    /// Items left for the next run: their slot was further than [`MAX_WAIT`].
    pub left: u64,
    /// When each billed call was made, from the start of the run.
    pub calls: Vec<Duration>,
}

impl Run {
    /// The rate the API saw, calls per second between the first call and the last.
    pub fn rate(&self) -> f64 {
        match (self.calls.first(), self.calls.last()) {
            (Some(first), Some(last)) if last > first => {
                (self.calls.len() - 1) as f64 / (*last - *first).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

/// Runs a batch of `items` calls against the sluice at `url` with `workers` workers, each call
/// waiting at most `max_wait` for its slot.
pub async fn run(
    url: &str,
    items: u64,
    workers: usize,
    max_wait: Duration,
) -> Result<Run, Box<dyn std::error::Error>> {
    let sluice = RateLimitClient::connect_lazy(url, "vendor")?
        .with_deadline(Duration::from_millis(200))
        .with_failure_policy(FailurePolicy::Closed {
            wait: Duration::from_secs(1),
        });
    let next = Arc::new(AtomicU64::new(0));
    let run = Arc::new(Mutex::new(Run::default()));
    let started = Instant::now();
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let (sluice, next, run) = (sluice.clone(), Arc::clone(&next), Arc::clone(&run));
            tokio::spawn(async move {
                let descriptors = [Descriptor::new([("api", "geocoder")])];
                // Relaxed: a ticket counter; each item is taken once, nothing else is published.
                while next.fetch_add(1, Ordering::Relaxed) < items {
                    match sluice.acquire(&descriptors, max_wait).await {
                        Ok(slot) => {
                            let at = call_the_api(started).await;
                            let mut run = run.lock().await;
                            run.billed += 1;
                            run.refusals += u64::from(slot.refusals);
                            run.calls.push(at);
                        }
                        Err(AcquireError::TooLong { .. }) => {
                            let mut run = run.lock().await;
                            run.refusals += 1;
                            run.left += 1;
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await?;
    }
    let mut run = std::mem::take(&mut *run.lock().await);
    run.calls.sort();
    Ok(run)
}

/// The third-party API: one billed call (here, a short pause), made at the returned instant.
async fn call_the_api(started: Instant) -> Duration {
    let at = started.elapsed();
    tokio::time::sleep(Duration::from_millis(2)).await;
    at
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let url = args.get(1).map_or("http://127.0.0.1:8081", String::as_str);
    let items: u64 = args.get(2).map_or(Ok(100), |n| n.parse())?;
    println!(
        "{items} calls at a stated {RATE_PER_SECOND} per second, {WORKERS} workers, each call \
         waiting at most {MAX_WAIT:?} for its slot"
    );
    let run = run(url, items, WORKERS, MAX_WAIT).await?;
    println!(
        "{} calls billed at {:.1} per second; {} refusals; {} left for the next run",
        run.billed,
        run.rate(),
        run.refusals,
        run.left
    );
    Ok(())
}
