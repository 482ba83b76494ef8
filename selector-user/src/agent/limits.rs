//! Bounds shared by the agent's two listeners (the control socket and the
//! metrics endpoint), so that no local process or scraper can starve the
//! agent: connections served at once, how long a reply may take to be
//! written, and a pause after a failed accept.

use std::{sync::Arc, time::Duration};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

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
}
