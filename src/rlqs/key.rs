//! A bucket's id as a stream keeps it: one run of bytes, each entry's key and then its value,
//! in the id's order, each after its length in four bytes (little-endian). Found with one read
//! of memory where the ordered map of strings it stands for takes three, and about a tenth of
//! its size. Read from the wire and written back to it as these bytes (`wire::quota`); the map
//! is made again only where a test or prost's own message needs it.

use super::BucketId;

/// A bucket id as kept ([`flatten`]).
pub type Flat = Box<[u8]>;

/// Writes `bucket` into `into`, cleared first. Two ids are equal exactly when their bytes are:
/// every key and value is told by its length. A string is at most a gRPC message's size, whose
/// length is itself four bytes, so no length reaches `u32::MAX`.
pub fn flatten(bucket: &BucketId, into: &mut Vec<u8>) {
    into.clear();
    for (key, value) in bucket {
        push_entry(into, key.as_bytes(), value.as_bytes());
    }
}

/// `bucket`'s bytes ([`flatten`]), in an allocation of their own.
#[must_use]
pub fn flat(bucket: &BucketId) -> Flat {
    let mut into = Vec::new();
    flatten(bucket, &mut into);
    into.into_boxed_slice()
}

/// The bytes of `entries`, given in their keys' order and each key once, in an allocation of
/// their own sized once.
#[must_use]
pub fn flat_of<'a>(entries: impl Iterator<Item = (&'a [u8], &'a [u8])> + Clone) -> Flat {
    let len = entries.clone().map(|(k, v)| entry_len(k, v)).sum();
    let mut flat = Vec::with_capacity(len);
    for (k, v) in entries {
        push_entry(&mut flat, k, v);
    }
    flat.into_boxed_slice()
}

/// Appends one entry to an id's bytes: entries pushed in their keys' order, each key once,
/// make the bytes [`flatten`] makes of their map.
pub fn push_entry(into: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    for s in [key, value] {
        let len = u32::try_from(s.len()).unwrap_or(u32::MAX);
        into.extend_from_slice(&len.to_le_bytes());
        into.extend_from_slice(s);
    }
}

/// The bytes an entry takes ([`push_entry`]).
#[must_use]
pub const fn entry_len(key: &[u8], value: &[u8]) -> usize {
    8 + key.len() + value.len()
}

/// The entries of `flat`, in order, as bytes. Bytes [`flatten`] did not write end the entries
/// where they stop making sense: they never come from a stream's own key.
pub fn raw_entries(flat: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    let mut rest = flat;
    let mut next = move || -> Option<&[u8]> {
        let (len, tail) = rest.split_first_chunk::<4>()?;
        let len = usize::try_from(u32::from_le_bytes(*len)).ok()?;
        let (s, tail) = tail.split_at_checked(len)?;
        rest = tail;
        Some(s)
    };
    std::iter::from_fn(move || Some((next()?, next()?)))
}

/// The entries of `flat`, in order ([`raw_entries`]); a string that is not UTF-8 reads as
/// empty, and never comes from a stream's own key either.
pub fn entries(flat: &[u8]) -> Vec<(&str, &str)> {
    let text = |s| std::str::from_utf8(s).unwrap_or_default();
    raw_entries(flat).map(|(k, v)| (text(k), text(v))).collect()
}

/// The bucket id `flat` stands for.
#[must_use]
pub fn bucket_id(flat: &[u8]) -> BucketId {
    entries(flat)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn id() -> impl Strategy<Value = BucketId> {
        proptest::collection::btree_map(".{0,6}", ".{0,6}", 1..5)
    }

    proptest! {
        /// So two ids have the same bytes only when they are equal.
        #[test]
        fn an_id_is_made_again_from_its_bytes(bucket in id()) {
            let mut flat = Vec::new();
            flatten(&bucket, &mut flat);
            prop_assert_eq!(bucket_id(&flat), bucket);
        }
    }

    #[test]
    fn an_entry_split_differently_is_another_id() {
        let a: BucketId = [("ab".to_owned(), "c".to_owned())].into();
        let b: BucketId = [("a".to_owned(), "bc".to_owned())].into();
        let (mut x, mut y) = (Vec::new(), Vec::new());
        flatten(&a, &mut x);
        flatten(&b, &mut y);
        assert_ne!(x, y);
    }

    #[test]
    fn bytes_cut_short_read_as_the_entries_before_the_cut() {
        let bucket: BucketId = [
            ("k".to_owned(), "v".to_owned()),
            ("x".to_owned(), "y".to_owned()),
        ]
        .into();
        let mut flat = Vec::new();
        flatten(&bucket, &mut flat);
        assert_eq!(entries(&flat[..flat.len() - 1]), vec![("k", "v")]);
        assert_eq!(entries(&[0xff; 7]), Vec::<(&str, &str)>::new());
    }
}
