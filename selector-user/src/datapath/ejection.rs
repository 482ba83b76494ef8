//! The agent's side of outlier ejection: it reads the failures in a row and
//! good replies the kernel (and the sweep) counted in `HEALTH`, runs
//! `selector_common::ejection::step_group` per group, and writes the
//! ejected and probe bits back, atomically, beside the kernel's probe
//! compare-and-swap and failing bits (a run the reply path saw reach
//! `eject_after`, held out of the choice until this step answers it).

use std::{collections::HashMap, net::SocketAddr, sync::atomic::Ordering};

use selector_common::{
    Group, MAX_GROUP_MEMBERS,
    ejection::{
        self, EJECT_AFTER_MASK, EJECTABLE_MASK, Event, FAILING_MASK, GoodWatch, Member, Seen,
        State, eject_after_field, ejected_bit, probe_bit,
    },
    names, split_backend_id,
};

use crate::{
    config::settings::BackendPlan,
    datapath::Selector,
    host::shared::{atomic, load},
    telemetry::EjectionState,
};

/// The agent's ejection records, per group.
#[derive(Debug, Default)]
pub struct Ejection {
    groups: HashMap<u32, GroupRecord>,
    /// xorshift state for the jitter.
    random: u64,
    /// The members by group, kept between checks: a check every 10 ms
    /// that regrouped them (hash maps, vectors, a sort) was most of an
    /// idle agent's CPU.
    layout: Layout,
    /// Each group's active members, as the last check read them.
    active: Vec<u32>,
    /// The last check found nothing in motion (`Selector::ejection_settled`).
    settled: bool,
}

/// The configured members by group, in group order, and the backends they
/// were made from (rebuilt only when those change: a reload).
#[derive(Debug, Default)]
struct Layout {
    backends: Vec<BackendPlan>,
    groups: Vec<(u32, Vec<(usize, SocketAddr)>)>,
}

impl Layout {
    fn of(backends: &[BackendPlan]) -> Layout {
        let mut by_group: HashMap<u32, Vec<(usize, SocketAddr)>> = HashMap::new();
        for b in backends {
            let (group, position) = split_backend_id(b.index);
            by_group.entry(group).or_default().push((position, b.addr));
        }
        let mut groups: Vec<_> = by_group.into_iter().collect();
        groups.sort();
        Layout {
            backends: backends.to_vec(),
            groups,
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct GroupRecord {
    members: [Member; MAX_GROUP_MEMBERS],
    over_cap: bool,
    /// When each member last answered well, for the sweep.
    good: [GoodWatch; MAX_GROUP_MEMBERS],
    /// The last check of this group, ns.
    checked_ns: u64,
}

impl Ejection {
    /// Group `group`'s members in service as the last check read them.
    pub(crate) fn active_members(&self, group: u32) -> u32 {
        self.active.get(group as usize).copied().unwrap_or(0)
    }

    fn next_random(&mut self) -> u32 {
        if self.random == 0 {
            self.random = crate::host::sys::monotonic_ns() | 1;
        }
        let mut x = self.random;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.random = x;
        (x >> 32) as u32
    }
}

impl Selector {
    /// Adds one failure in a row to `backend`: the sweep expired a request
    /// sent to it at `sent_ns`, and no good reply from it is known to have
    /// come since (else the run was already broken after this request).
    pub(crate) fn count_failure(&self, backend: u32, sent_ns: u64) {
        let (group, position) = split_backend_id(backend);
        let answered_since = self
            .ejection
            .groups
            .get(&group)
            .is_some_and(|r| !r.good[position % MAX_GROUP_MEMBERS].expiry_counts(sent_ns));
        if answered_since {
            return;
        }
        let h = self.health.ptr(group as usize);
        // SAFETY: a field of a live shared element, 8-byte aligned.
        unsafe {
            atomic(&raw mut (*h).failures[position % MAX_GROUP_MEMBERS])
                .fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Changes group `group`'s health word: clears `clear`, then sets `set`.
    pub(crate) fn change_bits(&self, group: u32, clear: u64, set: u64) {
        let h = self.health.ptr(group as usize);
        // SAFETY: a field of a live shared element, 8-byte aligned.
        let word = unsafe { atomic(&raw mut (*h).bits) };
        let _ = word.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
            Some((b & !clear) | set)
        });
    }

    /// One step of every group at `now_ns`: ejects, probes, restores, and
    /// returns what happened, one line each, for the log.
    pub fn check_ejection(&mut self, now_ns: u64) -> Vec<String> {
        if self.ejection.layout.backends != self.backends {
            self.ejection.layout = Layout::of(&self.backends);
        }
        // Every group's drained members in one system call (one lookup
        // per backend, every 10 ms, was most of an idle agent's CPU).
        let layout = std::mem::take(&mut self.ejection.layout);
        let lines = match self.read_active_members() {
            Ok(()) => {
                let active = std::mem::take(&mut self.ejection.active);
                let lines = self.check_groups(&layout, &active, now_ns);
                self.ejection.active = active;
                lines
            }
            Err(_) => Vec::new(),
        };
        self.ejection.layout = layout;
        lines
    }

    /// Reads every group's members in service (`Ejection::active_members`),
    /// in one system call.
    pub(crate) fn read_active_members(&mut self) -> anyhow::Result<()> {
        let groups = self.backends.iter().map(|b| b.group + 1).max().unwrap_or(0);
        let mut active = std::mem::take(&mut self.ejection.active);
        active.clear();
        active.resize(groups as usize, 0);
        let read = self.map(names::GROUPS).and_then(|map| {
            crate::datapath::batch::for_each(map, 0, groups, |g, group: &[Group]| {
                if let Some(a) = active.get_mut(g as usize) {
                    *a = group[0].active;
                }
            })
        });
        self.ejection.active = active;
        read
    }

    /// `check_ejection` of each group in `layout`, `active` its members
    /// in service.
    fn check_groups(&mut self, layout: &Layout, active: &[u32], now_ns: u64) -> Vec<String> {
        let params = self.settings.ejection.params(self.settings.timeout);
        let mut lines = Vec::new();
        let mut settled = true;
        for (group, members) in &layout.groups {
            let group = *group;
            let h = self.health.ptr(group as usize);
            // SAFETY: fields of a live shared element, 8-byte aligned.
            let bits = unsafe { load(&raw mut (*h).bits) };
            let mut seen = [Seen::default(); MAX_GROUP_MEMBERS];
            let mut len = 0;
            for &(p, _) in members {
                let p = p % MAX_GROUP_MEMBERS;
                // SAFETY: as above.
                let (failures, good) =
                    unsafe { (load(&raw mut (*h).failures[p]), load(&raw mut (*h).good[p])) };
                seen[p] = Seen {
                    failures,
                    good,
                    eligible: active
                        .get(group as usize)
                        .is_some_and(|a| a & (1 << p) != 0),
                    probe_offered: bits & probe_bit(p) != 0,
                };
                len = len.max(p + 1);
            }
            let mut record = self
                .ejection
                .groups
                .get(&group)
                .copied()
                .unwrap_or_default();
            for &(p, _) in members {
                let p = p % MAX_GROUP_MEMBERS;
                record.good[p].observe(seen[p].good, record.checked_ns);
            }
            record.checked_ns = now_ns;
            let mut random = [0u32; ejection::MAX_EVENTS];
            for r in &mut random {
                *r = self.ejection.next_random();
            }
            let mut draws = random.into_iter();
            let events = ejection::step_group(
                &mut record.members[..len],
                &seen[..len],
                &mut record.over_cap,
                &params,
                now_ns,
                || draws.next().unwrap_or(0),
            );
            self.ejection.groups.insert(group, record);
            // After the step: a member it ejected is in motion.
            settled &= bits & FAILING_MASK == 0
                && !record.over_cap
                && seen[..len].iter().all(|s| s.failures == 0)
                && record.members[..len]
                    .iter()
                    .all(|m| m.state == ejection::State::Healthy);
            let name = |p: usize| {
                members
                    .iter()
                    .find(|(q, _)| *q == p)
                    .map_or_else(|| format!("member {p}"), |(_, a)| a.to_string())
            };
            for event in events.iter() {
                match event {
                    Event::Ejected {
                        position,
                        for_ns,
                        failures,
                        probe_failed,
                    } => {
                        self.change_bits(group, probe_bit(position), ejected_bit(position));
                        let why = if probe_failed {
                            "its probe failed".to_string()
                        } else {
                            format!("{failures} failures in a row")
                        };
                        lines.push(format!(
                            "{} ejected for {:.1} s after {why} (ejection {})",
                            name(position),
                            for_ns as f64 / 1e9,
                            record.members[position].ejections
                        ));
                    }
                    Event::Probe { position, again } => {
                        // SAFETY: a field of a live shared element.
                        unsafe {
                            atomic(&raw mut (*h).failures[position % MAX_GROUP_MEMBERS])
                                .store(0, Ordering::SeqCst);
                        }
                        self.change_bits(group, ejected_bit(position), probe_bit(position));
                        lines.push(format!(
                            "{} half-open: {} read probes it",
                            name(position),
                            if again { "its probe had no result; another" } else { "one" }
                        ));
                    }
                    Event::Restored { position, probe } => {
                        self.change_bits(group, ejected_bit(position) | probe_bit(position), 0);
                        lines.push(if probe {
                            format!("{} restored: its probe was answered", name(position))
                        } else {
                            format!("{} released from ejection", name(position))
                        });
                    }
                    Event::OverCap { over, failing, cap } => lines.push(if over {
                        format!(
                            "group {}: {failing} members failing, more than --max-ejected allows ({cap}): none ejected, steering by counts alone",
                            group + 1
                        )
                    } else {
                        format!(
                            "group {}: {failing} members failing, within --max-ejected ({cap}): ejection resumes",
                            group + 1
                        )
                    }),
                }
            }
            // The reply path's failing bits seen by this step have had
            // their answer (ejected, or released); a bit set since waits
            // for the next step. The field the reply path compares runs
            // with follows `eject_after` (set, reload), and the members it
            // may mark follow the group's room under the cap.
            let ejectable = ejection::ejectable(
                &record.members[..len],
                &seen[..len],
                record.over_cap,
                &params,
            );
            self.change_bits(
                group,
                EJECT_AFTER_MASK | EJECTABLE_MASK | (bits & FAILING_MASK),
                eject_after_field(params.eject_after) | ejectable,
            );
        }
        self.ejection.settled = settled;
        lines
    }

    /// Whether the last check found nothing in motion: every member
    /// healthy, no failure counted since its last good reply, none marked
    /// failing, no group over the cap. Then nothing can change until a
    /// reply or an expiry counts a failure, and the reply path marks a
    /// member failing (no longer chosen) on its own, so the agent may check
    /// less often (`agent::run`: an idle agent's wakeups cost the host's
    /// other traffic).
    pub fn ejection_settled(&self) -> bool {
        self.ejection.settled
    }

    /// Each backend's ejection state as of `now_ns`, in `backends` order.
    pub fn ejection_states(&self, now_ns: u64) -> Vec<EjectionState> {
        self.backends
            .iter()
            .map(|b| {
                let (group, position) = split_backend_id(b.index);
                let p = position % MAX_GROUP_MEMBERS;
                let m = self
                    .ejection
                    .groups
                    .get(&group)
                    .map(|r| r.members[p])
                    .unwrap_or_default();
                let h = self.health.ptr(group as usize);
                let (slow, slowness_ns, slow_probes) = self.slowness_of(b.index);
                EjectionState {
                    ejection_state: m.state.name().into(),
                    ejections: m.ejections,
                    ejected_ns: m.time_out_ns(now_ns),
                    // SAFETY: a field of a live shared element.
                    failures_in_a_row: unsafe { load(&raw mut (*h).failures[p]) },
                    slow,
                    slowness_ns,
                    slow_probes,
                }
            })
            .collect()
    }

    /// Groups (numbered from 1) with more members failing than
    /// `--max-ejected` allows: steered by counts alone.
    pub fn groups_over_cap(&self) -> Vec<u32> {
        let mut over: Vec<u32> = self
            .ejection
            .groups
            .iter()
            .filter(|(_, r)| r.over_cap)
            .map(|(g, _)| g + 1)
            .collect();
        over.sort();
        over
    }

    /// Forgets what was known of the member at `position` of `group`, for a
    /// newcomer a reload puts there: the kernel's failures in a row, good
    /// replies and its bits (ejected, probe, failing, ejectable), and the
    /// agent's record (state, backoff, ejections). Nothing else writes them:
    /// no slot and no `BACKENDS` entry names the position.
    pub(crate) fn forget_member(&mut self, group: u32, position: usize) {
        let p = position % MAX_GROUP_MEMBERS;
        let h = self.health.ptr(group as usize);
        let bits = ejected_bit(p)
            | probe_bit(p)
            | selector_common::ejection::failing_bit(p)
            | (1 << (selector_common::ejection::EJECTABLE_SHIFT + p as u32));
        // SAFETY: fields of a live shared element, 8-byte aligned.
        unsafe {
            atomic(&raw mut (*h).failures[p]).store(0, Ordering::SeqCst);
            atomic(&raw mut (*h).good[p]).store(0, Ordering::SeqCst);
            atomic(&raw mut (*h).bits).fetch_and(!bits, Ordering::SeqCst);
        }
        if let Some(record) = self.ejection.groups.get_mut(&group) {
            record.members[p] = Member::default();
            record.good[p] = GoodWatch::default();
        }
    }

    /// Takes the ejections that adopted pins hold as this agent's own (an
    /// agent restarted on its predecessor's maps): a member ejected stays
    /// out for one base backoff from `now_ns`, then is probed as usual; a
    /// half-open one keeps its probe. Only `eject_after` is rewritten, to
    /// this agent's. A member out of the choice is never made eligible by
    /// a restart, not even until the first check.
    pub(crate) fn adopt_ejection(&mut self, now_ns: u64) {
        self.ejection.groups.clear();
        let base = self.settings.ejection.base.as_nanos() as u64;
        let word = eject_after_field(self.settings.ejection.eject_after.into());
        for g in 0..self.health.len() {
            let h = self.health.ptr(g);
            // SAFETY: a field of a live shared element.
            let bits = unsafe { atomic(&raw mut (*h).bits) };
            let _ = bits.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
                Some((b & !EJECT_AFTER_MASK) | word)
            });
            let found = bits.load(Ordering::SeqCst);
            let mut record = GroupRecord::default();
            let mut out = false;
            for p in 0..MAX_GROUP_MEMBERS {
                let state = if found & probe_bit(p) != 0 {
                    // SAFETY: as above.
                    let good_at = unsafe { load(&raw mut (*h).good[p]) };
                    State::HalfOpen {
                        good_at,
                        taken_ns: 0,
                    }
                } else if found & ejected_bit(p) != 0 {
                    State::Ejected {
                        until_ns: now_ns + base,
                    }
                } else {
                    continue;
                };
                record.members[p] = Member {
                    state,
                    in_a_row: 1,
                    since_ns: now_ns,
                    ..Member::default()
                };
                out = true;
            }
            if out {
                self.ejection.groups.insert(g as u32, record);
            }
        }
    }

    /// Forgets every ejection and clears the kernel's bits (a fresh agent
    /// on maps of its own), leaving only the `eject_after` the reply path
    /// compares runs with.
    pub(crate) fn reset_ejection(&mut self) {
        self.ejection.groups.clear();
        let word = eject_after_field(self.settings.ejection.eject_after.into());
        for g in 0..self.health.len() {
            let h = self.health.ptr(g);
            // SAFETY: a field of a live shared element.
            unsafe { atomic(&raw mut (*h).bits).store(word, Ordering::SeqCst) };
        }
    }
}
