//! Policies: envoyproxy/ratelimit's YAML files (plus our `burst`, `unit_multiplier`, and on a
//! descriptor `rate_limits` and `cost`), validated and compiled into an immutable [`PolicySet`]
//! that matching reads without locks. `load` reads files through three stages, `yaml` (text →
//! positioned tree), `model` (tree → raw structs, field errors) and `compile` (raw → `rule`
//! values and `matcher` tables, semantic errors), reporting every problem at once with file,
//! position and descriptor path; `set` holds the result. Of the process it knows only the
//! limiter's `Quota`: no store, no transport, no metrics.

mod compile;
mod load;
mod matcher;
mod model;
mod rule;
mod set;
mod yaml;

use std::fmt;
use std::path::PathBuf;

pub use load::{
    Files, LoadOptions, MAX_FILE_BYTES, load_dir, load_dir_with, load_str, load_str_with,
    policy_files,
};
pub use matcher::Domain;
pub use matcher::Resolved;
pub use rule::{Cost, Limit, Metadata, Rate, Rule, Unit};
pub use set::{PolicyHandle, PolicySet, Summary};
pub use yaml::Pos;

/// One problem found while loading policies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The file.
    pub file: String,
    /// Line and column, where the parser knows them.
    pub pos: Option<Pos>,
    /// The path of the field in the file, e.g. `descriptors[2].rate_limit.unit`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if let Some(pos) = self.pos {
            write!(f, ":{pos}")?;
        }
        if !self.path.is_empty() {
            write!(f, ": {}", self.path)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// Why policies could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The policy directory could not be listed.
    #[error("cannot read policy directory {}: {source}", dir.display())]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// One or more files are invalid; every problem is listed.
    #[error("{}", Problems(.0))]
    Invalid(Vec<Problem>),
    /// No domain would be loaded, and that is not allowed.
    #[error(
        "no policies in {}: {}, so every request would be answered OK with no limit (set allow_empty_policies: true to allow this)",
        dir.display(), files.describe()
    )]
    Empty {
        /// The directory.
        dir: PathBuf,
        /// Which entries were looked for.
        files: Files,
    },
}

struct Problems<'a>(&'a [Problem]);

impl fmt::Display for Problems<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len();
        write!(
            f,
            "{n} problem{} in policies",
            if n == 1 { "" } else { "s" }
        )?;
        for p in self.0 {
            write!(f, "\n  {p}")?;
        }
        Ok(())
    }
}

/// Loading shortcuts shared by the tests of the stages.
#[cfg(test)]
mod testing {
    use super::{Limit, PolicyError, PolicySet, Problem, load_str};

    /// `text` loaded as `test.yaml`; panics on a problem.
    pub(super) fn set(text: &str) -> PolicySet {
        load_str(&[("test.yaml", text)]).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The problems of `text` loaded as `bad.yaml`; panics if it loads.
    pub(super) fn problems(text: &str) -> Vec<Problem> {
        match load_str(&[("bad.yaml", text)]) {
            Err(PolicyError::Invalid(p)) => p,
            other => panic!("expected problems, got {other:?}"),
        }
    }

    /// `requests_per_unit` of the first rule matched in `test-domain` (`u32::MAX` when
    /// unlimited).
    pub(super) fn rpu(set: &PolicySet, entries: &[(&str, &str)]) -> Option<u32> {
        let d = set.domain("test-domain").expect("domain");
        d.resolve(entries.iter().copied())
            .map(|r| match r.rules[0].limit {
                Limit::Limited(rate) => rate.requests_per_unit,
                Limit::Unlimited => u32::MAX,
            })
    }
}
