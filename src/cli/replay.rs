//! `sluice replay`: a trace or a built-in scenario through the policies, printed as tables or
//! JSON and optionally drawn as SVG.

use std::process::ExitCode;

use super::{ReplayArgs, fail};
use crate::lab::{self, Source};

/// Runs `sluice replay`.
#[must_use]
pub fn run(args: &ReplayArgs) -> ExitCode {
    let own = args.policies.is_none() && args.config.is_none();
    let set = match args.scenario {
        Some(s) if own => match s.policies() {
            Ok(set) => set,
            Err(e) => return fail(&e, ExitCode::FAILURE),
        },
        _ => match super::policies(args.config.as_deref(), args.policies.clone()) {
            Ok(p) => p.set,
            Err(code) => return code,
        },
    };
    let (source, title) = match (args.scenario, &args.trace) {
        (Some(s), _) => (Source::Scenario(s), s.command().to_string()),
        (None, Some(path)) => (
            Source::Trace(path),
            format!("sluice replay {}", path.display()),
        ),
        (None, None) => return fail(&"give a trace or --scenario", ExitCode::from(2)),
    };
    let report = match lab::replay(set, source) {
        Ok(r) => r,
        Err(e) => return fail(&e, ExitCode::from(2)),
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
    } else {
        print!("{}", lab::render(&report));
    }
    if let Some(svg) = &args.svg
        && let Err(e) = lab::svg::draw(&report, svg, &title)
    {
        return fail(&e, ExitCode::FAILURE);
    }
    ExitCode::SUCCESS
}
