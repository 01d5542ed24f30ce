//! `sluice check`: validate settings and policies, and print each limited rule's guarantee
//! (and, for a rule that delays, whether Envoy's rate-limit filter waits long enough).

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
        hold_margin_nanos,
    } = match super::policies(args.config.as_deref(), dir) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let report = CheckReport::new(&dir, &set)
        .with_lease(lease_max_age_nanos)
        .with_rlqs(rlqs_ttl_nanos)
        .with_filter_timeout(args.filter_timeout, hold_margin_nanos);
    if args.json {
        println!("{}", report.json());
    } else {
        print!("{}", report.render());
        for w in report.warnings.iter().chain(&report.timeout_warnings) {
            eprintln!("sluice: warning: {w}");
        }
    }
    if args.strict && !(report.warnings.is_empty() && report.timeout_warnings.is_empty()) {
        let n = report.warnings.len();
        if n > 0 {
            eprintln!("sluice: --strict: {n} rule(s) inherit their burst");
        }
        let n = report.timeout_warnings.len();
        if n > 0 {
            eprintln!("sluice: --strict: {n} delaying rule(s) do not fit the filter timeout");
        }
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
