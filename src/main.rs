//! The `sluice` binary: parse the command line, load settings, then check or serve.
//! Exit status: 0 clean, 1 runtime failure, 2 invalid settings or policies.

use std::process::ExitCode;

use clap::Parser;
use sluice::app::{self, App, AppError};
use sluice::settings::{CheckArgs, Cli, Command, ServeArgs, Settings};
use sluice::{shutdown, telemetry};

fn main() -> ExitCode {
    match Cli::parse()
        .command
        .unwrap_or(Command::Serve(ServeArgs::default()))
    {
        Command::Check(args) => check(&args),
        Command::Serve(args) => serve(&args),
    }
}

fn check(args: &CheckArgs) -> ExitCode {
    let flags = ServeArgs {
        policies: args.path.clone().or_else(|| args.policies.clone()),
        ..ServeArgs::default()
    };
    let settings = match Settings::load(args.config.as_deref(), &flags) {
        Ok(s) => s,
        Err(e) => return fail(&e, ExitCode::from(2)),
    };
    for warning in &settings.compat_warnings {
        eprintln!("sluice: warning: {warning}");
    }
    match app::check(&settings) {
        Ok(summary) => {
            println!("{}: {summary}: ok", settings.policies.display());
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e, ExitCode::from(2)),
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
