//! The stampede lab: `sluice check`'s guarantees against numbers worked out by hand.

use std::process::{Command, Output};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

fn sluice(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("RUST_LOG")
        .output()
        .expect("run sluice")
}

fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON document")
}

const TWO_RULES: &str = "\
domain: db
descriptors:
  - key: tenant
    rate_limit: {name: inherited, unit: minute, requests_per_unit: 5000}
  - key: batch
    rate_limit: {name: chosen, unit: minute, requests_per_unit: 5000, burst: 100}
";

#[test]
fn check_rates_an_inherited_and_a_chosen_burst() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("db.yaml"), TWO_RULES).unwrap();
    let d = dir.path().to_str().unwrap();
    let out = sluice(&["check", d]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "warnings do not fail without --strict"
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    // T = 60 s / 5000 = 12 ms. Inherited: B = 5000, worst second 5000 + floor(1 s / 12 ms) =
    // 5083, worst minute 5000 + 5000 = 10000. Chosen: 100 + 83 = 183 and 100 + 5000 = 5100.
    // A fixed window of 5000 per minute: 2 × 5000 = 10000 in its worst second.
    for expected in [
        "db.tenant (inherited)\n  rate 5000 per minute, burst 5000 (inherited)\n",
        "at most 5000 at once after idling, then one every 12ms; at most 5083 in any second, 10000 in any minute",
        "the burst is inherited (B = L): the worst minute is 10000 (2·L)",
        "db.batch (chosen)\n  rate 5000 per minute, burst 100 (set)\n",
        "at most 100 at once after idling, then one every 12ms; at most 183 in any second, 5100 in any minute",
        "a fixed window of 5000 per minute lets 10000 through in its worst second",
    ] {
        assert!(stdout.contains(expected), "{expected:?} not in:\n{stdout}");
    }
    assert_eq!(
        stdout.matches("only a chosen burst bounds").count(),
        1,
        "{stdout}"
    );
    let last = stdout.lines().last().unwrap();
    assert!(
        last.starts_with(d)
            && last.ends_with(": 1 files, 1 domains, 2 rules (2 limited, 0 bans, 0 unlimited): ok"),
        "{last}"
    );
    assert_eq!(stderr.matches("warning:").count(), 1, "{stderr}");
    assert!(
        stderr.contains("warning: db.tenant (inherited): burst inherited"),
        "{stderr}"
    );

    let strict = sluice(&["check", "--strict", d]);
    assert_eq!(strict.status.code(), Some(1));

    let doc = json(&sluice(&["check", "--json", d]));
    let rules = doc["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 2);
    let by = |name: &str| rules.iter().find(|r| r["name"] == name).unwrap();
    let (inh, cho) = (by("inherited"), by("chosen"));
    assert_eq!(inh["domain"], "db");
    assert_eq!(inh["path"], "db.tenant");
    assert_eq!(
        (inh["burst"].as_u64(), inh["burst_set"].as_bool()),
        (Some(5000), Some(false))
    );
    assert_eq!(inh["worst_second"], 5083);
    assert_eq!(inh["worst_period"], 10_000);
    assert_eq!(inh["fixed_window_worst_second"], 10_000);
    assert_eq!(cho["path"], "db.batch");
    assert_eq!(
        (cho["burst"].as_u64(), cho["burst_set"].as_bool()),
        (Some(100), Some(true))
    );
    assert_eq!(cho["worst_second"], 183);
    assert_eq!(cho["worst_period"], 5100);
    assert_eq!(doc["warnings"].as_array().unwrap().len(), 1);
    assert_eq!(
        doc["summary"],
        "1 files, 1 domains, 2 rules (2 limited, 0 bans, 0 unlimited)"
    );
}
