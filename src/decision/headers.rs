//! Response headers and bodies sluice adds for Envoy to pass on (`response_headers_to_add`,
//! `raw_body`): the IETF `RateLimit-Policy`/`RateLimit` fields (draft-ietf-httpapi-ratelimit-
//! headers), or the reference service's `RateLimit-Limit/-Remaining/-Reset`, for the most
//! constrained limit; `Retry-After` on denials, never earlier than the exact wait and spread
//! upward by a jitter so refused clients do not return in lockstep; and an RFC 9457
//! problem+json body for denials.

use serde::{Deserialize, Serialize};

use super::{Code, Decision, Status};

/// Which rate-limit header fields to add.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum HeaderMode {
    /// None (Envoy can still build `x-ratelimit-*` itself from the statuses).
    #[default]
    None,
    /// `RateLimit-Policy` and `RateLimit` (IETF draft, structured fields).
    Draft,
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (envoyproxy/ratelimit), or
    /// the names [`LegacyNames`] gives.
    Legacy,
}

/// The names of the `legacy` fields: envoyproxy/ratelimit's by default, renamed as its
/// `LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER` and `LIMIT_RESET_HEADER` allow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LegacyNames {
    /// The limit's `requests_per_unit`.
    pub limit: String,
    /// Requests left.
    pub remaining: String,
    /// Seconds until the limit resets.
    pub reset: String,
}

impl Default for LegacyNames {
    fn default() -> Self {
        Self {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }
}

/// What to add to responses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeaderOptions {
    /// Which rate-limit fields.
    pub mode: HeaderMode,
    /// The names of the `legacy` fields.
    pub legacy_names: LegacyNames,
    /// Most seconds added to `Retry-After` (uniformly spread, 0 for none).
    pub retry_after_jitter_seconds: u64,
    /// Add an RFC 9457 problem+json body to denials.
    pub problem_body: bool,
}

/// Headers and body for one response.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Extras {
    /// (name, value) pairs, in order.
    headers: Vec<(String, String)>,
    /// A body for a denial (`raw_body`), empty for none.
    body: Vec<u8>,
}

/// Adds `decision`'s headers and body as `options` ask, with a fresh jitter.
pub(super) fn add(decision: &mut Decision, options: &HeaderOptions) {
    if options.mode == HeaderMode::None && !options.problem_body {
        return;
    }
    let jitter = if decision.overall == Code::OverLimit && options.retry_after_jitter_seconds > 0 {
        random_unit()
    } else {
        0.0
    };
    let extras = extras(decision, options, jitter);
    decision.headers = extras.headers;
    decision.body = extras.body;
}

/// The headers and body for `resp`; `jitter` is a number in `[0, 1)` drawn for this response.
fn extras(resp: &Decision, options: &HeaderOptions, jitter: f64) -> Extras {
    let mut out = Extras::default();
    let limited: Vec<&Status> = resp.statuses.iter().filter(|s| s.limit.is_some()).collect();
    // The most constrained limit, ranked as a descriptor's own limits are: over the limit
    // first, then the fewest remaining (as Envoy picks), then the longest wait; the first on a
    // tie.
    let rank = |s: &Status| {
        (
            s.code == Code::OverLimit,
            std::cmp::Reverse(s.remaining),
            s.reset_seconds,
        )
    };
    let tightest = limited
        .iter()
        .copied()
        .reduce(|a, b| if rank(b) > rank(a) { b } else { a });
    if let Some(s) = tightest {
        let Some(limit) = &s.limit else { return out };
        let window = limit.rate.unit.seconds() * u64::from(limit.rate.unit_multiplier);
        let reset = s.reset_seconds.unwrap_or(0);
        match options.mode {
            HeaderMode::None => {}
            HeaderMode::Draft => {
                let name = sf_string(&policy_name(s));
                out.headers.push((
                    "RateLimit-Policy".into(),
                    format!("{name};q={};w={window}", limit.rate.requests_per_unit),
                ));
                out.headers.push((
                    "RateLimit".into(),
                    format!("{name};r={};t={reset}", s.remaining),
                ));
            }
            HeaderMode::Legacy => {
                let names = &options.legacy_names;
                out.headers.push((
                    names.limit.clone(),
                    limit.rate.requests_per_unit.to_string(),
                ));
                out.headers
                    .push((names.remaining.clone(), s.remaining.to_string()));
                out.headers.push((names.reset.clone(), reset.to_string()));
            }
        }
    }
    if resp.overall == Code::OverLimit {
        let over: Vec<&Status> = limited
            .iter()
            .copied()
            .filter(|s| s.code == Code::OverLimit)
            .collect();
        // The longest exact wait, in whole seconds rounded up, at least 1.
        let wait = over
            .iter()
            .filter_map(|s| s.reset_seconds)
            .max()
            .unwrap_or(0)
            .max(1);
        // Truncation intended: a whole number of extra seconds in [0, jitter].
        let extra =
            (jitter.clamp(0.0, 1.0) * (options.retry_after_jitter_seconds + 1) as f64) as u64;
        let extra = extra.min(options.retry_after_jitter_seconds);
        out.headers
            .push(("Retry-After".into(), (wait + extra).to_string()));
        if options.problem_body {
            let violated: Vec<String> = over.iter().map(|s| policy_name(s)).collect();
            let body = serde_json::json!({
                "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
                "title": "Request cannot be satisfied as assigned quota has been exceeded",
                "status": 429,
                "violated-policies": violated,
            });
            out.body = body.to_string().into_bytes();
            out.headers
                .push(("content-type".into(), "application/problem+json".into()));
        }
    }
    out
}

/// A limit's name for headers: its configured name, else its path in the policy, else
/// `override` for a request's own limit.
fn policy_name(s: &Status) -> String {
    match s.limit.as_ref().and_then(|l| l.rule.as_ref()) {
        Some(rule) => rule.name.clone().unwrap_or_else(|| rule.stats_key.clone()),
        None => "override".into(),
    }
}

/// A number in `[0, 1)`, different for each call (for jitter, not for secrets).
fn random_unit() -> f64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    // Relaxed: only needs to differ between calls.
    let n = CALLS.fetch_add(1, Ordering::Relaxed);
    let bits = std::collections::hash_map::RandomState::new().hash_one(n);
    // The top 53 bits as a fraction; the precision loss is the point.
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// An RFC 9651 String: printable ASCII in quotes, `"` and `\` escaped, anything else replaced.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_over_limit_status_wins_the_headers_over_one_with_fewer_left() {
        use crate::decision::AppliedLimit;
        use crate::policy::{Rate, Unit};
        let status = |code, rpu, remaining, reset| Status {
            code,
            limit: Some(AppliedLimit {
                rate: Rate::per_unit(rpu, Unit::Minute),
                rule: None,
            }),
            remaining,
            reset_seconds: Some(reset),
        };
        let legacy = HeaderOptions {
            mode: HeaderMode::Legacy,
            ..HeaderOptions::default()
        };
        let limit = |statuses: Vec<Status>, overall| {
            let d = Decision {
                overall,
                statuses,
                headers: Vec::new(),
                body: Vec::new(),
                dynamic_metadata: None,
                trace: None,
                hold: None,
            };
            let e = extras(&d, &legacy, 0.0);
            e.headers
                .iter()
                .find(|(n, _)| n == "RateLimit-Limit")
                .map(|(_, v)| v.clone())
        };
        // A cost of 5 with 3 left is refused, though another limit has only 1 left.
        let refused = status(Code::OverLimit, 10, 3, 2);
        let tight = status(Code::Ok, 5, 1, 30);
        assert_eq!(
            limit(vec![tight.clone(), refused], Code::OverLimit).as_deref(),
            Some("10")
        );
        // Equal remaining: the longer wait; equal all through: the first.
        let long = status(Code::Ok, 7, 1, 90);
        assert_eq!(
            limit(vec![tight.clone(), long], Code::Ok).as_deref(),
            Some("7")
        );
        let twin = status(Code::Ok, 8, 1, 30);
        assert_eq!(limit(vec![tight, twin], Code::Ok).as_deref(), Some("5"));
    }

    #[test]
    fn sf_strings_are_escaped_and_ascii() {
        assert_eq!(sf_string("per-ip"), "\"per-ip\"");
        assert_eq!(sf_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
        assert_eq!(sf_string("naïve"), "\"na_ve\"");
    }
}
