//! Credentials out of logs: a Redis URL with its `user:password@` replaced by `***@`.

/// `urls` each through [`redact`], comma-separated.
#[must_use]
pub fn redact_all<'a>(urls: impl IntoIterator<Item = &'a str>) -> String {
    urls.into_iter().map(redact).collect::<Vec<_>>().join(",")
}

/// A Redis URL with any `user:password@` replaced by `***@`, for logs.
#[must_use]
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}
