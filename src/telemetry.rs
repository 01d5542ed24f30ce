//! Logging setup: one `tracing` subscriber for the process, text or JSON, filtered by
//! `RUST_LOG` when set and by the `log_level` setting otherwise. Library code only emits events.
//! Also [`cut`], how text from peers is bounded before it is sent on (span attributes, NACKs).

use serde::{Deserialize, Serialize};
use tracing_subscriber::EnvFilter;

/// Log output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Installs the global subscriber. Later calls (tests start many servers) are ignored.
pub fn init(format: LogFormat, level: &str) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only for a person at a terminal, never into files or log collectors.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let _already_set = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// `value` cut to at most `cap` bytes, on a character boundary.
#[must_use]
pub fn cut(value: &str, cap: usize) -> &str {
    if value.len() <= cap {
        return value;
    }
    let mut end = cap;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    &value[..end]
}

#[cfg(test)]
mod tests {
    use super::cut;

    #[test]
    fn values_are_cut_on_character_boundaries() {
        assert_eq!(cut("abcdef", 4), "abcd");
        assert_eq!(cut("ab", 4), "ab");
        assert_eq!(cut("aé", 2), "a");
        let long = "é".repeat(3_000);
        let cut = cut(&long, 4_096);
        assert_eq!(cut.len(), 4_096);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
