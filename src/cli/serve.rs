//! `sluice serve`: settings from every source, logging, then the [`App`] on a multi-threaded
//! runtime until SIGTERM or SIGINT. Also the binary invoked as `ratelimit`, which serves with
//! envoyproxy/ratelimit's environment and no command line.

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;

use super::{ServeArgs, fail};
use crate::app::{App, AppError};
use crate::settings::{Compat, Overrides, Settings};
use crate::{shutdown, telemetry};

/// Runs `sluice serve` (and `sluice` alone).
#[must_use]
pub fn run(args: &ServeArgs) -> ExitCode {
    serve(args.config.as_deref(), &args.into(), None)
}

/// Runs the binary invoked as `ratelimit`: `compat: envoy-ratelimit` whatever `SLUICE_COMPAT`
/// says, no settings file, and `ignored` (its arguments) logged as unread, as envoyproxy/ratelimit
/// reads none (AI Gateway passes `--quotaRateLimitServiceAddr=...`).
#[must_use]
pub fn run_as_reference(ignored: &[OsString]) -> ExitCode {
    let overrides = Overrides {
        compat: Some(Compat::EnvoyRatelimit),
        ..Overrides::default()
    };
    serve(None, &overrides, Some(ignored))
}

fn serve(config: Option<&Path>, overrides: &Overrides, ignored: Option<&[OsString]>) -> ExitCode {
    let settings = match Settings::load(config, overrides) {
        Ok(s) => s,
        Err(e) => return fail(&e, ExitCode::from(2)),
    };
    telemetry::init(settings.log_format, &settings.log_level);
    tracing::info!(version = env!("CARGO_PKG_VERSION"), "starting sluice");
    if let Some(ignored) = ignored {
        let args: Vec<_> = ignored.iter().map(|a| a.to_string_lossy()).collect();
        tracing::info!(
            ?args,
            "invoked as ratelimit: envoyproxy/ratelimit's environment is read, arguments are ignored"
        );
    }
    for line in settings.summary() {
        tracing::info!("{line}");
    }
    tracing::debug!(?settings, "settings");
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
