//! Bounds shared by the agent's two listeners (the control socket and the
//! metrics endpoint), so that no local process or scraper can starve the
//! agent: connections served at once, how long a reply may take to be
//! written, and a pause after a failed accept.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Connections a listener serves at once; a connection beyond them is
/// closed at once (a scraper retries, a command says so). Each waits at
/// most its request timeout, so idle ones make room within seconds.
pub const MAX_CONNECTIONS: usize = 64;

/// Longest a reply may take to be written: a reader that never reads
/// gives its connection up then.
pub const WRITE_WAIT: Duration = Duration::from_secs(5);

/// Pause after a failed accept (out of descriptors, say), so the loop does
/// not spin on the error.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Room for [`MAX_CONNECTIONS`] connections.
#[derive(Clone)]
pub struct ConnectionLimit(Arc<Semaphore>);

impl Default for ConnectionLimit {
    fn default() -> Self {
        Self(Arc::new(Semaphore::new(MAX_CONNECTIONS)))
    }
}

impl ConnectionLimit {
    /// A place for one more connection, held until the permit drops;
    /// `None` when all are taken.
    pub fn admit(&self) -> Option<OwnedSemaphorePermit> {
        self.0.clone().try_acquire_owned().ok()
    }
}

/// Room for [`MAX_CONNECTIONS`] connections where a new one is never
/// refused: when all are taken, the oldest is told to give its place up
/// (the metrics endpoint, whose port the kubelet's probes share with
/// anyone on the network: a peer holding every place with idle
/// connections would otherwise have the agent restarted for failing its
/// liveness probe). A probe answers in a millisecond, so it is evicted
/// only by as many newer connections within that millisecond.
#[derive(Clone, Default)]
pub struct EvictingLimit(Arc<Mutex<Places>>);

#[derive(Default)]
struct Places {
    next_id: u64,
    /// Live connections, oldest first: (id, told to leave).
    held: VecDeque<(u64, Arc<Notify>)>,
}

/// A connection's place; dropping it frees the place.
pub struct Place {
    id: u64,
    /// Notified when a newer connection needs the place.
    pub evicted: Arc<Notify>,
    limit: EvictingLimit,
}

impl EvictingLimit {
    /// A place for one more connection, the oldest's if all are taken.
    pub fn admit(&self) -> Place {
        let mut places = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if places.held.len() >= MAX_CONNECTIONS
            && let Some((_, oldest)) = places.held.pop_front()
        {
            // Stored, so that an eviction before the task waits is kept.
            oldest.notify_one();
        }
        let id = places.next_id;
        places.next_id += 1;
        let evicted = Arc::new(Notify::new());
        places.held.push_back((id, evicted.clone()));
        Place {
            id,
            evicted,
            limit: self.clone(),
        }
    }

    /// Connections holding a place.
    pub fn held(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).held.len()
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut places = self.limit.0.lock().unwrap_or_else(|e| e.into_inner());
        places.held.retain(|(id, _)| *id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_beyond_the_limit_are_refused_until_one_ends() {
        let limit = ConnectionLimit::default();
        let held: Vec<_> = (0..MAX_CONNECTIONS)
            .map(|_| limit.admit().unwrap())
            .collect();
        assert!(limit.admit().is_none());
        drop(held);
        assert!(limit.admit().is_some());
    }

    #[tokio::test]
    async fn a_connection_beyond_the_evicting_limit_takes_the_oldest_place() {
        let limit = EvictingLimit::default();
        let mut held: VecDeque<Place> = (0..MAX_CONNECTIONS).map(|_| limit.admit()).collect();
        let newest = limit.admit();
        assert_eq!(limit.held(), MAX_CONNECTIONS);
        // The oldest was told (and its place already given), no other.
        let oldest = held.pop_front().unwrap();
        tokio::time::timeout(Duration::from_secs(1), oldest.evicted.notified())
            .await
            .expect("the oldest is told to leave");
        let second = held.pop_front().unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(50), second.evicted.notified())
                .await
                .is_err()
        );
        drop((oldest, second, newest));
        assert_eq!(limit.held(), MAX_CONNECTIONS - 2);
    }
}
