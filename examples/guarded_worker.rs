//! A worker that asks sluice before each job, on `sluice::client`.
//!
//! Before each job it asks about the descriptor `[tenant=<name>]` in domain `jobs`:
//! - allowed: it does the job;
//! - refused: it waits as [`Backoff`] says (never less than the server's wait, spread upward so
//!   workers refused together do not return together), then asks again;
//! - sluice does not answer within the client's deadline: the client fails open, as stated in
//!   its [`FailurePolicy`], and counts the failure; the worker does the job and says so. (A
//!   worker for which overload costs more than refusal would use `FailurePolicy::Closed`.)
//!
//! Run a server with a `jobs` policy, e.g.
//! `domain: jobs` / `descriptors: [{key: tenant, rate_limit: {unit: second, requests_per_unit: 5}}]`,
//! then: `cargo run --features client --example guarded_worker -- http://127.0.0.1:8081 acme 20`

use std::time::{Duration, Instant};

use sluice::client::{Answer, Backoff, Descriptor, FailurePolicy, RateLimitClient};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:8081".into());
    let tenant = args.next().unwrap_or_else(|| "acme".into());
    let jobs: u32 = args.next().map_or(Ok(20), |n| n.parse())?;

    let sluice = RateLimitClient::connect_lazy(&url, "jobs")?
        .with_deadline(Duration::from_millis(50))
        .with_failure_policy(FailurePolicy::Open);
    let descriptors = [Descriptor::new([("tenant", tenant.as_str())])];
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
    let started = Instant::now();
    let mut done = 0;
    while done < jobs {
        let failures = sluice.failures();
        match sluice.check(&descriptors).await {
            Answer::Allowed => {
                backoff.reset();
                done += 1;
                let t = started.elapsed().as_secs_f64();
                if sluice.failures() > failures {
                    println!("{t:>6.2}s sluice did not answer; job {done} done anyway (fail open)");
                } else {
                    println!("{t:>6.2}s job {done} done");
                }
            }
            Answer::Refused { wait } => {
                let pause = backoff.after_refusal(wait);
                println!(
                    "{:>6.2}s over the limit for {wait:?}; asking again in {pause:.2?}",
                    started.elapsed().as_secs_f64()
                );
                tokio::time::sleep(pause).await;
            }
        }
    }
    println!("{jobs} jobs; {} calls to sluice failed", sluice.failures());
    Ok(())
}
