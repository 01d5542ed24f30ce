//! The places of quota streams: how many are open on each connection and from each peer
//! address, from their headers on, held to `rlqs.max_streams_per_connection` and
//! `rlqs.max_streams_per_peer` (the table counts `rlqs.max_streams`, and knows no connection).
//! A place is taken before a stream's first message is read and given back when the stream's
//! task drops it. The server puts a [`ConnectionStreams`] into each connection's requests.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The quota streams open on one connection, from their headers on, and the connection's peer
/// address: the connection puts one into the extensions of each of its requests, and a stream
/// holds a [`StreamPlace`] of it until it ends, so that one peer cannot hold every place of
/// `rlqs.max_streams` over a few streams of one connection.
#[derive(Clone, Debug, Default)]
pub struct ConnectionStreams {
    open: Arc<AtomicUsize>,
    /// The peer's address, when the connection has one.
    peer: Option<IpAddr>,
}

impl ConnectionStreams {
    /// The connection's peer address, when it has one.
    #[must_use]
    pub fn peer(&self) -> Option<IpAddr> {
        self.peer
    }

    /// The count of a connection from `peer`.
    #[must_use]
    pub fn from_peer(peer: IpAddr) -> Self {
        Self {
            open: Arc::default(),
            peer: Some(peer.to_canonical()),
        }
    }

    /// A place for one more stream, or `None` when `max` are open.
    #[must_use]
    pub fn take(&self, max: usize) -> Option<StreamPlace> {
        // Relaxed: a lone count; no other memory is ordered with it.
        self.open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| StreamPlace(Arc::clone(&self.open)))
    }
}

/// One stream's place on its connection, given back when dropped.
#[derive(Debug)]
pub struct StreamPlace(Arc<AtomicUsize>);

impl Drop for StreamPlace {
    fn drop(&mut self) {
        // Relaxed: as in `ConnectionStreams::take`.
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The quota streams open from each peer address, across all its connections, from their
/// headers on, so that one client cannot hold every place of `rlqs.max_streams` over many
/// connections. An address is forgotten when its last stream ends, so the map holds no more
/// entries than streams are open.
#[derive(Clone, Debug, Default)]
pub struct PeerStreams(Arc<Mutex<HashMap<IpAddr, usize>>>);

impl PeerStreams {
    fn open(&self) -> MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place for one more stream from `peer`, or `None` when `max` are open.
    #[must_use]
    pub fn take(&self, peer: IpAddr, max: usize) -> Option<PeerPlace> {
        let mut open = self.open();
        let n = open.entry(peer).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(PeerPlace {
            peers: self.clone(),
            peer,
        })
    }

    /// Addresses with a stream open.
    #[cfg(test)]
    fn peers(&self) -> usize {
        self.open().len()
    }
}

/// One stream's place among its peer's, given back when dropped.
#[derive(Debug)]
pub struct PeerPlace {
    peers: PeerStreams,
    peer: IpAddr,
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        let mut open = self.peers.open();
        if let Some(n) = open.get_mut(&self.peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_holds_at_most_its_places_and_is_forgotten_with_its_last_stream() {
        let peers = PeerStreams::default();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let mut held: Vec<PeerPlace> = (0..3).map(|_| peers.take(a, 3).unwrap()).collect();
        assert!(peers.take(a, 3).is_none(), "a fourth place for one address");
        let other = peers
            .take(b, 3)
            .expect("another address has its own places");
        held.pop();
        held.push(peers.take(a, 3).expect("a place given back is taken again"));
        drop(held);
        drop(other);
        assert_eq!(peers.peers(), 0, "no address is kept without a stream");
    }

    #[test]
    fn an_ipv4_peer_over_ipv6_counts_as_itself() {
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let streams = ConnectionStreams::from_peer(mapped);
        assert_eq!(streams.peer, Some("10.0.0.1".parse().unwrap()));
    }
}
