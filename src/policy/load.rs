//! Loading: which entries of a directory are policy files, reading each (regular files only,
//! bounded in size), and text → `yaml` → `model` → `compile` for every file, merging domains
//! when asked. A load is all or nothing and reports every problem of every file.

use std::path::{Path, PathBuf};

use super::set::PolicySet;
use super::{PolicyError, Problem, compile, model, yaml};

/// The largest policy file read, in bytes. Policy files are small; anything bigger is a mistake.
pub const MAX_FILE_BYTES: u64 = 16 << 20;

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
    pub(super) fn describe(self) -> &'static str {
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
