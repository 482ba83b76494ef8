//! Hedged reads, agent side (`--hedge-after`, `--hedge-budget`): a thread
//! with a timer queue fed by the egress program's ring buffer. At the delay
//! it checks, in the slot shared with the kernel, that the same request
//! instance is still live and unanswered, takes a budget token, claims the
//! hedge with a compare-and-swap on the slot's hedge word, counts the copy
//! in the target's `issued`, and sends it from the client's own address and
//! port through a raw socket carrying the `--mark` bit (the egress program
//! passes it untouched). The protocol and its races are described in
//! `selector_common::hedge` and docs/design.md ("Hedged reads"). The
//! hand-over in the shared slots is the data path's
//! (`crate::datapath::hedges`).

pub mod auto;
pub mod wire;

use std::{
    cmp::Reverse,
    collections::BinaryHeap,
    net::SocketAddr,
    os::fd::AsRawFd as _,
    sync::{
        Arc, RwLock,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    thread::JoinHandle,
};

use anyhow::Result;
use aya::maps::{Array, MapData, RingBuf};
use selector_common::{
    Endpoint, Group, GroupCounters, GroupHealth, MAX_BACKENDS, backend_id,
    hedge::{
        self, HedgeEvent, TokenBucket, choose_target, claimed_word, hedge_usable, open_word,
        within_max_pending,
    },
    inflight::{InflightSlot, PROBE_WINDOW, client_slot, key_hashes, open_members, probe},
    policy::GroupLoad,
    split_backend_id,
};

use crate::{
    config::defaults::RunDefaults,
    hedging::auto::AutoDelays,
    hedging::wire::HedgeSockets,
    host::shared::{SharedArray, atomic, load},
    host::sys,
};

/// Reads waiting for their hedge delay at most; more are not hedged (counted).
pub const MAX_QUEUED: usize = 65_536;
/// Longest sleep of the hedge thread (it checks for a stop this often).
const IDLE_WAIT_NS: u64 = 50_000_000;

/// The agent's per-backend counters, shared with the hedge thread.
#[derive(Default)]
pub(crate) struct AgentCounts {
    pub(crate) sent: AtomicU64,
    pub(crate) over_budget: AtomicU64,
    pub(crate) no_target: AtomicU64,
    pub(crate) queue_full: AtomicU64,
    pub(crate) send_failed: AtomicU64,
}

/// What the main thread and the hedge thread share.
pub(crate) struct Control {
    pub(crate) enabled: AtomicBool,
    pub(crate) budget_percent: AtomicU32,
    /// `--max-pending` (0: none): no copy goes to a member at it.
    pub(crate) max_pending: AtomicU32,
    /// `--max-pending-client` (0: none): a client socket at it gets no
    /// copy, which would be one more pending request of its own.
    pub(crate) max_pending_client: AtomicU32,
    /// `--timeout` in force: copies are claimed only in its first half.
    pub(crate) timeout_ns: AtomicU64,
    /// The delay for reads to each primary, by backend id.
    pub(crate) delay_ns: Vec<AtomicU64>,
    pub(crate) counts: Vec<AgentCounts>,
    /// Backend id -> address, as of the last reload: a position a reload
    /// gives to another member sends its copies to the new one.
    pub(crate) targets: RwLock<Vec<Option<SocketAddr>>>,
    pub(crate) stop: AtomicBool,
}

/// The hedging state a `Selector` carries.
pub struct Hedging {
    pub(crate) control: Arc<Control>,
    pub(crate) thread: Option<JoinHandle<()>>,
    /// `--hedge-after auto`'s delays.
    pub(crate) auto: AutoDelays,
}

impl Default for Hedging {
    fn default() -> Self {
        Self {
            control: Arc::new(Control {
                enabled: AtomicBool::new(false),
                budget_percent: AtomicU32::new(
                    RunDefaults::default().tunables.hedging.budget_percent,
                ),
                max_pending: AtomicU32::new(0),
                max_pending_client: AtomicU32::new(0),
                timeout_ns: AtomicU64::new(RunDefaults::default().timeout.as_nanos() as u64),
                delay_ns: (0..MAX_BACKENDS).map(|_| AtomicU64::new(0)).collect(),
                counts: (0..MAX_BACKENDS).map(|_| AgentCounts::default()).collect(),
                targets: RwLock::new(vec![None; MAX_BACKENDS as usize]),
                stop: AtomicBool::new(false),
            }),
            thread: None,
            auto: AutoDelays::default(),
        }
    }
}

impl Drop for Hedging {
    fn drop(&mut self) {
        self.control.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The maps the hedge thread works on: second descriptors of the loaded
/// ones, so the thread owns them.
pub struct HedgeMaps {
    /// The egress program's hedge offers.
    pub ring: RingBuf<MapData>,
    pub slots: SharedArray<InflightSlot>,
    pub counters: SharedArray<GroupCounters>,
    pub groups: Array<MapData, Group>,
    /// Outlier ejection's health words: ejected members are no target.
    pub health: SharedArray<GroupHealth>,
    /// Pending reads per client socket (`--max-pending-client`).
    pub client_pending: SharedArray<u64>,
}

impl Hedging {
    /// Starts the hedge thread on `maps`, sending through `sockets`.
    pub fn start(
        &mut self,
        maps: HedgeMaps,
        sockets: HedgeSockets,
        budget_percent: u32,
    ) -> Result<()> {
        let mut hedger = HedgeLoop {
            ring: maps.ring,
            slots: maps.slots,
            counters: maps.counters,
            groups: maps.groups,
            health: maps.health,
            client_pending: maps.client_pending,
            sockets,
            control: self.control.clone(),
            queue: BinaryHeap::new(),
            order: 0,
            bucket: TokenBucket::new(budget_percent),
        };
        let thread = std::thread::Builder::new()
            .name("selector-hedge".into())
            .spawn(move || hedger.run())?;
        self.thread = Some(thread);
        Ok(())
    }
}

/// Set by [`plant_hedge_thread_panic`].
#[cfg(feature = "testing")]
static PANIC_PLANTED: AtomicBool = AtomicBool::new(false);

#[cfg(feature = "testing")]
/// For tests: the next hedge thread of this process to look panics, as a
/// bug in it would (nothing else sets this).
pub fn plant_hedge_thread_panic() {
    PANIC_PLANTED.store(true, Ordering::SeqCst);
}

/// One read waiting for its hedge delay.
struct Due {
    at_ns: u64,
    order: u64,
    event: Box<HedgeEvent>,
}

impl PartialEq for Due {
    fn eq(&self, o: &Self) -> bool {
        (self.at_ns, self.order) == (o.at_ns, o.order)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Due {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at_ns, self.order).cmp(&(o.at_ns, o.order))
    }
}

/// The hedge thread's state.
struct HedgeLoop {
    ring: RingBuf<MapData>,
    slots: SharedArray<InflightSlot>,
    counters: SharedArray<GroupCounters>,
    groups: Array<MapData, Group>,
    health: SharedArray<GroupHealth>,
    client_pending: SharedArray<u64>,
    sockets: HedgeSockets,
    control: Arc<Control>,
    queue: BinaryHeap<Reverse<Due>>,
    order: u64,
    bucket: TokenBucket,
}

impl HedgeLoop {
    fn run(&mut self) {
        while !self.control.stop.load(Ordering::SeqCst) {
            #[cfg(feature = "testing")]
            if PANIC_PLANTED.load(Ordering::Relaxed) && PANIC_PLANTED.swap(false, Ordering::SeqCst)
            {
                panic!("planted panic (plant_hedge_thread_panic)");
            }
            let now = sys::monotonic_ns();
            // The kernel does not wake this thread per event: it drains the
            // ring at least twice per the shortest delay, so every read is
            // queued before it is due.
            let wait = self
                .queue
                .peek()
                .map_or(IDLE_WAIT_NS, |Reverse(d)| d.at_ns.saturating_sub(now))
                .min(self.drain_every_ns());
            self.wait_readable(wait);
            self.drain_ring();
            self.fire_due();
        }
    }

    /// Half the shortest hedge delay in force (at most `IDLE_WAIT_NS`).
    fn drain_every_ns(&self) -> u64 {
        let targets = self
            .control
            .targets
            .read()
            .unwrap_or_else(|e| e.into_inner());
        let shortest = targets
            .iter()
            .enumerate()
            .filter(|(_, t)| t.is_some())
            .map(|(id, _)| self.control.delay_ns[id].load(Ordering::Relaxed))
            .filter(|d| *d > 0)
            .min()
            .unwrap_or(IDLE_WAIT_NS);
        (shortest / 2).clamp(1, IDLE_WAIT_NS)
    }

    /// Sleeps until the ring has events or `wait_ns` passes (nanosecond
    /// timer, unlike tokio's millisecond wheel).
    fn wait_readable(&self, wait_ns: u64) {
        if wait_ns == 0 {
            return;
        }
        let mut fds = libc::pollfd {
            fd: self.ring.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = libc::timespec {
            tv_sec: (wait_ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (wait_ns % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: one valid pollfd, a valid timespec, no signal mask.
        unsafe { libc::ppoll(&mut fds, 1, &ts, std::ptr::null()) };
    }

    fn drain_ring(&mut self) {
        let percent = self.control.budget_percent.load(Ordering::Relaxed);
        self.bucket.set_percent(percent);
        let enabled = self.control.enabled.load(Ordering::SeqCst);
        while let Some(item) = self.ring.next() {
            if item.len() < size_of::<HedgeEvent>() {
                continue;
            }
            // SAFETY: the kernel wrote a HedgeEvent (plain old data); the
            // ring's memory need not be aligned for it, so read unaligned.
            let event: HedgeEvent =
                unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<HedgeEvent>()) };
            drop(item);
            // Every read handed over refills the budget.
            self.bucket.on_read();
            if !enabled {
                continue;
            }
            let primary = usize::from(event.primary) % MAX_BACKENDS as usize;
            if self.queue.len() >= MAX_QUEUED {
                self.control.counts[primary]
                    .queue_full
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let delay = self.control.delay_ns[primary].load(Ordering::Relaxed);
            self.order += 1;
            self.queue.push(Reverse(Due {
                at_ns: event.sent_ns + delay,
                order: self.order,
                event: Box::new(event),
            }));
        }
    }

    fn fire_due(&mut self) {
        let now = sys::monotonic_ns();
        while self.queue.peek().is_some_and(|Reverse(d)| d.at_ns <= now) {
            let Some(Reverse(due)) = self.queue.pop() else {
                break;
            };
            if self.control.enabled.load(Ordering::SeqCst) {
                self.hedge(&due.event, now);
            }
        }
    }

    /// Sends one read's hedge if it is still live and unanswered, within
    /// the budget, and a target exists.
    fn hedge(&mut self, event: &HedgeEvent, now: u64) {
        let i = event.index as usize;
        if i >= self.slots.len() {
            return;
        }
        let p = self.slots.ptr(i);
        // SAFETY: words of a live shared element.
        let live = |p: *mut InflightSlot| unsafe { load(&raw mut (*p).state) } == event.state;
        if !live(p) {
            return; // answered (or expired) in time: the usual case
        }
        let slot = self.slots.read(i);
        if !live(p) || slot.state != event.state {
            return;
        }
        let open = open_word(event.state);
        // SAFETY: the hedge word of a live shared element.
        let word = unsafe { atomic(&raw mut (*p).hedge) };
        if word.load(Ordering::SeqCst) != open {
            return; // answered, closed, or never hedgeable
        }
        // Far from the timeout, so the claim and its count are never split
        // by the sweep's expiry of the target.
        let timeout_ns = self.control.timeout_ns.load(Ordering::Relaxed);
        if now.saturating_sub(slot.sent_ns) >= timeout_ns / 2 {
            return;
        }
        let primary = usize::from(slot.primary) % MAX_BACKENDS as usize;
        let (group, chosen_pos) = split_backend_id(u32::from(slot.chosen));
        let Ok(members) = self.groups.get(&group, 0) else {
            return;
        };
        let h = self.health.ptr(group as usize);
        // SAFETY: a field of a live shared element, 8-byte aligned.
        let bits = unsafe { load(&raw mut (*h).bits) };
        let target = hedge_target(
            &members,
            &self.counters.read(group as usize),
            bits,
            self.control.max_pending.load(Ordering::Relaxed),
            chosen_pos,
            self.others_open(i, &slot),
        );
        let client_slot = client_slot(&slot.client_addr, slot.client_port) as usize;
        let client_pending = if client_slot < self.client_pending.len() {
            // SAFETY: a live shared element, 8-byte aligned.
            unsafe { load(self.client_pending.ptr(client_slot)) }
        } else {
            0
        };
        let cap = self.control.max_pending_client.load(Ordering::Relaxed);
        let target = target.filter(|_| client_may_send_copy(client_pending, cap));
        let copy = target.and_then(|pos| {
            let table = self
                .control
                .targets
                .read()
                .unwrap_or_else(|e| e.into_inner())[backend_id(group, pos) as usize];
            copy_address(table, members.endpoints.get(pos)?).map(|to| (pos, to))
        });
        let Some((target_pos, to)) = copy else {
            self.control.counts[primary]
                .no_target
                .fetch_add(1, Ordering::Relaxed);
            return;
        };
        if !self.bucket.try_take() {
            self.control.counts[primary]
                .over_budget
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        if word
            .compare_exchange(
                open,
                claimed_word(open, target_pos),
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_err()
        {
            // A reply won or the sweep closed it a moment ago.
            self.bucket.refund();
            return;
        }
        let c = self.counters.ptr(group as usize);
        // SAFETY: a field of a live shared element, 8-byte aligned.
        unsafe { atomic(&raw mut (*c).issued[target_pos]) }.fetch_add(1, Ordering::SeqCst);
        let target = backend_id(group, target_pos) as usize;
        let counts = &self.control.counts[target];
        // From the application's own address and port.
        let from = Endpoint::new(slot.client_addr, slot.client_port).socket_addr();
        let payload = &event.payload[..(event.len as usize).min(hedge::PAYLOAD_MAX)];
        let sent = self.sockets.send(from, to, payload).is_ok();
        // Not sent: the target's count expires with the read.
        let counter = if sent {
            &counts.sent
        } else {
            &counts.send_failed
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

impl HedgeLoop {
    /// The members at which another instance of the key of `slot` (slot
    /// `index`) has a count open (`selector_common::inflight::open_members`):
    /// an older one, when the application reused the id once the older was
    /// answered. Read from the key's probe window as it is now, without the
    /// slot protocol's checks: a slot changing under the read only makes
    /// the choice of target a worse one, never a count wrong.
    fn others_open(&self, index: usize, slot: &InflightSlot) -> u8 {
        let key = slot.key();
        let mask = self.slots.len() as u32 - 1;
        let home = key_hashes(&key).home;
        let mut open = 0;
        for n in 0..PROBE_WINDOW {
            let j = probe(home, n, mask) as usize;
            if j == index {
                continue;
            }
            let other = self.slots.read(j);
            if other.key() == key {
                open |= open_members(other.state, u32::from(other.chosen), other.hedge);
            }
        }
        open
    }
}

/// Where a copy to a member goes: the address the agent's table holds for
/// its id (`table`, as of the last reload), only while the kernel's group
/// (`member`, the entry the target was chosen from) holds that address at
/// its position. They differ in the moment a reload gives a freed position
/// to another member: the copy is then refused, not sent to an address its
/// id no longer names (and counted as the new member's read).
fn copy_address(table: Option<SocketAddr>, member: &Endpoint) -> Option<SocketAddr> {
    table.filter(|to| {
        let to = Endpoint::from(*to);
        (to.addr, to.port) == (member.addr, member.port)
    })
}

/// The hedge target for a read that went to member `chosen` of a group
/// with `members`, `counters` and health word `health_bits`: the least
/// pending other member that is neither drained nor ejected nor waiting
/// for its half-open probe, nor in `avoid` (members an older instance of
/// the read's id still awaits a reply from).
pub(crate) fn hedge_target(
    members: &Group,
    counters: &GroupCounters,
    health_bits: u64,
    max_pending: u32,
    chosen: usize,
    avoid: u8,
) -> Option<usize> {
    let mut load = GroupLoad::of(members, counters);
    load.usable = within_max_pending(
        hedge_usable(load.usable, health_bits),
        &load.pending,
        max_pending,
    ) & !avoid;
    choose_target(&load, chosen)
}

/// Whether a client socket with `pending` reads may have one more, a copy,
/// under `--max-pending-client` `cap` (0: no bound): the kernel admits a
/// read only below the cap, and a copy is pending work of the same client.
fn client_may_send_copy(pending: u64, cap: u32) -> bool {
    cap == 0 || pending < u64::from(cap)
}

#[cfg(test)]
mod tests {
    use selector_common::ejection::{ejected_bit, probe_bit};

    use super::*;

    /// Three active members; `issued` reads sent to each, none answered.
    fn group(issued: [u64; 3]) -> (Group, GroupCounters) {
        let g = Group {
            len: 3,
            active: 0b111,
            ..Default::default()
        };
        let mut c = GroupCounters::default();
        c.issued[..3].copy_from_slice(&issued);
        (g, c)
    }

    /// A copy goes to the address its id names in the agent's table only
    /// while the kernel's group holds the same member there: a position a
    /// reload has just given to another member (the table not yet
    /// rewritten, or rewritten first) refuses the copy.
    #[test]
    fn a_copy_is_refused_when_its_ids_address_changed() {
        let old: SocketAddr = "10.0.0.2:11211".parse().unwrap();
        let new: SocketAddr = "10.0.0.9:11211".parse().unwrap();
        let v6: SocketAddr = "[fd77::2]:11211".parse().unwrap();
        assert_eq!(copy_address(Some(old), &Endpoint::from(old)), Some(old));
        assert_eq!(copy_address(Some(v6), &Endpoint::from(v6)), Some(v6));
        assert_eq!(copy_address(Some(old), &Endpoint::from(new)), None);
        assert_eq!(copy_address(Some(new), &Endpoint::from(old)), None);
        // A freed position (no address in the table) gets no copy either.
        assert_eq!(copy_address(None, &Endpoint::from(new)), None);
        let other_port: SocketAddr = "10.0.0.2:11212".parse().unwrap();
        assert_eq!(copy_address(Some(old), &Endpoint::from(other_port)), None);
    }

    #[test]
    fn the_hedge_target_skips_ejected_and_probing_members() {
        let (g, c) = group([9, 3, 0]);
        // Healthy: the least pending.
        assert_eq!(hedge_target(&g, &c, 0, 0, 0, 0), Some(2));
        // Ejected, though least pending: the next one.
        assert_eq!(hedge_target(&g, &c, ejected_bit(2), 0, 0, 0), Some(1));
        // Half-open with its probe not taken: its one probe is egress's.
        assert_eq!(hedge_target(&g, &c, probe_bit(2), 0, 0, 0), Some(1));
        // Every other member out: no hedge at all.
        assert_eq!(
            hedge_target(&g, &c, ejected_bit(1) | ejected_bit(2), 0, 0, 0),
            None
        );
        // An ejected primary is no target for a read moved off it.
        assert_eq!(hedge_target(&g, &c, ejected_bit(0), 0, 2, 0), Some(1));
    }

    #[test]
    fn the_hedge_target_is_under_max_pending() {
        let (g, c) = group([9, 3, 0]);
        assert_eq!(hedge_target(&g, &c, 0, 0, 0, 0), Some(2));
        // Member 2 has none pending: still a target under a bound of 1.
        assert_eq!(hedge_target(&g, &c, 0, 1, 0, 0), Some(2));
        assert_eq!(hedge_target(&g, &c, ejected_bit(2), 3, 0, 0), None);
        assert_eq!(hedge_target(&g, &c, ejected_bit(2), 4, 0, 0), Some(1));
    }

    #[test]
    fn the_hedge_target_is_no_member_an_older_instance_of_the_id_awaits() {
        let (g, c) = group([9, 3, 0]);
        // Member 2 is the least pending, but an older read with the same
        // id still awaits its reply there.
        assert_eq!(hedge_target(&g, &c, 0, 0, 0, 0b100), Some(1));
        assert_eq!(hedge_target(&g, &c, 0, 0, 0, 0b110), None);
    }

    #[test]
    fn a_client_at_max_pending_client_gets_no_copy() {
        // No bound: always.
        assert!(client_may_send_copy(1_000, 0));
        // The read being hedged is one of the client's pending reads: with
        // a bound of 1 its copy would be a second.
        assert!(!client_may_send_copy(1, 1));
        assert!(client_may_send_copy(1, 2));
        assert!(!client_may_send_copy(3, 2));
    }
}
