//! A microservice that asks sluice before doing work.
//!
//! It processes jobs for a tenant; before each job it calls `ShouldRateLimit` with the
//! descriptor `[tenant=<name>]` in domain `jobs`:
//! - `OK`: do the job;
//! - `OVER_LIMIT`: wait `duration_until_reset`, plus up to 50 % jitter so that many workers
//!   refused at once do not retry in lockstep, then ask again;
//! - sluice unreachable or erroring (no answer within 50 ms): the stated policy is to **fail
//!   open**, doing the job anyway, because the limit protects a downstream that is also guarded
//!   elsewhere; a service for which overload is worse than refusal would fail closed instead.
//!
//! Run a server with a `jobs` policy, e.g.
//! `domain: jobs` / `descriptors: [{key: tenant, rate_limit: {unit: second, requests_per_unit: 5}}]`,
//! then: `cargo run --example guarded_worker -- http://127.0.0.1:8081 acme 20`

use std::time::{Duration, Instant};

use sluice::pb::rate_limit_response::Code;
use sluice::pb::rate_limit_service_client::RateLimitServiceClient;
use sluice::pb::{RateLimitDescriptor, RateLimitRequest, rate_limit_descriptor::Entry};
use tonic::transport::Channel;

/// What to do for one job, as sluice (or its absence) decides.
enum Verdict {
    Go,
    WaitFor(Duration),
    Unavailable(String),
}

async fn ask(client: &mut RateLimitServiceClient<Channel>, tenant: &str) -> Verdict {
    let request = RateLimitRequest {
        domain: "jobs".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "tenant".into(),
                value: tenant.into(),
            }],
            ..RateLimitDescriptor::default()
        }],
        hits_addend: 1,
    };
    let mut call = tonic::Request::new(request);
    call.set_timeout(Duration::from_millis(50));
    match client.should_rate_limit(call).await {
        Ok(answer) => {
            let answer = answer.into_inner();
            if answer.overall_code == Code::OverLimit as i32 {
                let wait = answer
                    .statuses
                    .iter()
                    .filter(|s| s.code == Code::OverLimit as i32)
                    .filter_map(|s| s.duration_until_reset.as_ref())
                    .map(|d| Duration::from_secs(u64::try_from(d.seconds).unwrap_or(0)))
                    .max()
                    .unwrap_or(Duration::from_secs(1));
                Verdict::WaitFor(wait.max(Duration::from_millis(100)))
            } else {
                Verdict::Go
            }
        }
        Err(status) => Verdict::Unavailable(status.to_string()),
    }
}

/// A jitter fraction in [0, 0.5) that differs between calls and processes.
fn jitter() -> f64 {
    use std::hash::BuildHasher;
    let bits = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
    (bits >> 11) as f64 / (1u64 << 53) as f64 / 2.0
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:8081".into());
    let tenant = args.next().unwrap_or_else(|| "acme".into());
    let jobs: u32 = args.next().map_or(Ok(20), |n| n.parse())?;
    let channel = Channel::from_shared(url)?.connect_lazy();
    let mut client = RateLimitServiceClient::new(channel);
    let started = Instant::now();
    let mut done = 0;
    while done < jobs {
        match ask(&mut client, &tenant).await {
            Verdict::Go => {
                done += 1;
                println!("{:>6.2}s job {done} done", started.elapsed().as_secs_f64());
            }
            Verdict::WaitFor(wait) => {
                let wait = wait.mul_f64(1.0 + jitter());
                println!(
                    "{:>6.2}s over the limit; retrying in {wait:.2?}",
                    started.elapsed().as_secs_f64()
                );
                tokio::time::sleep(wait).await;
            }
            Verdict::Unavailable(why) => {
                // Fail open (see the module documentation), and say so.
                done += 1;
                println!(
                    "{:>6.2}s sluice unavailable ({why}); job {done} done anyway",
                    started.elapsed().as_secs_f64()
                );
            }
        }
    }
    Ok(())
}
