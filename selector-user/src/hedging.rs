//! Hedged reads, agent side (`--hedge-after`, `--hedge-budget`): a thread
//! with a timer queue fed by the egress program's ring buffer. At the delay
//! it checks, in the slot shared with the kernel, that the same request
//! instance is still live and unanswered, takes a budget token, claims the
//! hedge with a compare-and-swap on the slot's hedge word, counts the copy
//! in the target's `issued`, and sends it from the client's own address and
//! port through a raw socket carrying the `--mark` bit (the egress program
//! passes it untouched). The protocol and its races are described in
//! `selector_common::hedge` and docs/design.md ("Hedged reads").

use std::{
    cmp::Reverse,
    collections::BinaryHeap,
    fmt,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    os::fd::{AsFd as _, AsRawFd as _},
    str::FromStr,
    sync::{
        Arc, RwLock,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use aya::maps::{Array, MapData, PerCpuArray, PerCpuValues, RingBuf};
use selector_common::{
    Endpoint, Group, GroupCounters, MAX_BACKENDS, MAX_GROUP_MEMBERS, MAX_GROUPS, backend_id,
    hedge::{
        self, HedgeConfig, HedgeEvent, HedgeStats, TokenBucket, auto_ceiling_ns, choose_target,
        claimed_word, is_sent, open_word, settling_word,
    },
    inflight::{InflightSlot, PHASE_LINGER, PHASE_LIVE, phase},
    names,
    policy::GroupLoad,
    split_backend_id,
};
use serde::{Deserialize, Serialize};

use crate::{
    Selector,
    hedge_auto::AutoDelays,
    hedge_wire::HedgeSockets,
    shared::{SharedArray, atomic, load},
    sys,
};

/// `--hedge-budget` default: hedges per second at most 5% of reads (plus
/// the burst of `selector_common::hedge::BURST`).
pub const DEFAULT_BUDGET_PERCENT: u32 = 5;
/// The shortest fixed `--hedge-after`.
pub const MIN_FIXED_DELAY: Duration = Duration::from_micros(100);
/// Reads waiting for their hedge delay at most; more are not hedged (counted).
pub const MAX_QUEUED: usize = 65_536;
/// Longest sleep of the hedge thread (it checks for a stop this often).
const IDLE_WAIT_NS: u64 = 50_000_000;

/// `--hedge-after`: when a pending read gets its copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HedgeAfter {
    /// Never (the default).
    #[default]
    Off,
    /// After this long.
    Fixed(Duration),
    /// After the primary's recent p95 latency (The Tail at Scale), clamped.
    Auto,
}

impl fmt::Display for HedgeAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::Auto => f.write_str("auto"),
            Self::Fixed(d) => write!(f, "{}", d.as_secs_f64() * 1000.0),
        }
    }
}

impl FromStr for HedgeAfter {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            ms => {
                let value: f64 = ms
                    .parse()
                    .map_err(|_| format!("'{s}' is not off, auto or milliseconds"))?;
                if !(value.is_finite() && value > 0.0) {
                    return Err(format!("'{s}': milliseconds must be positive"));
                }
                Ok(Self::Fixed(Duration::from_nanos(
                    (value * 1e6).round() as u64
                )))
            }
        }
    }
}

impl Serialize for HedgeAfter {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for HedgeAfter {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// The hedging settings in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HedgeSettings {
    pub after: HedgeAfter,
    /// Hedges at most this percentage of reads (plus a burst).
    pub budget_percent: u32,
}

impl Default for HedgeSettings {
    fn default() -> Self {
        Self {
            after: HedgeAfter::Off,
            budget_percent: DEFAULT_BUDGET_PERCENT,
        }
    }
}

impl HedgeSettings {
    /// Checks them against the request timeout: a hedge must go out well
    /// before the read expires.
    pub fn check(&self, timeout: Duration) -> Result<()> {
        if !(1..=100).contains(&self.budget_percent) {
            bail!("--hedge-budget must be 1 to 100 (percent of reads)");
        }
        if let HedgeAfter::Fixed(d) = self.after {
            if d < MIN_FIXED_DELAY {
                bail!("--hedge-after must be at least 0.1 ms");
            }
            if d > timeout / 2 {
                bail!(
                    "--hedge-after must be at most half of --timeout ({} ms)",
                    (timeout / 2).as_secs_f64() * 1000.0
                );
            }
        }
        Ok(())
    }

    pub fn enabled(&self) -> bool {
        self.after != HedgeAfter::Off
    }
}

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
    /// Reads to this primary not hedged, by reason: over the budget, no
    /// other usable member, timer queue full, ring buffer full, longer than
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

/// The agent's per-backend counters, shared with the hedge thread.
#[derive(Default)]
struct AgentCounts {
    sent: AtomicU64,
    over_budget: AtomicU64,
    no_target: AtomicU64,
    queue_full: AtomicU64,
    send_failed: AtomicU64,
}

/// What the main thread and the hedge thread share.
struct Control {
    enabled: AtomicBool,
    budget_percent: AtomicU32,
    /// The delay for reads to each primary, by backend id.
    delay_ns: Vec<AtomicU64>,
    counts: Vec<AgentCounts>,
    /// Backend id -> address, as of the last reload: a position a reload
    /// gives to another member sends its copies to the new one.
    targets: RwLock<Vec<Option<SocketAddr>>>,
    stop: AtomicBool,
}

/// The hedging state a [`Selector`] carries.
pub struct Hedging {
    control: Arc<Control>,
    thread: Option<JoinHandle<()>>,
    /// `--hedge-after auto`'s delays.
    auto: AutoDelays,
}

impl Default for Hedging {
    fn default() -> Self {
        Self {
            control: Arc::new(Control {
                enabled: AtomicBool::new(false),
                budget_percent: AtomicU32::new(DEFAULT_BUDGET_PERCENT),
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

/// A second descriptor of a loaded map, for the hedge thread.
fn map_copy(selector: &Selector, name: &str) -> Result<MapData> {
    let map = selector.map(name)?;
    let data = match map {
        aya::maps::Map::Array(d) | aya::maps::Map::RingBuf(d) => d,
        _ => bail!("map {name} is not an array"),
    };
    let fd = data.fd().as_fd().try_clone_to_owned()?;
    Ok(MapData::from_fd(fd)?)
}

impl Selector {
    /// Puts the hedging settings in force: the members' addresses (as of
    /// this reload), starts the hedge thread the first time hedging is on
    /// (a raw socket needs CAP_NET_RAW), sets its delay
    /// and budget, and switches the kernel's hand-over on or off. Hedging
    /// is off while steering is (shutdown).
    pub(crate) fn write_hedge_config(&mut self, steering_off: bool) -> Result<()> {
        let hedging = self.settings.hedging;
        let on = hedging.enabled() && !steering_off;
        {
            let control = &self.hedging.control;
            let mut targets = control.targets.write().unwrap_or_else(|e| e.into_inner());
            targets.fill(None);
            for b in &self.backends {
                targets[b.index as usize % MAX_BACKENDS as usize] = Some(b.addr);
            }
        }
        if on && self.hedging.thread.is_none() {
            self.start_hedge_thread()?;
        }
        let control = &self.hedging.control;
        control
            .budget_percent
            .store(hedging.budget_percent, Ordering::SeqCst);
        let ceiling = auto_ceiling_ns(self.settings.timeout.as_nanos() as u64);
        let ids = self.backend_ids();
        if hedging.after != HedgeAfter::Auto || !self.hedging.auto.tracks(&ids) {
            // Turned on again later, or with other backends (a reload):
            // `auto` begins anew, its warm-up too.
            self.hedging.auto.reset();
        }
        for b in &self.backends {
            let delay = &control.delay_ns[b.index as usize];
            match hedging.after {
                HedgeAfter::Fixed(d) => delay.store(d.as_nanos() as u64, Ordering::SeqCst),
                // Until the primary has replied enough: the ceiling.
                HedgeAfter::Auto if !self.hedging.auto.begun() => {
                    delay.store(ceiling, Ordering::SeqCst)
                }
                // A shorter timeout lowers the ceiling at once.
                HedgeAfter::Auto => {
                    delay.fetch_min(ceiling, Ordering::SeqCst);
                }
                HedgeAfter::Off => {}
            }
        }
        control.enabled.store(on, Ordering::SeqCst);
        let mut config: Array<_, HedgeConfig> =
            Array::try_from(self.map_mut(hedge::names::CONFIG)?)?;
        config.set(
            0,
            HedgeConfig {
                enabled: u32::from(on),
                _pad: 0,
            },
            0,
        )?;
        Ok(())
    }

    fn start_hedge_thread(&mut self) -> Result<()> {
        let sockets = HedgeSockets::open(
            &self.settings.iface,
            self.settings.mark,
            self.backends.iter().any(|b| b.addr.is_ipv4()),
            self.backends.iter().any(|b| b.addr.is_ipv6()),
        )?;
        let ring = RingBuf::try_from(
            self.ebpf_mut()
                .take_map(hedge::names::EVENTS)
                .context("the hedge event ring is missing (hedging started twice?)")?,
        )?;
        let slots = SharedArray::map(
            map_copy(self, names::INFLIGHT)?.fd().as_fd(),
            self.slots.len(),
        )?;
        let counters = SharedArray::map(
            map_copy(self, names::COUNTERS)?.fd().as_fd(),
            MAX_GROUPS as usize,
        )?;
        let groups = Array::try_from(aya::maps::Map::from_map_data(map_copy(
            self,
            names::GROUPS,
        )?)?)?;
        let mut hedger = HedgeLoop {
            ring,
            slots,
            counters,
            groups,
            sockets,
            control: self.hedging.control.clone(),
            queue: BinaryHeap::new(),
            order: 0,
            bucket: TokenBucket::new(self.settings.hedging.budget_percent),
            timeout_ns: self.settings.timeout.as_nanos() as u64,
        };
        let thread = std::thread::Builder::new()
            .name("selector-hedge".into())
            .spawn(move || hedger.run())?;
        self.hedging.thread = Some(thread);
        Ok(())
    }

    /// What the hedge thread died of, once, if it ended while it was to
    /// run (a panic: a bug); hedging is then switched off in the kernel
    /// and in what the agent reports, since nothing hedges any more.
    pub fn hedge_thread_failure(&mut self) -> Option<String> {
        let thread = self.hedging.thread.as_ref()?;
        if !thread.is_finished() || self.hedging.control.stop.load(Ordering::SeqCst) {
            return None;
        }
        let why = match self.hedging.thread.take()?.join() {
            Ok(()) => "it ended".to_string(),
            Err(panic) => panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into()),
        };
        self.hedging.control.enabled.store(false, Ordering::SeqCst);
        let off = HedgeConfig {
            enabled: 0,
            _pad: 0,
        };
        let written = self
            .map_mut(hedge::names::CONFIG)
            .and_then(|m| Ok(Array::<_, HedgeConfig>::try_from(m)?.set(0, off, 0)?));
        if let Err(e) = written {
            log::warn!("switching the kernel's hedge hand-over off: {e:#}");
        }
        Some(why)
    }

    /// For `auto`: the p95 of each backend's recent replies becomes the
    /// delay of reads to it (`crate::hedge_auto`). Does nothing before
    /// `hedge_refresh_due`.
    pub fn refresh_hedge_delays(&mut self) -> Result<()> {
        // Turning `auto` off resets its state (`write_hedge_config`).
        let now = Instant::now();
        if self.settings.hedging.after != HedgeAfter::Auto || !self.hedging.auto.is_due(now) {
            return Ok(());
        }
        let ceiling = auto_ceiling_ns(self.settings.timeout.as_nanos() as u64);
        let latency = match self.latency() {
            Ok(latency) => latency,
            Err(e) => {
                self.hedging.auto.failed(now);
                return Err(e);
            }
        };
        let ids = self.backend_ids();
        let delays = self.hedging.auto.refresh(now, &ids, latency, ceiling);
        for (b, delay) in self.backends.iter().zip(delays) {
            if let Some(d) = delay {
                self.hedging.control.delay_ns[b.index as usize].store(d, Ordering::SeqCst);
            }
        }
        Ok(())
    }

    fn backend_ids(&self) -> Vec<u32> {
        self.backends.iter().map(|b| b.index).collect()
    }

    /// When `refresh_hedge_delays` next has work: `None` unless hedging is
    /// `auto`.
    pub fn hedge_refresh_due(&self) -> Option<Instant> {
        (self.settings.hedging.after == HedgeAfter::Auto)
            .then(|| self.hedging.auto.due().unwrap_or_else(Instant::now))
    }

    /// Hedging counters per backend, in `backends` order.
    pub fn hedge_counts(&self) -> Result<Vec<HedgeCounts>> {
        let stats = self.sum_per_backend(hedge::names::STATS, |t: &mut HedgeStats, s| t.add(s))?;
        let control = &self.hedging.control;
        let on = control.enabled.load(Ordering::SeqCst);
        self.backends
            .iter()
            .map(|b| {
                let k = stats[b.index as usize];
                let a = &control.counts[b.index as usize];
                let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
                Ok(HedgeCounts {
                    hedges_sent: get(&a.sent),
                    hedges_won: k.won,
                    hedges_lost: k.lost,
                    hedge_replies_dropped: k.replies_dropped,
                    hedge_over_budget: get(&a.over_budget),
                    hedge_no_target: get(&a.no_target),
                    hedge_queue_full: get(&a.queue_full),
                    hedge_ring_full: k.ring_full,
                    hedge_too_large: k.too_large,
                    hedge_send_failed: get(&a.send_failed),
                    hedge_delay_ns: on
                        .then(|| control.delay_ns[b.index as usize].load(Ordering::Relaxed)),
                })
            })
            .collect()
    }

    /// Zeroes backend `id`'s hedge counts, the kernel's and the agent's,
    /// for a new member given the id (see `zero_backend`).
    pub(crate) fn zero_hedge_counts(&mut self, id: u32) -> Result<()> {
        let a = &self.hedging.control.counts[id as usize % MAX_BACKENDS as usize];
        for c in [
            &a.sent,
            &a.over_budget,
            &a.no_target,
            &a.queue_full,
            &a.send_failed,
        ] {
            c.store(0, Ordering::Relaxed);
        }
        let cpus = aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?;
        let mut stats: PerCpuArray<_, HedgeStats> =
            PerCpuArray::try_from(self.map_mut(hedge::names::STATS)?)?;
        stats.set(
            id,
            PerCpuValues::try_from(vec![HedgeStats::default(); cpus])?,
            0,
        )?;
        Ok(())
    }

    /// Hedged reads whose hedge target has not answered or expired yet:
    /// its reply may still need rewriting, so a stopping agent waits for them.
    pub fn hedges_in_flight(&self) -> usize {
        let mut settling = 0;
        self.for_each_occupied(|(i, state)| {
            // SAFETY: a word of a live shared element.
            let word = unsafe { load(&raw mut (*self.slots.ptr(i)).hedge) };
            if matches!(phase(state), PHASE_LIVE | PHASE_LINGER)
                && hedge::same_instance(word, state)
                && settling_word(word).is_some()
            {
                settling += 1;
            }
        });
        settling
    }

    /// Moves slot `i`'s hedge word, while it holds the instance of `state`,
    /// to what `next` makes of it, by compare-and-swap: `Ok(word replaced)`,
    /// or `Err(Some(word))` where `next` declined, `Err(None)` if the slot
    /// holds another instance.
    fn update_hedge_word(
        &self,
        i: usize,
        state: u64,
        next: impl Fn(u64) -> Option<u64>,
    ) -> Result<u64, Option<u64>> {
        let p = self.slots.ptr(i);
        // SAFETY: the hedge word of a live shared element.
        let word = unsafe { atomic(&raw mut (*p).hedge) };
        loop {
            let w = word.load(Ordering::SeqCst);
            if !hedge::same_instance(w, state) {
                return Err(None);
            }
            let to = next(w).ok_or(Some(w))?;
            if word
                .compare_exchange(w, to, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                return Ok(w);
            }
        }
    }

    /// The sweep's part: before expiring a read, closes its hedge word so no
    /// hedge can start any more; returns whether a hedge was sent (then the
    /// slot must linger for the target's reply).
    pub(crate) fn close_hedge(&self, i: usize, state: u64) -> bool {
        matches!(
            self.update_hedge_word(i, state, hedge::closing_word),
            Err(Some(w)) if is_sent(w)
        )
    }

    /// The sweep's other part: expires the hedge target's accounting of the
    /// instance `state` in slot `i` (in group `group`) if nobody has ended
    /// it; true if this call did.
    pub(crate) fn expire_hedge(&self, i: usize, state: u64, group: u32) -> bool {
        let Ok(w) = self.update_hedge_word(i, state, settling_word) else {
            return false;
        };
        let c = self.counters.ptr(group as usize);
        let position = hedge::target(w) % MAX_GROUP_MEMBERS;
        // SAFETY: a field of a live shared element, 8-byte aligned.
        unsafe { atomic(&raw mut (*c).expired[position]) }.fetch_add(1, Ordering::SeqCst);
        true
    }
}

impl Selector {
    /// For packet fixtures: claims a hedge to member `target` for the live
    /// request under `key`, as the hedge thread would (hedge word and the
    /// target's `issued`), without sending anything. False if no live slot
    /// holds `key` or its read was answered or closed.
    pub fn plant_hedge(&self, key: &selector_common::InflightKey, target: usize) -> bool {
        use selector_common::inflight::{PROBE_WINDOW, key_hashes, probe};
        let mask = self.slots.len() as u32 - 1;
        let hash = key_hashes(key).home;
        for n in 0..PROBE_WINDOW {
            let i = probe(hash, n, mask) as usize;
            let slot = self.slots.read(i);
            if phase(slot.state) != PHASE_LIVE || slot.key() != *key {
                continue;
            }
            let open = open_word(slot.state);
            let p = self.slots.ptr(i);
            // SAFETY: the hedge word of a live shared element.
            let word = unsafe { atomic(&raw mut (*p).hedge) };
            // A fixture's slot may never have been offered (hedging off).
            let _ = word.compare_exchange(0, open, Ordering::SeqCst, Ordering::SeqCst);
            if word
                .compare_exchange(
                    open,
                    claimed_word(open, target),
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_err()
            {
                return false;
            }
            let (group, _) = split_backend_id(u32::from(slot.chosen));
            self.add_to_issued(backend_id(group, target), 1);
            return true;
        }
        false
    }
}

/// Set by [`plant_hedge_thread_panic`].
static PANIC_PLANTED: AtomicBool = AtomicBool::new(false);

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
    sockets: HedgeSockets,
    control: Arc<Control>,
    queue: BinaryHeap<Reverse<Due>>,
    order: u64,
    bucket: TokenBucket,
    timeout_ns: u64,
}

impl HedgeLoop {
    fn run(&mut self) {
        while !self.control.stop.load(Ordering::SeqCst) {
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
        if now.saturating_sub(slot.sent_ns) >= self.timeout_ns / 2 {
            return;
        }
        let primary = usize::from(slot.primary) % MAX_BACKENDS as usize;
        let (group, chosen_pos) = split_backend_id(u32::from(slot.chosen));
        let Ok(members) = self.groups.get(&group, 0) else {
            return;
        };
        let load = GroupLoad::of(&members, &self.counters.read(group as usize));
        let Some(target_pos) = choose_target(&load, chosen_pos) else {
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
        // The application's own address: IPv6, or IPv4-mapped.
        let client = Endpoint::new(slot.client_addr, 0)
            .ipv4_octets()
            .map_or(IpAddr::V6(Ipv6Addr::from(slot.client_addr)), |o| {
                IpAddr::V4(o.into())
            });
        let to = self
            .control
            .targets
            .read()
            .unwrap_or_else(|e| e.into_inner())[target];
        let sent = to.is_some_and(|to| {
            let payload = &event.payload[..(event.len as usize).min(hedge::PAYLOAD_MAX)];
            let from = SocketAddr::new(client, slot.client_port);
            self.sockets.send(from, to, payload).is_ok()
        });
        // Not sent: the target's count expires with the read.
        let counter = if sent {
            &counts.sent
        } else {
            &counts.send_failed
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The hedging lines of `selector status` and of the exit summary.
pub fn render(settings: &HedgeSettings, counts: &[(SocketAddr, HedgeCounts)]) -> String {
    use fmt::Write as _;
    let mut all = HedgeCounts::default();
    for (_, c) in counts {
        all.add(c);
    }
    let mut out = format!(
        "hedging: after {} ms, budget {}%: sent {}  won {}  lost {}  replies dropped {}\n\
         not hedged: over budget {}  no target {}  queue full {}  ring full {}  too large {}  send failed {}\n",
        settings.after,
        settings.budget_percent,
        all.hedges_sent,
        all.hedges_won,
        all.hedges_lost,
        all.hedge_replies_dropped,
        all.hedge_over_budget,
        all.hedge_no_target,
        all.hedge_queue_full,
        all.hedge_ring_full,
        all.hedge_too_large,
        all.hedge_send_failed,
    );
    if all.hedges_sent + all.hedge_replies_dropped > 0 {
        let _ = writeln!(
            out,
            "{:<22} {:>8} {:>8} {:>8} {:>8} {:>9}",
            "hedges", "sent", "won", "lost", "dropped", "delay"
        );
        for (addr, c) in counts {
            let delay = c
                .hedge_delay_ns
                .map_or("-".to_string(), |d| format!("{:.2}ms", d as f64 / 1e6));
            let _ = writeln!(
                out,
                "{:<22} {:>8} {:>8} {:>8} {:>8} {:>9}",
                addr.to_string(),
                c.hedges_sent,
                c.hedges_won,
                c.hedges_lost,
                c.hedge_replies_dropped,
                delay
            );
        }
    }
    out
}

/// The live table's hedging line: rates over the interval, all backends.
pub fn render_interval(
    backends: &[crate::settings::BackendPlan],
    before: &crate::telemetry::Snapshot,
    now: &crate::telemetry::Snapshot,
) -> String {
    let secs = now.at.duration_since(before.at).as_secs_f64().max(1e-3);
    let (a, b) = (total(&now.hedges), total(&before.hedges));
    let rate = |n: u64, o: u64| n.saturating_sub(o) as f64 / secs;
    let delays: Vec<String> = backends
        .iter()
        .zip(&now.hedges)
        .filter_map(|(p, c)| {
            c.hedge_delay_ns
                .map(|d| format!("{} {:.2}ms", p.addr, d as f64 / 1e6))
        })
        .collect();
    format!(
        "hedges/s: sent {:.0}  won {:.0}  lost {:.0}  dropped {:.0}  over budget {:.0}; delay: {}\n",
        rate(a.hedges_sent, b.hedges_sent),
        rate(a.hedges_won, b.hedges_won),
        rate(a.hedges_lost, b.hedges_lost),
        rate(a.hedge_replies_dropped, b.hedge_replies_dropped),
        rate(a.hedge_over_budget, b.hedge_over_budget),
        if delays.is_empty() {
            "-".to_string()
        } else {
            delays.join(", ")
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hedge_after_parses_off_auto_and_milliseconds() {
        assert_eq!("off".parse(), Ok(HedgeAfter::Off));
        assert_eq!("auto".parse(), Ok(HedgeAfter::Auto));
        assert_eq!("2".parse(), Ok(HedgeAfter::Fixed(Duration::from_millis(2))));
        assert_eq!(
            "0.5".parse(),
            Ok(HedgeAfter::Fixed(Duration::from_micros(500)))
        );
        assert!("0".parse::<HedgeAfter>().is_err());
        assert!("-1".parse::<HedgeAfter>().is_err());
        assert!("soon".parse::<HedgeAfter>().is_err());
        for h in ["off", "auto", "2", "0.5"] {
            let v: HedgeAfter = h.parse().unwrap();
            assert_eq!(v.to_string(), h);
            let json = serde_json::to_string(&v).unwrap();
            assert_eq!(serde_json::from_str::<HedgeAfter>(&json).unwrap(), v);
        }
    }

    #[test]
    fn settings_are_checked_against_the_timeout() {
        let timeout = Duration::from_millis(100);
        let ok = HedgeSettings {
            after: HedgeAfter::Fixed(Duration::from_millis(2)),
            budget_percent: 5,
        };
        ok.check(timeout).unwrap();
        let late = HedgeSettings {
            after: HedgeAfter::Fixed(Duration::from_millis(60)),
            ..ok
        };
        assert!(
            late.check(timeout)
                .unwrap_err()
                .to_string()
                .contains("half")
        );
        let tiny = HedgeSettings {
            after: HedgeAfter::Fixed(Duration::from_micros(10)),
            ..ok
        };
        assert!(tiny.check(timeout).is_err());
        for budget in [0, 101] {
            let b = HedgeSettings {
                budget_percent: budget,
                ..ok
            };
            assert!(b.check(timeout).unwrap_err().to_string().contains("budget"));
        }
        HedgeSettings::default().check(timeout).unwrap();
        assert!(!HedgeSettings::default().enabled());
    }
}
