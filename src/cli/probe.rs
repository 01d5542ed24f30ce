//! `sluice probe`: the flags as a [`ProbeConfig`], one run on a fresh runtime, and its report
//! printed as text or JSON.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use super::{ProbeArgs, fail};
use crate::probe::{self, ProbeConfig};

/// Runs `sluice probe`.
#[must_use]
pub fn run(args: &ProbeArgs) -> ExitCode {
    let config = match ProbeConfig::new(&args.addr, &args.domain, &args.descriptors) {
        Ok(c) => c,
        Err(e) => return fail(&e, ExitCode::from(2)),
    }
    .hits_addend(args.hits_addend)
    .paced(
        args.rate,
        args.concurrency,
        Duration::from_secs_f64(args.duration),
        args.requests,
    )
    .timeout(Duration::from_millis(args.timeout_ms))
    // JSON on standard output still shows progress to a person watching standard error.
    .progress(!args.json || std::io::stderr().is_terminal());
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => return fail(&e, ExitCode::FAILURE),
    };
    match runtime.block_on(probe::run(config)) {
        Ok(report) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).unwrap_or_default()
                );
            } else {
                print!("{}", report.render());
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e, ExitCode::FAILURE),
    }
}
