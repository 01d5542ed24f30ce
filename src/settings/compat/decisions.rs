//! How requests are answered, from the reference's variables: shadow and quota modes, the
//! rate-limit headers and their names, dynamic metadata and the near-limit ratio.

use serde_json::json;

use super::{CompatError, Env, Mapped, bad};

/// `SHADOW_MODE`, `QUOTA_MODE`, `LIMIT_RESPONSE_HEADERS_ENABLED` and the header names,
/// `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`, `RESPONSE_DYNAMIC_METADATA`, `NEAR_LIMIT_RATIO`.
pub(super) fn answers(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    if let Some(shadow) = env.bool("SHADOW_MODE")? {
        m.set("shadow_mode", json!(shadow));
    }
    if let Some(quota) = env.bool("QUOTA_MODE")? {
        m.set("quota_mode", json!(quota));
    }
    if let Some(enabled) = env.bool("LIMIT_RESPONSE_HEADERS_ENABLED")? {
        m.set(
            "response_headers",
            json!(if enabled { "legacy" } else { "none" }),
        );
    }
    for (variable, setting) in [
        ("LIMIT_LIMIT_HEADER", "legacy_headers.limit"),
        ("LIMIT_REMAINING_HEADER", "legacy_headers.remaining"),
        ("LIMIT_RESET_HEADER", "legacy_headers.reset"),
    ] {
        if let Some(name) = env.get(variable) {
            m.set(setting, json!(name));
        }
    }
    // sluice never charges a refused request, so the option is always on.
    env.bool("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT")?;
    if let Some(enabled) = env.bool("RESPONSE_DYNAMIC_METADATA")? {
        m.set("response_dynamic_metadata", json!(enabled));
    }
    if let Some(text) = env.get("NEAR_LIMIT_RATIO") {
        let ratio = text
            .parse::<f64>()
            .ok()
            .filter(|r| (0.0..=1.0).contains(r))
            .ok_or_else(|| bad("NEAR_LIMIT_RATIO", text, "not a number from 0 to 1"))?;
        m.set("metrics.near_limit_ratio", json!(ratio));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::compat::tests::{get, map, quiet};

    #[test]
    fn decisions_and_headers() {
        let m = map(&[
            ("SHADOW_MODE", "1"),
            ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
        ])
        .unwrap();
        assert_eq!(get(&m, "shadow_mode"), Some(&json!(true)));
        assert_eq!(get(&m, "response_headers"), Some(&json!("legacy")));
        let m = map(&[
            ("LIMIT_REMAINING_HEADER", "X-Left"),
            ("NEAR_LIMIT_RATIO", "0.5"),
        ])
        .unwrap();
        assert_eq!(get(&m, "legacy_headers.remaining"), Some(&json!("X-Left")));
        assert_eq!(get(&m, "legacy_headers.limit"), None);
        assert_eq!(get(&m, "metrics.near_limit_ratio"), Some(&json!(0.5)));
        for ratio in ["high", "1.5", "-0.1"] {
            assert_eq!(
                map(&[("NEAR_LIMIT_RATIO", ratio)]).unwrap_err().variable,
                "NEAR_LIMIT_RATIO"
            );
        }
        let m = map(&[("QUOTA_MODE", "true")]).unwrap();
        assert_eq!(get(&m, "quota_mode"), Some(&json!(true)));
        assert_eq!(
            map(&[("QUOTA_MODE", "sometimes")]).unwrap_err().variable,
            "QUOTA_MODE"
        );
        let m = quiet(&[("RESPONSE_DYNAMIC_METADATA", "true")]).unwrap();
        assert_eq!(get(&m, "response_dynamic_metadata"), Some(&json!(true)));
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
        let m = map(&[("RESPONSE_DYNAMIC_METADATA", "False")]).unwrap();
        assert_eq!(get(&m, "response_dynamic_metadata"), Some(&json!(false)));
        assert_eq!(
            map(&[("RESPONSE_DYNAMIC_METADATA", "enabled")])
                .unwrap_err()
                .variable,
            "RESPONSE_DYNAMIC_METADATA"
        );
        assert_eq!(
            map(&[("SHADOW_MODE", "on")]).unwrap_err().variable,
            "SHADOW_MODE"
        );
    }
}
