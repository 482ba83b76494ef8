//! What a graceful stop needs from the kernel side: stop making redirects,
//! and know how many redirected reads are still waiting for their reply.
//! Also the passed-untouched counters the telemetry shows.
// MERGE: minimal bodies over the current maps; the loader rewrite replaces them.

use anyhow::Result;
use selector_common::Policy;

use crate::Selector;

impl Selector {
    /// Makes the kernel redirect no new request; requests already in flight
    /// still complete (and their replies are still rewritten).
    pub fn stop_steering(&mut self) -> Result<()> {
        let threshold = self.settings.threshold;
        self.write_config(Policy::Observe, threshold)
    }

    /// Redirected requests still in flight: the replies a detach now would
    /// leave unrewritten.
    pub fn redirected_in_flight(&self) -> Result<usize> {
        Ok(self
            .inflight()?
            .iter()
            .filter(|(_, entry)| entry.chosen != entry.primary)
            .count())
    }

    /// Packets passed untouched since start: (direction, reason, count).
    pub fn passed(&self) -> Result<Vec<(String, String, u64)>> {
        Ok(Vec::new())
    }
}
