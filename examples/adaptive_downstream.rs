//! A service whose downstream slows down under load, with and without an adaptive concurrency
//! limit in front of it, beside sluice's rate limit for the same downstream.
//!
//! Self-contained: it starts sluice in-process on loopback with one limit, 125 calls a second
//! (burst 15) to the downstream `db`. The downstream is simulated: 40 ms a call while at most 4
//! calls are in flight, and proportionally slower beyond (8 in flight: 80 ms), so it completes
//! at most 100 calls a second however many it is sent. Jobs arrive at a rate that climbs from
//! 25 to 250 a second over 3 s, then holds for 1 s. Each job asks sluice, then calls the
//! downstream. Two runs of 4 s:
//!
//! - **fixed**: no limit of its own. Past 125 jobs a second sluice refuses the excess, and the
//!   100 a second the downstream can do fall behind the 125 sluice admits: calls pile up in
//!   flight and latency climbs without bound.
//! - **adaptive**: each job first takes a permit from a Vegas [`AdaptiveLimit`]. As latency
//!   climbs above its minimum the limit shrinks, and jobs beyond it are shed locally, before
//!   asking sluice: the downstream's latency stays within about twice its 40 ms (the limit
//!   settles near 6–8 in flight), and sluice does not have to refuse.
//!
//! Every 250 ms it prints the limit, the calls in flight, the latency, and what was done, refused
//! and shed. `cargo run --features client --example adaptive_downstream`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sluice::app::App;
use sluice::client::adaptive::{AdaptiveLimit, Vegas};
use sluice::client::{Answer, Descriptor, RateLimitClient};
use sluice::settings::Written;

const POLICY: &str = "
domain: reports
descriptors:
  - key: downstream
    value: db
    rate_limit: {unit: second, requests_per_unit: 125, burst: 15}
";

/// How long each run offers jobs.
const RUN: Duration = Duration::from_secs(4);

/// The simulated downstream: latency grows with the calls in flight past its capacity.
#[derive(Default)]
struct Downstream {
    in_flight: AtomicUsize,
}

impl Downstream {
    const SLOTS: f64 = 4.0;
    const BASE: Duration = Duration::from_millis(40);

    async fn call(&self) -> Duration {
        // Relaxed here and below: counters for the printout, read on their own.
        let n = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        let latency = Self::BASE.mul_f64((n as f64 / Self::SLOTS).max(1.0));
        tokio::time::sleep(latency).await;
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        latency
    }
}

/// What happened to the jobs, since the last printout.
#[derive(Default)]
struct Tally {
    offered: AtomicU64,
    done: AtomicU64,
    refused: AtomicU64,
    shed: AtomicU64,
    latency_micros: AtomicU64,
}

impl Tally {
    fn take(counter: &AtomicU64) -> u64 {
        counter.swap(0, Ordering::Relaxed)
    }
}

/// One job: a permit (adaptive run), sluice's answer, the downstream call.
async fn job(
    sluice: RateLimitClient,
    limit: Option<AdaptiveLimit>,
    downstream: Arc<Downstream>,
    tally: Arc<Tally>,
) {
    let permit = match &limit {
        Some(limit) => match limit.try_acquire() {
            Some(permit) => Some(permit),
            None => {
                tally.shed.fetch_add(1, Ordering::Relaxed);
                return;
            }
        },
        None => None,
    };
    if let Answer::Refused { .. } = sluice
        .check(&[Descriptor::new([("downstream", "db")])])
        .await
    {
        // Dropping the permit unreported: a cancelled call, no sample.
        tally.refused.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let latency = downstream.call().await;
    if let Some(permit) = permit {
        permit.success();
    }
    tally.done.fetch_add(1, Ordering::Relaxed);
    let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
    tally.latency_micros.fetch_add(micros, Ordering::Relaxed);
}

/// Jobs a second at `t` into the run: 25 climbing to 250 over 3 s, then flat.
fn arrival_rate(t: Duration) -> f64 {
    25.0 + 225.0 * (t.as_secs_f64() / 3.0).min(1.0)
}

async fn run(name: &str, sluice: &RateLimitClient, limit: Option<AdaptiveLimit>) {
    println!("\n{name}:");
    println!("     t  offered/s  limit  in flight  latency   done/s  refused/s  shed/s");
    let downstream = Arc::new(Downstream::default());
    let tally = Arc::new(Tally::default());
    let (mut refused_total, mut shed_total, mut worst) = (0, 0, Duration::ZERO);
    let failures = sluice.failures();
    let started = Instant::now();
    let mut due = 0.0;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    let mut next_print = Duration::from_millis(250);
    loop {
        tick.tick().await;
        let t = started.elapsed();
        if t >= RUN {
            break;
        }
        due += arrival_rate(t) * 0.005;
        while due >= 1.0 {
            due -= 1.0;
            tally.offered.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(job(
                sluice.clone(),
                limit.clone(),
                Arc::clone(&downstream),
                Arc::clone(&tally),
            ));
        }
        if t >= next_print {
            next_print += Duration::from_millis(250);
            let per_second = |n: u64| n * 4;
            let done = Tally::take(&tally.done);
            let latency = Duration::from_micros(Tally::take(&tally.latency_micros) / done.max(1));
            let (refused, shed) = (Tally::take(&tally.refused), Tally::take(&tally.shed));
            refused_total += refused;
            shed_total += shed;
            worst = worst.max(latency);
            let limit = limit
                .as_ref()
                .map_or_else(|| "-".to_string(), |l| l.limit().to_string());
            println!(
                "{:>5.2}s {:>10} {:>6} {:>10} {:>8.1?} {:>8} {:>10} {:>7}",
                t.as_secs_f64(),
                per_second(Tally::take(&tally.offered)),
                limit,
                downstream.in_flight.load(Ordering::Relaxed),
                latency,
                per_second(done),
                per_second(refused),
                per_second(shed),
            );
        }
    }
    println!(
        "{name}: sluice refused {refused_total}, shed locally {shed_total}, worst mean latency \
         {worst:.1?}, calls to sluice without an answer (failed open) {}",
        sluice.failures() - failures
    );
    // Let the calls still in flight finish before the next run (bounded: they are sleeps).
    let drained = Instant::now();
    while downstream.in_flight.load(Ordering::Relaxed) > 0 && drained.elapsed() < RUN * 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("reports.yaml"), POLICY)?;
    let settings = Written {
        grpc_addr: "127.0.0.1:0".parse()?,
        admin_addr: "127.0.0.1:0".parse()?,
        policies: dir.path().to_path_buf(),
        watch_policies: false,
        ..Written::default()
    }
    .validate()?;
    let app = App::bind(settings).await?;
    let grpc = app.grpc_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run(async {
        let _ = stopped.await;
    }));
    // A deadline with room for a debug build: the demo is about the downstream.
    let sluice = RateLimitClient::connect_lazy(&format!("http://{grpc}"), "reports")?
        .with_deadline(Duration::from_millis(50));

    run("fixed (no limit of its own)", &sluice, None).await;
    // Wait out the bucket the first run emptied.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let vegas = Vegas::builder()
        .initial_limit(20)
        .min_limit(1)
        .max_limit(100)
        .build()?;
    run("adaptive (Vegas)", &sluice, Some(AdaptiveLimit::new(vegas))).await;

    let _ = stop.send(());
    server.await??;
    Ok(())
}
