//! Policies: the envoyproxy/ratelimit YAML files (plus our `burst`, `unit_multiplier`, and on a
//! descriptor `rate_limits` and `cost`), validated and compiled into an immutable [`PolicySet`] that matching reads without locks.
//!
//! Loading is three steps, each in its own file: `yaml` (text → positioned tree), `model` (tree →
//! raw structs, field and type errors), `compile` (raw → lookup tables, semantic errors).
//! Every problem of a load is reported at once, with file, line and column, and descriptor path.
//! This module knows the `Quota` value type of the limiter and nothing else of the process: no
//! store, no transport, no metrics.

mod compile;
mod matcher;
mod model;
mod yaml;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::limiter::Quota;
use crate::limiter::gcra::NANOS_PER_SEC;

pub use matcher::Resolved;
pub use yaml::Pos;

/// A descriptor's `metadata` map, as JSON values (the reference turns it into a protobuf
/// `Struct`; JSON is the same data model without the transport).
pub type Metadata = serde_json::Map<String, serde_json::Value>;

/// The largest policy file read, in bytes. Policy files are small; anything bigger is a mistake.
pub const MAX_FILE_BYTES: u64 = 16 << 20;

/// A time unit of `rate_limit.unit`. Months are 30 days and years 365, as in Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3 600 s.
    Hour,
    /// 86 400 s.
    Day,
    /// 604 800 s.
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// Parses a unit name, ignoring case.
    #[must_use]
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name.to_ascii_lowercase().as_str() {
            "second" => Self::Second,
            "minute" => Self::Minute,
            "hour" => Self::Hour,
            "day" => Self::Day,
            "week" => Self::Week,
            "month" => Self::Month,
            "year" => Self::Year,
            _ => return None,
        })
    }

    /// The unit's length in seconds.
    #[must_use]
    pub const fn seconds(self) -> u64 {
        match self {
            Self::Second => 1,
            Self::Minute => 60,
            Self::Hour => 3_600,
            Self::Day => 86_400,
            Self::Week => 604_800,
            Self::Month => 2_592_000,
            Self::Year => 31_536_000,
        }
    }

    /// The unit's upper-case name, as Envoy spells it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Second => "SECOND",
            Self::Minute => "MINUTE",
            Self::Hour => "HOUR",
            Self::Day => "DAY",
            Self::Week => "WEEK",
            Self::Month => "MONTH",
            Self::Year => "YEAR",
        }
    }
}

/// A limited rate, as configured and as compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    /// `requests_per_unit` (0 bans).
    pub requests_per_unit: u32,
    /// `unit`.
    pub unit: Unit,
    /// `unit_multiplier`: the period is `unit × unit_multiplier`.
    pub unit_multiplier: u32,
    /// `burst`: the bucket capacity (defaults to `requests_per_unit`).
    pub burst: u32,
    /// Whether `burst` was written in the policy (false: inherited from `requests_per_unit`).
    pub burst_set: bool,
    /// The compiled quota.
    pub quota: Quota,
}

impl Rate {
    /// A rate of `requests_per_unit` per `unit` with the burst equal to it, as a request's
    /// `RateLimitOverride` asks for.
    #[must_use]
    pub fn per_unit(requests_per_unit: u32, unit: Unit) -> Self {
        let r = u64::from(requests_per_unit);
        let quota = Quota::new(unit.seconds() * NANOS_PER_SEC, r, r)
            .unwrap_or_else(|_| Quota::ban(unit.seconds() * NANOS_PER_SEC));
        Self {
            requests_per_unit,
            unit,
            unit_multiplier: 1,
            burst: requests_per_unit,
            burst_set: false,
            quota,
        }
    }
}

/// What a rule allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// `unlimited: true`: always OK, never counted.
    Unlimited,
    /// A GCRA limit.
    Limited(Rate),
}

/// A compiled `rate_limit` and the flags of its descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Stable identity: a hash of the domain and the descriptor path (keys and configured
    /// values). Unchanged across reloads while the path is unchanged, so counters survive.
    pub id: u128,
    /// Where it is in its file, e.g. `descriptors[1].descriptors[0]`, or for an entry of
    /// `rate_limits` e.g. `descriptors[1].rate_limits[0]`.
    pub path: String,
    /// The reference's stats key, e.g. `edge.generic_key_api.api_key`.
    pub stats_key: String,
    /// The levels of the stats key after the domain (`key_value`, or `key` for a key-only
    /// level), e.g. `["generic_key_api", "api_key"]`: the metric labels `key1`, `key2`.
    pub levels: Vec<String>,
    /// The limit.
    pub limit: Limit,
    /// `rate_limit.name`.
    pub name: Option<String>,
    /// `rate_limit.replaces[].name`.
    pub replaces: Vec<String>,
    /// `shadow_mode`.
    pub shadow_mode: bool,
    /// `quota_mode`.
    pub quota_mode: bool,
    /// `detailed_metric`.
    pub detailed_metric: bool,
    /// `value_to_metric`.
    pub value_to_metric: bool,
    /// For one of several limits of a node (`rate_limits` with two or more entries): the entry's
    /// name, which sets its `/rlconfig` line and metric labels apart from its siblings'.
    pub entry: Option<String>,
}

impl Rule {
    /// The stats key, with the entry's name in brackets for one of several limits of a node,
    /// e.g. `edge.user[user_day]`.
    #[must_use]
    pub fn qualified_key(&self) -> String {
        match &self.entry {
            Some(name) => format!("{}[{name}]", self.stats_key),
            None => self.stats_key.clone(),
        }
    }
}

/// A cost node: a descriptor with `cost` and no limit of its own, drawing `cost` tokens per hit
/// from the limits of its nearest ancestor that has any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cost {
    /// Tokens per hit (at least 1, at most the ancestor's smallest burst).
    pub cost: u64,
    /// Where it is in its file.
    pub path: String,
    /// Its stats key, e.g. `edge.user.route_search`.
    pub stats_key: String,
    /// The stats key of the ancestor whose buckets it draws from, e.g. `edge.user`.
    pub of: String,
}

/// One domain's compiled descriptor tree.
#[derive(Clone, Debug)]
pub struct Domain {
    name: String,
    /// The files it was loaded from: one, or several with merged domains, in load order.
    files: Vec<String>,
    root: matcher::Level,
    nodes: Vec<matcher::TreeNode>,
}

impl Domain {
    /// The domain name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The (first) file it was loaded from.
    #[must_use]
    pub fn file(&self) -> &str {
        self.files.first().map_or("", String::as_str)
    }

    /// Every file it was loaded from, in load order: one, unless domains are merged.
    #[must_use]
    pub fn files(&self) -> &[String] {
        &self.files
    }

    /// Every rule of the domain, in file order; each entry of a `rate_limits` is one.
    pub fn rules(&self) -> impl Iterator<Item = &Rule> {
        self.nodes
            .iter()
            .flat_map(|n| n.rules.iter().map(Arc::as_ref))
    }

    /// Every cost node of the domain, in file order.
    pub fn costs(&self) -> impl Iterator<Item = &Cost> {
        self.nodes.iter().filter_map(|n| n.cost.as_ref())
    }
}

/// All loaded domains. Immutable; reloading builds a new one and swaps it in.
#[derive(Clone, Debug, Default)]
pub struct PolicySet {
    domains: matcher::FastMap<String, Domain>,
    files: usize,
}

impl PolicySet {
    /// The domain named `name`.
    #[must_use]
    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    /// All domains, sorted by name.
    #[must_use]
    pub fn domains(&self) -> Vec<&Domain> {
        let mut all: Vec<&Domain> = self.domains.values().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    /// Counts for a one-line summary.
    #[must_use]
    pub fn summary(&self) -> Summary {
        let mut s = Summary {
            files: self.files,
            domains: self.domains.len(),
            ..Summary::default()
        };
        s.costs = self.domains.values().map(|d| d.costs().count()).sum();
        for rule in self.domains.values().flat_map(Domain::rules) {
            match rule.limit {
                Limit::Unlimited => s.unlimited += 1,
                Limit::Limited(r) if r.requests_per_unit == 0 => s.bans += 1,
                Limit::Limited(_) => s.limited += 1,
            }
        }
        s
    }
}

/// Counts of what a [`PolicySet`] holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Files read.
    pub files: usize,
    /// Domains.
    pub domains: usize,
    /// Rules with a limit above zero.
    pub limited: usize,
    /// Rules with `requests_per_unit: 0`.
    pub bans: usize,
    /// Rules with `unlimited: true`.
    pub unlimited: usize,
    /// Cost nodes (not rules: they draw from an ancestor's).
    pub costs: usize,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} files, {} domains, {} rules ({} limited, {} bans, {} unlimited)",
            self.files,
            self.domains,
            self.limited + self.bans + self.unlimited,
            self.limited,
            self.bans,
            self.unlimited
        )?;
        if self.costs > 0 {
            write!(
                f,
                ", {} cost node{}",
                self.costs,
                if self.costs == 1 { "" } else { "s" }
            )?;
        }
        Ok(())
    }
}

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

/// Which entries of the policy directory are policy files.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Files {
    /// `*.yaml` and `*.yml`, hidden ones (`.x.yaml`, a ConfigMap's `..data`) skipped.
    #[default]
    Yaml,
    /// Every entry, whatever its name, hidden ones included: envoyproxy/ratelimit's reading
    /// (`RUNTIME_IGNOREDOTFILES=false`, its default).
    All,
    /// Every entry whose name does not start with `.`, whatever its extension:
    /// envoyproxy/ratelimit with `RUNTIME_IGNOREDOTFILES=true`.
    Visible,
}

impl Files {
    /// Whether a directory entry named `name` is a policy file.
    fn selects(self, name: &str) -> bool {
        let hidden = name.starts_with('.');
        match self {
            Self::Yaml => (name.ends_with(".yaml") || name.ends_with(".yml")) && !hidden,
            Self::All => true,
            Self::Visible => !hidden,
        }
    }

    /// The selection in words, for the error of an empty directory.
    fn describe(self) -> &'static str {
        match self {
            Self::Yaml => "no *.yaml or *.yml file",
            Self::All => "no file",
            Self::Visible => "no file not starting with a dot",
        }
    }
}

/// The policy files of a directory: every entry directly in it that `files` selects, sorted by
/// name (subdirectories are not descended into). Entries are listed by name whatever they are;
/// [`load_dir`] refuses one that is not a readable regular file (or a symlink to one, so a
/// Kubernetes ConfigMap mount works).
///
/// # Errors
///
/// [`PolicyError::Dir`] when the directory cannot be listed.
pub fn policy_files(dir: &Path, files: Files) -> Result<Vec<PathBuf>, PolicyError> {
    let read = std::fs::read_dir(dir).map_err(|source| PolicyError::Dir {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mut found = Vec::new();
    for entry in read {
        let entry = entry.map_err(|source| PolicyError::Dir {
            dir: dir.to_path_buf(),
            source,
        })?;
        if files.selects(&entry.file_name().to_string_lossy()) {
            found.push(entry.path());
        }
    }
    found.sort();
    Ok(found)
}

/// How a directory of policies is loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Accept a directory with no policy file (no domain at all). Off by default: an empty set
    /// answers every request OK with no limit, which is more often a broken deploy than a wish.
    pub allow_empty: bool,
    /// Which entries are policy files.
    pub files: Files,
    /// Merge files that name the same domain into one tree (envoyproxy/ratelimit's
    /// `MERGE_DOMAIN_CONFIG`) instead of refusing the second.
    pub merge_domains: bool,
}

/// Loads and compiles every policy file of `dir`, refusing a directory without any.
///
/// # Errors
///
/// As [`load_dir_with`] with the default [`LoadOptions`].
pub fn load_dir(dir: &Path) -> Result<PolicySet, PolicyError> {
    load_dir_with(dir, LoadOptions::default())
}

/// Loads and compiles every policy file of `dir`. A load is all or nothing: an entry named as a
/// policy file that is not a readable regular file (a dangling symlink, a directory, a FIFO, a
/// socket or device, unreadable) is a problem like an invalid file, never skipped.
///
/// # Errors
///
/// [`PolicyError::Dir`] when the directory cannot be listed, [`PolicyError::Invalid`] listing
/// every problem of every file, [`PolicyError::Empty`] when no domain would be loaded and
/// `options` does not allow it.
pub fn load_dir_with(dir: &Path, options: LoadOptions) -> Result<PolicySet, PolicyError> {
    let mut sources = Vec::new();
    let mut problems = Vec::new();
    for path in policy_files(dir, options.files)? {
        let name = path.display().to_string();
        match read_file(&path) {
            Ok(text) => sources.push((name, text)),
            Err(message) => problems.push(Problem {
                file: name,
                pos: None,
                path: String::new(),
                message,
            }),
        }
    }
    let set = load_sources(&sources, problems, options.merge_domains)?;
    if set.domains.is_empty() && !options.allow_empty {
        return Err(PolicyError::Empty {
            dir: dir.to_path_buf(),
            files: options.files,
        });
    }
    Ok(set)
}

/// Reads one policy file. Its type is checked (following symlinks) before it is opened, so a
/// FIFO is never opened (that would block until a writer came), and again once open, in case
/// the entry was replaced in between.
fn read_file(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let meta = std::fs::metadata(path).map_err(|e| match std::fs::read_link(path) {
        Ok(target) if e.kind() == std::io::ErrorKind::NotFound => format!(
            "cannot read: dangling symlink (to {}, which does not exist)",
            target.display()
        ),
        _ => format!("cannot read: {e}"),
    })?;
    regular(&meta)?;
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("cannot read: {e}"))?;
    regular(&meta)?;
    let size = meta.len();
    if size > MAX_FILE_BYTES {
        return Err(format!(
            "file is {size} bytes, more than the {MAX_FILE_BYTES} allowed"
        ));
    }
    let mut text = String::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read: {e}"))?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "file grew past the {MAX_FILE_BYTES} bytes allowed while read"
        ));
    }
    Ok(text)
}

/// `Ok` for a regular file, else what the entry is instead.
fn regular(meta: &std::fs::Metadata) -> Result<(), String> {
    let t = meta.file_type();
    if t.is_file() {
        return Ok(());
    }
    let what = if t.is_dir() {
        "a directory"
    } else {
        special_kind(t)
    };
    Err(format!(
        "not a regular file ({what}); a policy file must be a regular file or a symlink to one"
    ))
}

#[cfg(unix)]
fn special_kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_char_device() {
        "a character device"
    } else {
        "not a file"
    }
}

#[cfg(not(unix))]
fn special_kind(_t: std::fs::FileType) -> &'static str {
    "not a file"
}

/// Compiles policies from `(file name, YAML text)` pairs.
///
/// # Errors
///
/// [`PolicyError::Invalid`] listing every problem.
pub fn load_str(sources: &[(&str, &str)]) -> Result<PolicySet, PolicyError> {
    load_str_with(sources, false)
}

/// As [`load_str`]; with `merge_domains`, files naming the same domain are merged in the order
/// given (see [`LoadOptions::merge_domains`]).
///
/// # Errors
///
/// [`PolicyError::Invalid`] listing every problem.
pub fn load_str_with(
    sources: &[(&str, &str)],
    merge_domains: bool,
) -> Result<PolicySet, PolicyError> {
    let owned: Vec<(String, String)> = sources
        .iter()
        .map(|(n, t)| ((*n).to_string(), (*t).to_string()))
        .collect();
    load_sources(&owned, Vec::new(), merge_domains)
}

fn load_sources(
    sources: &[(String, String)],
    mut problems: Vec<Problem>,
    merge_domains: bool,
) -> Result<PolicySet, PolicyError> {
    let mut set = PolicySet {
        files: sources.len(),
        ..PolicySet::default()
    };
    // With merged domains, the files of each domain in load order, the domains in the order
    // they first appear; compiled together once all are read.
    let mut merged: Vec<(String, Vec<(&str, model::RawPolicy)>)> = Vec::new();
    for (file, text) in sources {
        let before = problems.len();
        let Some(raw) = read_one(file, text, &mut problems) else {
            continue;
        };
        let named = raw
            .domain
            .as_ref()
            .map(|d| d.value.clone())
            .filter(|d| !d.is_empty());
        if merge_domains && let Some(name) = named {
            match merged.iter_mut().find(|(n, _)| *n == name) {
                Some((_, files)) => files.push((file, raw)),
                None => merged.push((name, vec![(file, raw)])),
            }
            continue;
        }
        let domain = compile::compile(&[(file, raw)], &mut problems);
        problems[before..].sort_by_key(|p| p.pos.map(|p| (p.line, p.col)));
        let Some(domain) = domain.filter(|_| problems.len() == before) else {
            continue;
        };
        if let Some(first) = set.domains.get(&domain.name) {
            problems.push(Problem {
                file: file.clone(),
                pos: None,
                path: "domain".into(),
                message: format!(
                    "duplicate domain {:?} (also in {}); set merge_domains: true to merge them",
                    domain.name,
                    first.file()
                ),
            });
            continue;
        }
        set.domains.insert(domain.name.clone(), domain);
    }
    for (name, files) in merged {
        let before = problems.len();
        let domain = compile::compile(&files, &mut problems);
        // Each file's problems together, in position order.
        let order = |file: &str| files.iter().position(|(f, _)| *f == file);
        problems[before..].sort_by_key(|p| (order(&p.file), p.pos.map(|p| (p.line, p.col))));
        if let Some(domain) = domain {
            set.domains.insert(name, domain);
        }
    }
    if problems.is_empty() {
        Ok(set)
    } else {
        Err(PolicyError::Invalid(problems))
    }
}

/// Parses one file into the raw model, appending its problems in position order. `None` when
/// the YAML cannot be read or is not one document; a file with field problems is still
/// returned, so compiling it reports its semantic problems too.
fn read_one(file: &str, text: &str, problems: &mut Vec<Problem>) -> Option<model::RawPolicy> {
    let docs = match yaml::parse(text) {
        Ok(docs) => docs,
        Err(e) => {
            problems.push(Problem {
                file: file.to_string(),
                pos: Some(e.pos),
                path: String::new(),
                message: e.message,
            });
            return None;
        }
    };
    let doc = match docs.as_slice() {
        [doc] => doc,
        [] => {
            problems.push(Problem {
                file: file.to_string(),
                pos: None,
                path: String::new(),
                message: "file is empty (expected a domain and its descriptors)".into(),
            });
            return None;
        }
        [_, second, ..] => {
            problems.push(Problem {
                file: file.to_string(),
                pos: Some(second.pos),
                path: String::new(),
                message: "expected one YAML document (one domain per file)".into(),
            });
            return None;
        }
    };
    let before = problems.len();
    let raw = model::Reader { file, problems }.policy(doc);
    problems[before..].sort_by_key(|p| p.pos.map(|p| (p.line, p.col)));
    Some(raw)
}

/// The live policy set, swapped atomically on reload; readers never block.
#[derive(Debug, Clone)]
pub struct PolicyHandle(Arc<ArcSwap<PolicySet>>);

impl PolicyHandle {
    /// A handle holding `set`.
    #[must_use]
    pub fn new(set: PolicySet) -> Self {
        Self(Arc::new(ArcSwap::from_pointee(set)))
    }

    /// The current set; hold it for the whole of one request.
    #[must_use]
    pub fn load(&self) -> Arc<PolicySet> {
        self.0.load_full()
    }

    /// Replaces the current set.
    pub fn store(&self, set: PolicySet) {
        self.0.store(Arc::new(set));
    }

    /// Replaces the current set and returns the previous one (freeing a large set takes a
    /// while, so the caller chooses where that happens).
    pub fn swap(&self, set: PolicySet) -> Arc<PolicySet> {
        self.0.swap(Arc::new(set))
    }
}

#[cfg(test)]
mod tests;
