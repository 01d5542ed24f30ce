//! The stampede lab, behind `sluice check` and `sluice replay`: what a policy promises
//! ([`guarantee`]), and what it and the usual alternatives ([`algorithms`]) actually let through
//! on a trace ([`trace`]) or a built-in scenario ([`scenario`]), replayed through the server's
//! own decider ([`mod@replay`]) and drawn as a chart ([`svg`]); a rule's `delay` is replayed by
//! a model of its own ([`delay`]). A token trace, whose costs are
//! reported after the work, is replayed with GCRA and the reference's fixed window only. The lab never serves and never
//! touches a network; a trace line is read by the admin port's own `/json` parser
//! ([`crate::wire::json`]), so it means exactly what the admin port would take it to.

pub mod algorithms;
pub mod delay;
pub mod guarantee;
pub mod replay;
pub mod scenario;
pub mod svg;
pub mod trace;

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::limiter::gcra::NANOS_PER_SEC;
use crate::policy::PolicySet;

pub use guarantee::{CheckReport, Guarantee, guarantees};
pub use replay::{Algorithm, Lab, ReplayError, Report};
pub use scenario::Scenario;
pub use trace::{Event, TraceError, TraceReader, Usage};

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A request of the trace was refused.
    #[error("{}:{line}: {source}", path.display())]
    Request {
        /// The trace.
        path: std::path::PathBuf,
        /// Its line.
        line: u64,
        /// Why.
        source: ReplayError,
    },
    /// The built-in scenario failed.
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// The chart could not be drawn or written.
    #[error("{0}")]
    Svg(String),
}

/// Replays a whole trace through every algorithm, or through [`Algorithm::TOKENS`] when its
/// first request has its cost reported after the work (a token trace), showing progress on
/// stderr.
///
/// # Errors
///
/// [`LabError`] naming the first bad line.
pub fn replay_trace(policies: PolicySet, mut trace: TraceReader) -> Result<Report, LabError> {
    let path = trace.path().to_path_buf();
    let mut next = trace.next().transpose()?;
    let tokens = next.as_ref().is_some_and(|e| e.usage.is_some());
    let algorithms: &[Algorithm] = if tokens {
        &Algorithm::TOKENS
    } else {
        &Algorithm::ALL
    };
    let mut lab = Lab::new(policies, algorithms);
    let mut progress = Progress::new();
    while let Some(event) = next {
        let verdicts = match event.usage {
            Some(usage) => lab.offer_usage(event.t, &event.request, usage),
            None => lab.offer(event.t, &event.request),
        };
        verdicts.map_err(|source| LabError::Request {
            path: path.clone(),
            line: trace.lines_read(),
            source,
        })?;
        progress.tick(trace.lines_read(), event.t);
        next = trace.next().transpose()?;
    }
    progress.done();
    Ok(lab.finish()?)
}

/// What to replay.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// A built-in scenario.
    Scenario(Scenario),
    /// A trace file (`-` for standard input).
    Trace(&'a Path),
}

/// Replays `source` through `policies` with every algorithm.
///
/// # Errors
///
/// [`LabError`] naming the first bad line of a trace.
pub fn replay(policies: PolicySet, source: Source<'_>) -> Result<Report, LabError> {
    match source {
        Source::Scenario(s) => Ok(scenario::run(s, |algorithms| {
            Lab::new(policies.clone(), algorithms)
        })?),
        Source::Trace(path) => replay_trace(policies, TraceReader::open(path)?),
    }
}

/// A progress line on stderr: rewritten in place on a terminal (4 times a second), else a
/// line every 10 s; nothing for a replay that ends sooner.
#[derive(Debug)]
struct Progress {
    tty: bool,
    start: Instant,
    last: Instant,
    every: Duration,
    shown: bool,
}

impl Progress {
    fn new() -> Self {
        let tty = std::io::stderr().is_terminal();
        let now = Instant::now();
        Self {
            tty,
            start: now,
            last: now,
            every: Duration::from_millis(if tty { 250 } else { 10_000 }),
            shown: false,
        }
    }

    fn tick(&mut self, lines: u64, t: u64) {
        if !lines.is_multiple_of(4096) || self.last.elapsed() < self.every {
            return;
        }
        self.last = Instant::now();
        let line = format!(
            "replay: {lines} lines, trace at {} s, {:.0} s elapsed",
            trace::seconds(t - t % NANOS_PER_SEC),
            self.start.elapsed().as_secs_f64()
        );
        if self.tty {
            eprint!("\r\x1b[2K{line}");
        } else {
            eprintln!("{line}");
        }
        self.shown = true;
    }

    fn done(&mut self) {
        if self.shown && self.tty {
            eprintln!();
        }
    }
}

/// A rule of a token trace: calls admitted and refused at their check, and the tokens they
/// spent, reported at their end, or would have spent.
fn render_tokens(out: &mut String, rule: &replay::RuleReport) {
    let _ = writeln!(
        out,
        "  {:<15} {:>7} {:>7} {:>8} {:>8} {:>9} {:>13}",
        "algorithm", "calls", "refused", "spent", "refused", "worst 1s", "worst period"
    );
    for a in Algorithm::EVERY {
        let Some(t) = rule.algorithms.get(a) else {
            continue;
        };
        let calls = t.calls.unwrap_or_default();
        let _ = writeln!(
            out,
            "  {:<15} {:>7} {:>7} {:>8} {:>8} {:>9} {:>13}",
            a.name(),
            calls.admitted,
            calls.denied,
            t.admitted,
            t.denied,
            t.worst_second,
            t.worst_period
        );
    }
}

/// The report as tables, one per rule.
#[must_use]
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    for rule in &report.rules {
        let period = match rule.period_seconds {
            1 => "second".to_string(),
            60 => "minute".to_string(),
            3_600 => "hour".to_string(),
            86_400 => "day".to_string(),
            s => guarantee::duration(s * NANOS_PER_SEC),
        };
        let name = if rule.name.is_empty() {
            String::new()
        } else {
            format!(" ({})", rule.name)
        };
        let delay = if rule.delay_ns > 0 {
            format!(", delay {}", guarantee::duration(rule.delay_ns))
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "{}{name}: {} per {period}, burst {} ({}){delay}",
            rule.path,
            rule.limit,
            rule.burst,
            if rule.burst_set { "set" } else { "inherited" }
        );
        if report.tokens {
            render_tokens(&mut out, rule);
            continue;
        }
        let _ = writeln!(
            out,
            "  {:<15} {:>9} {:>9} {:>9} {:>13} {:>14}",
            "algorithm", "admitted", "denied", "worst 1s", "worst period", "offered in 1s"
        );
        for a in Algorithm::EVERY {
            let Some(t) = rule.algorithms.get(a) else {
                continue;
            };
            let _ = writeln!(
                out,
                "  {:<15} {:>9} {:>9} {:>9} {:>13} {:>14}",
                a.name(),
                t.admitted,
                t.denied,
                t.worst_second,
                t.worst_period,
                t.offered_worst_second
            );
        }
        for a in Algorithm::EVERY {
            if let Some(w) = rule.algorithms.get(a).and_then(|t| t.waits) {
                let _ = writeln!(
                    out,
                    "  {}: {} admitted at their slot, waiting {} on average and {} at most",
                    a.name(),
                    w.delayed,
                    guarantee::duration(w.mean_ns),
                    guarantee::duration(w.longest_ns)
                );
            }
        }
    }
    out
}
