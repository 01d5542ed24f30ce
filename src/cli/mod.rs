//! The command line: clap's model of `sluice` and its five subcommands, one module each with a
//! `run(args) -> ExitCode`. The top of the library: `main` dispatches here and nothing in the
//! library imports it. It turns flags into the lower modules' own values (`serve`'s overlay
//! becomes [`settings::Overrides`]) and prints; the work is theirs. Exit status: 0 clean, 1
//! runtime failure (or `check --strict` with a warning), 2 invalid settings, policies or input.
//! Invoked as `ratelimit` (envoyproxy/ratelimit's binary name) there is no command line: it
//! serves in `compat: envoy-ratelimit` and ignores its arguments, as that service does.

pub mod check;
pub mod probe;
pub mod replay;
pub mod serve;
pub mod top;

use std::ffi::OsStr;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::builder::PossibleValue;
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::app;
use crate::decision::{HeaderMode, OnBackendError};
use crate::policy::PolicySet;
use crate::settings::{self, BackendKind, Settings};
use crate::telemetry::LogFormat;

/// The file name envoyproxy/ratelimit's image runs its binary under (`/bin/ratelimit`), as
/// Envoy Gateway's Deployment starts it: invoked under it, sluice serves as that service does,
/// reading its environment and ignoring its arguments ([`serve::run_as_reference`]).
pub const REFERENCE_NAME: &str = "ratelimit";

/// Whether `argv0` (the program as invoked) is named [`REFERENCE_NAME`], whatever its directory.
#[must_use]
pub fn invoked_as_reference(argv0: &OsStr) -> bool {
    Path::new(argv0).file_name() == Some(OsStr::new(REFERENCE_NAME))
}

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "sluice",
    version,
    about = "A GCRA rate-limit server for Envoy's RateLimitService API"
)]
pub struct Cli {
    /// What to do; `serve` when omitted.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server (the default).
    Serve(ServeArgs),
    /// Validate settings and policies; print each limited rule's guarantee and a summary.
    ///
    /// Exits 0 when valid, 1 when valid but `--strict` and a burst is inherited, 2 when invalid.
    Check(CheckArgs),
    /// Replay a trace or a built-in scenario: what GCRA and three other counters let through.
    ///
    /// The requests run through the policies with sluice's own decision code on the trace's
    /// clock, beside an epoch-aligned fixed window, a sliding log and a sliding-window counter
    /// of the same limits.
    Replay(ReplayArgs),
    /// Load a running rate-limit service and report what it answered.
    ///
    /// Real `ShouldRateLimit` calls, paced and bounded in count and time; at the end a
    /// per-second timeline of OK and OVER_LIMIT, call latency and the rate-limit headers seen.
    Probe(ProbeArgs),
    /// Who is being limited on a running server: its `/limited`, refreshed in the terminal.
    Top(TopArgs),
}

impl Default for Command {
    /// `sluice` alone serves.
    fn default() -> Self {
        Self::Serve(ServeArgs::default())
    }
}

/// Flags of `sluice serve`.
#[derive(Debug, Default, Args)]
pub struct ServeArgs {
    /// Settings file (YAML).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Directory of policy files.
    #[arg(long, value_name = "DIR")]
    pub policies: Option<PathBuf>,
    /// gRPC listen address (port 0 picks a free port).
    #[arg(long, value_name = "HOST:PORT")]
    pub grpc_addr: Option<SocketAddr>,
    /// HTTP admin listen address (port 0 picks a free port).
    #[arg(long, value_name = "HOST:PORT")]
    pub admin_addr: Option<SocketAddr>,
    /// Log format.
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// Log level or filter directives (overridden by `RUST_LOG`).
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Most counters the in-memory store holds.
    #[arg(long, value_name = "N")]
    pub max_keys: Option<usize>,
    /// Where counters live: `memory` (this node) or `redis` (shared by several nodes).
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// Redis URL(s), comma-separated (the seed nodes of a cluster).
    #[arg(long, value_name = "URL")]
    pub redis_url: Option<String>,
    /// The answer when the backend cannot decide.
    #[arg(long, value_enum)]
    pub on_backend_error: Option<OnBackendError>,
    /// Rate-limit header fields to add to responses.
    #[arg(long, value_enum)]
    pub response_headers: Option<HeaderMode>,
}

impl From<&ServeArgs> for settings::Overrides {
    fn from(args: &ServeArgs) -> Self {
        Self {
            compat: None,
            policies: args.policies.clone(),
            grpc_addr: args.grpc_addr,
            admin_addr: args.admin_addr,
            log_format: args.log_format,
            log_level: args.log_level.clone(),
            max_keys: args.max_keys,
            backend: args.backend,
            redis_url: args.redis_url.clone(),
            on_backend_error: args.on_backend_error,
            response_headers: args.response_headers,
        }
    }
}

/// `--backend`'s values, spelled as the `backend` setting spells them.
impl ValueEnum for BackendKind {
    fn value_variants<'a>() -> &'a [Self] {
        &[Self::Memory, Self::Redis]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            Self::Memory => PossibleValue::new("memory").help("In this process's memory"),
            Self::Redis => PossibleValue::new("redis")
                .help("In Redis (single node or cluster), shared by every node pointed at it"),
        })
    }
}

/// Flags of `sluice check`.
#[derive(Debug, Default, Args)]
pub struct CheckArgs {
    /// Settings file (YAML).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Directory of policy files.
    #[arg(long, value_name = "DIR")]
    pub policies: Option<PathBuf>,
    /// Directory of policy files (same as `--policies`).
    #[arg(value_name = "PATH", conflicts_with = "policies")]
    pub path: Option<PathBuf>,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
    /// Exit 1 when any limited rule inherits its burst, or a delaying rule's longest hold does
    /// not fit the filter timeout.
    #[arg(long)]
    pub strict: bool,
    /// The `timeout` of Envoy's rate-limit filter in front of sluice (e.g. `300ms`, `1s`),
    /// which a delaying rule's `delay` must fit; Envoy's default, 20ms, when not given.
    #[arg(long, value_name = "DURATION", value_parser = parse_timeout)]
    pub filter_timeout: Option<u64>,
}

/// Flags of `sluice replay`.
#[derive(Debug, Default, Args)]
pub struct ReplayArgs {
    /// Settings file (YAML), for its policy directory.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Directory of policy files (a scenario's own policy when omitted with `--scenario`).
    #[arg(long, value_name = "DIR")]
    pub policies: Option<PathBuf>,
    /// The trace: JSON Lines of `POST /json` bodies with `"t"` (seconds), plain or gzip;
    /// `-` for standard input.
    #[arg(
        value_name = "TRACE",
        required_unless_present = "scenario",
        conflicts_with = "scenario"
    )]
    pub trace: Option<PathBuf>,
    /// A built-in scenario instead of a trace.
    #[arg(long, value_enum)]
    pub scenario: Option<crate::lab::Scenario>,
    /// Print one JSON document instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Also draw admitted per 100 ms for each algorithm into this SVG file.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
}

/// Flags of `sluice probe`.
#[derive(Debug, Args)]
pub struct ProbeArgs {
    /// The rate-limit service: `HOST:PORT` or an `http://` URL.
    #[arg(value_name = "ADDR")]
    pub addr: String,
    /// The request's domain.
    #[arg(long)]
    pub domain: String,
    /// A descriptor, `key=value[,key=value…]`; repeat for several.
    #[arg(long = "descriptor", value_name = "KEY=VALUE,...", required = true)]
    pub descriptors: Vec<String>,
    /// Calls per second, over all workers.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub rate: u32,
    /// Calls in flight at most.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1_024))]
    pub concurrency: u32,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 10.0, value_parser = parse_duration)]
    pub duration: f64,
    /// Stop after this many calls (default: rate × duration).
    #[arg(long, value_name = "N")]
    pub requests: Option<u64>,
    /// `hits_addend` of each call (0: the server's default of 1).
    #[arg(long, default_value_t = 0)]
    pub hits_addend: u32,
    /// Per-call timeout, in milliseconds.
    #[arg(long, default_value_t = 1_000)]
    pub timeout_ms: u64,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `sluice top`.
#[derive(Debug, Args)]
pub struct TopArgs {
    /// The server's admin port: `HOST:PORT` or an `http://` URL.
    #[arg(value_name = "ADDR")]
    pub addr: String,
    /// Seconds between polls.
    #[arg(long, default_value_t = 2.0, value_parser = parse_duration)]
    pub interval: f64,
    /// Print once and exit.
    #[arg(long)]
    pub once: bool,
}

/// A run length in seconds: more than 0, at most an hour.
fn parse_duration(s: &str) -> Result<f64, String> {
    let secs: f64 = s
        .trim_end_matches('s')
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if secs > 0.0 && secs <= 3_600.0 {
        Ok(secs)
    } else {
        Err(format!("{s} must be more than 0 and at most 3600 seconds"))
    }
}

/// A timeout as Envoy's YAML writes a duration, in whole milliseconds (`250ms`) or seconds
/// (`1s`, `0.3s`), more than 0 and at most an hour: nanoseconds.
fn parse_timeout(s: &str) -> Result<u64, String> {
    let bad = || format!("{s:?} is not a duration such as 250ms or 1s");
    let (number, per) = if let Some(ms) = s.strip_suffix("ms") {
        (ms, 1_000_000_u64)
    } else if let Some(secs) = s.strip_suffix('s') {
        (secs, 1_000_000_000)
    } else {
        return Err(bad());
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty()
        || !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return Err(bad());
    }
    let whole: u64 = whole.parse().map_err(|_| bad())?;
    // Digits past nanoseconds are dropped (a timeout is never that fine).
    let mut part = 0_u64;
    let mut scale = per;
    for b in fraction.bytes() {
        scale /= 10;
        part += u64::from(b - b'0') * scale;
    }
    let ns = whole
        .checked_mul(per)
        .and_then(|n| n.checked_add(part))
        .ok_or_else(bad)?;
    if ns == 0 || ns > 3_600 * 1_000_000_000 {
        return Err(format!("{s} must be more than 0 and at most 3600s"));
    }
    Ok(ns)
}

/// The policies `check` and `replay` read, as `--config` and the policy directory name them.
struct Policies {
    /// The directory they came from, for the report.
    dir: String,
    /// The validated set.
    set: PolicySet,
    /// With leased counting: a slice's longest life, in nanoseconds.
    lease_max_age_nanos: Option<u64>,
    /// With the quota service on: an assignment's life (`rlqs.assignment_ttl_ms`), in nanoseconds.
    rlqs_ttl_nanos: Option<u64>,
    /// How long before a caller's deadline a held answer is given, in nanoseconds.
    hold_margin_nanos: u64,
}

/// Loads the settings of `config` with `dir` over their policy directory, then their policies;
/// compat warnings go to standard error. Invalid settings or policies exit 2. With policies from
/// an xDS server and no `dir`, only the settings are checked (an empty set).
fn policies(config: Option<&Path>, dir: Option<PathBuf>) -> Result<Policies, ExitCode> {
    let explicit = dir.is_some();
    let overrides = settings::Overrides {
        compat: None,
        policies: dir,
        ..settings::Overrides::default()
    };
    let settings = Settings::load(config, &overrides).map_err(|e| fail(&e, ExitCode::from(2)))?;
    for warning in &settings.compat_warnings {
        eprintln!("sluice: warning: {warning}");
    }
    let from_xds = settings.xds.as_ref().filter(|_| !explicit);
    let set = match from_xds {
        // Nothing to read: the settings alone were checked.
        Some(xds) => {
            eprintln!(
                "sluice: policies come from the xDS server {} (policy_source: xds); pass a \
                 directory to check policy files",
                xds.authority
            );
            PolicySet::default()
        }
        None => app::load_policies(&settings).map_err(|e| fail(&e, ExitCode::from(2)))?,
    };
    Ok(Policies {
        dir: match from_xds {
            Some(xds) => format!("xds://{}", xds.authority),
            None => settings.policies.display().to_string(),
        },
        set,
        lease_max_age_nanos: settings.lease.map(|l| l.max_age_nanos()),
        rlqs_ttl_nanos: settings
            .rlqs
            .map(|q| u64::try_from(q.assignment_ttl.as_nanos()).unwrap_or(u64::MAX)),
        hold_margin_nanos: u64::try_from(settings.grpc.hold_deadline_margin.as_nanos())
            .unwrap_or(u64::MAX),
    })
}

/// Prints `err` as sluice's one-line error and gives `code`.
fn fail(err: &dyn std::fmt::Display, code: ExitCode) -> ExitCode {
    eprintln!("sluice: {err}");
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_timeout_reads_as_envoy_writes_durations() {
        assert_eq!(parse_timeout("20ms"), Ok(20_000_000));
        assert_eq!(parse_timeout("1s"), Ok(1_000_000_000));
        assert_eq!(parse_timeout("0.3s"), Ok(300_000_000));
        assert_eq!(parse_timeout("1.25s"), Ok(1_250_000_000));
        for bad in ["20", "ms", "-5ms", "1.s.s", "0ms", "3601s", "1e3ms", " 5ms"] {
            assert!(parse_timeout(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_reference_name_is_the_file_name_alone() {
        for (argv0, is) in [
            ("/bin/ratelimit", true),
            ("ratelimit", true),
            ("./target/ratelimit", true),
            ("/usr/local/bin/sluice", false),
            ("/bin/ratelimit2", false),
            ("/ratelimit/sluice", false),
        ] {
            assert_eq!(invoked_as_reference(OsStr::new(argv0)), is, "{argv0}");
        }
    }
}
