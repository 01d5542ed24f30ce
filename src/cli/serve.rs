//! `sluice serve`: settings from every source, logging, then the [`App`] on a multi-threaded
//! runtime until SIGTERM or SIGINT.

use std::process::ExitCode;

use super::{ServeArgs, fail};
use crate::app::{App, AppError};
use crate::settings::Settings;
use crate::{shutdown, telemetry};

/// Runs `sluice serve` (and `sluice` alone).
#[must_use]
pub fn run(args: &ServeArgs) -> ExitCode {
    let settings = match Settings::load(args.config.as_deref(), &args.into()) {
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
