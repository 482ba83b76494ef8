//! The hedge hand-over in the in-flight slots shared with the kernel: the
//! hedge thread's settings and targets as of each configuration, the
//! claims and closes of hedge words the sweep and the fixtures make, and
//! the hedging counters read from the maps. The thread itself is in
//! [`crate::hedging`].

use std::{
    os::fd::AsFd as _,
    sync::atomic::{AtomicU64, Ordering},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use aya::maps::{Array, MapData, PerCpuArray, PerCpuValues, RingBuf};
use selector_common::{
    CLIENT_SLOTS, MAX_BACKENDS, MAX_GROUP_MEMBERS, MAX_GROUPS, Policy,
    hedge::{self, HedgeConfig, HedgeStats, auto_ceiling_ns, is_sent, settling_word},
    inflight::{PHASE_LINGER, PHASE_LIVE, phase},
    names,
};

use crate::{
    config::hedge::HedgeAfter,
    datapath::Selector,
    hedging::{HedgeMaps, wire::HedgeSockets},
    host::shared::{SharedArray, atomic, load},
    telemetry::hedges::HedgeCounts,
};

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
    /// (with the raw sockets opened at start, while the agent had
    /// CAP_NET_RAW), sets its delay
    /// and budget, and switches the kernel's hand-over on or off. Hedging
    /// is off while steering is (shutdown).
    pub(crate) fn write_hedge_config(&mut self, steering_off: bool) -> Result<()> {
        let hedging = self.settings.tunables.hedging;
        // Observe moves no read, and sends no copy either.
        let on =
            hedging.enabled() && !steering_off && self.settings.tunables.policy != Policy::Observe;
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
        control
            .max_pending
            .store(self.settings.tunables.max_pending, Ordering::SeqCst);
        control
            .max_pending_client
            .store(self.settings.tunables.max_pending_client, Ordering::SeqCst);
        control
            .timeout_ns
            .store(self.settings.timeout.as_nanos() as u64, Ordering::SeqCst);
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
        let sockets = HedgeSockets::opened_at_start_or_open(
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
        let health = SharedArray::map(
            map_copy(self, names::HEALTH)?.fd().as_fd(),
            MAX_GROUPS as usize,
        )?;
        let client_pending = SharedArray::map(
            map_copy(self, names::CLIENT_PENDING)?.fd().as_fd(),
            CLIENT_SLOTS as usize,
        )?;
        let budget_percent = self.settings.tunables.hedging.budget_percent;
        self.hedging.start(
            HedgeMaps {
                ring,
                slots,
                counters,
                groups,
                health,
                client_pending,
            },
            sockets,
            budget_percent,
        )
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
    /// delay of reads to it (`crate::hedging::auto`). Does nothing before
    /// `hedge_refresh_due`.
    pub fn refresh_hedge_delays(&mut self) -> Result<()> {
        // Turning `auto` off resets its state (`write_hedge_config`).
        let now = Instant::now();
        if self.settings.tunables.hedging.after != HedgeAfter::Auto
            || !self.hedging.auto.is_due(now)
        {
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
        (self.settings.tunables.hedging.after == HedgeAfter::Auto)
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
                    hedge_errors_held: k.errors_held,
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
