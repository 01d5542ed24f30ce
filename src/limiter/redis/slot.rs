//! Redis Cluster's hash slots: which slot a key lives in, and a request's keys grouped by slot
//! (each group is one atomic script call in a cluster).

/// Redis Cluster's hash slot of a key: CRC16 (XMODEM) of the key, or of its `{hash tag}`.
fn hash_slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|b| *b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|b| *b == b'}')
                .filter(|len| *len > 0)
                .map(|len| &rest[..len])
        })
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &b in tagged {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// The indices of `keys` grouped by hash slot, in order of first appearance.
pub(super) fn group_by_slot<K: AsRef<[u8]>>(
    keys: impl IntoIterator<Item = K>,
) -> Vec<(u16, Vec<usize>)> {
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, key) in keys.into_iter().enumerate() {
        let slot = hash_slot(key.as_ref());
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, idx)) => idx.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_slots_match_redis() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(hash_slot(b"123456789"), 0x31C3);
        assert_eq!(hash_slot(b"foo"), 12182);
        assert_eq!(hash_slot(b"{user1000}.following"), hash_slot(b"user1000"));
        // An empty first tag: the whole key is hashed (CRC16/XMODEM of "foo{}{bar}" is 8363
        // mod 16384), not "bar".
        assert_eq!(hash_slot(b"foo{}{bar}"), 8363);
        assert_ne!(hash_slot(b"foo{}{bar}"), hash_slot(b"bar"));
    }

    #[test]
    fn keys_group_by_slot_in_order_of_first_appearance() {
        let groups = group_by_slot(["{a}1", "{b}1", "{a}2", "{b}2", "{a}3"]);
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0], (hash_slot(b"a"), vec![0, 2, 4]));
        assert_eq!(groups[1], (hash_slot(b"b"), vec![1, 3]));
    }
}
