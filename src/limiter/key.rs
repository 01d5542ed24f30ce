//! Counter keys: a 128-bit hash of everything that identifies one bucket (the rule and the
//! request values it depends on). Storing the hash instead of the strings bounds memory per key;
//! at 128 bits a collision among billions of keys is negligible.

use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::xxh3_128;

/// The identity of one counter.
pub type Key = u128;

/// Bytes a key's input may take before it moves to the heap: a seed and a few short parts.
const INLINE: usize = 176;

/// Builds a [`Key`] from a sequence of byte strings. Each part is length-prefixed, so
/// `("ab", "c")` and `("a", "bc")` differ.
///
/// The parts are gathered in a stack buffer and hashed in one call at the end: XXH3's one-shot
/// form on short input is several times cheaper than its streaming state (a 600-byte struct to
/// set up and copy through), and gives the same hash.
#[derive(Clone)]
pub struct KeyBuilder {
    inline: [u8; INLINE],
    len: usize,
    /// The whole input once it outgrows `inline`.
    spill: Vec<u8>,
}

impl KeyBuilder {
    /// A builder seeded with `seed`, typically the identity of a rule.
    #[must_use]
    pub fn new(seed: u128) -> Self {
        let mut builder = Self {
            inline: [0; INLINE],
            len: 0,
            spill: Vec::new(),
        };
        builder.push(&seed.to_le_bytes());
        builder
    }

    /// Appends one part.
    pub fn part(&mut self, bytes: &[u8]) -> &mut Self {
        // usize → u64 never truncates on supported targets.
        self.push(&(bytes.len() as u64).to_le_bytes());
        self.push(bytes);
        self
    }

    fn push(&mut self, bytes: &[u8]) {
        if self.spill.is_empty() {
            if let Some(room) = self.inline.get_mut(self.len..self.len + bytes.len()) {
                room.copy_from_slice(bytes);
                self.len += bytes.len();
                return;
            }
            self.spill.reserve(self.len + bytes.len());
            self.spill.extend_from_slice(&self.inline[..self.len]);
        }
        self.spill.extend_from_slice(bytes);
    }

    /// The key.
    #[must_use]
    pub fn finish(&self) -> Key {
        if self.spill.is_empty() {
            xxh3_128(&self.inline[..self.len])
        } else {
            xxh3_128(&self.spill)
        }
    }
}

impl std::fmt::Debug for KeyBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyBuilder")
    }
}

/// The hasher of maps keyed by a [`Key`] (or another 128-bit hash): folds it, nothing more.
pub type KeyHash = BuildHasherDefault<KeyHasher>;

/// Hashes a [`Key`], which is already a uniformly distributed 128-bit hash, by folding it to
/// 64 bits instead of hashing it again.
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(word);
        }
    }

    fn write_u128(&mut self, n: u128) {
        // Truncation intended: fold the two halves.
        self.0 ^= (n as u64) ^ ((n >> 64) as u64);
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

    /// The key is XXH3-128 of the length-prefixed parts, whether the input stays inline or
    /// spills to the heap (keys must not change: Redis stores counters under them).
    #[test]
    fn key_is_xxh3_of_the_framed_parts() {
        use xxhash_rust::xxh3::Xxh3Default;
        for sizes in [
            &[0usize][..],
            &[3, 5],
            &[100, 40],
            &[150, 10, 3],
            &[500],
            &[10, 1000, 2],
        ] {
            let parts: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|b| (b * 7 + i) as u8).collect())
                .collect();
            let mut builder = KeyBuilder::new(42);
            let mut reference = Xxh3Default::new();
            reference.update(&42u128.to_le_bytes());
            for p in &parts {
                builder.part(p);
                reference.update(&(p.len() as u64).to_le_bytes());
                reference.update(p);
            }
            assert_eq!(
                builder.finish(),
                reference.digest128(),
                "parts of {sizes:?}"
            );
        }
    }
}
