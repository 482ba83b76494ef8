//! Direct writes into the state shared with the kernel, for packet-fixture
//! tests and benchmarks that need a table in a given state without sending
//! the traffic that would build it. They follow the kernel's own protocol
//! (reserve, write, publish), so the programs see exactly what a real
//! request would have left.

use std::sync::atomic::Ordering;

use selector_common::{
    backend_id,
    hedge::{claimed_word, open_word},
    inflight::phase,
};

use selector_common::{
    InflightKey,
    inflight::{
        AGENT_HOLD, FREE, InflightSlot, PHASE_LIVE, PHASE_WRITING, PROBE_WINDOW, datagrams_open,
        key_hashes, mark_of, probe, sequence, state,
    },
    split_backend_id,
};

use crate::{datapath::Selector, host::shared::atomic};

/// The CPU id the agent's planted instances claim: kernel CPU ids stay
/// below it, so planted and kernel instance numbers never collide.
const AGENT_CPU: u32 = 0xfff;

impl Selector {
    /// Puts a live request in flight under `key`, as the egress program
    /// would, without counting it: callers set the counters they need
    /// (`add_to_issued`). False if its window is full.
    pub fn plant_inflight(
        &mut self,
        key: &InflightKey,
        primary: u32,
        chosen: u32,
        sent_ns: u64,
    ) -> bool {
        self.planted += 1;
        let seq = sequence(self.planted, AGENT_CPU);
        let mask = self.slots.len() as u32 - 1;
        let hash = key_hashes(key).home;
        for i in 0..PROBE_WINDOW {
            let index = probe(hash, i, mask) as usize;
            let p = self.slots.ptr(index);
            // SAFETY: the state word of a live shared element.
            let word = unsafe { atomic(&raw mut (*p).state) };
            let writing = state(seq, PHASE_WRITING);
            if word
                .compare_exchange(FREE, writing, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                continue;
            }
            let (mark, bit) = mark_of(index as u32);
            // SAFETY: a word of a live shared element.
            unsafe { atomic(self.marks.ptr(mark as usize)) }.fetch_or(bit, Ordering::SeqCst);
            // Its send time may be any: the sweep must not skip its word.
            self.sweep_schedule.visit_soon(mark as usize);
            let slot = InflightSlot {
                state: writing,
                request_id: key.request_id,
                client_addr: key.client_addr,
                client_port: key.client_port,
                group: key.group as u16,
                primary: primary as u16,
                chosen: chosen as u16,
                sent_ns,
                datagrams_seen: datagrams_open(writing),
                ..Default::default()
            };
            // SAFETY: this slot is ours while WRITING.
            unsafe { std::ptr::write_volatile(p, slot) };
            word.store(state(seq, PHASE_LIVE), Ordering::SeqCst);
            return true;
        }
        false
    }

    /// Leaves slot `index` held (`AGENT_HOLD`) with its mark set, as an
    /// agent killed between taking the hold and releasing it leaves it in
    /// pinned maps the next agent adopts. False if the slot is not free.
    pub fn plant_hold(&mut self, index: usize) -> bool {
        let p = self.slots.ptr(index % self.slots.len());
        // SAFETY: the state word of a live shared element.
        let word = unsafe { atomic(&raw mut (*p).state) };
        if word
            .compare_exchange(FREE, AGENT_HOLD, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return false;
        }
        let (mark, bit) = mark_of((index % self.slots.len()) as u32);
        // SAFETY: a word of a live shared element.
        unsafe { atomic(self.marks.ptr(mark as usize)) }.fetch_or(bit, Ordering::SeqCst);
        self.sweep_schedule.visit_soon(mark as usize);
        true
    }

    /// Adds `delta` to backend `id`'s issued counter.
    pub fn add_to_issued(&self, id: u32, delta: i64) {
        let (group, position) = split_backend_id(id);
        let c = self.counters.ptr(group as usize);
        // SAFETY: a field of a live shared element, 8-byte aligned.
        unsafe { atomic(&raw mut (*c).issued[position]) }.fetch_add(delta as u64, Ordering::SeqCst);
    }

    /// Sets the agent's heartbeat in the kernel's config to `ns`
    /// (CLOCK_MONOTONIC), as a sweep at that time would have left it.
    pub fn plant_heartbeat(&self, ns: u64) {
        self.set_heartbeat(ns);
    }

    /// Sets backend `id`'s service time, as the reply path would have
    /// measured it.
    pub fn plant_service_time(&self, id: u32, service_ns: u64) {
        let (group, position) = split_backend_id(id);
        let s = self.service.ptr(group as usize);
        // SAFETY: a field of a live shared element, 8-byte aligned.
        unsafe { atomic(&raw mut (*s).service_ns[position]) }.store(service_ns, Ordering::SeqCst);
    }

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
