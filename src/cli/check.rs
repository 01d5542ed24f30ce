//! `sluice check`: validate settings and policies, and print each limited rule's guarantee.

use std::process::ExitCode;

use super::{CheckArgs, Policies};
use crate::lab::CheckReport;

/// Runs `sluice check`.
#[must_use]
pub fn run(args: &CheckArgs) -> ExitCode {
    let dir = args.path.clone().or_else(|| args.policies.clone());
    let Policies {
        dir,
        set,
        lease_max_age_nanos,
        rlqs_ttl_nanos,
    } = match super::policies(args.config.as_deref(), dir) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let report = CheckReport::new(&dir, &set)
        .with_lease(lease_max_age_nanos)
        .with_rlqs(rlqs_ttl_nanos);
    if args.json {
        println!("{}", report.json());
    } else {
        print!("{}", report.render());
        for w in &report.warnings {
            eprintln!("sluice: warning: {w}");
        }
    }
    if args.strict && !report.warnings.is_empty() {
        let n = report.warnings.len();
        eprintln!("sluice: --strict: {n} rule(s) inherit their burst");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
