//! The in-flight table's marks (one bit per slot, see
//! `selector_common::inflight`): the agent visits only marked slots, so a
//! sweep or a count costs the slots in use since the last sweep plus a
//! read of the mark words (1/512 of the table), not the whole table.

use std::{ops::Range, sync::atomic::Ordering};

use selector_common::inflight::{AGENT_HOLD, FREE, MARK_BITS};

use crate::{
    datapath::Selector,
    host::shared::{atomic, load},
};

/// Mark words whose slots are prefetched together.
const PREFETCH_WORDS: usize = 32;

/// A hint to bring the line at `p` into the cache (no effect elsewhere
/// than x86-64).
#[inline(always)]
fn prefetch(p: *const i8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, whatever the address.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// An occupied slot: its index and the state it was seen in.
pub(crate) type Occupied = (usize, u64);

impl Selector {
    /// Mark words in the table.
    pub(crate) fn mark_words(&self) -> usize {
        self.marks.len()
    }

    /// Puts the occupied slots of mark word `w` in `out` (cleared first),
    /// and clears the marks of its free slots. A free slot is held
    /// (`AGENT_HOLD`) while its bit is cleared, so no inserter can take it
    /// and set the bit in between: a slot in use never loses its mark,
    /// which the request path relies on to skip unmarked slots. A slot
    /// taken before it could be held keeps its bit.
    pub(crate) fn occupied_in(&self, w: usize, out: &mut Vec<Occupied>) {
        out.clear();
        let mark = self.marks.ptr(w);
        // SAFETY: a word of a live shared element.
        let word = unsafe { load(mark) };
        if word == 0 {
            return;
        }
        let state_word = |i: usize| {
            // SAFETY: the state word of a live shared element, 8-byte aligned.
            unsafe { atomic(&raw mut (*self.slots.ptr(i)).state) }
        };
        let first = w * MARK_BITS as usize;
        let mut bits = word;
        while bits != 0 {
            let b = bits.trailing_zeros();
            bits &= bits - 1;
            let i = first + b as usize;
            if i >= self.slots.len() {
                continue;
            }
            let state = state_word(i).load(Ordering::SeqCst);
            if state != FREE {
                out.push((i, state));
                continue;
            }
            if state_word(i)
                .compare_exchange(FREE, AGENT_HOLD, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                // Taken meanwhile: its inserter marks it; the next sweep
                // sees it.
                continue;
            }
            // SAFETY: as above, 8-byte aligned.
            unsafe { atomic(mark) }.fetch_and(!(1 << b), Ordering::SeqCst);
            state_word(i).store(FREE, Ordering::SeqCst);
        }
    }

    /// Frees the slots an agent killed inside its hold left held: between
    /// clearing a free slot's mark and releasing it ([`Self::occupied_in`]),
    /// a slot is held and unmarked, so no sweep visits it (the sweep frees
    /// a hold it sees stuck, but sees marked slots only) and no inserter
    /// can take it: lost to the table for as long as its pinned maps live.
    /// For a new agent adopting pinned maps, before it holds any itself
    /// (the hold is the agent's alone: a program's writing state carries a
    /// sequence). How many it freed.
    pub(crate) fn free_stale_holds(&self) -> usize {
        (0..self.slots.len())
            .filter(|&i| {
                // SAFETY: the state word of a live shared element, 8-byte
                // aligned.
                let state = unsafe { atomic(&raw mut (*self.slots.ptr(i)).state) };
                state.load(Ordering::Relaxed) == AGENT_HOLD
                    && state
                        .compare_exchange(AGENT_HOLD, FREE, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
            })
            .count()
    }

    /// Calls `visit` with every occupied slot, one mark word at a time.
    pub(crate) fn for_each_occupied(&self, mut visit: impl FnMut(Occupied)) {
        let mut found = Vec::with_capacity(MARK_BITS as usize);
        for words in self.mark_runs() {
            if !self.prefetch_marked(words.clone()) {
                continue;
            }
            for w in words {
                self.occupied_in(w, &mut found);
                found.iter().copied().for_each(&mut visit);
            }
        }
    }

    /// The mark words in runs of `PREFETCH_WORDS`, to be given to
    /// [`Self::prefetch_marked`] before they are visited.
    pub(crate) fn mark_runs(&self) -> impl Iterator<Item = Range<usize>> + use<> {
        let words = self.mark_words();
        (0..words)
            .step_by(PREFETCH_WORDS)
            .map(move |start| start..(start + PREFETCH_WORDS).min(words))
    }

    /// Asks the CPU for the state lines of the marked slots of `words`: a
    /// marked slot is a random place in a table of up to 256 MB, and one
    /// miss after another made those loads most of the agent's time at
    /// 100 k requests/s; fetched together they overlap. False if no slot
    /// of `words` was marked: the caller skips them (most of a large,
    /// quiet table).
    pub(crate) fn prefetch_marked(&self, words: impl Iterator<Item = usize>) -> bool {
        let mut any = false;
        for w in words {
            any |= self.prefetch_word(w);
        }
        any
    }

    fn prefetch_word(&self, w: usize) -> bool {
        // SAFETY: a word of a live shared element.
        let mut bits = unsafe { load(self.marks.ptr(w)) };
        let marked = bits != 0;
        while bits != 0 {
            let i = w * MARK_BITS as usize + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if i < self.slots.len() {
                prefetch(self.slots.ptr(i).cast_const().cast());
            }
        }
        marked
    }
}
