//! Reading the maps into a [`Snapshot`].

use std::time::Instant;

use anyhow::Result;

use crate::{datapath::Selector, telemetry::Snapshot};

impl Selector {
    pub fn snapshot(&self) -> Result<Snapshot> {
        let accounting = self.accounting()?;
        // Every live request is pending at exactly one backend: the count
        // costs no visit of the in-flight table.
        let inflight = accounting
            .iter()
            .map(|&(issued, completed, expired)| {
                selector_common::pending_of(issued, completed, expired)
            })
            .sum::<u64>() as usize;
        Ok(Snapshot {
            at: Instant::now(),
            accounting,
            stats: self.stats()?,
            latency: self.latency()?,
            inflight,
            passed: self
                .passed()?
                .into_iter()
                .map(|(d, r, n)| (d.name().to_string(), r.name().to_string(), n))
                .collect(),
            hedges: self.hedge_counts()?,
            service_ns: self.service_times(),
            ejection: self.ejection_states(crate::host::sys::monotonic_ns()),
        })
    }
}
