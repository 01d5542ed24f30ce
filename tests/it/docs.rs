//! The book under `docs/src` and the pages at the top of the repository, held to the code: every
//! relative link and `#anchor` resolves, every page is in `SUMMARY.md`, the settings table has
//! one row per field of [`Written`] with the code's default, flag and environment variable, and
//! the metrics tables name exactly the metrics the code registers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use sluice::settings::Written;

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

pub(crate) fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

pub(crate) fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every file under `dir` whose name ends with `ext`, sorted.
pub(crate) fn files_under(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.to_string_lossy().ends_with(ext) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The book's pages and the Markdown files a reader opens at the top of the repository.
pub(crate) fn pages() -> Vec<PathBuf> {
    let mut pages = files_under(&repo().join("docs/src"), ".md");
    for top in ["README.md", "BENCHMARKS.md", "CHANGELOG.md"] {
        if repo().join(top).exists() {
            pages.push(repo().join(top));
        }
    }
    pages
}

/// The lines of a Markdown text outside fenced code blocks, with their line numbers.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push((n + 1, line));
        }
    }
    out
}

/// The targets of the inline links and images on a line: `[text](target)`.
fn link_targets(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(&after[..end]);
        rest = &after[end..];
    }
    out
}

/// The anchor mdbook gives a heading: its text without Markdown, lower case, spaces as `-`,
/// every other character that is not alphanumeric, `-` or `_` dropped. GitHub's is the same
/// for the headings these pages have.
fn anchor(heading: &str) -> String {
    let mut text = String::new();
    let mut chars = heading.chars().peekable();
    while let Some(c) = chars.next() {
        // A link keeps its text: `[text](target)` reads as `text`.
        if c == ']' && chars.peek() == Some(&'(') {
            for c in chars.by_ref() {
                if c == ')' {
                    break;
                }
            }
            continue;
        }
        text.push(c);
    }
    text.trim()
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_ascii_lowercase())
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The anchors of a page's headings, a repeated one numbered as mdbook numbers it.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let id = anchor(heading);
        let n = seen.entry(id.clone()).or_insert(0);
        out.insert(if *n == 0 {
            id.clone()
        } else {
            format!("{id}-{n}")
        });
        *n += 1;
    }
    out
}

#[test]
fn every_relative_link_and_anchor_in_the_book_resolves() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = read(&page);
        let dir = page.parent().unwrap();
        for (n, line) in prose(&text) {
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, fragment) = target.split_once('#').unwrap_or((target, ""));
                let path = if file.is_empty() {
                    page.clone()
                } else {
                    dir.join(file)
                };
                let here = format!("{}:{n}: {target}", page.display());
                if !path.exists() {
                    broken.push(format!("{here}: no such file"));
                } else if !fragment.is_empty() && !anchors(&read(&path)).contains(fragment) {
                    broken.push(format!("{here}: no heading has this anchor"));
                }
            }
            // mdbook's includes: `{{#include path}}` or `{{#include path:anchor}}`.
            if let Some(rest) = line.trim().strip_prefix("{{#include ") {
                let target = rest.trim_end_matches("}}");
                let file = target.split(':').next().unwrap();
                if !dir.join(file).exists() {
                    broken.push(format!(
                        "{}:{n}: include {file}: no such file",
                        page.display()
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_page_of_the_book_is_in_its_summary() {
    let src = repo().join("docs/src");
    let summary = read(&src.join("SUMMARY.md"));
    let listed: BTreeSet<PathBuf> = prose(&summary)
        .into_iter()
        .flat_map(|(_, line)| link_targets(line))
        .map(|target| src.join(target))
        .collect();
    let orphans: Vec<_> = files_under(&src, ".md")
        .into_iter()
        .filter(|p| !p.ends_with("SUMMARY.md") && !listed.contains(p))
        .collect();
    assert!(orphans.is_empty(), "pages not in SUMMARY.md: {orphans:?}");
}

/// The cells of the rows of every table on a page whose header row starts with `first`.
fn table_rows(text: &str, first: &str) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let mut inside = false;
    for (_, line) in prose(text) {
        let line = line.trim();
        if !line.starts_with('|') {
            inside = false;
            continue;
        }
        let cells: Vec<String> = line
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect();
        if cells[0] == first {
            inside = true;
        } else if inside && !cells[0].starts_with("---") {
            rows.push(cells);
        }
    }
    rows
}

/// A cell's text inside backticks: `` `x` `` reads as `x`.
fn code(cell: &str) -> &str {
    cell.trim().trim_matches('`')
}

/// A setting's dotted name: `key` under `prefix` (`redis` and `url` give `redis.url`).
fn dotted(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Every setting's dotted name and default, as the code has them.
fn settings_in_the_code() -> BTreeMap<String, serde_json::Value> {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    walk(&dotted(prefix, k), v, out);
                }
            }
            leaf => {
                out.insert(prefix.to_string(), leaf.clone());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(
        "",
        &serde_json::to_value(Written::default()).unwrap(),
        &mut out,
    );
    out
}

/// How the settings page writes a default: the value as the settings file would, `""` for an
/// empty text, `unset` for none.
fn written_default(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "unset".into(),
        serde_json::Value::String(s) if s.is_empty() => "\"\"".into(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Every long flag `sluice serve --help` lists, but `--config` and `--help`.
fn serve_flags() -> BTreeSet<String> {
    let out = std::process::Command::new(BIN)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(|w| w.trim_end_matches(',').to_string())
        .filter(|w| w != "--config" && w != "--help")
        .collect()
}

#[test]
fn the_settings_page_has_every_setting_with_its_default_flag_and_variable() {
    let page = read(&repo().join("docs/src/operate/settings.md"));
    let settings = settings_in_the_code();
    let flags = serve_flags();
    let mut problems = Vec::new();
    let mut rows: BTreeMap<String, usize> = BTreeMap::new();
    let mut flags_seen = BTreeSet::new();
    for cells in table_rows(&page, "setting") {
        let [name, default, flag, env, meaning] = &cells[..] else {
            problems.push(format!("not five cells: {cells:?}"));
            continue;
        };
        let name = code(name);
        *rows.entry(name.to_string()).or_default() += 1;
        let Some(value) = settings.get(name) else {
            problems.push(format!("{name}: no such setting"));
            continue;
        };
        if code(default) != written_default(value) {
            problems.push(format!(
                "{name}: the page says {default}, the code {}",
                written_default(value)
            ));
        }
        let variable = format!("SLUICE_{}", name.to_uppercase().replace('.', "__"));
        if code(env) != variable {
            problems.push(format!("{name}: the variable is {variable}, not {env}"));
        }
        if !flag.is_empty() {
            if !flags.contains(code(flag)) {
                problems.push(format!("{name}: `sluice serve` has no flag {flag}"));
            }
            flags_seen.insert(code(flag).to_string());
        }
        if meaning.is_empty() {
            problems.push(format!("{name}: no meaning"));
        }
    }
    for name in settings.keys() {
        match rows.get(name) {
            None => problems.push(format!("{name}: no row")),
            Some(1) => {}
            Some(n) => problems.push(format!("{name}: {n} rows")),
        }
    }
    for flag in flags.difference(&flags_seen) {
        problems.push(format!(
            "{flag}: a flag of `sluice serve` that no row names"
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The metric names the code registers: every string literal in `src/` that is a whole
/// metric name of ours or of envoyproxy/ratelimit's Prometheus mapping.
fn metrics_in_the_code() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for file in files_under(&repo().join("src"), ".rs") {
        let text = read(&file);
        for prefix in ["\"sluice_", "\"ratelimit_service_"] {
            for (i, _) in text.match_indices(prefix) {
                let literal = text[i + 1..].split('"').next().unwrap();
                if literal
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                {
                    out.insert(literal.to_string());
                }
            }
        }
    }
    out
}

#[test]
fn the_metrics_page_names_exactly_the_metrics_of_the_code() {
    let page = read(&repo().join("docs/src/operate/metrics.md"));
    let documented: BTreeSet<String> = table_rows(&page, "metric")
        .iter()
        .map(|cells| code(&cells[0]).to_string())
        .collect();
    let registered = metrics_in_the_code();
    assert!(!registered.is_empty(), "no metric found in src/");
    let missing: Vec<_> = registered.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&registered).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "metrics with no row: {missing:?}; rows naming no metric of the code: {unknown:?}"
    );
}

/// The dotted names of the values written in a YAML mapping.
fn yaml_leaves(prefix: &str, yaml: &yaml_rust2::Yaml, out: &mut BTreeSet<String>) {
    match yaml.as_hash() {
        Some(map) => {
            for (k, v) in map {
                let k = k.as_str().expect("a settings key is text");
                yaml_leaves(&dotted(prefix, k), v, out);
            }
        }
        None => {
            out.insert(prefix.to_string());
        }
    }
}

/// `config/sluice.yaml` writes out every setting (its values are the defaults: the settings
/// module's own test loads it and compares). A setting unset by default may stand there as a
/// comment, `# name: example`.
#[test]
fn the_settings_file_writes_out_every_setting() {
    let text = read(&repo().join("config/sluice.yaml"));
    let docs = yaml_rust2::YamlLoader::load_from_str(&text).unwrap();
    let mut written = BTreeSet::new();
    yaml_leaves("", &docs[0], &mut written);
    let missing: Vec<_> = settings_in_the_code()
        .into_iter()
        .filter(|(name, default)| {
            let last = name.rsplit('.').next().unwrap();
            let commented = default.is_null() && text.contains(&format!("# {last}:"));
            !written.contains(name) && !commented
        })
        .map(|(name, _)| name)
        .collect();
    assert!(
        missing.is_empty(),
        "settings not written out in config/sluice.yaml: {missing:?}"
    );
}

/// `1234567` as the log writes it: `1,234,567`.
fn with_commas(n: &str) -> String {
    let mut out = String::new();
    for (i, c) in n.chars().enumerate() {
        if i > 0 && (n.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The plot draws recorded figures only: every number of `benches/load/figures.csv`, and its
/// commit, is in the benchmark log.
#[test]
fn the_plotted_figures_are_in_the_benchmark_log() {
    let log = read(&repo().join("docs/src/benchmarks/log.md"));
    let csv = read(&repo().join("benches/load/figures.csv"));
    let mut problems = Vec::new();
    for line in csv.lines().skip(1) {
        // "scenario",floor,sluice,commit,date,"source"
        let rest = line.split_once("\",").map_or(line, |(_, after)| after);
        let fields: Vec<&str> = rest.split(',').collect();
        for figure in fields[..2].iter().filter(|f| !f.is_empty()) {
            if !log.contains(&with_commas(figure)) {
                problems.push(format!("{figure} is not in the log ({line})"));
            }
        }
        if !log.contains(&format!("`{}`", fields[2])) {
            problems.push(format!("commit {} is not in the log", fields[2]));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The pages at the top of the repository stay a front door: the manual is the book.
#[test]
fn the_readme_and_benchmarks_pages_stay_short() {
    for (page, most) in [("README.md", 200), ("BENCHMARKS.md", 150)] {
        let lines = read(&repo().join(page)).lines().count();
        assert!(lines <= most, "{page} has {lines} lines, more than {most}");
    }
}
