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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Domain, Limit};

    #[test]
    fn duplicate_domains_across_files() {
        let err = load_str(&[("a.yaml", "domain: d"), ("b.yaml", "domain: d")]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("b.yaml: domain: duplicate domain \"d\" (also in a.yaml)"),
            "{text}"
        );
    }

    #[test]
    fn load_dir_reads_yaml_files_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), "domain: a").unwrap();
        std::fs::write(dir.path().join("b.yml"), "domain: b").unwrap();
        std::fs::write(dir.path().join("README.md"), "not yaml").unwrap();
        std::fs::write(dir.path().join(".hidden.yaml"), "broken: [").unwrap();
        let s = load_dir(dir.path()).unwrap();
        assert_eq!(s.summary().files, 2);
        assert!(s.domain("a").is_some() && s.domain("b").is_some());
        assert!(matches!(
            load_dir(&dir.path().join("missing")),
            Err(PolicyError::Dir { .. })
        ));
    }

    /// Loads `dir` on another thread, failing the test instead of hanging if the load blocks.
    fn load_dir_within_10s(
        dir: &std::path::Path,
        options: LoadOptions,
    ) -> Result<PolicySet, PolicyError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let dir = dir.to_path_buf();
        std::thread::spawn(move || {
            let _ = tx.send(load_dir_with(&dir, options));
        });
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("load_dir blocked (opened a FIFO?)")
    }

    #[cfg(unix)]
    #[test]
    fn entries_named_as_policies_that_are_not_readable_files_fail_the_load() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("good.yaml"), "domain: good").unwrap();
        std::fs::write(d.join("README.md"), "not a policy").unwrap();
        std::os::unix::fs::symlink("gone.yaml", d.join("dangling.yaml")).unwrap();
        std::fs::create_dir(d.join("dir.yaml")).unwrap();
        let status = std::process::Command::new("mkfifo")
            .arg(d.join("fifo.yml"))
            .status()
            .unwrap();
        assert!(status.success());
        let _socket = std::os::unix::net::UnixListener::bind(d.join("socket.yaml")).unwrap();
        // Hidden entries stay ignored whatever they are.
        std::os::unix::fs::symlink("nowhere", d.join(".hidden.yaml")).unwrap();

        let Err(PolicyError::Invalid(problems)) = load_dir_within_10s(d, LoadOptions::default())
        else {
            panic!("the load must fail");
        };
        let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
        let expect = |file: &str, says: &str| {
            let line = format!("{}: {says}", d.join(file).display());
            assert!(
                lines.iter().any(|l| l.starts_with(&line)),
                "{line:?} not in {lines:#?}"
            );
        };
        expect(
            "dangling.yaml",
            "cannot read: dangling symlink (to gone.yaml, which does not exist)",
        );
        expect("dir.yaml", "not a regular file (a directory)");
        expect("fifo.yml", "not a regular file (a FIFO)");
        expect("socket.yaml", "not a regular file (a socket)");
        assert_eq!(lines.len(), 4, "{lines:#?}");
    }

    #[test]
    fn a_directory_without_policies_is_refused_unless_allowed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("README.md"), "no policies here").unwrap();
        let err = load_dir(dir.path()).unwrap_err();
        assert!(matches!(err, PolicyError::Empty { .. }), "{err:?}");
        assert!(
            err.to_string().contains("allow_empty_policies: true"),
            "{err}"
        );
        let set = load_dir_with(
            dir.path(),
            LoadOptions {
                allow_empty: true,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        assert_eq!(set.summary().domains, 0);
        // Problems are reported first: an empty set is not the news when files are broken.
        std::fs::write(dir.path().join("x.yaml"), "domain: [").unwrap();
        assert!(matches!(load_dir(dir.path()), Err(PolicyError::Invalid(_))));
    }

    /// envoyproxy/ratelimit's reading: every file whatever its extension (`Files::All`), or every
    /// file not starting with a dot (`Files::Visible`, its `RUNTIME_IGNOREDOTFILES=true`).
    #[test]
    fn any_extension_reads_every_file_and_visible_skips_dot_files() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("edge"), "domain: edge\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n").unwrap();
        std::fs::write(d.join("api.conf"), "domain: api\n").unwrap();
        std::fs::write(d.join(".hidden"), "domain: hidden\n").unwrap();
        let domains = |files: Files| {
            let set = load_dir_with(
                d,
                LoadOptions {
                    files,
                    ..LoadOptions::default()
                },
            )
            .unwrap();
            set.domains()
                .into_iter()
                .map(|d| d.name.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(domains(Files::All), ["api", "edge", "hidden"]);
        assert_eq!(domains(Files::Visible), ["api", "edge"]);
        // The default reads *.yaml/*.yml only: none here.
        let err = load_dir(d).unwrap_err();
        assert!(matches!(err, PolicyError::Empty { .. }), "{err}");
        // A file that is not YAML breaks the whole load, as in the reference.
        std::fs::write(d.join("notes.txt"), "just: [text").unwrap();
        let err = load_dir_with(
            d,
            LoadOptions {
                files: Files::Visible,
                ..LoadOptions::default()
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("notes.txt"), "{err}");
    }

    const MERGE_A: &str = r"
domain: d
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: w
    value: x*
    rate_limit: {unit: minute, requests_per_unit: 2}
";

    const MERGE_B: &str = r"
domain: d
descriptors:
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 3}
    descriptors:
      - key: c
        rate_limit: {unit: minute, requests_per_unit: 4}
  - key: w
    value: xy*
    rate_limit: {unit: minute, requests_per_unit: 5}
";

    #[test]
    fn merged_domains_concatenate_the_files_in_order() {
        let s = load_str_with(
            &[
                ("a.yaml", MERGE_A),
                ("b.yaml", MERGE_B),
                ("o.yaml", "domain: other"),
            ],
            true,
        )
        .unwrap();
        assert_eq!(s.summary().domains, 2);
        let d = s.domain("d").unwrap();
        assert_eq!(d.files(), ["a.yaml", "b.yaml"]);
        assert_eq!(d.file(), "a.yaml");
        let rpu = |e: &[(&str, &str)]| {
            d.resolve(e.iter().copied())
                .map(|r| match r.rules[0].limit {
                    Limit::Limited(rate) => rate.requests_per_unit,
                    Limit::Unlimited => u32::MAX,
                })
        };
        assert_eq!(rpu(&[("a", "1")]), Some(1));
        assert_eq!(rpu(&[("b", "1")]), Some(3));
        assert_eq!(rpu(&[("b", "1"), ("c", "2")]), Some(4));
        // Wildcards in file order, across files: a.yaml's `x*` comes before b.yaml's `xy*`.
        assert_eq!(rpu(&[("w", "xyz")]), Some(2));
        // The rules' identities are the domain's and path's, whichever file holds them, so
        // counters are the same merged or not.
        let alone = load_str(&[("b.yaml", MERGE_B)]).unwrap();
        let ids = |d: &Domain| {
            let mut v: Vec<(String, u128)> =
                d.rules().map(|r| (r.stats_key.clone(), r.id)).collect();
            v.sort();
            v
        };
        let merged_ids = ids(d);
        for id in ids(alone.domain("d").unwrap()) {
            if id.0 != "d.w_xy*" {
                assert!(merged_ids.contains(&id), "{id:?}");
            }
        }
        // Without merging the second file is refused, naming both and the setting.
        let err = load_str(&[("a.yaml", MERGE_A), ("b.yaml", MERGE_B)])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "b.yaml: domain: duplicate domain \"d\" (also in a.yaml); set merge_domains: true"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_descriptor_in_two_merged_files_is_a_duplicate_naming_both() {
        let b = "domain: d\ndescriptors:\n  - key: z\n    rate_limit: {unit: minute, requests_per_unit: 1}\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 9}\n";
        let c = "domain: d\ndescriptors:\n  - key: q\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n";
        let Err(PolicyError::Invalid(p)) =
            load_str_with(&[("a.yaml", MERGE_A), ("b.yaml", b), ("c.yaml", c)], true)
        else {
            panic!("expected problems");
        };
        let text: Vec<String> = p.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "b.yaml:5:5: descriptors[1]: duplicate descriptor `a` (already at descriptors[0] of a.yaml)",
                "c.yaml:4:24: descriptors[0].rate_limit.unit: invalid rate limit unit \"fortnight\" (expected second, minute, hour, day, week, month or year)",
            ]
        );
        // A file without a domain is still reported as such.
        let Err(PolicyError::Invalid(p)) =
            load_str_with(&[("a.yaml", MERGE_A), ("n.yaml", "descriptors: []")], true)
        else {
            panic!("expected problems");
        };
        assert_eq!(p[0].to_string(), "n.yaml:1:1: domain: missing domain");
    }
}
