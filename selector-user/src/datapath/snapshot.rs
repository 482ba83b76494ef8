//! Reading the counters out of the maps: per backend, per group, per pass
//! reason, the latency histograms, and all of them at one moment as a
//! [`Snapshot`].

use std::time::Instant;

use anyhow::Result;
use selector_common::{
    BackendStats, Direction, PassReason,
    inflight::{InflightSlot, PHASE_LIVE, phase},
    names, pass_index, split_backend_id,
};

use crate::{
    datapath::Selector,
    host::shared::load,
    telemetry::{HeadersPulled, Snapshot},
};

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
            headers_pulled: self.headers_pulled()?,
            hedges: self.hedge_counts()?,
            service_ns: self.service_times(),
            ejection: self.ejection_states(crate::host::sys::monotonic_ns()),
        })
    }

    /// Pending requests per backend (`issued - completed - expired`).
    pub fn pending(&self) -> Result<Vec<u64>> {
        Ok(self
            .accounting()?
            .into_iter()
            .map(|(issued, completed, expired)| {
                selector_common::pending_of(issued, completed, expired)
            })
            .collect())
    }

    /// (issued, completed, expired) per backend: the raw counters behind
    /// `pending`, for checking that none drifted.
    pub fn accounting(&self) -> Result<Vec<(u64, u64, u64)>> {
        Ok(self
            .backends
            .iter()
            .map(|b| {
                let (group, position) = split_backend_id(b.index);
                let c = self.counters.ptr(group as usize);
                // SAFETY: fields of a live shared element, 8-byte aligned.
                unsafe {
                    (
                        load(&raw mut (*c).issued[position]),
                        load(&raw mut (*c).completed[position]),
                        load(&raw mut (*c).expired[position]),
                    )
                }
            })
            .collect())
    }

    /// Service time per backend (ns; 0 until the kernel measured one), as
    /// the latency policy sees it.
    pub fn service_times(&self) -> Vec<u64> {
        self.backends
            .iter()
            .map(|b| {
                let (group, position) = split_backend_id(b.index);
                let s = self.service.ptr(group as usize);
                // SAFETY: a field of a live shared element, 8-byte aligned.
                unsafe { load(&raw mut (*s).service_ns[position]) }
            })
            .collect()
    }

    /// Per-backend statistics summed over CPUs.
    pub fn stats(&self) -> Result<Vec<BackendStats>> {
        let all = self.sum_per_backend(names::STATS, |total: &mut BackendStats, s| total.add(s))?;
        Ok(self
            .backends
            .iter()
            .map(|b| all[b.index as usize])
            .collect())
    }

    /// Every backend id's element of the per-CPU map `name` (up to the
    /// last configured backend's), summed over CPUs with `add`, read in
    /// batches.
    pub(crate) fn sum_per_backend<T: Copy + Default>(
        &self,
        name: &str,
        add: impl Fn(&mut T, &T),
    ) -> Result<Vec<T>> {
        let end = self.backends.iter().map(|b| b.index + 1).max().unwrap_or(0);
        let mut out = Vec::with_capacity(end as usize);
        crate::datapath::batch::for_each(self.map(name)?, 0, end, |_, per_cpu: &[T]| {
            let mut total = T::default();
            for v in per_cpu {
                add(&mut total, v);
            }
            out.push(total);
        })?;
        Ok(out)
    }

    /// Latency histogram buckets per backend, summed over CPUs.
    pub fn latency(&self) -> Result<Vec<Vec<u64>>> {
        use selector_common::latency::LATENCY_BUCKETS;
        let map = self.map(names::LATENCY)?;
        let accounting = self.accounting()?;
        let mut cache = self.latency_cache.lock().unwrap_or_else(|e| e.into_inner());
        self.backends
            .iter()
            .zip(accounting)
            .map(|(b, (_, completed, _))| {
                // A histogram changes only with its backend's completed
                // count, in the same program run: read it (in one batch)
                // when the count moved since the last read, and once more
                // after, for a bucket added just after the count.
                let known = cache.get(&b.index);
                let moved = known.is_none_or(|k| k.completed != completed);
                if moved || known.is_some_and(|k| k.moved) {
                    let buckets = crate::datapath::batch::sum_u64(
                        map,
                        b.index * LATENCY_BUCKETS,
                        LATENCY_BUCKETS,
                    )?;
                    cache.insert(
                        b.index,
                        CachedHistogram {
                            completed,
                            moved,
                            buckets,
                        },
                    );
                }
                Ok(cache[&b.index].buckets.clone())
            })
            .collect()
    }

    /// Copies of the requests in flight now (`LIVE` slots).
    pub fn inflight(&self) -> Result<Vec<InflightSlot>> {
        let mut out = Vec::new();
        self.for_each_occupied(|(i, state)| {
            if phase(state) == PHASE_LIVE {
                let slot = self.slots.read(i);
                if slot.state == state {
                    out.push(slot);
                }
            }
        });
        Ok(out)
    }

    /// Packets passed untouched, by direction and reason, summed over CPUs.
    pub fn passed(&self) -> Result<Vec<(Direction, PassReason, u64)>> {
        let reasons = PassReason::ALL.len() as u32;
        let counts = crate::datapath::batch::sum_u64(self.map(names::PASSED)?, 0, 2 * reasons)?;
        let mut out = Vec::new();
        for direction in [Direction::Egress, Direction::Ingress] {
            for reason in PassReason::ALL {
                let n = counts[pass_index(direction, reason) as usize];
                out.push((direction, reason, n));
            }
        }
        Ok(out)
    }
}

impl Selector {
    /// Packets the programs pulled, by direction, summed over CPUs.
    pub fn headers_pulled(&self) -> Result<HeadersPulled> {
        let counts = crate::datapath::batch::sum_u64(self.map(names::PULLED)?, 0, 2)?;
        Ok(HeadersPulled {
            egress: counts[Direction::Egress as usize],
            ingress: counts[Direction::Ingress as usize],
        })
    }
}

/// A backend's latency histogram as last read, and its completed count then.
pub(crate) struct CachedHistogram {
    completed: u64,
    /// The count had moved at that read.
    moved: bool,
    buckets: Vec<u64>,
}
