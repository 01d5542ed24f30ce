//! The book under `docs/src` and the pages at the top of the repository: every relative link
//! and `#anchor` resolves, and every page is in `SUMMARY.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every file under `dir` whose name ends with `ext`, sorted.
fn files_under(dir: &Path, ext: &str) -> Vec<PathBuf> {
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
fn pages() -> Vec<PathBuf> {
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
