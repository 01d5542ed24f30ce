//! The `sluice` binary: parse the command line, load settings, then serve, check, replay or
//! probe. Exit status: 0 clean, 1 runtime failure (or `check --strict` with a warning), 2
//! invalid settings, policies or input.

use std::process::ExitCode;

use clap::Parser;
use sluice::app::{self, App, AppError};
use sluice::lab::{self, CheckReport, Source};
use sluice::policy::PolicySet;
use sluice::probe::{self, ProbeConfig};
use sluice::settings::{CheckArgs, Cli, Command, ProbeArgs, ReplayArgs, ServeArgs, Settings};
use sluice::{shutdown, telemetry};

#[global_allocator]
static ALLOCATOR: sluice::allocator::Allocator = sluice::allocator::ALLOCATOR;

fn main() -> ExitCode {
    sluice::tls::install_crypto_provider();
    match Cli::parse()
        .command
        .unwrap_or(Command::Serve(ServeArgs::default()))
    {
        Command::Check(args) => check(&args),
        Command::Serve(args) => serve(&args),
        Command::Replay(args) => replay(&args),
        Command::Probe(args) => probe(&args),
    }
}

/// The policies named by `--config`/`--policies`, with the directory they came from.
fn policies(
    config: Option<&std::path::Path>,
    dir: Option<std::path::PathBuf>,
) -> Result<(String, PolicySet, Option<u64>), ExitCode> {
    let flags = ServeArgs {
        policies: dir,
        ..ServeArgs::default()
    };
    let settings = Settings::load(config, &flags).map_err(|e| fail(&e, ExitCode::from(2)))?;
    for warning in &settings.compat_warnings {
        eprintln!("sluice: warning: {warning}");
    }
    let set = app::check(&settings).map_err(|e| fail(&e, ExitCode::from(2)))?;
    let lease = settings.lease.map(|l| l.max_age_nanos());
    Ok((settings.policies.display().to_string(), set, lease))
}

fn check(args: &CheckArgs) -> ExitCode {
    let dir = args.path.clone().or_else(|| args.policies.clone());
    let (name, set, lease) = match policies(args.config.as_deref(), dir) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let report = CheckReport::new(&name, &set).with_lease(lease);
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

fn replay(args: &ReplayArgs) -> ExitCode {
    let own = args.policies.is_none() && args.config.is_none();
    let set = match args.scenario {
        Some(s) if own => match s.policies() {
            Ok(set) => set,
            Err(e) => return fail(&e, ExitCode::FAILURE),
        },
        _ => match policies(args.config.as_deref(), args.policies.clone()) {
            Ok((_, set, _)) => set,
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

fn probe(args: &ProbeArgs) -> ExitCode {
    let descriptors = match args
        .descriptors
        .iter()
        .map(|d| probe::parse_descriptor(d))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(d) => d,
        Err(e) => return fail(&e, ExitCode::from(2)),
    };
    let by_time = (f64::from(args.rate) * args.duration).ceil() as u64;
    let config = ProbeConfig {
        endpoint: probe::endpoint(&args.addr),
        request: sluice::pb::RateLimitRequest {
            domain: args.domain.clone(),
            descriptors,
            hits_addend: args.hits_addend,
        },
        rate: args.rate,
        concurrency: args.concurrency,
        duration: std::time::Duration::from_secs_f64(args.duration),
        calls: args.requests.map_or(by_time, |n| n.min(by_time)),
        timeout: std::time::Duration::from_millis(args.timeout_ms),
        progress: !args.json || std::io::IsTerminal::is_terminal(&std::io::stderr()),
    };
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

fn serve(args: &ServeArgs) -> ExitCode {
    let settings = match Settings::load(args.config.as_deref(), args) {
        Ok(s) => s,
        Err(e) => return fail(&e, ExitCode::from(2)),
    };
    telemetry::init(settings.log_format, &settings.log_level);
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        ?settings,
        "starting sluice"
    );
    for warning in &settings.compat_warnings {
        tracing::warn!(compat = "envoy-ratelimit", "{warning}");
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => return fail(&e, ExitCode::FAILURE),
    };
    let result = runtime.block_on(async {
        let app = App::bind(settings).await?;
        app.run(shutdown::signal()).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ AppError::Policy(_)) => fail(&e, ExitCode::from(2)),
        Err(e) => fail(&e, ExitCode::FAILURE),
    }
}

fn fail(err: &dyn std::fmt::Display, code: ExitCode) -> ExitCode {
    eprintln!("sluice: {err}");
    code
}
