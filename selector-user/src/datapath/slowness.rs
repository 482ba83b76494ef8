//! The agent's side of the memory of slowness
//! (`selector_common::slowness`): every few milliseconds it measures each
//! member from what the kernel counted (the latency histogram's new
//! replies, and how long reads have waited with no completion), runs
//! `step_group` per group, and sets or clears the slow and slow-probe bits
//! of the group's health word, beside ejection's bits and the kernel's
//! probe compare-and-swap.

use std::collections::HashMap;

use selector_common::{
    MAX_GROUP_MEMBERS,
    ejection::{
        EXPLORE_MASK, SLOW_MASK, SLOW_PROBE_MASK, ejected_mask, explore_bit, slow_bit,
        slow_probe_bit,
    },
    latency::{bucket_edge_ns, bucket_lower_ns},
    pending_of,
    slowness::{self, Event, Memory, Probe, Seen, Standing},
    split_backend_id,
};

use crate::{config::tunables::AvoidSlow, datapath::Selector, host::shared::load};

/// The agent's memory of slowness, per group and per backend.
#[derive(Debug, Default)]
pub struct Slowness {
    groups: HashMap<u32, GroupMemory>,
    /// Per backend id: the histogram at the last step, the step that
    /// first saw requests pending on it (0: none pending then).
    backends: HashMap<u32, BackendWatch>,
    /// The counts the last step read, and whether nothing had moved since
    /// the step before and no member was slow (`Selector::slowness_settled`).
    accounting: Vec<(u64, u64, u64)>,
    settled: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct GroupMemory {
    members: [Memory; MAX_GROUP_MEMBERS],
    stepped_ns: u64,
    /// Probes reads took, per member, since start.
    probes: [u64; MAX_GROUP_MEMBERS],
}

/// Whether `m` has a probe offered and not taken.
fn offering(m: &Memory) -> bool {
    matches!(
        m.standing,
        Standing::Slow {
            probe: Probe::Offered,
            ..
        }
    )
}

#[derive(Debug, Default, Clone)]
struct BackendWatch {
    /// The histogram when the current sample's window began, and when.
    histogram: Vec<u64>,
    window_ns: u64,
    pending_since_ns: u64,
}

impl BackendWatch {
    /// The latency sample of the replies since the window began, once
    /// there are enough of them or the window is long enough
    /// (`slowness::sample_ready`); the next window begins then.
    fn latency_sample(&mut self, now: &[u64], now_ns: u64) -> Option<u64> {
        if self.window_ns == 0 {
            // First sight: the history so far is no recent sample.
            self.histogram.clone_from(&now.to_vec());
            self.window_ns = now_ns;
            return None;
        }
        let (replies, mean) = mean_of_new(&self.histogram, now);
        if !slowness::sample_ready(replies, now_ns.saturating_sub(self.window_ns)) {
            return None;
        }
        self.histogram.clone_from(&now.to_vec());
        self.window_ns = now_ns;
        mean
    }
}

/// How many replies `now` counts that `before` does not, and their mean
/// latency (bucket midpoints; `None` if none).
pub fn mean_of_new(before: &[u64], now: &[u64]) -> (u64, Option<u64>) {
    let (mut count, mut sum) = (0u64, 0u128);
    for (i, &n) in now.iter().enumerate() {
        let new = n.saturating_sub(before.get(i).copied().unwrap_or(0));
        if new == 0 {
            continue;
        }
        let lower = bucket_lower_ns(i as u32);
        let mid = lower + (bucket_edge_ns(i as u32) - lower) / 2;
        count += new;
        sum += u128::from(new) * u128::from(mid);
    }
    (count, (count > 0).then(|| (sum / u128::from(count)) as u64))
}

impl Selector {
    /// One step of every group at `now_ns`; what changed, a line each.
    pub fn check_slowness(&mut self, now_ns: u64) -> Vec<String> {
        if self.settings.tunables.avoid_slow == AvoidSlow::Off {
            // Turned off (or never on): nothing remembered, no bit set.
            if !self.slowness.groups.is_empty() {
                self.reset_slowness();
            }
            self.slowness.settled = true;
            return Vec::new();
        }
        let (Ok(accounting), Ok(histograms)) = (self.accounting(), self.latency()) else {
            return Vec::new();
        };
        // Which members are in service: not left to ejection's last check,
        // which may be 250 ms old or (an embedding without it) never ran.
        if self.read_active_members().is_err() {
            return Vec::new();
        }
        let any_slow = self
            .slowness
            .groups
            .values()
            .any(|g| g.members.iter().any(Memory::is_slow));
        self.slowness.settled = !any_slow && accounting == self.slowness.accounting;
        self.slowness.accounting.clone_from(&accounting);
        let mut by_group: HashMap<u32, Vec<(usize, usize)>> = HashMap::new();
        for (i, b) in self.backends.iter().enumerate() {
            let (group, position) = split_backend_id(b.index);
            by_group.entry(group).or_default().push((position, i));
        }
        let mut lines = Vec::new();
        for (group, members) in by_group {
            let h = self.health.ptr(group as usize);
            // SAFETY: a field of a live shared element, 8-byte aligned.
            let word = unsafe { load(&raw mut (*h).bits) };
            let ejected = ejected_mask(word);
            let active = self.ejection.active_members(group);
            let mut seen = [Seen::default(); MAX_GROUP_MEMBERS];
            let mut len = 0;
            for &(position, i) in &members {
                let p = position % MAX_GROUP_MEMBERS;
                let b = &self.backends[i];
                let (issued, completed, expired) = accounting[i];
                let pending = pending_of(issued, completed, expired);
                let s = self.service.ptr(group as usize);
                // SAFETY: as above.
                let last_completion_ns = unsafe { load(&raw mut (*s).last_completion_ns[p]) };
                let watch = self.slowness.backends.entry(b.index).or_default();
                let latency_ns = watch.latency_sample(&histograms[i], now_ns);
                watch.pending_since_ns = match (pending, watch.pending_since_ns) {
                    (0, _) => 0,
                    (_, 0) => now_ns,
                    (_, since) => since,
                };
                let waiting_since = watch.pending_since_ns.max(last_completion_ns);
                seen[p] = Seen {
                    latency_ns,
                    stalled_ns: if pending == 0 {
                        0
                    } else {
                        now_ns.saturating_sub(waiting_since)
                    },
                    eligible: active & (1 << p) != 0 && ejected & (1 << p) == 0,
                    probe_offered: word & slow_probe_bit(p) != 0,
                    explore_offered: word & explore_bit(p) != 0,
                };
                len = len.max(p + 1);
            }
            let record = self.slowness.groups.entry(group).or_default();
            let elapsed = match record.stepped_ns {
                0 => 0,
                at => now_ns.saturating_sub(at),
            };
            record.stepped_ns = now_ns;
            let offered: Vec<bool> = record.members[..len].iter().map(offering).collect();
            let events =
                slowness::step_group(&mut record.members[..len], &seen[..len], now_ns, elapsed);
            for (p, was) in offered.into_iter().enumerate() {
                // Offered before the step, taken by a read since.
                record.probes[p] += u64::from(was && !seen[p].probe_offered);
            }
            let explore = slowness::to_explore(&record.members[..len], &seen[..len], now_ns);
            if explore != 0 {
                let set = (0..len)
                    .filter(|p| explore & (1 << p) != 0)
                    .fold(0, |w, p| w | explore_bit(p));
                self.change_bits(group, 0, set);
            }
            let name = |p: usize| {
                members.iter().find(|(q, _)| *q == p).map_or_else(
                    || format!("member {p}"),
                    |&(_, i)| self.backends[i].addr.to_string(),
                )
            };
            let ms = |ns: u64| ns as f64 / 1e6;
            for event in events.iter() {
                let (clear, set) = match event {
                    Event::Slow {
                        position,
                        score_ns,
                        fastest_ns,
                    } => {
                        lines.push(format!(
                            "{} slow: {:.1} ms recently against {:.1} ms; its reads go elsewhere until a probe finds it fast",
                            name(position),
                            ms(score_ns),
                            ms(fastest_ns)
                        ));
                        (0, slow_bit(position))
                    }
                    Event::ProbeOffered { position } => (0, slow_probe_bit(position)),
                    Event::ProbeSlow {
                        position,
                        sample_ns,
                        backoff_ns,
                    } => {
                        log::debug!(
                            "{} still slow: its probe took {:.1} ms; the next in {:.1} s",
                            name(position),
                            ms(sample_ns),
                            backoff_ns as f64 / 1e9
                        );
                        (slow_probe_bit(position), 0)
                    }
                    Event::Fine {
                        position,
                        sample_ns,
                    } => {
                        lines.push(format!(
                            "{} fast again ({:.1} ms): chosen as before",
                            name(position),
                            ms(sample_ns)
                        ));
                        (slow_bit(position) | slow_probe_bit(position), 0)
                    }
                };
                self.change_bits(group, clear, set);
            }
        }
        lines
    }

    /// Whether the last step found nothing in motion: no request issued,
    /// completed or expired since the step before, no member slow. Then
    /// nothing can be measured until one is, and the agent may step less
    /// often (an idle agent's wakeups cost the host's other traffic).
    pub fn slowness_settled(&self) -> bool {
        self.slowness.settled
    }

    /// Whether backend `id` is slow now, its score (ns) and the probes
    /// reads took since start.
    pub fn slowness_of(&self, id: u32) -> (bool, u64, u64) {
        let (group, position) = split_backend_id(id);
        let p = position % MAX_GROUP_MEMBERS;
        self.slowness.groups.get(&group).map_or((false, 0, 0), |g| {
            (g.members[p].is_slow(), g.members[p].score_ns, g.probes[p])
        })
    }

    /// Forgets the memory of the member at `position` of `group` (a
    /// newcomer a reload puts there) and clears its bits.
    pub(crate) fn forget_slowness(&mut self, group: u32, position: usize) {
        let p = position % MAX_GROUP_MEMBERS;
        self.change_bits(group, slow_bit(p) | slow_probe_bit(p) | explore_bit(p), 0);
        if let Some(g) = self.slowness.groups.get_mut(&group) {
            g.members[p] = Memory::default();
        }
        self.slowness
            .backends
            .remove(&selector_common::backend_id(group, p));
    }

    /// Takes the slow members that adopted pins hold as this agent's own
    /// (an agent restarted on its predecessor's maps): each stays slow
    /// until its first probe, after `PROBE_FIRST_NS`, or keeps the probe
    /// it was offered. A restart never sends reads back to a slow member
    /// unprobed.
    pub(crate) fn adopt_slowness(&mut self, now_ns: u64) {
        self.slowness = Slowness::default();
        for g in 0..self.health.len() {
            let h = self.health.ptr(g);
            // SAFETY: a field of a live shared element, 8-byte aligned.
            let word = unsafe { load(&raw mut (*h).bits) };
            if word & SLOW_MASK == 0 {
                continue;
            }
            let mut record = GroupMemory::default();
            for (p, m) in record.members.iter_mut().enumerate() {
                if word & slow_bit(p) == 0 {
                    continue;
                }
                let probe = if word & slow_probe_bit(p) != 0 {
                    Probe::Offered
                } else {
                    Probe::Waiting
                };
                m.standing = Standing::Slow {
                    next_probe_ns: now_ns + slowness::PROBE_FIRST_NS,
                    backoff_ns: slowness::PROBE_FIRST_NS,
                    probe,
                };
            }
            self.slowness.groups.insert(g as u32, record);
        }
    }

    /// Forgets every memory and clears the slow bits of every group (a
    /// fresh agent on maps of its own).
    pub(crate) fn reset_slowness(&mut self) {
        self.slowness = Slowness::default();
        for g in 0..self.health.len() {
            self.change_bits(g as u32, SLOW_MASK | SLOW_PROBE_MASK | EXPLORE_MASK, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use selector_common::latency::{LATENCY_BUCKETS, bucket};

    use super::*;

    #[test]
    fn the_mean_is_of_the_new_replies_only() {
        let mut before = vec![0u64; LATENCY_BUCKETS as usize];
        before[bucket(100_000) as usize] = 1_000;
        let mut now = before.clone();
        assert_eq!(mean_of_new(&before, &now), (0, None));
        now[bucket(20_000_000) as usize] += 1;
        now[bucket(200_000) as usize] += 3;
        let (replies, mean) = mean_of_new(&before, &now);
        assert_eq!(replies, 4);
        let mean = mean.unwrap();
        // (20 ms + 3 x 0.2 ms) / 4, within the buckets' 25%.
        assert!((4_500_000..=6_500_000).contains(&mean), "{mean}");
        // A histogram seen for the first time counts whole.
        assert!(mean_of_new(&[], &before).1.unwrap() >= 100_000);
    }

    #[test]
    fn a_sample_waits_for_enough_replies_or_a_long_enough_window() {
        const MS: u64 = 1_000_000;
        let mut h = vec![0u64; LATENCY_BUCKETS as usize];
        let mut watch = BackendWatch::default();
        assert_eq!(watch.latency_sample(&h, 10 * MS), None, "first sight");
        // Three replies of 5 ms in 10 ms: too few, too soon.
        h[bucket(5_000_000) as usize] += 3;
        assert_eq!(watch.latency_sample(&h, 20 * MS), None);
        // Five more of 5 ms: eight, a sample of all eight.
        h[bucket(5_000_000) as usize] += 5;
        let mean = watch.latency_sample(&h, 30 * MS).unwrap();
        assert!((4_000_000..=6_250_000).contains(&mean), "{mean}");
        // One reply, then the window's length makes it a sample (a probe).
        h[bucket(12_000_000) as usize] += 1;
        assert_eq!(watch.latency_sample(&h, 40 * MS), None);
        let probe = watch
            .latency_sample(&h, 30 * MS + slowness::SAMPLE_WINDOW_NS)
            .unwrap();
        assert!(probe >= 10_000_000, "{probe}");
    }
}
