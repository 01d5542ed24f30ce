//! Counter keys: a 128-bit hash of everything that identifies one bucket (the rule and the
//! request values it depends on). Storing the hash instead of the strings bounds memory per key;
//! at 128 bits a collision among billions of keys is negligible.

use xxhash_rust::xxh3::Xxh3Default;

/// The identity of one counter.
pub type Key = u128;

/// Builds a [`Key`] from a sequence of byte strings. Each part is length-prefixed, so
/// `("ab", "c")` and `("a", "bc")` differ.
#[derive(Clone)]
pub struct KeyBuilder {
    state: Xxh3Default,
}

impl KeyBuilder {
    /// A builder seeded with `seed`, typically the identity of a rule.
    #[must_use]
    pub fn new(seed: u128) -> Self {
        let mut state = Xxh3Default::new();
        state.update(&seed.to_le_bytes());
        Self { state }
    }

    /// Appends one part.
    pub fn part(&mut self, bytes: &[u8]) -> &mut Self {
        // usize → u64 never truncates on supported targets.
        self.state.update(&(bytes.len() as u64).to_le_bytes());
        self.state.update(bytes);
        self
    }

    /// The key.
    #[must_use]
    pub fn finish(&self) -> Key {
        self.state.digest128()
    }
}

impl std::fmt::Debug for KeyBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyBuilder")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_delimited() {
        let k1 = KeyBuilder::new(1).part(b"ab").part(b"c").finish();
        let k2 = KeyBuilder::new(1).part(b"a").part(b"bc").finish();
        let k3 = KeyBuilder::new(2).part(b"ab").part(b"c").finish();
        assert_ne!(k1, k2);
        assert_ne!(k1, k3);
        assert_eq!(k1, KeyBuilder::new(1).part(b"ab").part(b"c").finish());
    }
}
