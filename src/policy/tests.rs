use super::*;

/// envoyproxy/ratelimit's `test/config/basic_config.yaml`, re-typed.
const BASIC: &str = r"
domain: test-domain
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 5}
      - key: subkey1
        value: subvalue1
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key2
    value: value2
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: key2
    value: value3
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: key4
    rate_limit: {name: key4_rate_limit, unit: day, requests_per_unit: 1}
  - key: key5
    value: value5
    rate_limit: {unit: day, requests_per_unit: 15}
    descriptors:
      - key: subkey5
        value: subvalue5
        rate_limit: {unit: day, requests_per_unit: 25}
  - key: key6
    rate_limit: {unlimited: true}
  - key: key7
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 70}
";

fn set(text: &str) -> PolicySet {
    load_str(&[("test.yaml", text)]).unwrap_or_else(|e| panic!("{e}"))
}

fn problems(text: &str) -> Vec<Problem> {
    match load_str(&[("bad.yaml", text)]) {
        Err(PolicyError::Invalid(p)) => p,
        other => panic!("expected problems, got {other:?}"),
    }
}

fn rpu(set: &PolicySet, entries: &[(&str, &str)]) -> Option<u32> {
    let d = set.domain("test-domain").expect("domain");
    d.resolve(entries.iter().copied())
        .map(|r| match r.rule.limit {
            Limit::Limited(rate) => rate.requests_per_unit,
            Limit::Unlimited => u32::MAX,
        })
}

#[test]
fn matching_follows_the_reference() {
    let s = set(BASIC);
    // Exact beats key-only, at any depth.
    assert_eq!(rpu(&s, &[("key1", "value1"), ("subkey1", "x")]), Some(5));
    assert_eq!(
        rpu(&s, &[("key1", "value1"), ("subkey1", "subvalue1")]),
        Some(10)
    );
    assert_eq!(rpu(&s, &[("key2", "anything")]), Some(20));
    assert_eq!(rpu(&s, &[("key2", "value2")]), Some(30));
    // A node with no rate_limit whitelists.
    assert_eq!(rpu(&s, &[("key2", "value3")]), None);
    assert_eq!(rpu(&s, &[("key1", "value1")]), None);
    // Fewer entries reach an intermediate node with its own limit.
    assert_eq!(rpu(&s, &[("key5", "value5")]), Some(15));
    assert_eq!(
        rpu(&s, &[("key5", "value5"), ("subkey5", "subvalue5")]),
        Some(25)
    );
    // Deeper than the tree, or no backtracking to a key-only sibling: no limit.
    assert_eq!(rpu(&s, &[("key3", "x"), ("extra", "y")]), None);
    assert_eq!(rpu(&s, &[("key1", "value1"), ("nope", "x")]), None);
    assert_eq!(rpu(&s, &[("unknown", "x")]), None);
    assert_eq!(rpu(&s, &[]), None);
    assert_eq!(rpu(&s, &[("key6", "x")]), Some(u32::MAX));
    assert_eq!(
        s.summary().to_string(),
        "1 files, 1 domains, 10 rules (9 limited, 0 bans, 1 unlimited)"
    );
}

#[test]
fn wildcards_in_file_order_then_key_only() {
    let s = set(r"
domain: test-domain
descriptors:
  - key: path
    value: /api/*/admin
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: /api/*
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    value: /api/v1/admin
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: nested
    value: val1
    descriptors:
      - key: wild
        value: goo*
        rate_limit: {unit: minute, requests_per_unit: 5}
");
    assert_eq!(rpu(&s, &[("path", "/api/v1/admin")]), Some(3));
    assert_eq!(rpu(&s, &[("path", "/api/v2/admin")]), Some(1));
    assert_eq!(rpu(&s, &[("path", "/api/v2/users")]), Some(2));
    assert_eq!(rpu(&s, &[("path", "/static")]), Some(4));
    assert_eq!(rpu(&s, &[("nested", "val1"), ("wild", "goose")]), Some(5));
    assert_eq!(rpu(&s, &[("nested", "val1"), ("wild", "duck")]), None);
}

#[test]
fn counters_are_per_value_unless_share_threshold() {
    let s = set(r"
domain: test-domain
descriptors:
  - key: ip
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: other
    value: files/*
    rate_limit: {unit: hour, requests_per_unit: 10}
");
    let d = s.domain("test-domain").unwrap();
    let key = |k: &str, v: &str| d.resolve([(k, v)]).unwrap().key;
    assert_ne!(key("ip", "1.1.1.1"), key("ip", "2.2.2.2"));
    assert_eq!(key("files", "files/a"), key("files", "files/b"));
    assert_ne!(key("other", "files/a"), key("other", "files/b"));
    assert_ne!(key("files", "files/a"), key("other", "files/a"));
}

#[test]
fn rule_identity_survives_a_reload_and_ignores_the_rate() {
    let a = set(
        "domain: test-domain\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1}}]",
    );
    let b = set(
        "domain: test-domain\ndescriptors:\n  - key: x\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 9, burst: 3}\n",
    );
    let ka = a
        .domain("test-domain")
        .unwrap()
        .resolve([("k", "v")])
        .unwrap();
    let kb = b
        .domain("test-domain")
        .unwrap()
        .resolve([("k", "v")])
        .unwrap();
    assert_eq!(ka.key, kb.key);
    assert_ne!(ka.rule.limit, kb.rule.limit);
}

#[test]
fn extensions_and_units() {
    let s = set(r"
domain: test-domain
descriptors:
  - key: a
    rate_limit: {unit: MINUTE, requests_per_unit: 100, unit_multiplier: 5, burst: 10}
  - key: b
    rate_limit: {unit: Week, requests_per_unit: 7}
  - key: c
    rate_limit: {unit: second, requests_per_unit: 0}
");
    let d = s.domain("test-domain").unwrap();
    let Limit::Limited(a) = d.resolve([("a", "x")]).unwrap().rule.limit else {
        panic!("limited")
    };
    assert_eq!((a.burst, a.unit_multiplier, a.unit), (10, 5, Unit::Minute));
    assert_eq!(a.quota.interval(), 3 * NANOS_PER_SEC);
    assert_eq!(a.quota.burst(), 10);
    let Limit::Limited(b) = d.resolve([("b", "x")]).unwrap().rule.limit else {
        panic!("limited")
    };
    assert_eq!((b.unit, b.burst), (Unit::Week, 7));
    let Limit::Limited(c) = d.resolve([("c", "x")]).unwrap().rule.limit else {
        panic!("limited")
    };
    assert!(c.quota.is_ban());
}

#[test]
fn accepts_the_whole_reference_schema() {
    set(r#"
domain: test-domain
descriptors:
  - key: category
    value: account
    rate_limit:
      replaces: [{name: bkthomps}, {name: fake_name}]
      unit: minute
      requests_per_unit: 4
  - key: foo
    rate_limit: {unit: minute, requests_per_unit: 2}
    descriptors:
      - key: bar
        value: bkthomps
        rate_limit: {name: bkthomps, unit: minute, requests_per_unit: 1}
      - key: baz
        value: shady
        shadow_mode: true
        value_to_metric: true
        rate_limit: {unit: minute, requests_per_unit: 3}
  - key: unspec
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: service
    value: service_1
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {service_with_quota: {name: "service_1"}}
"#);
}

#[test]
fn every_problem_is_reported_with_position_and_path() {
    let p = problems(
        r#"domain: test-domain
descriptors:
  - key: a
    rate_limit: {unit: minutes, requests_per_unit: 5}
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 5}
  - value: v
  - key: b
    ratelimit: {}
  - key: c
    rate_limit: {unlimited: true, unit: second}
  - key: d
    rate_limit: {name: me, unit: second, requests_per_unit: 1, replaces: [{name: me}, {name: ""}]}
  - key: e
    rate_limit: {unit: second, requests_per_unit: -1, burst: 0}
  - key: f
    value: plain
    share_threshold: true
  - key: g
    rate_limit: {name: "a\"b", unit: second, requests_per_unit: 1}
"#,
    );
    let shown: Vec<String> = p.iter().map(ToString::to_string).collect();
    let expect = [
        r#"bad.yaml:4:24: descriptors[0].rate_limit.unit: invalid rate limit unit "minutes""#,
        "bad.yaml:5:5: descriptors[1]: duplicate descriptor `a` (already at descriptors[0])",
        "bad.yaml:7:5: descriptors[2]: descriptor has empty key",
        "bad.yaml:9:5: descriptors[3].ratelimit: unknown field `ratelimit`",
        "bad.yaml:11:41: descriptors[4].rate_limit.unit: should not specify rate limit unit when unlimited",
        "descriptors[5].rate_limit.replaces[0].name: replaces should not contain name of same descriptor",
        "descriptors[5].rate_limit.replaces[1].name: should not have an empty replaces entry",
        "descriptors[6].rate_limit.requests_per_unit: expected a whole number",
        "descriptors[6].rate_limit.burst: must be between 1 and",
        "descriptors[7].share_threshold: share_threshold needs a value with a `*` wildcard",
        "descriptors[8].rate_limit.name: name must not contain '\"'",
    ];
    for e in expect {
        assert!(
            shown.iter().any(|s| s.contains(e)),
            "missing {e:?} in:\n{}",
            shown.join("\n")
        );
    }
    assert_eq!(shown.len(), expect.len(), "{}", shown.join("\n"));
}

#[test]
fn file_level_problems() {
    assert!(problems("")[0].message.contains("file is empty"));
    assert!(
        problems("descriptors: []")[0]
            .message
            .contains("missing domain")
    );
    assert!(problems("domain: ''")[0].message.contains("empty domain"));
    assert!(problems("domain: [a]")[0].message.contains("expected text"));
    assert!(problems("- a\n- b")[0].message.contains("expected a map"));
    assert!(
        problems("domain: a\n---\ndomain: b")[0]
            .message
            .contains("one YAML document")
    );
    let p = problems("domain: a\ndescriptors: [\n");
    assert!(p[0].message.contains("invalid YAML"), "{p:?}");
    assert!(p[0].pos.is_some());
    let p = problems("domain: a\ndomain: b\n");
    assert!(p[0].message.contains("given twice"), "{p:?}");
}

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

#[test]
fn aliases_reuse_rate_limit_blocks() {
    let s = set(
        "domain: test-domain\ndescriptors:\n  - key: key1\n    rate_limit: &std {unit: minute, requests_per_unit: 7}\n  - key: key2\n    rate_limit: *std\n",
    );
    assert_eq!(rpu(&s, &[("key1", "v")]), Some(7));
    assert_eq!(rpu(&s, &[("key2", "v")]), Some(7));
}

#[test]
fn an_alias_bomb_is_a_positioned_problem() {
    let text = super::yaml::tests::alias_bomb(9, 9);
    let p = problems(&text);
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(
        p[0].to_string(),
        format!(
            "bad.yaml:{}: YAML aliases expand to more than 1000000 nodes",
            p[0].pos.unwrap()
        )
    );
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

    let Err(PolicyError::Invalid(problems)) = load_dir_within_10s(d, LoadOptions::default()) else {
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
