//! Two replicas of a service enforcing sluice's quota assignments locally, on
//! `sluice::client::Quota`: no call to sluice per request, one report a replica per interval.
//!
//! Self-contained: it starts sluice in-process on loopback with one rule, 40 requests a second
//! per tenant, in domain `api`. Two replicas each serve tenant `acme` at 150 requests a second
//! for 3 s, each asking its own enforcer before every request (`quota.check`, synchronous).
//! Each enforcer reports `acme`'s usage every 250 ms on its `StreamRateLimitQuotas` stream;
//! sluice divides the rule between the two streams by their demand and sends each a token
//! bucket, so together they admit about 40 a second, not 80.
//!
//! Every 500 ms it prints, per replica, the requests offered, admitted and refused, and the
//! rate of the token bucket it holds, then the rate both admitted after the first second. In
//! the first half-second they admit several times the rule: each replica's first token bucket
//! starts full (as Envoy's does), the first one's with the whole rule, since it was alone, and
//! its share shrinks only at its next report.
//! `cargo run --features client --example quota_enforcer`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sluice::app::App;
use sluice::client::quota::Strategy;
use sluice::client::{Answer, Bucket, FailurePolicy, Quota};
use sluice::settings::Written;

const POLICY: &str = "
domain: api
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 40}
";

/// How long the replicas serve.
const RUN: Duration = Duration::from_secs(3);

/// What one replica did since the last printout.
#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    refused: AtomicU64,
}

/// One replica: a request every `pace`, each asked about first.
async fn replica(quota: Quota, tally: Arc<Tally>, pace: Duration) {
    let acme = Bucket::new([("tenant", "acme")]);
    let started = Instant::now();
    let mut tick = tokio::time::interval(pace);
    while started.elapsed() < RUN {
        tick.tick().await;
        // Relaxed: counters for the printout, read on their own.
        match quota.check(&acme) {
            Answer::Allowed => tally.admitted.fetch_add(1, Ordering::Relaxed),
            Answer::Refused { .. } => tally.refused.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// The rate of the token bucket `quota` holds for `acme`, or what it holds instead.
fn holds(quota: &Quota) -> String {
    match quota.assignment(&Bucket::new([("tenant", "acme")])) {
        Some(a) => match a.strategy {
            Strategy::TokenBucket(b) => format!("{:.1}/s", b.rate()),
            other => format!("{other:?}"),
        },
        None => "no assignment yet".into(),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("api.yaml"), POLICY)?;
    let settings = Written {
        grpc_addr: "127.0.0.1:0".parse()?,
        admin_addr: "127.0.0.1:0".parse()?,
        policies: dir.path().to_path_buf(),
        watch_policies: false,
        ..Written::default()
    }
    .validate()?;
    let app = App::bind(settings).await?;
    let address = format!("http://{}", app.grpc_addr());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run(async {
        let _ = stopped.await;
    }));

    // Each replica has its own enforcer (its own stream), as two pods would.
    let enforcer = || {
        Quota::builder("api")
            .with_report_interval(Duration::from_millis(250))
            // Before a bucket's first assignment: allow (the default).
            .with_unassigned(Answer::Allowed)
            // Once an assignment expires with sluice unreachable: refuse, for 1 s.
            .with_failure_policy(FailurePolicy::Closed {
                wait: Duration::from_secs(1),
            })
            .connect_lazy(&address)
    };
    let replicas = [enforcer()?, enforcer()?];
    let tallies = [Arc::new(Tally::default()), Arc::new(Tally::default())];
    for (quota, tally) in replicas.iter().zip(&tallies) {
        tokio::spawn(replica(
            quota.clone(),
            Arc::clone(tally),
            Duration::from_micros(6_667),
        ));
    }

    println!("     t  replica  offered/s  admitted/s  refused/s  holds");
    let started = Instant::now();
    let (mut total, mut first_second) = (0, None);
    while started.elapsed() < RUN {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let t = started.elapsed().as_secs_f64();
        for (i, (quota, tally)) in replicas.iter().zip(&tallies).enumerate() {
            let admitted = tally.admitted.swap(0, Ordering::Relaxed);
            let refused = tally.refused.swap(0, Ordering::Relaxed);
            total += admitted;
            println!(
                "{t:>5.2}s {:>8} {:>10} {:>11} {:>10}  {}",
                i + 1,
                (admitted + refused) * 2,
                admitted * 2,
                refused * 2,
                holds(quota),
            );
        }
        if first_second.is_none() && t >= 1.0 {
            first_second = Some(total);
        }
    }
    let after = total - first_second.unwrap_or(0);
    let span = started.elapsed().as_secs_f64() - 1.0;
    println!(
        "after the first second: {after} admitted in {span:.1} s by both replicas, {:.1}/s \
         (the rule: 40/s)",
        after as f64 / span
    );

    drop(replicas);
    let _ = stop.send(());
    server.await??;
    Ok(())
}
