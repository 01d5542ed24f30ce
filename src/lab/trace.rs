//! Traces: JSON Lines, one request per line ([`parse_line`]), optionally gzip-compressed
//! (recognised by its magic bytes, whatever the file is called), read by [`TraceReader`]. A line
//! with `"tokens"` is a request whose cost is reported after the work ([`Usage`]). Lines must
//! be in time order of arrival; blank lines and lines starting with `#` are skipped. A bad line is an
//! error naming its line number; reading stops there.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::decision::Request;
use crate::limiter::gcra::NANOS_PER_SEC;
use crate::wire::json;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// When it arrived, in nanoseconds from the trace's origin.
    pub t: u64,
    /// The request.
    pub request: Request,
    /// For a request whose cost is known only at its end (a token trace's line), that cost and
    /// when it is reported; `None` for a request charged as it arrives.
    pub usage: Option<Usage>,
}

/// What a request whose cost is reported after the work spends, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Its cost (tokens), reported when it ends.
    pub tokens: u64,
    /// From its arrival to its end, in nanoseconds.
    pub duration: u64,
}

/// Why a trace cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file cannot be opened or read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A line is not a request with a time.
    #[error("{}:{line}: {message}", path.display())]
    Line {
        /// The file.
        path: PathBuf,
        /// The line number, from 1.
        line: u64,
        /// What is wrong.
        message: String,
    },
}

/// Reads a trace line by line.
pub struct TraceReader {
    path: PathBuf,
    input: Box<dyn BufRead>,
    line: u64,
    last: u64,
    buf: String,
}

impl std::fmt::Debug for TraceReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceReader")
            .field("path", &self.path)
            .field("line", &self.line)
            .finish_non_exhaustive()
    }
}

impl TraceReader {
    /// Opens `path` (`-` for standard input), gzip or plain.
    ///
    /// # Errors
    ///
    /// [`TraceError::Io`] when it cannot be opened.
    pub fn open(path: &Path) -> Result<Self, TraceError> {
        let io_err = |source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        };
        let raw: Box<dyn Read> = if path == Path::new("-") {
            Box::new(io::stdin())
        } else {
            Box::new(File::open(path).map_err(io_err)?)
        };
        let mut raw = BufReader::new(raw);
        let gzip = raw.fill_buf().map_err(io_err)?.starts_with(&[0x1f, 0x8b]);
        let input: Box<dyn BufRead> = if gzip {
            Box::new(BufReader::new(flate2::bufread::MultiGzDecoder::new(raw)))
        } else {
            Box::new(raw)
        };
        Ok(Self::new(path, input))
    }

    /// A reader over `input`, reported as `path`.
    #[must_use]
    pub fn new(path: &Path, input: Box<dyn BufRead>) -> Self {
        Self {
            path: path.to_path_buf(),
            input,
            line: 0,
            last: 0,
            buf: String::new(),
        }
    }

    /// The trace's name.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Lines read so far.
    #[must_use]
    pub fn lines_read(&self) -> u64 {
        self.line
    }

    fn bad(&self, message: impl Into<String>) -> TraceError {
        TraceError::Line {
            path: self.path.clone(),
            line: self.line,
            message: message.into(),
        }
    }
}

impl Iterator for TraceReader {
    type Item = Result<Event, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.buf.clear();
            self.line += 1;
            match self.input.read_line(&mut self.buf) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(e) => return Some(Err(self.bad(e.to_string()))),
            }
            let text = self.buf.trim();
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            let event = parse_line(text).map_err(|m| self.bad(m));
            return Some(event.and_then(|e| {
                if e.t < self.last {
                    return Err(self.bad(format!(
                        "t = {} s is earlier than the line before ({} s); a trace must be in \
                         time order",
                        seconds(e.t),
                        seconds(self.last)
                    )));
                }
                self.last = e.t;
                Ok(e)
            }));
        }
    }
}

/// One line: the body `POST /json` takes (a proto3-JSON `RateLimitRequest`, read by the admin
/// port's own parser, [`crate::wire::json`]) plus `"t"`: when the request arrived, in seconds (a
/// number, may be fractional) from any origin, e.g. Unix time.
///
/// ```text
/// {"t": 59.9, "domain": "db", "descriptors": [{"entries": [{"key": "tenant", "value": "a"}]}]}
/// {"t": 60.1, "domain": "db", "descriptors": [{"entries": [{"key": "tenant", "value": "a"}]}], "hitsAddend": 2}
/// ```
///
/// A line of a token trace adds `"tokens"` (a whole number ≥ 0, the cost known only at the
/// request's end) and `"duration"` (seconds from its arrival to its end); it is replayed as a
/// check of cost 0 on arrival and, when that is admitted, the tokens reported at its end:
///
/// ```text
/// {"t": 12.5, "duration": 3.2, "tokens": 812, "domain": "ai", "descriptors": [{"entries": [{"key": "tenant", "value": "a"}]}]}
/// ```
///
/// # Errors
///
/// What is wrong with it, for [`TraceError::Line`].
pub fn parse_line(text: &str) -> Result<Event, String> {
    let mut value: Value = serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    let Some(object) = value.as_object_mut() else {
        return Err("expected a JSON object (a RateLimitRequest with \"t\")".into());
    };
    let t = match object.remove("t") {
        None => return Err("missing \"t\" (seconds)".into()),
        Some(Value::Number(n)) => n.as_f64().unwrap_or(f64::NAN),
        Some(other) => return Err(format!("\"t\" must be a number of seconds, found {other}")),
    };
    // 2^64 ns is about 584 years; anything at or beyond it cannot be a time here.
    if !(0.0..1.8e10).contains(&t) {
        return Err(format!("\"t\" = {t} is not a time in seconds ≥ 0"));
    }
    // Rounded to the nanosecond: 59.9 is 59 900 000 000 ns, not 59 899 999 999.
    let t = (t * NANOS_PER_SEC as f64).round() as u64;
    let usage = usage(object)?;
    let body = serde_json::to_vec(&value).map_err(|e| e.to_string())?;
    let request = json::parse(&body).map_err(|e| e.to_string())?;
    Ok(Event { t, request, usage })
}

/// `"tokens"` and `"duration"`, taken out of a line: both or neither.
fn usage(object: &mut serde_json::Map<String, Value>) -> Result<Option<Usage>, String> {
    let (tokens, duration) = (object.remove("tokens"), object.remove("duration"));
    let (tokens, duration) = match (tokens, duration) {
        (None, None) => return Ok(None),
        (Some(t), Some(d)) => (t, d),
        (Some(_), None) => return Err("\"tokens\" without \"duration\" (seconds)".into()),
        (None, Some(_)) => return Err("\"duration\" without \"tokens\"".into()),
    };
    let Some(tokens) = tokens.as_u64() else {
        return Err(format!(
            "\"tokens\" must be a whole number ≥ 0, found {tokens}"
        ));
    };
    let duration = duration.as_f64().unwrap_or(f64::NAN);
    // At most a day: a request still running after that is not one a token budget waits for.
    if !(0.0..=86_400.0).contains(&duration) {
        return Err(format!(
            "\"duration\" = {duration} is not a number of seconds from 0 to 86400"
        ));
    }
    Ok(Some(Usage {
        tokens,
        duration: (duration * NANOS_PER_SEC as f64).round() as u64,
    }))
}

/// `ns` as seconds, e.g. `59.9`.
#[must_use]
pub fn seconds(ns: u64) -> String {
    let s = format!("{}.{:09}", ns / NANOS_PER_SEC, ns % NANOS_PER_SEC);
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Vec<Result<Event, TraceError>> {
        TraceReader::new(
            Path::new("t.jsonl"),
            Box::new(io::Cursor::new(text.as_bytes().to_vec())),
        )
        .collect()
    }

    const LINE: &str = r#"{"domain":"d","descriptors":[{"entries":[{"key":"k","value":"v"}]}]"#;

    #[test]
    fn reads_times_and_requests() {
        let text = format!("# a comment\n{LINE},\"t\":59.9}}\n\n{LINE},\"t\":60.1}}\n");
        let events: Vec<Event> = read(&text).into_iter().map(Result::unwrap).collect();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].t, 59_900_000_000);
        assert_eq!(events[1].t, 60_100_000_000);
        assert_eq!(events[1].request.descriptors[0].entries[0].value, "v");
        assert_eq!(events[0].usage, None);
    }

    #[test]
    fn a_token_line_carries_its_tokens_and_duration() {
        let text = format!("{LINE},\"t\":1,\"tokens\":812,\"duration\":3.2}}\n");
        let events: Vec<Event> = read(&text).into_iter().map(Result::unwrap).collect();
        assert_eq!(
            events[0].usage,
            Some(Usage {
                tokens: 812,
                duration: 3_200_000_000
            })
        );
        for (extra, expected) in [
            ("\"tokens\":5", "\"tokens\" without \"duration\""),
            ("\"duration\":1", "\"duration\" without \"tokens\""),
            (
                "\"tokens\":-5,\"duration\":1",
                "\"tokens\" must be a whole number",
            ),
            ("\"tokens\":5,\"duration\":-1", "\"duration\" = -1 is not"),
        ] {
            let text = format!("{LINE},\"t\":1,{extra}}}\n");
            let err = read(&text).into_iter().find_map(Result::err).unwrap();
            assert!(err.to_string().contains(expected), "{err} / {expected}");
        }
    }

    #[test]
    fn a_bad_line_names_its_number() {
        let cases = [
            (
                format!("{LINE},\"t\":1}}\nnot json\n"),
                "t.jsonl:2: invalid JSON",
            ),
            (format!("{LINE}}}\n"), "t.jsonl:1: missing \"t\""),
            (
                format!("{LINE},\"t\":\"1\"}}\n"),
                "t.jsonl:1: \"t\" must be a number",
            ),
            (
                format!("{LINE},\"t\":-1}}\n"),
                "t.jsonl:1: \"t\" = -1 is not a time",
            ),
            (
                format!("{LINE},\"t\":2}}\n{LINE},\"t\":1}}\n"),
                "t.jsonl:2: t = 1 s is earlier than the line before (2 s)",
            ),
            (
                "{\"t\":1,\"domain\":\"d\",\"descriptor\":[]}\n".into(),
                "t.jsonl:1: invalid request body: unknown field `descriptor`",
            ),
            ("[1]\n".into(), "t.jsonl:1: expected a JSON object"),
        ];
        for (text, expected) in cases {
            let err = read(&text)
                .into_iter()
                .find_map(Result::err)
                .unwrap_or_else(|| panic!("no error for {text:?}"));
            assert!(err.to_string().starts_with(expected), "{err} / {expected}");
        }
    }

    #[test]
    fn gzip_is_recognised_by_its_magic() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl.gz");
        let mut gz = flate2::write::GzEncoder::new(
            File::create(&path).unwrap(),
            flate2::Compression::fast(),
        );
        for t in [1, 2, 3] {
            writeln!(gz, "{LINE},\"t\":{t}}}").unwrap();
        }
        gz.finish().unwrap();
        let events: Vec<Event> = TraceReader::open(&path)
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            events.iter().map(|e| e.t).collect::<Vec<_>>(),
            [1_000_000_000, 2_000_000_000, 3_000_000_000]
        );
    }
}
