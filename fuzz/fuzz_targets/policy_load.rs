//! Policy files: arbitrary text through `sluice::policy::load_str`. Up to four files, split at
//! NUL bytes, loaded apart and (with two or more) with merged domains.
//!
//! Beyond "no panic", every rule the loader accepts must have the quota its numbers say,
//! computed here in u128 so nothing wraps: period `P = unit × unit_multiplier × 1e9 ns`,
//! interval `ceil(P / requests_per_unit)`, tolerance `interval × burst`. Accepted sets also go
//! through `sluice check`'s report, as an operator's files would.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::lab::CheckReport;
use sluice::policy::{Limit, PolicySet, load_str_with};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let names: Vec<String> = (0..4).map(|i| format!("f{i}.yaml")).collect();
    let sources: Vec<(&str, &str)> = text
        .splitn(4, '\0')
        .zip(&names)
        .map(|(t, n)| (n.as_str(), t))
        .collect();
    let merges: &[bool] = if sources.len() > 1 {
        &[false, true]
    } else {
        &[false]
    };
    for &merge in merges {
        match load_str_with(&sources, merge) {
            Ok(set) => accepted(&set),
            Err(e) => drop(e.to_string()),
        }
    }
});

fn accepted(set: &PolicySet) {
    for domain in set.domains() {
        for rule in domain.rules() {
            let Limit::Limited(rate) = rule.limit else {
                continue;
            };
            let q = rate.quota;
            let period =
                u128::from(rate.unit.seconds()) * u128::from(rate.unit_multiplier) * 1_000_000_000;
            let at = || format!("{}: {} {:?}", domain.name(), rule.path, rate);
            // A ban's period is its retry hint, so it must not wrap either.
            assert_eq!(u128::from(q.period()), period, "period of {}", at());
            if rate.requests_per_unit == 0 {
                assert!(q.is_ban(), "requests_per_unit 0 is a ban: {}", at());
                continue;
            }
            let interval = period.div_ceil(u128::from(rate.requests_per_unit));
            assert_eq!(u128::from(q.interval()), interval, "interval of {}", at());
            assert_eq!(q.burst(), u64::from(rate.burst), "burst of {}", at());
            assert_eq!(
                u128::from(q.tolerance()),
                interval * u128::from(rate.burst),
                "tolerance of {}",
                at()
            );
        }
    }
    let report = CheckReport::new("fuzz", set);
    drop(report.render());
    drop(report.json());
    drop(report.with_lease(Some(250_000_000)).render());
}
