//! `sluice top ADDR`: who is being limited, in the terminal. Polls a server's `GET /limited` on
//! its admin port and prints, per rule, the admitted and refused rates since the last poll, the
//! heaviest refused keys and the keys nearest their limit: the live page's content as text.
//! Speaks plain HTTP/1.1 over one short connection per poll; reads the JSON, decides nothing.

use std::io::{IsTerminal, Read, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{TopArgs, fail};

/// Rows shown per list.
const ROWS: usize = 5;

/// Runs `sluice top`.
#[must_use]
pub fn run(args: &TopArgs) -> ExitCode {
    let addr = args
        .addr
        .trim_start_matches("http://")
        .trim_end_matches('/');
    let clear = !args.once && std::io::stdout().is_terminal();
    let mut last: Option<(Instant, Value)> = None;
    loop {
        let now = Instant::now();
        let data = match fetch(addr) {
            Ok(d) => d,
            Err(e) => {
                return fail(
                    &format!("GET http://{addr}/limited: {e}"),
                    ExitCode::FAILURE,
                );
            }
        };
        let since = last
            .as_ref()
            .map(|(t, prev)| (now.duration_since(*t).as_secs_f64(), prev));
        let text = render(addr, &data, since);
        let mut out = std::io::stdout().lock();
        if clear {
            let _ = write!(out, "\x1b[H\x1b[2J");
        }
        let _ = write!(out, "{text}");
        let _ = out.flush();
        if args.once {
            return ExitCode::SUCCESS;
        }
        last = Some((now, data));
        std::thread::sleep(Duration::from_secs_f64(args.interval));
    }
}

/// `GET /limited` on `addr`, its body parsed.
fn fetch(addr: &str) -> Result<Value, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    let timeout = Some(Duration::from_secs(5));
    s.set_read_timeout(timeout).map_err(|e| e.to_string())?;
    write!(
        s,
        "GET /limited HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let raw = String::from_utf8_lossy(&raw);
    let (head, body) = raw.split_once("\r\n\r\n").ok_or("no HTTP answer")?;
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        return Err(format!("status {status}"));
    }
    serde_json::from_str(body).map_err(|e| e.to_string())
}

/// A key's entries as `k=v, k=v`, control characters shown escaped so a value cannot move the
/// terminal's cursor.
fn key(entries: &Value) -> String {
    let pairs: Vec<String> = entries
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    let k = e["key"].as_str().unwrap_or("");
                    let v = e["value"].as_str().unwrap_or("");
                    format!("{k}={v}")
                })
                .collect()
        })
        .unwrap_or_default();
    pairs.join(", ").escape_debug().to_string()
}

fn wait(ms: u64) -> String {
    match ms {
        0 => "0".into(),
        1..=999 => format!("{ms} ms"),
        1_000..=119_999 => format!("{:.1} s", ms as f64 / 1000.0),
        _ => format!("{} min", ms.div_ceil(60_000)),
    }
}

/// The screen for `data`; with the previous poll `since` seconds ago, the rates since then.
fn render(addr: &str, data: &Value, since: Option<(f64, &Value)>) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let p = &data["policy"];
    let _ = writeln!(
        out,
        "sluice top {addr} · {}: {} · policy version {} · reloads {} (failed {})",
        data["backend"].as_str().unwrap_or("?"),
        data["view"].as_str().unwrap_or(""),
        p["version"],
        p["reloads"],
        p["reloads_failed"],
    );
    let _ = writeln!(
        out,
        "window: {}; {}",
        data["window"].as_str().unwrap_or(""),
        data["error_bound"].as_str().unwrap_or("")
    );
    let rules = data["rules"].as_array().map_or(&[][..], Vec::as_slice);
    if rules.is_empty() {
        let _ = writeln!(out, "\nno limited rule has been hit yet");
    }
    for r in rules {
        let total = |v: &Value, f: &str| v[f].as_u64().unwrap_or(0);
        let rate = |f: &str| {
            since
                .and_then(|(secs, prev)| {
                    let prev = prev["rules"]
                        .as_array()?
                        .iter()
                        .find(|x| x["domain"] == r["domain"] && x["rule"] == r["rule"])?;
                    Some(format!(
                        "{:.1}/s",
                        total(r, f).saturating_sub(total(prev, f)) as f64 / secs.max(0.001)
                    ))
                })
                .unwrap_or_else(|| "-".into())
        };
        let _ = writeln!(
            out,
            "\n{} / {} {} · admitted {} ({} total) · refused {} ({} total) · ± {} refused, ± {} hits",
            r["domain"].as_str().unwrap_or(""),
            r["rule"].as_str().unwrap_or(""),
            r["name"]
                .as_str()
                .filter(|n| !n.is_empty())
                .map(|n| format!("({n})"))
                .unwrap_or_default(),
            rate("admitted_total"),
            total(r, "admitted_total"),
            rate("refused_total"),
            total(r, "refused_total"),
            r["error_bound"]["refused"],
            r["error_bound"]["hits"],
        );
        let _ = writeln!(
            out,
            "  {:<40} {:>9} {:>6} {:>5} {:>9}",
            "top refused", "refused", "±", "left", "wait"
        );
        for k in r["top_refused"].as_array().into_iter().flatten().take(ROWS) {
            let _ = writeln!(
                out,
                "  {:<40} {:>9} {:>6} {:>5} {:>9}",
                key(&k["entries"]),
                total(k, "count"),
                total(k, "error"),
                total(k, "remaining"),
                wait(total(k, "wait_ms"))
            );
        }
        let _ = writeln!(
            out,
            "  {:<40} {:>9} {:>6} {:>5} {:>9}",
            "nearest their limit", "hits", "", "left", "wait"
        );
        for k in r["nearest_limit"]
            .as_array()
            .into_iter()
            .flatten()
            .take(ROWS)
        {
            let _ = writeln!(
                out,
                "  {:<40} {:>9} {:>6} {:>5} {:>9}",
                key(&k["entries"]),
                total(k, "hits"),
                "",
                total(k, "remaining"),
                wait(total(k, "wait_ms"))
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn data(admitted: u64, refused: u64) -> Value {
        json!({
            "backend": "memory", "view": "local", "window": "w", "error_bound": "b",
            "policy": {"version": 2, "reloads": 1, "reloads_failed": 0},
            "rules": [{
                "domain": "api", "rule": "api.user", "name": "per_user",
                "admitted_total": admitted, "refused_total": refused,
                "error_bound": {"hits": 0, "refused": 0},
                "top_refused": [{"entries": [{"key": "user", "value": "a\u{1b}[2J"}],
                                 "count": 7, "error": 0, "remaining": 0, "wait_ms": 1500}],
                "nearest_limit": [{"entries": [{"key": "user", "value": "b"}],
                                   "hits": 3, "remaining": 1, "wait_ms": 0}],
            }],
        })
    }

    #[test]
    fn shows_rates_since_the_last_poll_and_escapes_control_characters() {
        let before = data(10, 4);
        let text = render("h:1", &data(30, 14), Some((2.0, &before)));
        assert!(
            text.contains("policy version 2 · reloads 1 (failed 0)"),
            "{text}"
        );
        assert!(
            text.contains(
                "api / api.user (per_user) · admitted 10.0/s (30 total) · refused 5.0/s (14 total)"
            ),
            "{text}"
        );
        assert!(text.contains("user=a\\u{1b}[2J"), "{text}");
        assert!(
            !text.contains('\u{1b}'),
            "no raw escape reaches the terminal"
        );
        assert!(text.contains("1.5 s"), "{text}");
        let first = render("h:1", &before, None);
        assert!(first.contains("admitted - (10 total)"), "{first}");
    }
}
