//! The policy directory, from the reference's `RUNTIME_*` layout, read as it reads it (every
//! file, dot files too unless `RUNTIME_IGNOREDOTFILES`), and `MERGE_DOMAIN_CONFIG`. With
//! `CONFIG_TYPE=GRPC_XDS_SOTW` the layout is not read, only warned of.

use std::path::PathBuf;

use serde_json::json;

use super::{CompatError, Env, Mapped};

/// The reference's defaults for the parts of the layout left unset.
const DEFAULT_RUNTIME_ROOT: &str = "/srv/runtime_data/current";
const DEFAULT_APPDIRECTORY: &str = "config";

/// The policy directory `RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY`, read as the
/// reference reads it: every file whatever its extension, dot files too unless
/// `RUNTIME_IGNOREDOTFILES`. Both of its reload modes (`RUNTIME_WATCH_ROOT`: a symlink swap of
/// the root, or changes in the directory) are followed by sluice's one watcher, which sees
/// either. `MERGE_DOMAIN_CONFIG` (read with or without the layout) is `merge_domains`.
pub(super) fn runtime(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    let layout = [
        "RUNTIME_ROOT",
        "RUNTIME_SUBDIRECTORY",
        "RUNTIME_APPDIRECTORY",
        "RUNTIME_IGNOREDOTFILES",
        "RUNTIME_WATCH_ROOT",
    ];
    // Read whatever the layout: files of one domain may be merged in sluice's own directory.
    if let Some(merge) = env.bool("MERGE_DOMAIN_CONFIG")? {
        m.set("merge_domains", json!(merge));
    }
    if !env.any_set(&layout) {
        return Ok(());
    }
    if super::xds::selected(env)? {
        let set: Vec<&str> = layout
            .iter()
            .copied()
            .filter(|n| env.get(n).is_some())
            .collect();
        m.warn(format!(
            "{}: not read with CONFIG_TYPE=GRPC_XDS_SOTW (as in the reference): policies come \
             from the xDS server, and nothing is read from or written to the runtime directory",
            set.join(", ")
        ));
        return Ok(());
    }
    let mut dir = PathBuf::from(env.get("RUNTIME_ROOT").unwrap_or(DEFAULT_RUNTIME_ROOT));
    if let Some(sub) = env.get("RUNTIME_SUBDIRECTORY") {
        dir.push(sub);
    }
    dir.push(
        env.get("RUNTIME_APPDIRECTORY")
            .unwrap_or(DEFAULT_APPDIRECTORY),
    );
    m.set("policies", json!(dir));
    let ignore_dot = env.bool("RUNTIME_IGNOREDOTFILES")?.unwrap_or(false);
    m.set(
        "policy_files",
        json!(if ignore_dot { "visible" } else { "all" }),
    );
    // Either mode: sluice's watcher (`watch_policies`) watches the directory and its parent
    // and re-scans it, which follows a swapped root and changed files alike.
    env.bool("RUNTIME_WATCH_ROOT")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::compat::tests::{get, map, quiet};

    #[test]
    fn the_runtime_layout_is_the_policy_directory() {
        let m = map(&[
            ("RUNTIME_ROOT", "/data/current"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("RUNTIME_IGNOREDOTFILES", "true"),
            ("RUNTIME_WATCH_ROOT", "false"),
        ])
        .unwrap();
        assert_eq!(
            get(&m, "policies"),
            Some(&json!("/data/current/ratelimit/config"))
        );
        assert_eq!(get(&m, "policy_files"), Some(&json!("visible")));
        let m = map(&[
            ("RUNTIME_SUBDIRECTORY", "rl"),
            ("RUNTIME_APPDIRECTORY", "c"),
        ])
        .unwrap();
        assert_eq!(
            get(&m, "policies"),
            Some(&json!("/srv/runtime_data/current/rl/c"))
        );
        assert_eq!(get(&m, "policy_files"), Some(&json!("all")));
        assert_eq!(
            map(&[("RUNTIME_IGNOREDOTFILES", "yes")])
                .unwrap_err()
                .variable,
            "RUNTIME_IGNOREDOTFILES"
        );
        let m = quiet(&[("RUNTIME_ROOT", "/r"), ("MERGE_DOMAIN_CONFIG", "true")]).unwrap();
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
        assert_eq!(get(&m, "merge_domains"), Some(&json!(true)));
        // Read on its own too, and false is said as well.
        let m = map(&[("MERGE_DOMAIN_CONFIG", "0")]).unwrap();
        assert_eq!(get(&m, "merge_domains"), Some(&json!(false)));
        assert_eq!(get(&m, "policies"), None);
        // Envoy Gateway's xDS Deployment sets the layout with no volume: not read, said.
        let m = quiet(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("RUNTIME_IGNOREDOTFILES", "true"),
            ("RUNTIME_WATCH_ROOT", "false"),
        ])
        .unwrap();
        assert_eq!(get(&m, "policies"), None);
        assert_eq!(get(&m, "policy_files"), None);
        assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
        assert!(m.warnings[0].starts_with(
            "RUNTIME_ROOT, RUNTIME_SUBDIRECTORY, RUNTIME_IGNOREDOTFILES, RUNTIME_WATCH_ROOT: not read"
        ));
        assert_eq!(
            map(&[("MERGE_DOMAIN_CONFIG", "merge")])
                .unwrap_err()
                .variable,
            "MERGE_DOMAIN_CONFIG"
        );
    }
}
