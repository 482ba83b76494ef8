//! Expiry of lost requests. The sweep and the response path race to delete
//! an in-flight entry; whoever deletes it accounts for it, so a pending
//! count is never subtracted twice or leaked.

use anyhow::Result;
use aya::maps::HashMap;
use selector_common::{InflightEntry, InflightKey, names};

use crate::{Selector, sys};

/// What one sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Entries this sweep expired (and subtracted).
    pub expired: u64,
    /// Entries the response path completed first.
    pub lost_race: u64,
}

impl Selector {
    /// Expires in-flight entries older than the timeout, as of `now_ns`
    /// (CLOCK_MONOTONIC).
    pub fn sweep(&mut self, now_ns: u64) -> Result<SweepReport> {
        let timeout_ns = self.settings.timeout.as_nanos() as u64;
        let is_stale = |e: &InflightEntry| now_ns.saturating_sub(e.sent_ns) >= timeout_ns;
        let stale: Vec<(InflightKey, InflightEntry)> = self
            .inflight()?
            .into_iter()
            .filter(|(_, e)| is_stale(e))
            .collect();
        let fd = self.inflight_fd()?;
        let mut report = SweepReport::default();
        let mut touched = Vec::new();
        for (key, seen) in stale {
            // Re-read just before deleting: a reply may have completed it and
            // a new request reused the key since the listing.
            if self.inflight_entry(&key)? != Some(seen) {
                report.lost_race += 1;
                continue;
            }
            let Some(entry) = sys::lookup_and_delete::<_, InflightEntry>(fd, &key)? else {
                report.lost_race += 1;
                continue;
            };
            if !is_stale(&entry) && self.restore(&key, &entry)? {
                // A new request reused the key after we listed it; it is back.
                continue;
            }
            if let Some(count) = self.expired.get_mut(entry.chosen as usize) {
                *count += 1;
                touched.push(selector_common::split_backend_id(entry.chosen).0);
                report.expired += 1;
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for group in touched {
            self.write_expired(group)?;
        }
        Ok(report)
    }

    fn inflight_entry(&self, key: &InflightKey) -> Result<Option<InflightEntry>> {
        let table: HashMap<_, InflightKey, InflightEntry> =
            HashMap::try_from(self.map(names::INFLIGHT)?)?;
        match table.get(key, 0) {
            Ok(e) => Ok(Some(e)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Puts back an entry removed by mistake; false if the kernel already
    /// inserted another under the same key (then ours must be expired).
    fn restore(&mut self, key: &InflightKey, entry: &InflightEntry) -> Result<bool> {
        let mut table: HashMap<_, InflightKey, InflightEntry> =
            HashMap::try_from(self.map_mut(names::INFLIGHT)?)?;
        Ok(table.insert(key, entry, 1 /* BPF_NOEXIST */).is_ok())
    }
}
