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
        .map(|r| match r.rules[0].limit {
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
    let key = |k: &str, v: &str| d.resolve([(k, v)]).map(|r| r.key(&r.rules[0])).unwrap();
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
    assert_eq!(ka.key(&ka.rules[0]), kb.key(&kb.rules[0]));
    assert_ne!(ka.rules[0].limit, kb.rules[0].limit);
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
    let Limit::Limited(a) = d.resolve([("a", "x")]).unwrap().rules[0].limit else {
        panic!("limited")
    };
    assert_eq!((a.burst, a.unit_multiplier, a.unit), (10, 5, Unit::Minute));
    assert!(a.burst_set);
    assert_eq!(a.quota.interval(), 3 * NANOS_PER_SEC);
    assert_eq!(a.quota.burst(), 10);
    let Limit::Limited(b) = d.resolve([("b", "x")]).unwrap().rules[0].limit else {
        panic!("limited")
    };
    assert_eq!((b.unit, b.burst), (Unit::Week, 7));
    assert!(
        !b.burst_set,
        "no burst written: inherited from requests_per_unit"
    );
    let Limit::Limited(c) = d.resolve([("c", "x")]).unwrap().rules[0].limit else {
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

const SEVERAL: &str = r"
domain: test-domain
descriptors:
  - key: user
    rate_limits:
      - {name: per_second, unit: second, requests_per_unit: 10, burst: 20}
      - {name: per_day, unit: day, requests_per_unit: 1000}
    descriptors:
      - key: route
        value: search
        cost: 10
      - key: route
        value: item
        cost: 1
      - key: route
        value: own
        rate_limit: {unit: minute, requests_per_unit: 5}
  - key: one
    rate_limits:
      - {unit: minute, requests_per_unit: 7}
";

#[test]
fn rate_limits_are_rules_of_their_own() {
    let s = set(SEVERAL);
    let d = s.domain("test-domain").unwrap();
    let r = d.resolve([("user", "u1")]).unwrap();
    assert_eq!(r.cost, 1);
    let names: Vec<_> = r.rules.iter().map(|r| r.name.as_deref().unwrap()).collect();
    assert_eq!(names, ["per_second", "per_day"]);
    // Distinct identities, counters and labels; one stats key, told apart by the name.
    assert_ne!(r.rules[0].id, r.rules[1].id);
    assert_ne!(r.key(&r.rules[0]), r.key(&r.rules[1]));
    assert_eq!(r.rules[0].stats_key, "test-domain.user");
    assert_eq!(r.rules[1].qualified_key(), "test-domain.user[per_day]");
    assert_eq!(r.rules[0].path, "descriptors[0].rate_limits[0]");
    // The key handed over last is the same as a copied one.
    assert_eq!(r.key(&r.rules[1]), r.clone().into_key(&r.rules[1]));
    // A single entry needs no name and its stats key stays plain.
    let one = d.resolve([("one", "x")]).unwrap();
    assert_eq!(one.rules.len(), 1);
    assert_eq!(one.rules[0].qualified_key(), "test-domain.one");
    // The summary counts each entry, and the cost nodes apart.
    assert_eq!(
        s.summary().to_string(),
        "1 files, 1 domains, 4 rules (4 limited, 0 bans, 0 unlimited), 2 cost nodes"
    );
}

#[test]
fn rate_limits_ids_are_stable_and_tied_to_the_entry_name() {
    let id = |text: &str| {
        let s = set(text);
        let d = s.domain("test-domain").unwrap();
        let r = d.resolve([("k", "v")]).unwrap();
        r.rules.iter().map(|r| r.id).collect::<Vec<_>>()
    };
    let a = id(
        "domain: test-domain\ndescriptors:\n  - key: k\n    rate_limits:\n      - {name: a, unit: second, requests_per_unit: 1}\n      - {name: b, unit: day, requests_per_unit: 9}\n",
    );
    // Reordered and re-rated: each name keeps its identity (its counter survives a reload).
    let b = id(
        "domain: test-domain\ndescriptors:\n  - key: k\n    rate_limits:\n      - {name: b, unit: day, requests_per_unit: 5}\n      - {name: a, unit: second, requests_per_unit: 2}\n",
    );
    assert_eq!((a[0], a[1]), (b[1], b[0]));
    // `rate_limit` keeps the identity it always had, distinct from any entry's.
    let single = id(
        "domain: test-domain\ndescriptors:\n  - key: k\n    rate_limit: {name: a, unit: second, requests_per_unit: 1}\n",
    );
    assert!(!a.contains(&single[0]));
}

#[test]
fn cost_nodes_draw_from_the_ancestors_counters() {
    let s = set(SEVERAL);
    let d = s.domain("test-domain").unwrap();
    let user = d.resolve([("user", "u1")]).unwrap();
    let search = d.resolve([("user", "u1"), ("route", "search")]).unwrap();
    let item = d.resolve([("user", "u1"), ("route", "item")]).unwrap();
    assert_eq!((search.cost, item.cost), (10, 1));
    for r in [&search, &item] {
        assert!(std::ptr::eq(r.rules, user.rules));
        for rule in r.rules {
            assert_eq!(r.key(rule), user.key(rule));
        }
    }
    // Another user has counters of its own.
    let other = d.resolve([("user", "u2"), ("route", "search")]).unwrap();
    assert_ne!(other.key(&other.rules[0]), user.key(&user.rules[0]));
    // A node with its own limit under the user is a rule as before, not a cost node.
    let own = d.resolve([("user", "u1"), ("route", "own")]).unwrap();
    assert_eq!((own.rules.len(), own.cost), (1, 1));
    // Deeper than the cost node, or a route with no node: not limited, as in the reference.
    assert!(
        d.resolve([("user", "u1"), ("route", "search"), ("x", "y")])
            .is_none()
    );
    assert!(d.resolve([("user", "u1"), ("route", "other")]).is_none());
    let costs: Vec<_> = d
        .costs()
        .map(|c| (c.stats_key.as_str(), c.cost, c.of.as_str()))
        .collect();
    assert_eq!(
        costs,
        [
            ("test-domain.user.route_search", 10, "test-domain.user"),
            ("test-domain.user.route_item", 1, "test-domain.user"),
        ]
    );
}

#[test]
fn a_cost_node_under_a_key_only_node_with_share_threshold_above() {
    // The ancestor's key is built from its levels only: the wildcard level above shares.
    let s = set(r"
domain: test-domain
descriptors:
  - key: path
    value: /api/*
    share_threshold: true
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 100}
        descriptors:
          - key: route
            cost: 5
");
    let d = s.domain("test-domain").unwrap();
    let a = d
        .resolve([("path", "/api/a"), ("user", "u"), ("route", "r1")])
        .unwrap();
    let b = d.resolve([("path", "/api/b"), ("user", "u")]).unwrap();
    assert_eq!(a.cost, 5);
    assert_eq!(a.key(&a.rules[0]), b.key(&b.rules[0]));
}

#[test]
fn rate_limits_and_cost_problems_are_positioned() {
    let p = problems(
        r"domain: test-domain
descriptors:
  - key: both
    rate_limit: {unit: second, requests_per_unit: 1}
    rate_limits: [{unit: second, requests_per_unit: 1}]
  - key: empty
    rate_limits: []
  - key: unnamed
    rate_limits:
      - {name: a, unit: second, requests_per_unit: 1}
      - {unit: day, requests_per_unit: 1}
  - key: twice
    rate_limits:
      - {name: a, unit: second, requests_per_unit: 1}
      - {name: a, unit: day, requests_per_unit: 1}
  - key: user
    rate_limits:
      - {name: s, unit: second, requests_per_unit: 10, burst: 20}
      - {name: d, unit: day, requests_per_unit: 100, burst: 15}
    descriptors:
      - key: zero
        cost: 0
      - key: big
        cost: 16
      - key: own
        cost: 2
        rate_limit: {unit: second, requests_per_unit: 1}
  - key: orphan
    cost: 3
  - key: bad
    rate_limits: {unit: second}
",
    );
    let shown: Vec<String> = p.iter().map(ToString::to_string).collect();
    let expect = [
        "bad.yaml:5:18: descriptors[0].rate_limits: rate_limit and rate_limits cannot both be given",
        "bad.yaml:7:18: descriptors[1].rate_limits: rate_limits must not be empty",
        "bad.yaml:11:9: descriptors[2].rate_limits[1]: each of several rate_limits needs a name",
        "bad.yaml:15:16: descriptors[3].rate_limits[1].name: duplicate rate_limits name \"a\" (already at descriptors[3].rate_limits[0])",
        "bad.yaml:22:15: descriptors[4].descriptors[0].cost: must be between 1 and",
        "bad.yaml:24:15: descriptors[4].descriptors[1].cost: cost 16 is above the burst 15 of test-domain.user, so such a request could never pass",
        "bad.yaml:26:15: descriptors[4].descriptors[2].cost: cost is for a node without a limit of its own",
        "bad.yaml:29:11: descriptors[5].cost: cost needs an ancestor descriptor with a rate_limit",
        "bad.yaml:31:18: descriptors[6].rate_limits: expected a list, found a map",
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

fn metadata_of(set: &PolicySet, domain: &str, entries: &[(&str, &str)]) -> Option<Metadata> {
    set.domain(domain)
        .expect("domain")
        .resolve(entries.iter().copied())
        .and_then(|r| r.metadata.cloned())
}

#[test]
fn metadata_is_kept_typed_as_written_on_the_matched_node() {
    let s = set(r#"
domain: test-domain
descriptors:
  - key: service
    value: one
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata:
      service_with_quota: {name: "service_1"}
      n: 3
      big: 18446744073709551615
      f: -2.5e1
      flags: [true, False, null, ~, yes, "7"]
      0.5: half
  - key: acct
    rate_limit: {unit: minute, requests_per_unit: 10}
    metadata: {level: acct}
    descriptors:
      - key: route
        cost: 2
        metadata: {level: route}
      - key: plain
        cost: 1
  - key: empty
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {}
  - key: whitelisted
    metadata: {never: returned}
"#);
    let m = metadata_of(&s, "test-domain", &[("service", "one")]).unwrap();
    assert_eq!(
        serde_json::Value::Object(m),
        serde_json::json!({
            "service_with_quota": {"name": "service_1"},
            "n": 3,
            "big": 18_446_744_073_709_551_615_u64,
            "f": -25.0,
            "flags": [true, false, null, null, "yes", "7"],
            "0.5": "half",
        })
    );
    // A request that stops at the limited node gets its metadata; a cost node its own, or
    // none (not its ancestor's).
    let level = |e: &[(&str, &str)]| metadata_of(&s, "test-domain", e).map(|m| m["level"].clone());
    assert_eq!(level(&[("acct", "a")]), Some("acct".into()));
    assert_eq!(
        level(&[("acct", "a"), ("route", "r")]),
        Some("route".into())
    );
    assert_eq!(level(&[("acct", "a"), ("plain", "p")]), None);
    assert_eq!(metadata_of(&s, "test-domain", &[("empty", "x")]), None);
    // No rule applies: no match, so nothing to return.
    assert!(
        s.domain("test-domain")
            .unwrap()
            .resolve([("whitelisted", "x")])
            .is_none()
    );
}

#[test]
fn bad_metadata_is_a_positioned_problem() {
    let p = problems(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    metadata: {x: .inf, y: 1e999, z: {w: 1, w: 2}, [1]: v}\n",
    );
    let text: Vec<String> = p.iter().map(ToString::to_string).collect();
    assert!(
        text.iter()
            .any(|t| t.contains("descriptors[0].metadata.y: metadata number 1e999 is not finite")),
        "{text:?}"
    );
    assert!(
        text.iter()
            .any(|t| t.contains("descriptors[0].metadata.z.w: metadata key `w` is given twice")),
        "{text:?}"
    );
    assert!(
        text.iter()
            .any(|t| t.contains("metadata keys must be text, found a list")),
        "{text:?}"
    );
    // `.inf` is not a decimal number: it stays text.
    assert_eq!(p.len(), 3, "{text:?}");
    let p = problems("domain: d\ndescriptors:\n  - key: a\n    metadata: [1]\n");
    assert!(p[0].message.contains("expected a map"), "{p:?}");
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
        let mut v: Vec<(String, u128)> = d.rules().map(|r| (r.stats_key.clone(), r.id)).collect();
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
