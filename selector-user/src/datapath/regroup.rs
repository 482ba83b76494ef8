//! Groups changed in place by a reload (just over 500 lines: the pure plan
//! and the writes that carry it out, kept side by side).
//!
//! Tunables and the descriptor are rewritten in `CONFIG`. Groups change in
//! place, and a backend's id (`group * 8 + position`) never changes while
//! it is configured, since its counters, statistics and in-flight requests
//! are all keyed by it:
//! - a kept member keeps its position (and its drained state);
//! - an added member takes the lowest free position of its group (a new
//!   group, the lowest free group index), with its counters zeroed first;
//! - a removed member *retires*: its `BACKENDS` entry gets
//!   [`BACKEND_RETIRING`] (egress no longer tracks or steers requests to
//!   its address) and its active bit is cleared (nothing is redirected to
//!   it), while its endpoint stays, so the reply path still completes and
//!   rewrites the requests in flight. Once `timeout + grace` has passed
//!   since the reload and no in-flight slot names it, its entry is deleted
//!   and its position is free again.
//!
//! Groups of the new file are matched to running ones by name, else by the
//! members they share. A member cannot move between groups in one reload
//! (its address has one `BACKENDS` entry): remove it, and add it back once
//! it has retired.

use std::{
    net::SocketAddr,
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::maps::{Array, HashMap, PerCpuArray, PerCpuValues};
use selector_common::{
    BACKEND_RETIRING, BackendStats, Endpoint, Group, MAX_GROUP_MEMBERS, MAX_GROUPS, backend_id,
    inflight::{FREE, PHASE_WRITING, phase},
    latency::LATENCY_BUCKETS,
    names, split_backend_id,
};

use crate::{config::settings::BackendPlan, datapath::Selector, host::shared::atomic};

/// A member in the kernel's tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    pub addr: SocketAddr,
    /// Removed by a reload at this instant; its requests still complete.
    pub retiring_since: Option<Instant>,
}

/// A group in the kernel's tables: `members[p]` is at position `p`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableGroup {
    pub name: Option<String>,
    pub members: [Option<Member>; MAX_GROUP_MEMBERS],
}

impl TableGroup {
    fn position_of(&self, addr: SocketAddr) -> Option<usize> {
        self.members
            .iter()
            .position(|m| m.is_some_and(|m| m.addr == addr))
    }

    fn is_empty(&self) -> bool {
        self.members.iter().all(Option::is_none)
    }

    /// The kernel's `len`: one past the last occupied position.
    fn len(&self) -> u32 {
        self.members
            .iter()
            .rposition(Option::is_some)
            .map_or(0, |p| p as u32 + 1)
    }
}

/// The groups as the kernel holds them: `groups[g]` is group index `g`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupTable {
    pub groups: Vec<Option<TableGroup>>,
}

impl GroupTable {
    /// The table `selector run` starts with: groups and members in order.
    pub fn from_start(groups: &[Vec<SocketAddr>], names: &[Option<String>]) -> Self {
        let groups = groups
            .iter()
            .enumerate()
            .map(|(g, members)| {
                let mut group = TableGroup {
                    name: names.get(g).cloned().flatten(),
                    ..TableGroup::default()
                };
                for (p, addr) in members.iter().take(MAX_GROUP_MEMBERS).enumerate() {
                    group.members[p] = Some(Member {
                        addr: *addr,
                        retiring_since: None,
                    });
                }
                Some(group)
            })
            .collect();
        Self { groups }
    }

    /// Every backend in the tables, retiring ones included, by id.
    pub fn backends(&self) -> Vec<BackendPlan> {
        self.members()
            .map(|(g, p, m)| BackendPlan {
                index: backend_id(g as u32, p),
                addr: m.addr,
                group: g as u32,
            })
            .collect()
    }

    fn members(&self) -> impl Iterator<Item = (usize, usize, &Member)> {
        self.groups.iter().enumerate().flat_map(|(g, group)| {
            group.iter().flat_map(move |group| {
                group
                    .members
                    .iter()
                    .enumerate()
                    .filter_map(move |(p, m)| m.as_ref().map(|m| (g, p, m)))
            })
        })
    }

    /// Whether `addr` is a member being removed.
    pub fn is_retiring(&self, addr: SocketAddr) -> bool {
        self.members()
            .any(|(_, _, m)| m.addr == addr && m.retiring_since.is_some())
    }

    /// (group, position) of `addr`, retiring or not.
    fn find(&self, addr: SocketAddr) -> Option<(usize, usize)> {
        self.members()
            .find(|(_, _, m)| m.addr == addr)
            .map(|(g, p, _)| (g, p))
    }
}

/// What a reload does to the groups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupChanges {
    /// The tables after the reload.
    pub table: GroupTable,
    /// Members new to the tables.
    pub added: Vec<BackendPlan>,
    /// Members that start retiring.
    pub removed: Vec<BackendPlan>,
    /// Retiring members configured again (same id).
    pub restored: Vec<BackendPlan>,
}

impl GroupChanges {
    /// No change: `table` as it is.
    pub fn none(table: GroupTable) -> Self {
        Self {
            table,
            added: Vec::new(),
            removed: Vec::new(),
            restored: Vec::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.restored.is_empty()
    }
}

/// Plans the tables for `wanted` groups (validated, members in preference
/// order) from `current`, keeping every kept member's id. Pure: the kernel
/// is written by [`Selector::apply_groups`].
pub fn plan_groups(
    current: &GroupTable,
    wanted: &[Vec<SocketAddr>],
    names: &[Option<String>],
    now: Instant,
) -> Result<GroupChanges> {
    let label = |w: usize| match names.get(w).cloned().flatten() {
        Some(name) => format!("group '{name}'"),
        None => format!("group {}", w + 1),
    };
    // Which running group each wanted group continues.
    let mut continues: Vec<Option<usize>> = Vec::new();
    for (w, members) in wanted.iter().enumerate() {
        let by_name = names.get(w).cloned().flatten().and_then(|name| {
            current.groups.iter().position(|g| {
                g.as_ref()
                    .is_some_and(|g| g.name.as_deref() == Some(&*name))
            })
        });
        let by_members = || {
            let mut found: Vec<usize> = members
                .iter()
                .filter_map(|addr| current.find(*addr).map(|(g, _)| g))
                .collect();
            found.sort_unstable();
            found.dedup();
            match found.as_slice() {
                [] => Ok(None),
                [one] => Ok(Some(*one)),
                [a, b, ..] => Err(anyhow!(
                    "{} takes members of running groups {} and {}; move members between groups in separate reloads",
                    label(w),
                    a + 1,
                    b + 1
                )),
            }
        };
        let running = match by_name {
            Some(g) => Some(g),
            None => by_members()?,
        };
        if let Some(g) = running
            && let Some(other) = continues.iter().position(|c| *c == Some(g))
        {
            bail!(
                "{} and {} both continue running group {}; split groups in separate reloads",
                label(other),
                label(w),
                g + 1
            );
        }
        continues.push(running);
    }

    let mut table = current.clone();
    let mut changes = GroupChanges {
        table: GroupTable::default(),
        added: Vec::new(),
        removed: Vec::new(),
        restored: Vec::new(),
    };
    // Running groups no wanted group continues: every member retires.
    for (g, group) in table.groups.iter_mut().enumerate() {
        let Some(group) = group else { continue };
        if continues.contains(&Some(g)) {
            continue;
        }
        retire_all_but(group, g, &[], now, &mut changes.removed);
    }
    for (w, members) in wanted.iter().enumerate() {
        let g = match continues[w] {
            Some(g) => g,
            None => {
                let free = (0..MAX_GROUPS as usize)
                    .find(|g| table.groups.get(*g).is_none_or(Option::is_none))
                    .ok_or_else(|| {
                        anyhow!(
                            "no free group index for {}: groups being removed still hold theirs; reload again once their requests finish",
                            label(w)
                        )
                    })?;
                if table.groups.len() <= free {
                    table.groups.resize(free + 1, None);
                }
                table.groups[free] = Some(TableGroup::default());
                free
            }
        };
        let group = table.groups[g].get_or_insert_with(TableGroup::default);
        group.name = names.get(w).cloned().flatten();
        retire_all_but(group, g, members, now, &mut changes.removed);
        for addr in members {
            if let Some(p) = group.position_of(*addr) {
                let member = group.members[p].as_mut().expect("found above");
                if member.retiring_since.take().is_some() {
                    changes.restored.push(plan(g, p, *addr));
                }
                continue;
            }
            if let Some((other, _)) = current.find(*addr) {
                bail!(
                    "backend {addr} would move from running group {} to {}: remove it in one reload and add it in a later one, once its requests have finished",
                    other + 1,
                    label(w)
                );
            }
            let p = group.members.iter().position(Option::is_none).ok_or_else(|| {
                anyhow!(
                    "{} has no free position for {addr}: members being removed still hold theirs; reload again once their requests finish",
                    label(w)
                )
            })?;
            group.members[p] = Some(Member {
                addr: *addr,
                retiring_since: None,
            });
            changes.added.push(plan(g, p, *addr));
        }
    }
    changes.table = table;
    for list in [
        &mut changes.added,
        &mut changes.removed,
        &mut changes.restored,
    ] {
        list.sort_by_key(|b| b.index);
    }
    Ok(changes)
}

/// Marks every configured member of `group` not in `keep` as retiring.
fn retire_all_but(
    group: &mut TableGroup,
    g: usize,
    keep: &[SocketAddr],
    now: Instant,
    removed: &mut Vec<BackendPlan>,
) {
    for (p, member) in group.members.iter_mut().enumerate() {
        if let Some(m) = member
            && m.retiring_since.is_none()
            && !keep.contains(&m.addr)
        {
            m.retiring_since = Some(now);
            removed.push(plan(g, p, m.addr));
        }
    }
}

fn plan(g: usize, p: usize, addr: SocketAddr) -> BackendPlan {
    BackendPlan {
        index: backend_id(g as u32, p),
        addr,
        group: g as u32,
    }
}

/// The kernel side of a reload: a separate impl block of [`Selector`].
impl Selector {
    /// The groups as the maps hold them: every member `BACKENDS` names, at
    /// the position its id gives, retiring (from now) if marked so. What an
    /// earlier agent left pinned, after whatever reloads it applied.
    pub fn table_in_maps(&self) -> Result<GroupTable> {
        let backends: HashMap<_, Endpoint, u32> = HashMap::try_from(self.map(names::BACKENDS)?)?;
        let now = Instant::now();
        let mut table = GroupTable { groups: Vec::new() };
        for entry in backends.iter() {
            let (endpoint, value) = entry?;
            let (g, p) = split_backend_id(value & !BACKEND_RETIRING);
            let g = g as usize;
            if g >= MAX_GROUPS as usize || p >= MAX_GROUP_MEMBERS {
                bail!("the pinned BACKENDS map holds an id out of range: {value:#x}");
            }
            if table.groups.len() <= g {
                table.groups.resize(g + 1, None);
            }
            let group = table.groups[g].get_or_insert_with(TableGroup::default);
            group.members[p] = Some(Member {
                addr: endpoint.socket_addr(),
                retiring_since: (value & BACKEND_RETIRING != 0).then_some(now),
            });
        }
        Ok(table)
    }

    /// Writes `changes` into `GROUPS` and `BACKENDS`. A member becomes
    /// choosable only once the reply path knows it, and a retiring member
    /// keeps its endpoint, so no reply in flight goes unrecognised.
    pub fn apply_groups(&mut self, changes: &GroupChanges) -> Result<()> {
        for b in &changes.added {
            self.zero_backend(b.index)?;
        }
        // Endpoints and lengths first, with the added members not yet active.
        {
            let mut groups: Array<_, Group> = Array::try_from(self.map_mut(names::GROUPS)?)?;
            for (g, group) in changes.table.groups.iter().enumerate() {
                let Some(group) = group else { continue };
                let mut entry = groups.get(&(g as u32), 0)?;
                for (p, member) in group.members.iter().enumerate() {
                    let bit = 1 << p;
                    match member {
                        Some(m) => {
                            entry.endpoints[p] = Endpoint::from(m.addr);
                            if m.retiring_since.is_some() {
                                entry.active &= !bit;
                            }
                        }
                        None => {
                            entry.endpoints[p] = Endpoint::default();
                            entry.active &= !bit;
                        }
                    }
                }
                for b in changes.added.iter().filter(|b| b.group == g as u32) {
                    entry.active &= !(1 << (b.index as usize % MAX_GROUP_MEMBERS));
                }
                entry.len = group.len();
                groups.set(g as u32, entry, 0)?;
            }
        }
        self.add_member_ports(
            changes
                .added
                .iter()
                .chain(&changes.restored)
                .map(|b| b.addr.port()),
        )?;
        {
            let mut backends: HashMap<_, Endpoint, u32> =
                HashMap::try_from(self.map_mut(names::BACKENDS)?)?;
            for b in changes.added.iter().chain(&changes.restored) {
                backends.insert(Endpoint::from(b.addr), b.index, 0)?;
            }
            for b in &changes.removed {
                backends.insert(Endpoint::from(b.addr), b.index | BACKEND_RETIRING, 0)?;
            }
        }
        for b in changes.added.iter().chain(&changes.restored) {
            self.set_drained(b.index, false)?;
        }
        Ok(())
    }

    /// Zeroes the counters, statistics, latency, service time, last
    /// completion, hedge counts and ejection state of a backend id about to
    /// be given to a new member (a retired member may have left them: its
    /// service time would steer the latency policy, its hedges would read
    /// as the new member's, its failures in a row would eject it unheard).
    fn zero_backend(&mut self, id: u32) -> Result<()> {
        let (group, position) = selector_common::split_backend_id(id);
        let c = self.counters.ptr(group as usize);
        let s = self.service.ptr(group as usize);
        // SAFETY: fields of live shared elements, 8-byte aligned. Nothing
        // else writes them: no slot and no BACKENDS entry names this id.
        unsafe {
            for field in [
                &raw mut (*c).issued[position],
                &raw mut (*c).completed[position],
                &raw mut (*c).expired[position],
                &raw mut (*s).service_ns[position],
                &raw mut (*s).last_completion_ns[position],
            ] {
                atomic(field).store(0, Ordering::SeqCst);
            }
        }
        self.forget_member(group, position);
        self.forget_slowness(group, position);
        self.zero_hedge_counts(id)?;
        let cpus = aya::util::nr_cpus().map_err(|(what, e)| anyhow!("{what}: {e}"))?;
        let mut stats: PerCpuArray<_, BackendStats> =
            PerCpuArray::try_from(self.map_mut(names::STATS)?)?;
        stats.set(
            id,
            PerCpuValues::try_from(vec![BackendStats::default(); cpus])?,
            0,
        )?;
        let mut latency: PerCpuArray<_, u64> =
            PerCpuArray::try_from(self.map_mut(names::LATENCY)?)?;
        for bucket in 0..LATENCY_BUCKETS {
            latency.set(
                id * LATENCY_BUCKETS + bucket,
                PerCpuValues::try_from(vec![0u64; cpus])?,
                0,
            )?;
        }
        Ok(())
    }

    /// Whether any in-flight slot (live or lingering) names backend `id`
    /// as primary or as the member it went to.
    fn referenced(&self, id: u32) -> bool {
        let mut named = false;
        self.for_each_occupied(|(i, _)| {
            let slot = self.slots.read(i);
            named |= slot.state != FREE
                && (phase(slot.state) == PHASE_WRITING
                    || u32::from(slot.primary) == id
                    || u32::from(slot.chosen) == id);
        });
        named
    }

    /// Forgets the retiring members of `table` whose requests are done:
    /// `linger` (timeout + grace) has passed since their removal and no
    /// slot names them. Returns them.
    pub fn retire_finished(
        &mut self,
        table: &mut GroupTable,
        linger: Duration,
        now: Instant,
    ) -> Result<Vec<SocketAddr>> {
        let due: Vec<(usize, usize, SocketAddr)> = table
            .members()
            .filter(|(_, _, m)| {
                m.retiring_since
                    .is_some_and(|since| now.saturating_duration_since(since) >= linger)
            })
            .map(|(g, p, m)| (g, p, m.addr))
            .filter(|(g, p, _)| !self.referenced(backend_id(*g as u32, *p)))
            .collect();
        let mut retired = Vec::new();
        for (g, p, addr) in due {
            let mut backends: HashMap<_, Endpoint, u32> =
                HashMap::try_from(self.map_mut(names::BACKENDS)?)?;
            backends
                .remove(&Endpoint::from(addr))
                .with_context(|| format!("removing {addr}"))?;
            let group = table.groups[g].as_mut().expect("a member's group");
            group.members[p] = None;
            let mut groups: Array<_, Group> = Array::try_from(self.map_mut(names::GROUPS)?)?;
            let mut entry = groups.get(&(g as u32), 0)?;
            entry.endpoints[p] = Endpoint::default();
            entry.active &= !(1 << p);
            entry.len = group.len();
            groups.set(g as u32, entry, 0)?;
            if group.is_empty() {
                table.groups[g] = None;
            }
            retired.push(addr);
        }
        if !retired.is_empty() {
            while table.groups.last().is_some_and(Option::is_none) {
                table.groups.pop();
            }
            self.backends = table.backends();
        }
        Ok(retired)
    }
}
