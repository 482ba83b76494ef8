//! Hedging counters, per backend.

use serde::{Deserialize, Serialize};

/// Hedging counters of one backend: the kernel's (won, lost, dropped,
/// reads not handed over) and the agent's (sent, reads not hedged). Fields
/// of a backend in `selector status --json`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HedgeCounts {
    /// Copies sent to this backend.
    pub hedges_sent: u64,
    /// Copies to this backend whose reply reached the application first.
    pub hedges_won: u64,
    /// Copies to this backend beaten by the first member's reply.
    pub hedges_lost: u64,
    /// Reply datagrams from this backend dropped in the kernel as the later
    /// reply of a hedged read.
    pub hedge_replies_dropped: u64,
    /// Error replies from this backend to hedged reads dropped while the
    /// other copy could still answer (an error reaches the application only
    /// when both copies fail).
    pub hedge_errors_held: u64,
    /// Reads to this primary not hedged, by reason: over the budget, no
    /// other usable member (or the client socket at
    /// `--max-pending-client`), timer queue full, ring buffer full, longer than
    /// the event holds; and copies to this backend the socket refused.
    pub hedge_over_budget: u64,
    pub hedge_no_target: u64,
    pub hedge_queue_full: u64,
    pub hedge_ring_full: u64,
    pub hedge_too_large: u64,
    pub hedge_send_failed: u64,
    /// The delay in force for reads to this primary (null: hedging off).
    pub hedge_delay_ns: Option<u64>,
}

impl HedgeCounts {
    pub fn add(&mut self, o: &Self) {
        self.hedges_sent += o.hedges_sent;
        self.hedges_won += o.hedges_won;
        self.hedges_lost += o.hedges_lost;
        self.hedge_replies_dropped += o.hedge_replies_dropped;
        self.hedge_errors_held += o.hedge_errors_held;
        self.hedge_over_budget += o.hedge_over_budget;
        self.hedge_no_target += o.hedge_no_target;
        self.hedge_queue_full += o.hedge_queue_full;
        self.hedge_ring_full += o.hedge_ring_full;
        self.hedge_too_large += o.hedge_too_large;
        self.hedge_send_failed += o.hedge_send_failed;
    }
}

/// The counters of all backends summed (no delay).
pub fn total(counts: &[HedgeCounts]) -> HedgeCounts {
    let mut all = HedgeCounts::default();
    for c in counts {
        all.add(c);
    }
    all
}
