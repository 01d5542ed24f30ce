//! The admin port's write token (`admin.write_token_file`): a secret read once at startup, compared
//! in constant time and named in logs only by a fingerprint. Who must present it (the admin
//! routes that write) is the server's business; what a token is and how it is checked is here.

use std::path::Path;

use subtle::ConstantTimeEq;

/// A bearer token that allows writes on the admin port. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct WriteToken {
    secret: Box<[u8]>,
    fingerprint: String,
}

impl std::fmt::Debug for WriteToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteToken")
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

/// Why a token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The file cannot be read.
    #[error("admin.write_token_file {path:?}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds nothing but white space.
    #[error("admin.write_token_file {0:?} is empty")]
    Empty(String),
    /// The token holds a character a header value cannot carry.
    #[error("admin.write_token_file {0:?}: the token must be printable ASCII without spaces")]
    NotPrintable(String),
}

impl WriteToken {
    /// The token in `path`: its contents, white space at either end trimmed.
    ///
    /// # Errors
    ///
    /// [`TokenError`] when the file cannot be read, is empty, or holds a token no
    /// `Authorization` header can carry.
    pub fn read(path: &Path) -> Result<Self, TokenError> {
        let shown = || path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
            path: shown(),
            source,
        })?;
        Self::new(text.trim()).map_err(|e| match e {
            TokenError::Empty(_) => TokenError::Empty(shown()),
            _ => TokenError::NotPrintable(shown()),
        })
    }

    /// `token` as a write token.
    ///
    /// # Errors
    ///
    /// [`TokenError::Empty`] or [`TokenError::NotPrintable`] (naming no file).
    pub fn new(token: &str) -> Result<Self, TokenError> {
        if token.is_empty() {
            return Err(TokenError::Empty(String::new()));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::NotPrintable(String::new()));
        }
        Ok(Self {
            secret: token.as_bytes().into(),
            fingerprint: fingerprint(token.as_bytes()),
        })
    }

    /// Whether `presented` is this token, compared in time independent of where they differ
    /// (a different length is told at once; the length is not the secret).
    #[must_use]
    pub fn matches(&self, presented: &[u8]) -> bool {
        bool::from(self.secret.as_ref().ct_eq(presented))
    }

    /// A short name for this token in logs: the first 8 hex digits of its SHA-256.
    #[must_use]
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
}

/// The first 8 hex digits of the SHA-256 of `token`: enough to tell tokens apart in logs, far
/// too little to recover one.
#[must_use]
pub fn fingerprint(token: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, token);
    digest.as_ref()[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_token_matches() {
        let t = WriteToken::new("s3cret-token").unwrap();
        assert!(t.matches(b"s3cret-token"));
        assert!(!t.matches(b"s3cret-tokem"));
        assert!(!t.matches(b"s3cret-token "));
        assert!(!t.matches(b"s3cret"));
        assert!(!t.matches(b""));
    }

    #[test]
    fn debug_and_fingerprint_never_show_the_token() {
        let t = WriteToken::new("s3cret-token").unwrap();
        let shown = format!("{t:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert_eq!(t.fingerprint().len(), 8);
        assert!(shown.contains(t.fingerprint()));
        assert_ne!(t.fingerprint(), fingerprint(b"other"));
    }

    #[test]
    fn a_file_is_trimmed_and_an_empty_one_refused() {
        let dir = std::env::temp_dir().join(format!("sluice-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "  abc\n").unwrap();
        assert!(WriteToken::read(&path).unwrap().matches(b"abc"));
        std::fs::write(&path, " \n").unwrap();
        let e = WriteToken::read(&path).unwrap_err().to_string();
        assert!(e.contains("is empty") && e.contains("token"), "{e}");
        std::fs::write(&path, "a b").unwrap();
        assert!(matches!(
            WriteToken::read(&path),
            Err(TokenError::NotPrintable(_))
        ));
        let e = WriteToken::read(&dir.join("absent"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("absent"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
