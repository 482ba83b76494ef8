//! Expiry of lost requests, on the in-flight slots the agent shares with
//! the kernel. The sweep and the reply path race to move a slot out of
//! `LIVE` with a compare-and-swap on the exact state word each read; the
//! winner accounts for the request, so a pending count is never subtracted
//! twice or leaked, and the count is added in the same step as the claim
//! (no system call in between that could fail and leave it stale).

use std::{collections::HashMap, sync::atomic::Ordering};

use anyhow::Result;
use selector_common::{
    MAX_GROUP_MEMBERS, MAX_TIMEOUT_MS,
    inflight::{
        AGENT_HOLD, FREE, InflightSlot, MARK_BITS, PHASE_LINGER, PHASE_LIVE, client_slot, phase,
        with_phase,
    },
    split_backend_id,
};

use crate::{
    datapath::Selector,
    host::shared::{SharedArray, atomic, load},
};

/// What one sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Requests this sweep expired (and subtracted).
    pub expired: u64,
    /// Stale requests the reply path completed first.
    pub lost_race: u64,
    /// Lingering slots of redirected reads freed after their grace period.
    pub freed: u64,
    /// Hedge targets of this sweep's or earlier expired reads whose reply
    /// never came (their count expired here).
    pub hedges_expired: u64,
    /// Occupied slots this sweep read (those of mark words due).
    pub visited: u64,
    /// Slots freed after being seen in the agent's hold (`AGENT_HOLD`),
    /// unchanged, for [`STUCK_HOLD_NS`]: their holder is gone.
    pub reclaimed: u64,
}

/// How long a slot may stay in the agent's hold before the sweep frees it.
/// A hold lasts a few instructions (`Selector::occupied_in`); one
/// unchanged for a second has no holder left (an agent killed holding it,
/// its pinned maps adopted), and would hold back every member's retirement
/// (`Selector::referenced`: a slot being written may name any member) and
/// take a slot of the table for good.
pub const STUCK_HOLD_NS: u64 = 1_000_000_000;
/// ... and over at least this many sweeps, so a late or paused sweep does
/// not mistake a hold of this moment for a stuck one.
const STUCK_HOLD_SWEEPS: u32 = 3;

/// A slot seen in the agent's hold.
#[derive(Debug, Clone, Copy)]
struct Held {
    since_ns: u64,
    sightings: u32,
    /// The sweep that last saw it.
    sweep: u64,
}

/// When each mark word next has something for the sweep to do: the
/// earliest time one of its requests may expire or its lingering slot be
/// freed. A sweep skips words not due yet, so a request is looked at about
/// twice in its life (at its timeout, and at the end of its linger), not
/// on every sweep: at 100 k redirected reads/s lingering for 2 s, that is
/// 200 000 slots not re-read from a table of up to 256 MB every 250 ms.
///
/// Why a skipped word can hold nothing due: a request taken into a word
/// after the sweep that set its time was sent after that sweep began
/// (the kernel reads the clock after marking the slot), so it is due no
/// earlier than that sweep's now plus the timeout, the latest time a word
/// is ever set to. A slot's phase only moves on (live, lingering, free)
/// and its send time never changes while it is occupied. A word where a
/// slot was found free after the visit (freed by this sweep, its mark still
/// set) is due at the next sweep, which clears the mark. Requests planted
/// by the agent itself (tests, benchmarks) make their word due at once.
#[derive(Debug, Default)]
pub(crate) struct SweepSchedule {
    /// Per mark word, CLOCK_MONOTONIC ns; empty until the first sweep.
    due: Vec<u64>,
    /// The (timeout, linger) the times were computed for: a change of
    /// either (`selector set`) starts over.
    ages: (u64, u64),
    /// Slots seen held, by index, for [`STUCK_HOLD_NS`].
    held: HashMap<usize, Held>,
    /// Sweeps so far.
    sweeps: u64,
}

impl SweepSchedule {
    /// Word `w` must be visited by the next sweep.
    #[cfg(feature = "testing")]
    pub(crate) fn visit_soon(&mut self, w: usize) {
        if let Some(d) = self.due.get_mut(w) {
            *d = 0;
        }
    }

    /// Starts over when the table or the ages changed since the times were
    /// computed.
    fn fit(&mut self, words: usize, ages: &Ages) {
        let wanted = (ages.timeout_ns, ages.linger_ns);
        if self.ages != wanted || self.due.len() != words {
            *self = SweepSchedule {
                due: vec![0; words],
                ages: wanted,
                held: std::mem::take(&mut self.held),
                sweeps: self.sweeps,
            };
        }
    }

    /// Notes slot `i` seen held; true once it has been held, seen by every
    /// sweep in between, long enough to be freed.
    fn stuck_hold(&mut self, i: usize, now_ns: u64) -> bool {
        let sweep = self.sweeps;
        let seen = self.held.entry(i).or_insert(Held {
            since_ns: now_ns,
            sightings: 0,
            sweep,
        });
        seen.sightings += 1;
        seen.sweep = sweep;
        seen.sightings >= STUCK_HOLD_SWEEPS && now_ns.saturating_sub(seen.since_ns) >= STUCK_HOLD_NS
    }

    fn is_due(&self, w: usize, now_ns: u64) -> bool {
        self.due.get(w).is_none_or(|&d| d <= now_ns)
    }
}

/// The fields of a slot the sweep decides on, read consistently.
struct Stale {
    state: u64,
    slot: InflightSlot,
}

/// The sweep's clock and limits, in ns.
struct Ages {
    now_ns: u64,
    timeout_ns: u64,
    linger_ns: u64,
}

/// Reads slot `i` and checks its state did not change meanwhile.
fn read_consistent(slots: &SharedArray<InflightSlot>, i: usize, state: u64) -> Option<Stale> {
    let slot = slots.read(i);
    // SAFETY: the state word of a live shared element.
    let after = unsafe { load(&raw mut (*slots.ptr(i)).state) };
    (after == state).then_some(Stale { state, slot })
}

/// Moves slot `i` from `from` to `to`; true if the sweep made the move.
fn cas(slots: &SharedArray<InflightSlot>, i: usize, from: u64, to: u64) -> bool {
    // SAFETY: the state word of a live shared element, 8-byte aligned.
    unsafe { atomic(&raw mut (*slots.ptr(i)).state) }
        .compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok()
}

impl Selector {
    /// Expires requests older than the timeout and frees lingering slots
    /// older than timeout + grace, as of `now_ns` (CLOCK_MONOTONIC). Visits
    /// only marked slots (`crate::datapath::marks`): the cost follows the requests
    /// sent since the last sweep and those still in flight, not the size
    /// of the table. Then writes the agent's heartbeat (with the real
    /// clock, whatever `now_ns` says).
    pub fn sweep(&mut self, now_ns: u64) -> Result<SweepReport> {
        let ms = |d: std::time::Duration| d.as_millis().min(u128::from(MAX_TIMEOUT_MS)) as u64;
        let timeout_ns = ms(self.settings.timeout) * 1_000_000;
        let ages = Ages {
            now_ns,
            timeout_ns,
            linger_ns: timeout_ns + ms(self.settings.grace) * 1_000_000,
        };
        let mut report = SweepReport::default();
        let mut schedule = std::mem::take(&mut self.sweep_schedule);
        schedule.fit(self.mark_words(), &ages);
        schedule.sweeps += 1;
        let mut occupied = Vec::with_capacity(MARK_BITS as usize);
        let mut due = Vec::new();
        for words in self.mark_runs() {
            due.clear();
            due.extend(words.filter(|&w| schedule.is_due(w, now_ns)));
            if !self.prefetch_marked(due.iter().copied()) {
                continue;
            }
            for &w in &due {
                self.occupied_in(w, &mut occupied);
                report.visited += occupied.len() as u64;
                let mut next = now_ns.saturating_add(ages.timeout_ns);
                for &(i, state) in &occupied {
                    // Only the agent's hold: nothing is counted for it. A
                    // kernel writer has counted its request already, and
                    // always finishes within its program run.
                    if state == AGENT_HOLD
                        && schedule.stuck_hold(i, now_ns)
                        && cas(&self.slots, i, state, FREE)
                    {
                        // Its mark is cleared by the next sweep.
                        log::warn!("in-flight slot {i} stuck in the agent's hold: freed");
                        report.reclaimed += 1;
                    }
                    self.sweep_slot(i, state, &ages, &mut report);
                    next = next.min(self.slot_due(i, &ages));
                }
                schedule.due[w] = next;
            }
        }
        // A slot not seen held by this sweep was released: forgotten (a
        // held slot's word is due every sweep, so one still held was seen).
        let sweep = schedule.sweeps;
        schedule.held.retain(|_, seen| seen.sweep == sweep);
        self.sweep_schedule = schedule;
        // Done: the programs may trust the counts a while longer.
        self.heartbeat();
        Ok(report)
    }

    /// When slot `i`, just swept, next needs the sweep, as of `ages.now_ns`:
    /// a live request at its timeout; a lingering one at its timeout (a
    /// hedge target that never answered expires then), then at the end of
    /// its linger; a free slot (freed by this sweep, its mark still set,
    /// which the next sweep clears) or one being written at once.
    fn slot_due(&self, i: usize, ages: &Ages) -> u64 {
        // SAFETY: fields of a live shared element.
        let (state, sent_ns) = unsafe {
            let p = self.slots.ptr(i);
            (load(&raw mut (*p).state), load(&raw mut (*p).sent_ns))
        };
        let timeout_at = sent_ns.saturating_add(ages.timeout_ns);
        match phase(state) {
            PHASE_LIVE => timeout_at,
            PHASE_LINGER if timeout_at > ages.now_ns => timeout_at,
            PHASE_LINGER => sent_ns.saturating_add(ages.linger_ns),
            _ => ages.now_ns,
        }
    }

    /// Sweeps slot `i`, seen occupied in `state`.
    fn sweep_slot(&mut self, i: usize, state: u64, ages: &Ages, report: &mut SweepReport) {
        let age_over = |limit: u64| {
            // SAFETY: a field of a live shared element. A slot being
            // rewritten may show a newer time: then it is not stale.
            let sent = unsafe { load(&raw mut (*self.slots.ptr(i)).sent_ns) };
            ages.now_ns.saturating_sub(sent) >= limit
        };
        match phase(state) {
            PHASE_LIVE if age_over(ages.timeout_ns) => {
                let Some(stale) = read_consistent(&self.slots, i, state) else {
                    report.lost_race += 1;
                    return;
                };
                // No hedge may start once the read expires; one already
                // sent keeps the slot lingering for the target's reply.
                let hedged = self.close_hedge(i, state);
                if self.expire(i, &stale, hedged) {
                    report.expired += 1;
                } else {
                    report.lost_race += 1;
                }
                if hedged && self.expire_hedge(i, state, u32::from(stale.slot.group)) {
                    report.hedges_expired += 1;
                }
            }
            PHASE_LINGER if age_over(ages.timeout_ns) => {
                // A hedge target that never answered: its count ends at
                // the timeout, before the slot may be freed.
                if let Some(stale) = read_consistent(&self.slots, i, state)
                    && self.expire_hedge(i, state, u32::from(stale.slot.group))
                {
                    report.hedges_expired += 1;
                }
                if age_over(ages.linger_ns) && cas(&self.slots, i, state, FREE) {
                    report.freed += 1;
                }
            }
            _ => {}
        }
    }

    /// Claims a stale request; if the claim wins, counts it expired at its
    /// backend and releases its client's pending count.
    fn expire(&mut self, i: usize, stale: &Stale, hedged: bool) -> bool {
        let s = &stale.slot;
        let next = if s.primary != s.chosen || hedged {
            // A redirected read: a late reply must still be rewritten; a
            // hedged one: the target's reply must still be matched.
            with_phase(stale.state, PHASE_LINGER)
        } else {
            FREE
        };
        if !cas(&self.slots, i, stale.state, next) {
            return false;
        }
        let (group, position) = split_backend_id(u32::from(s.chosen));
        let c = self.counters.ptr(group as usize);
        // SAFETY: fields of live shared elements, 8-byte aligned.
        unsafe {
            atomic(&raw mut (*c).expired[position % MAX_GROUP_MEMBERS])
                .fetch_add(1, Ordering::SeqCst);
            let client = client_slot(&s.client_addr, s.client_port);
            atomic(self.clients.ptr(client as usize)).fetch_sub(1, Ordering::SeqCst);
        }
        // Lost: a failure of the member it was sent to (outlier ejection).
        self.count_failure(u32::from(s.chosen), s.sent_ns);
        true
    }
}
