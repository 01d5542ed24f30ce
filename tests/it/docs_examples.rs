//! The examples of the book and the README, held to what they show. Every shell block a reader
//! would paste is either a `console` block, whose `$ ` commands this module runs against the
//! debug binary (and a server it starts for `localhost:8080`) and whose output must match the
//! page (`...` stands for any lines), or is preceded by `<!-- not run: reason -->`. The Rust
//! examples of the client half are the doc tests of `sluice::client::layer` and
//! `sluice::client::quota::Quota`, line for line.
//! The benchmark log is history: its commands are not run (its preface says why).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::docs::{pages, read, repo};
use crate::helpers::free_port;

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

/// The quick start's server command, after `cargo run --release --`; the examples that call
/// `localhost:8080` run against it.
const QUICK_START_SERVE: [&str; 3] = ["serve", "--config", "config/sluice.yaml"];

/// A fenced block: where it opens, its language, the prose line just above it, and its lines.
struct Block {
    at: String,
    lang: String,
    above: String,
    body: Vec<String>,
}

impl Block {
    fn not_run(&self) -> bool {
        self.above
            .strip_prefix("<!-- not run:")
            .and_then(|r| r.strip_suffix("-->"))
            .is_some_and(|reason| !reason.trim().is_empty())
    }
}

/// The fenced blocks of the pages a reader pastes from: the book but its log, and the README.
fn blocks() -> Vec<Block> {
    let mut out = Vec::new();
    for page in pages() {
        if page.ends_with("benchmarks/log.md") {
            continue;
        }
        let text = read(&page);
        let mut open: Option<(Block, usize)> = None;
        let mut above = String::new();
        for (n, line) in text.lines().enumerate() {
            let trimmed = line.trim_start();
            if let Some(info) = trimmed.strip_prefix("```") {
                match open.take() {
                    Some((block, _)) => out.push(block),
                    None => {
                        let block = Block {
                            at: format!("{}:{}", page.display(), n + 1),
                            lang: info.split(',').next().unwrap().trim().to_string(),
                            above: above.clone(),
                            body: Vec::new(),
                        };
                        open = Some((block, line.len() - trimmed.len()));
                    }
                }
            } else if let Some((block, indent)) = open.as_mut() {
                block
                    .body
                    .push(line.get(*indent..).unwrap_or("").trim_end().to_string());
            } else if !trimmed.is_empty() {
                above = trimmed.to_string();
            }
        }
    }
    out
}

#[test]
fn every_shell_block_is_run_or_says_why_not() {
    let mut problems = Vec::new();
    for block in blocks() {
        let shell = matches!(block.lang.as_str(), "sh" | "bash" | "shell");
        if shell && !block.not_run() {
            problems.push(format!(
                "{}: a shell block neither run (a console block) nor marked <!-- not run: reason -->",
                block.at
            ));
        }
        if block.lang != "console" && block.body.iter().any(|l| l.starts_with("$ ")) {
            problems.push(format!(
                "{}: `$ ` commands belong in a console block",
                block.at
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A console block's commands (continuation lines joined) and the output each shows.
fn commands(block: &Block) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    let mut continued = false;
    for line in &block.body {
        if let Some(command) = line.strip_prefix("$ ") {
            out.push((command.to_string(), Vec::new()));
            continued = command.ends_with('\\');
        } else if continued {
            let (command, _) = out.last_mut().unwrap();
            command.push('\n');
            command.push_str(line);
            continued = line.ends_with('\\');
        } else if let Some((_, shown)) = out.last_mut() {
            shown.push(line.clone());
        }
    }
    out
}

/// Whether `actual` is what `shown` shows, a `...` line standing for any lines.
fn shows(shown: &[String], actual: &[&str]) -> bool {
    match shown.split_first() {
        None => actual.is_empty(),
        Some((first, rest)) if first == "..." => {
            (0..=actual.len()).any(|i| shows(rest, &actual[i..]))
        }
        Some((first, rest)) => actual.first() == Some(&first.as_str()) && shows(rest, &actual[1..]),
    }
}

/// The quick start's server, on free ports, for the commands that call `localhost:8080`.
struct Server {
    child: Child,
    admin: String,
}

impl Server {
    fn start() -> Self {
        let admin = format!("127.0.0.1:{}", free_port());
        let grpc = format!("127.0.0.1:{}", free_port());
        let child = Command::new(BIN)
            .args(QUICK_START_SERVE)
            .args(["--grpc-addr", &grpc, "--admin-addr", &admin])
            .current_dir(repo())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = Server { child, admin };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let health = Command::new("curl")
                .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
                .arg(format!("http://{}/healthcheck", server.admin))
                .output()
                .expect("curl runs the endpoints page's examples");
            if health.stdout == b"200" {
                return server;
            }
            assert!(
                Instant::now() < deadline,
                "the server did not become healthy"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The command as the test runs it: `sluice` and `cargo run --` are the debug binary,
/// `localhost:8080` the test's server, and an SVG the page names is written to a temporary file
/// (returned with the page's file, to compare).
fn as_run(
    command: &str,
    server: &mut Option<Server>,
    tmp: &Path,
) -> (String, Option<(PathBuf, PathBuf)>) {
    let mut command = command.to_string();
    for prefix in ["cargo run -- ", "sluice "] {
        if let Some(rest) = command.strip_prefix(prefix) {
            command = format!("{BIN} {rest}");
        }
    }
    if command.contains("localhost:8080") {
        let admin = server.get_or_insert_with(Server::start).admin.clone();
        command = command.replace("localhost:8080", &admin);
    }
    let mut svg = None;
    if let Some((_, rest)) = command.split_once("--svg ") {
        let shown = rest.split_whitespace().next().unwrap().to_string();
        if repo().join(&shown).exists() {
            let written = tmp.join("drawn.svg");
            command = command.replace(&shown, written.to_str().unwrap());
            svg = Some((repo().join(shown), written));
        }
    }
    (command, svg)
}

#[test]
fn console_blocks_print_what_the_pages_show() {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = None;
    let mut problems = Vec::new();
    let mut ran = 0;
    for block in blocks() {
        if block.lang != "console" || block.not_run() {
            continue;
        }
        for (command, shown) in commands(&block) {
            let (run, svg) = as_run(&command, &mut server, tmp.path());
            let out = Command::new("sh")
                .args(["-c", &run])
                .current_dir(repo())
                .output()
                .unwrap();
            ran += 1;
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            let actual: Vec<&str> = stdout.lines().chain(stderr.lines()).collect();
            if !shows(&shown, &actual) {
                problems.push(format!(
                    "{}: `{command}` printed\n{}\nwhere the page shows\n{}",
                    block.at,
                    actual.join("\n"),
                    shown.join("\n")
                ));
            }
            if let Some((page_svg, drawn)) = svg
                && read(&page_svg) != read(&drawn)
            {
                problems.push(format!(
                    "{}: `{command}` draws another SVG than {}",
                    block.at,
                    page_svg.display()
                ));
            }
        }
    }
    assert!(ran > 0, "no console block found");
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

#[test]
fn the_client_examples_are_doc_tests_of_the_client_half() {
    for (page, source) in [
        ("docs/src/client.md", "src/client/layer.rs"),
        ("docs/src/client/quota.md", "src/client/quota/mod.rs"),
    ] {
        // The doc comments' lines, less blank ones and the lines rustdoc hides (`# `).
        let doc: Vec<String> = read(&repo().join(source))
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("///"))
            .map(|l| l.strip_prefix(' ').unwrap_or(l).trim_end().to_string())
            .filter(|l| !l.is_empty() && !l.starts_with("# "))
            .collect();
        let examples: Vec<Block> = blocks()
            .into_iter()
            .filter(|b| b.lang == "rust" && b.at.contains(page))
            .collect();
        assert!(!examples.is_empty(), "no Rust example in {page}");
        for block in examples {
            let code: Vec<&String> = block.body.iter().filter(|l| !l.is_empty()).collect();
            let found = doc
                .windows(code.len())
                .any(|w| w.iter().eq(code.iter().copied()));
            assert!(
                found,
                "{}: not the doc test of {source} line for line",
                block.at
            );
        }
    }
}

#[test]
fn the_quick_start_serves_as_the_examples_server_does() {
    let command = format!("cargo run --release -- {}\n", QUICK_START_SERVE.join(" "));
    for page in ["README.md", "docs/src/get-started/index.md"] {
        assert!(
            read(&repo().join(page)).contains(&command),
            "{page}: the quick start no longer runs `{}`",
            command.trim()
        );
    }
}
