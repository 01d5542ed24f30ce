//! Every command sluice sends to Redis works on Redis 6.0 (Envoy Gateway's guide and e2e install
//! `redis:6.0.6`): the Lua scripts' `redis.call`/`redis.pcall` (and the prelude's `call`/`pcall_`
//! aliases) and the Rust code's `redis::cmd`, found by scanning `src/`, each name a command of
//! [`ALLOWED`] (every one in Redis by 6.0) and none of [`NEWER_COMMANDS`], with no option of
//! [`NEWER_OPTIONS`]. A command added to the code must be added to [`ALLOWED`], after checking
//! the version that brought it (and each option it is sent with).

use std::path::{Path, PathBuf};

/// The commands the code may send, each in Redis 6.0, with the version that brought it.
const ALLOWED: &[(&str, &str)] = &[
    ("DEL", "1.0"),
    ("EVALSHA", "2.6"),
    ("EXISTS", "1.0"),
    ("GET", "1.0"),
    ("HDEL", "2.0"),
    ("HGETALL", "2.0"),
    ("HSET", "2.0 (several fields: 4.0)"),
    ("MGET", "1.0"),
    ("PEXPIRE", "2.6"),
    ("PING", "1.0"),
    ("PTTL", "2.6"),
    ("ROLE", "2.8.12"),
    ("SENTINEL", "2.8"),
    ("SET", "1.0 (EX, PX, NX, XX: 2.6.12; KEEPTTL: 6.0)"),
    ("TIME", "2.6"),
    ("ZADD", "1.2 (NX, XX, CH, INCR: 3.0.2)"),
    ("ZCARD", "1.2"),
    ("ZREM", "1.2"),
    ("ZREMRANGEBYSCORE", "1.2"),
];

/// Commands of Redis 6.2 or later, never to be sent.
const NEWER_COMMANDS: &[(&str, &str)] = &[
    ("BLMOVE", "6.2"),
    ("COPY", "6.2"),
    ("FAILOVER", "6.2"),
    ("GEOSEARCH", "6.2"),
    ("GEOSEARCHSTORE", "6.2"),
    ("GETDEL", "6.2"),
    ("GETEX", "6.2"),
    ("HRANDFIELD", "6.2"),
    ("LMOVE", "6.2"),
    ("RESET", "6.2"),
    ("SMISMEMBER", "6.2"),
    ("XAUTOCLAIM", "6.2"),
    ("ZDIFF", "6.2"),
    ("ZDIFFSTORE", "6.2"),
    ("ZINTER", "6.2"),
    ("ZMSCORE", "6.2"),
    ("ZRANDMEMBER", "6.2"),
    ("ZRANGESTORE", "6.2"),
    ("ZUNION", "6.2"),
    ("BLMPOP", "7.0"),
    ("BZMPOP", "7.0"),
    ("EVAL_RO", "7.0"),
    ("EVALSHA_RO", "7.0"),
    ("EXPIRETIME", "7.0"),
    ("FCALL", "7.0"),
    ("FCALL_RO", "7.0"),
    ("FUNCTION", "7.0"),
    ("LCS", "7.0"),
    ("LMPOP", "7.0"),
    ("PEXPIRETIME", "7.0"),
    ("SINTERCARD", "7.0"),
    ("SORT_RO", "7.0"),
    ("ZMPOP", "7.0"),
    ("WAITAOF", "7.2"),
    ("HEXPIRE", "7.4"),
    ("HPEXPIRE", "7.4"),
    ("HPERSIST", "7.4"),
    ("HTTL", "7.4"),
    ("HGETDEL", "8.0"),
    ("HGETEX", "8.0"),
    ("HSETEX", "8.0"),
];

/// Options of Redis 6.2 or later: (command, option, version).
const NEWER_OPTIONS: &[(&str, &str, &str)] = &[
    ("SET", "PXAT", "6.2"),
    ("SET", "EXAT", "6.2"),
    ("SET", "GET", "6.2"),
    ("ZADD", "GT", "6.2"),
    ("ZADD", "LT", "6.2"),
    ("ZRANGE", "BYSCORE", "6.2"),
    ("ZRANGE", "BYLEX", "6.2"),
    ("ZRANGE", "REV", "6.2"),
    ("XADD", "NOMKSTREAM", "6.2"),
    ("XADD", "MINID", "6.2"),
    ("EXPIRE", "NX", "7.0"),
    ("EXPIRE", "XX", "7.0"),
    ("EXPIRE", "GT", "7.0"),
    ("EXPIRE", "LT", "7.0"),
    ("PEXPIRE", "NX", "7.0"),
    ("PEXPIRE", "XX", "7.0"),
    ("PEXPIRE", "GT", "7.0"),
    ("PEXPIRE", "LT", "7.0"),
    ("BITCOUNT", "BIT", "7.0"),
    ("CLIENT", "SETINFO", "7.2"),
];

/// One command the code sends: where, its name, and its literal arguments.
#[derive(Debug)]
struct Sent {
    at: String,
    command: String,
    literals: Vec<String>,
}

/// The calls of Lua `text`: `call(`, `pcall_(`, `redis.call(`, `redis.pcall(` with a quoted
/// command name, and the quoted literals among its arguments.
fn lua_calls(at: &str, text: &str) -> Vec<Sent> {
    let mut out = Vec::new();
    for start in ["call(", "pcall(", "pcall_("] {
        for (i, _) in text.match_indices(start) {
            // `call(` inside `pcall(` or another name is not one.
            let before = text[..i].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let args = &text[i + start.len()..];
            let end = args.find(')').unwrap_or(args.len());
            let literals: Vec<String> = args[..end]
                .split(',')
                .map(str::trim)
                .filter(|a| a.len() >= 2 && a.starts_with('\'') && a.ends_with('\''))
                .map(|a| a[1..a.len() - 1].to_ascii_uppercase())
                .collect();
            let Some(first) = args[..end].split(',').next().map(str::trim) else {
                continue;
            };
            if !first.starts_with('\'') {
                // A call through a variable command name (none exist): refuse to guess.
                panic!("{at}: a Redis call whose command is not a literal: {start}{first}");
            }
            out.push(Sent {
                at: at.to_owned(),
                command: literals[0].clone(),
                literals: literals[1..].to_vec(),
            });
        }
    }
    out
}

/// The commands of Rust `text`: `redis::cmd("X")` and the literal `.arg("...")`s after it in
/// the same statement.
fn rust_cmds(at: &str, text: &str) -> Vec<Sent> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices("redis::cmd(\"") {
        let rest = &text[i + "redis::cmd(\"".len()..];
        let name = &rest[..rest.find('"').unwrap()];
        let statement = &rest[..rest.find(';').unwrap_or(rest.len())];
        let literals = statement
            .match_indices(".arg(\"")
            .map(|(j, _)| {
                let a = &statement[j + ".arg(\"".len()..];
                a[..a.find('"').unwrap()].to_ascii_uppercase()
            })
            .collect();
        out.push(Sent {
            at: at.to_owned(),
            command: name.to_ascii_uppercase(),
            literals,
        });
    }
    out
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// What a list of sends breaks: each command or option of a newer Redis, or not known.
fn problems(sent: &[Sent]) -> Vec<String> {
    let mut found = Vec::new();
    for s in sent {
        if let Some((_, v)) = NEWER_COMMANDS.iter().find(|(c, _)| *c == s.command) {
            found.push(format!("{}: {} needs Redis {v}", s.at, s.command));
        } else if !ALLOWED.iter().any(|(c, _)| *c == s.command) {
            found.push(format!(
                "{}: {} is not in ALLOWED: check the version that brought it",
                s.at, s.command
            ));
        }
        for option in &s.literals {
            if let Some((_, _, v)) = NEWER_OPTIONS
                .iter()
                .find(|(c, o, _)| *c == s.command && o == option)
            {
                found.push(format!("{}: {} {option} needs Redis {v}", s.at, s.command));
            }
        }
    }
    found
}

#[test]
fn every_command_sent_to_redis_is_in_redis_6_0() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut sent = Vec::new();
    for path in &all {
        let at = path.strip_prefix(&src).unwrap().display().to_string();
        let text = std::fs::read_to_string(path).unwrap();
        match path.extension().and_then(|e| e.to_str()) {
            Some("lua") => sent.extend(lua_calls(&at, &text)),
            Some("rs") => {
                // A Lua script held in a Rust string (the heartbeat's) is scanned as Lua too.
                if text.contains("redis.call(") {
                    sent.extend(lua_calls(&at, &text));
                }
                sent.extend(rust_cmds(&at, &text));
            }
            _ => {}
        }
    }
    // The scan finds what is known to be sent: the scripts' writes and reads, the heartbeat, the
    // connection check.
    for (command, file) in [
        ("GET", "limiter/redis/gcra.lua"),
        ("GET", "limiter/redis/prelude.lua"),
        ("SET", "limiter/redis/gcra_lean.lua"),
        ("MGET", "limiter/redis/gcra_lean.lua"),
        ("SET", "limiter/redis/gcra.lua"),
        ("SET", "limiter/redis/slice.lua"),
        ("HSET", "limiter/redis/share.lua"),
        ("HSET", "limiter/redis/fleet.lua"),
        ("HGETALL", "limiter/redis/entries.lua"),
        ("ZADD", "limiter/redis/heartbeat.rs"),
        ("PING", "limiter/redis/connect.rs"),
        ("EVALSHA", "limiter/redis/call.rs"),
    ] {
        assert!(
            sent.iter().any(|s| s.command == command && s.at == file),
            "{command} in {file} not found: {sent:#?}"
        );
    }
    let found = problems(&sent);
    assert!(found.is_empty(), "{found:#?}");
}

/// The scan catches what it is for: a 6.2 option, a 6.2 command, an unknown command.
#[test]
fn the_scan_catches_newer_commands_and_options() {
    let sent = lua_calls(
        "t.lua",
        "redis.call('SET', key, tat, 'PXAT', ms)\ncall('SET', k, v, 'GET')\nlocal x = pcall_('GETDEL', k)\nredis.pcall('OBJECT', 'FREQ', k)\ncall('SET', k, v, 'PX', '10')",
    );
    assert_eq!(sent.len(), 5, "{sent:#?}");
    let found = problems(&sent);
    assert_eq!(found.len(), 4, "{found:#?}");
    for problem in [
        "SET PXAT needs Redis 6.2",
        "SET GET needs Redis 6.2",
        "GETDEL needs Redis 6.2",
        "OBJECT is not in ALLOWED",
    ] {
        assert!(
            found.iter().any(|f| f.contains(problem)),
            "{problem}: {found:#?}"
        );
    }
    let sent = rust_cmds(
        "t.rs",
        "let r = redis::cmd(\"CLIENT\").arg(\"SETINFO\").arg(x);",
    );
    assert_eq!(problems(&sent).len(), 2, "{sent:#?}");
}
