//! The crate's layers, checked from its imports: every `use` and every `crate::`/`super::` path
//! in `src/` (test modules aside) is resolved to the file that defines what it names, through
//! any `pub use` on the way, and must point to a lower layer, never into a circle of files.
//! `cargo test --test it layers -- --nocapture` prints the module graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, top first. A module may import only from the lines below its own; the modules of
/// one line are peers and import nothing from each other.
const LAYERS: &[&[&str]] = &[
    &["main"],
    &["cli"],
    &["app", "fuzz"],
    &["server", "lab", "reload", "xds", "probe", "client"],
    &["settings", "wire"],
    &["traces"],
    &["decision", "rlqs"],
    &["metrics"],
    &["policy"],
    &["limiter"],
    &[
        "histogram",
        "tls",
        "pb",
        "telemetry",
        "shutdown",
        "allocator",
    ],
];

/// Narrower rules for some files, first match by path prefix: the outside crates they must not
/// use, and the files they must not import (by path prefix, within the layers below them).
const RULES: &[Rule] = &[
    Rule {
        files: "limiter/redis/",
        why: "the Redis backend knows no transport (it runs on tokio)",
        no_crates: &["tonic", "axum", "hyper"],
        no_files: &[],
        only: None,
    },
    Rule {
        files: "limiter/",
        why: "counting is pure: no runtime, no transport",
        no_crates: &["tonic", "tokio", "axum", "hyper"],
        no_files: &[],
        only: None,
    },
    Rule {
        files: "policy/",
        why: "policies are pure: no runtime, no transport",
        no_crates: &["tonic", "tokio", "axum", "hyper"],
        no_files: &[],
        only: None,
    },
    Rule {
        files: "decision/",
        why: "the decision use case knows no transport",
        no_crates: &["tonic", "axum", "hyper"],
        no_files: &[],
        only: None,
    },
    Rule {
        files: "rlqs/",
        why: "RLQS assignments are plain values: no runtime, no transport",
        no_crates: &["tonic", "tokio", "axum", "hyper"],
        no_files: &[],
        only: None,
    },
    Rule {
        files: "server/",
        why: "the adapters reach the backend through its seam, no store",
        no_crates: &[],
        no_files: &["limiter/store.rs", "limiter/redis/", "limiter/fallback.rs"],
        only: None,
    },
    Rule {
        files: "lab/algorithms.rs",
        why: "the lab's comparison counters are pure",
        no_crates: &["tonic", "tokio", "axum", "hyper"],
        no_files: &[],
        only: Some(&[]),
    },
    Rule {
        files: "client/",
        why: "the client is the other side of the wire: it speaks pb only",
        no_crates: &[],
        no_files: &[],
        only: Some(&["pb"]),
    },
];

struct Rule {
    files: &'static str,
    why: &'static str,
    no_crates: &'static [&'static str],
    no_files: &'static [&'static str],
    /// When set, the only modules these files may import.
    only: Option<&'static [&'static str]>,
}

/// Whether `code` uses the outside crate `name` (a path starting with `name::`).
fn uses_crate(code: &str, name: &str) -> bool {
    let needle = format!("{name}::");
    code.match_indices(&needle).any(|(at, _)| {
        at == 0 || {
            let prev = code.as_bytes()[at - 1];
            !(prev.is_ascii_alphanumeric() || prev == b'_' || prev == b':')
        }
    })
}

/// One Rust file of the crate, as a module path (`["limiter", "redis", "lease"]`).
struct File {
    path: PathBuf,
    module: Vec<String>,
    /// The file's code, comments and test modules taken out.
    code: String,
}

/// What the check found.
#[derive(Debug, Default)]
struct Report {
    /// File → the files it takes names from.
    edges: BTreeMap<String, BTreeSet<String>>,
    /// Module → the modules it takes names from.
    modules: BTreeMap<String, BTreeSet<String>>,
    violations: Vec<String>,
}

fn files(src: &Path) -> Vec<File> {
    let mut out = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("src is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let mut module: Vec<String> = rel
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if module.last().is_some_and(|m| m == "mod" || m == "lib") {
                module.pop();
            }
            if module.last().is_some_and(|m| m == "tests") {
                continue; // a test module of its own file
            }
            let text = std::fs::read_to_string(&path).expect("a readable source file");
            out.push(File {
                path: rel.to_path_buf(),
                module,
                code: without_tests(&without_comments(&text)),
            });
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// The text with `//` comments blanked (string literals kept; a `//` inside one, as in a URL,
/// is not a comment).
fn without_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut in_str = false;
        let mut prev = '\0';
        let mut cut = line.len();
        for (i, c) in line.char_indices() {
            if c == '"' && prev != '\\' {
                in_str = !in_str;
            }
            if !in_str && c == '/' && prev == '/' {
                cut = i - 1;
                break;
            }
            prev = c;
        }
        out.push_str(&line[..cut]);
        out.push('\n');
    }
    out
}

/// The code with every `#[cfg(test)]` item (a test module, a test helper) taken out.
fn without_tests(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        // The item ends at its `;` or at the brace that closes its first `{`.
        let (semi, brace) = (after.find(';'), after.find('{'));
        let end = match (semi, brace) {
            (Some(s), Some(b)) if s < b => s + 1,
            (_, Some(b)) => {
                let mut depth = 0usize;
                let mut end = after.len();
                for (i, c) in after[b..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = b + i + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (Some(s), None) => s + 1,
            (None, None) => after.len(),
        };
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// A `use` tree (`a::{b, c::d as e, f::*}`) as flat paths, each with the name it binds.
fn expand(tree: &str) -> Vec<(Vec<String>, String)> {
    let mut tree = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    for (from, to) in [
        (":: ", "::"),
        (" ::", "::"),
        ("{ ", "{"),
        (" }", "}"),
        (", ", ","),
        (" ,", ","),
    ] {
        tree = tree.replace(from, to);
    }
    let mut out = Vec::new();
    expand_into(&tree, &mut Vec::new(), &mut out);
    out
}

fn expand_into(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<(Vec<String>, String)>) {
    let segments = |s: &str| -> Vec<String> {
        s.split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    };
    if let Some(open) = tree.find('{') {
        let depth = prefix.len();
        prefix.extend(segments(&tree[..open]));
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let mut level = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => level += 1,
                '}' => level -= 1,
                ',' if level == 0 => {
                    expand_into(&inner[start..i], prefix, out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand_into(&inner[start..], prefix, out);
        prefix.truncate(depth);
        return;
    }
    if tree.is_empty() {
        return;
    }
    let (path, alias) = match tree.split_once(" as ") {
        Some((path, alias)) => (path, Some(alias)),
        None => (tree, None),
    };
    let mut full = prefix.clone();
    full.extend(segments(path));
    if full.last().is_some_and(|s| s == "self") {
        full.pop();
    }
    let name = alias
        .map(str::to_string)
        .or_else(|| full.last().cloned())
        .unwrap_or_default();
    out.push((full, name));
}

/// The `use` statements of a file: (is a re-export, the tree, where the statement lies).
fn uses(code: &str) -> Vec<(bool, String, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut from = 0;
    while let Some(at) = code[from..].find("use ") {
        let at = from + at;
        from = at + 4;
        let boundary = at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_');
        if !boundary {
            continue;
        }
        let line_start = code[..at].rfind('\n').map_or(0, |i| i + 1);
        let before = code[line_start..at].trim();
        let public = before.starts_with("pub");
        if !(before.is_empty() || public) {
            continue;
        }
        let Some(end) = code[at..].find(';') else {
            break;
        };
        out.push((
            public,
            code[at + 4..at + end].trim().to_string(),
            line_start..at + end,
        ));
        from = at + end;
    }
    out
}

/// The `crate::`, `super::` and `sluice::` paths used in code outside `use` statements.
fn inline_paths(code: &str) -> Vec<Vec<String>> {
    let statements: Vec<_> = uses(code).into_iter().map(|(_, _, at)| at).collect();
    let mut out = Vec::new();
    for root in ["crate::", "super::", "sluice::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(root) {
            let at = from + at;
            from = at + root.len();
            if at > 0 {
                let prev = code.as_bytes()[at - 1];
                if prev.is_ascii_alphanumeric() || prev == b'_' || prev == b':' {
                    continue;
                }
            }
            if statements.iter().any(|s| s.contains(&at)) {
                continue;
            }
            let path: String = code[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            out.push(
                path.split("::")
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect(),
            );
        }
    }
    out
}

struct Crate {
    by_module: BTreeMap<Vec<String>, usize>,
    /// Per file: name → the path it re-exports.
    reexports: Vec<BTreeMap<String, Vec<String>>>,
}

impl Crate {
    fn new(files: &[File]) -> Self {
        let by_module = files
            .iter()
            .enumerate()
            .filter(|(_, f)| f.path != Path::new("main.rs"))
            .map(|(i, f)| (f.module.clone(), i))
            .collect();
        let mut krate = Crate {
            by_module,
            reexports: Vec::new(),
        };
        krate.reexports = files
            .iter()
            .map(|f| {
                uses(&f.code)
                    .into_iter()
                    .filter(|(public, _, _)| *public)
                    .flat_map(|(_, tree, _)| expand(&tree))
                    .map(|(path, name)| (name, krate.absolute(f, &path)))
                    .filter(|(_, path)| !path.is_empty())
                    .collect()
            })
            .collect();
        krate
    }

    /// A path as written in `file`, from the crate root; external crates give an empty path.
    fn absolute(&self, file: &File, path: &[String]) -> Vec<String> {
        let Some(first) = path.first() else {
            return Vec::new();
        };
        let base: &[String] = &file.module;
        // A non-`mod.rs` file's `super` is its folder's module.
        let mut here: Vec<String> = base.to_vec();
        match first.as_str() {
            "crate" | "sluice" => path[1..].to_vec(),
            "self" => {
                here.extend(path[1..].iter().cloned());
                here
            }
            "super" => {
                let mut rest = path;
                while rest.first().is_some_and(|s| s == "super") {
                    here.pop();
                    rest = &rest[1..];
                }
                here.extend(rest.iter().cloned());
                here
            }
            child => {
                let mut candidate = base.to_vec();
                candidate.push(child.to_string());
                if self.by_module.contains_key(&candidate) {
                    candidate.extend(path[1..].iter().cloned());
                    candidate
                } else {
                    Vec::new()
                }
            }
        }
    }

    /// The file that defines what `path` (from the crate root) names, through re-exports.
    fn defining(&self, path: &[String], depth: usize) -> Option<usize> {
        let mut split = path.len();
        let module = loop {
            if let Some(&i) = self.by_module.get(&path[..split]) {
                break i;
            }
            if split == 0 {
                return None;
            }
            split -= 1;
        };
        if let Some(name) = path.get(split)
            && depth < 16
            && let Some(target) = self.reexports[module].get(name)
        {
            let mut next = target.clone();
            next.extend(path[split + 1..].iter().cloned());
            return self.defining(&next, depth + 1).or(Some(module));
        }
        Some(module)
    }
}

fn top(file: &File) -> String {
    if file.path == Path::new("main.rs") {
        return "main".into();
    }
    file.module.first().cloned().unwrap_or_else(|| "lib".into())
}

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn check(src: &Path) -> Report {
    let files = files(src);
    let krate = Crate::new(&files);
    let mut report = Report::default();
    let mut edges: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); files.len()];
    let mut graph = edges.clone();
    for (i, file) in files.iter().enumerate() {
        let mut paths: Vec<Vec<String>> = uses(&file.code)
            .into_iter()
            .flat_map(|(_, tree, _)| expand(&tree))
            .map(|(path, _)| path)
            .collect();
        paths.extend(inline_paths(&file.code));
        for path in paths {
            let absolute = krate.absolute(file, &path);
            if absolute.is_empty() {
                continue;
            }
            if let Some(j) = krate.defining(&absolute, 0)
                && j != i
            {
                edges[i].insert(j);
                // A file may use what its own module (an enclosing `mod.rs`) defines: the
                // folder is one module. What the module only re-exports was resolved above to
                // the file that defines it.
                let own = files[j].module.len() < files[i].module.len()
                    && files[i].module.starts_with(&files[j].module);
                if !own {
                    graph[i].insert(j);
                }
            }
        }
    }
    let name = |i: usize| files[i].path.display().to_string();
    for (i, targets) in edges.iter().enumerate() {
        let from = top(&files[i]);
        if from == "lib" {
            continue;
        }
        for &j in targets {
            report.edges.entry(name(i)).or_default().insert(name(j));
            let to = top(&files[j]);
            if to == from || to == "lib" {
                continue;
            }
            report
                .modules
                .entry(from.clone())
                .or_default()
                .insert(to.clone());
            match (layer(&from), layer(&to)) {
                (None, _) => report
                    .violations
                    .push(format!("{from} is in no layer ({})", name(i))),
                (_, None) => report
                    .violations
                    .push(format!("{to} is in no layer ({})", name(j))),
                (Some(a), Some(b)) if b <= a => report.violations.push(format!(
                    "{} imports {}: {to} is not below {from}",
                    name(i),
                    name(j)
                )),
                _ => {}
            }
        }
    }
    for (i, file) in files.iter().enumerate() {
        let path = file.path.display().to_string();
        let Some(rule) = RULES.iter().find(|r| path.starts_with(r.files)) else {
            continue;
        };
        for name in rule.no_crates {
            if uses_crate(&file.code, name) {
                report
                    .violations
                    .push(format!("{path} uses {name}: {}", rule.why));
            }
        }
        for &j in &edges[i] {
            let target = name(j);
            let to = top(&files[j]);
            let banned = rule.no_files.iter().any(|p| target.starts_with(p));
            let outside = rule
                .only
                .is_some_and(|only| to != top(file) && !only.contains(&to.as_str()));
            if banned || outside {
                report
                    .violations
                    .push(format!("{path} imports {target}: {}", rule.why));
            }
        }
    }
    for circle in circles(&graph) {
        let names: Vec<String> = circle.into_iter().map(name).collect();
        report
            .violations
            .push(format!("a circle of files: {}", names.join(" → ")));
    }
    report.violations.sort();
    report.violations.dedup();
    report
}

/// The strongly connected components of more than one file (Tarjan's algorithm).
fn circles(graph: &[BTreeSet<usize>]) -> Vec<Vec<usize>> {
    struct State<'g> {
        graph: &'g [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State<'_>, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in s.graph[v].clone().iter() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort_unstable();
                s.out.push(component);
            }
        }
    }
    let n = graph.len();
    let mut s = State {
        graph,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

fn render(report: &Report) -> String {
    let mut out = String::from("the crate's modules by layer, top first, and what each imports:\n");
    for layer in LAYERS {
        for module in *layer {
            let deps = report.modules.get(*module).map_or_else(String::new, |d| {
                d.iter().cloned().collect::<Vec<_>>().join(", ")
            });
            out.push_str(&format!("  {module:<10} → {deps}\n"));
        }
        out.push_str("  ──────────\n");
    }
    out
}

#[test]
fn every_import_points_to_a_lower_layer_and_no_files_form_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let report = check(&src);
    println!("{}", render(&report));
    assert!(
        report.violations.is_empty(),
        "layer violations:\n{}",
        report.violations.join("\n")
    );
    // The check read the tree: the known arrows are there.
    assert!(report.modules["server"].contains("decision"));
    assert!(report.modules["lab"].contains("wire"));
    assert!(
        report.edges.len() > 40,
        "{} files with imports",
        report.edges.len()
    );
}

/// A small crate written to a temporary directory.
fn planted(files: &[(&str, &str)]) -> Report {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    // Relaxed: only uniqueness matters.
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("sluice-layers-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (path, text) in files {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    let report = check(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    report
}

const CLEAN: &[(&str, &str)] = &[
    (
        "lib.rs",
        "pub mod limiter;\npub mod tls;\npub mod settings;\n",
    ),
    ("tls/mod.rs", "pub struct TlsFiles;\n"),
    (
        "settings/mod.rs",
        "use crate::tls::TlsFiles;\npub struct GrpcTls(TlsFiles);\n",
    ),
    (
        "limiter/mod.rs",
        "pub mod gcra;\npub mod redis;\npub use gcra::Quota;\n",
    ),
    ("limiter/gcra.rs", "pub struct Quota;\n"),
    (
        "limiter/redis/mod.rs",
        "// use crate::settings::GrpcTls;\nuse crate::limiter::gcra::Quota;\nuse crate::tls::TlsFiles;\n",
    ),
];

fn with(change: (&'static str, &'static str)) -> Vec<(&'static str, &'static str)> {
    let mut files: Vec<_> = CLEAN
        .iter()
        .copied()
        .filter(|(p, _)| *p != change.0)
        .collect();
    files.push(change);
    files
}

#[test]
fn a_planted_crate_without_violations_passes() {
    let report = planted(CLEAN);
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert!(report.modules["settings"].contains("tls"));
    assert!(report.modules["limiter"].contains("tls"));
}

#[test]
fn an_import_of_a_higher_layer_fails() {
    let report = planted(&with((
        "limiter/redis/mod.rs",
        "use crate::settings::GrpcTls;\n",
    )));
    assert_eq!(
        report.violations,
        ["limiter/redis/mod.rs imports settings/mod.rs: settings is not below limiter"]
    );
    // Written inline rather than in a `use`, it fails the same.
    let report = planted(&with((
        "limiter/redis/mod.rs",
        "fn f() -> Option<crate::settings::GrpcTls> { None }\n",
    )));
    assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
}

#[test]
fn an_import_through_a_reexport_is_judged_by_where_the_name_is_defined() {
    // `tls` re-exports a settings type: the leaf reaches up, and so would any caller of it.
    let mut files = with(("tls/mod.rs", "pub use crate::settings::GrpcTls;\n"));
    files.retain(|(p, _)| *p != "settings/mod.rs");
    files.push(("settings/mod.rs", "pub struct GrpcTls;\n"));
    files.push((
        "limiter/key.rs",
        "use crate::tls::GrpcTls;\npub fn f(_: GrpcTls) {}\n",
    ));
    let report = planted(&files);
    assert!(
        report.violations.contains(
            &"limiter/key.rs imports settings/mod.rs: settings is not below limiter".into()
        ),
        "{:?}",
        report.violations
    );
    assert!(
        report
            .violations
            .contains(&"tls/mod.rs imports settings/mod.rs: settings is not below tls".into()),
        "{:?}",
        report.violations
    );
}

#[test]
fn a_circle_of_files_fails_also_through_a_parents_reexport() {
    // Each of two files takes a name from the other, one of them through `mod.rs`.
    let circle = [
        (
            "limiter/redis/mod.rs",
            "mod coalesce;\nmod lease;\npub use coalesce::Job;\n",
        ),
        (
            "limiter/redis/lease.rs",
            "use super::Job;\npub struct Lease(Job);\n",
        ),
        (
            "limiter/redis/coalesce.rs",
            "pub struct Job(Option<Box<super::lease::Lease>>);\n",
        ),
    ];
    let mut files = with(circle[0]);
    files.extend(&circle[1..]);
    assert_eq!(
        planted(&files).violations,
        ["a circle of files: limiter/redis/coalesce.rs → limiter/redis/lease.rs"]
    );
    // A file may use what its own module's `mod.rs` defines: the folder is one module.
    let mut files = with((
        "limiter/redis/mod.rs",
        "mod lease;\npub use lease::Leased;\npub struct Store;\n",
    ));
    files.push((
        "limiter/redis/lease.rs",
        "use super::Store;\npub struct Leased(Store);\n",
    ));
    let report = planted(&files);
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    // `super::super` up to a re-export resolves to the file that defines the name.
    let report = planted(&with((
        "limiter/redis/mod.rs",
        "use super::super::limiter::Quota;\n",
    )));
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert!(report.edges["limiter/redis/mod.rs"].contains("limiter/gcra.rs"));
}

#[test]
fn peers_of_one_layer_import_nothing_from_each_other() {
    let report = planted(
        &[
            ("lib.rs", "pub mod server;\npub mod lab;\n"),
            ("server/mod.rs", "pub fn serve() {}\n"),
            ("lab/mod.rs", "use crate::server::serve;\n"),
        ][..],
    );
    assert_eq!(
        report.violations,
        ["lab/mod.rs imports server/mod.rs: server is not below lab"]
    );
}

#[test]
fn the_narrower_rules_fail_too() {
    let report = planted(&with((
        "limiter/gcra.rs",
        "pub struct Quota;\nasync fn f() { tokio::task::yield_now().await }\n",
    )));
    assert_eq!(
        report.violations,
        ["limiter/gcra.rs uses tokio: counting is pure: no runtime, no transport"]
    );
    let report = planted(&with((
        "limiter/redis/mod.rs",
        "async fn f() { tokio::task::yield_now().await }\n",
    )));
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let mut files = CLEAN.to_vec();
    files.push(("client/mod.rs", "use crate::limiter::gcra::Quota;\n"));
    files.push((
        "lib.rs",
        "pub mod client;\npub mod limiter;\npub mod tls;\npub mod settings;\n",
    ));
    files.retain(|(p, t)| *p != "lib.rs" || t.contains("client"));
    assert_eq!(
        planted(&files).violations,
        [
            "client/mod.rs imports limiter/gcra.rs: the client is the other side of the wire: it speaks pb only"
        ]
    );
}

#[test]
fn test_modules_and_comments_are_not_imports() {
    let report = planted(&with((
        "limiter/redis/mod.rs",
        "/// [`crate::settings::GrpcTls`]\npub fn f() {}\n\n#[cfg(test)]\nmod tests {\n    use crate::settings::GrpcTls;\n}\n",
    )));
    assert!(report.violations.is_empty(), "{:?}", report.violations);
}
