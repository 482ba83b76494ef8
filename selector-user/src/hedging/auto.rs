//! `--hedge-after auto`: each primary's hedge delay follows the p95 of its
//! recent replies, read from the kernel's cumulative latency histograms.
//!
//! Steady state: every [`AUTO_STEP`] a snapshot joins the history and the
//! p95 over the last [`AUTO_WINDOW_STEPS`] steps becomes the delay. Before
//! a backend has its first estimate its delay is the ceiling (no hedging in
//! practice), so the first estimate must not wait for a whole step: a stall
//! in the first quarter second after `auto` is turned on (an agent start, a
//! `selector set`) would go unhedged. Until every backend has an estimate,
//! and for at most [`AUTO_WARMUP`], the delays are refreshed every
//! [`AUTO_WARMUP_STEP`] from the replies since `auto` began, as soon as a
//! backend has enough of them (`AUTO_MIN_SAMPLES`).

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

use selector_common::hedge::auto_delay_ns;

/// How often the steady-state delay is recomputed, and how many steps its
/// window is.
pub const AUTO_STEP: Duration = Duration::from_millis(250);
pub const AUTO_WINDOW_STEPS: usize = 4;
/// How often a backend without an estimate yet is looked at, and for how
/// long after `auto` began (a backend no read goes to never gets one).
pub const AUTO_WARMUP_STEP: Duration = Duration::from_millis(10);
pub const AUTO_WARMUP: Duration = Duration::from_secs(1);

/// The `auto` state: snapshots of every backend's cumulative histogram.
#[derive(Debug, Default)]
pub struct AutoDelays {
    /// Cumulative histograms per backend (by position), one per step,
    /// oldest first; the first is the one taken when `auto` began.
    history: VecDeque<Vec<Vec<u64>>>,
    /// `None` until `auto` begins.
    clock: Option<Clock>,
    /// Per backend position: whether it has had an estimate.
    estimated: Vec<bool>,
    /// The backend ids the positions stand for.
    ids: Vec<u32>,
    /// After a failed read of the histograms: no refresh before this.
    retry_at: Option<Instant>,
    /// Per backend position: its own p95 as last estimated (`None`: too
    /// few replies in the last window).
    own: Vec<Option<u64>>,
}

/// When `auto` began, when the last snapshot joined the history, and when
/// the delays were last refreshed (a step or a warm-up look).
#[derive(Clone, Copy, Debug)]
struct Clock {
    began: Instant,
    stepped: Instant,
    refreshed: Instant,
}

impl AutoDelays {
    /// Forgets everything (`auto` turned off): the next refresh begins anew.
    pub fn reset(&mut self) {
        *self = Self::default();
    }

    /// Whether `auto` has begun (delays were set at least once).
    pub fn begun(&self) -> bool {
        self.clock.is_some()
    }

    /// Whether the history is of these backends, position by position.
    pub fn tracks(&self, ids: &[u32]) -> bool {
        self.ids == ids
    }

    /// Reading the histograms failed at `now`: the next try is a step
    /// later, so a lasting failure does not spin the agent.
    pub fn failed(&mut self, now: Instant) {
        self.retry_at = Some(now + AUTO_STEP);
    }

    /// When the next refresh is due: `None` (at once) if not begun, every
    /// `AUTO_WARMUP_STEP` while warming up, else one step after the last;
    /// never before a retry after a failure.
    pub fn due(&self) -> Option<Instant> {
        let scheduled = self.clock.map(|c| {
            let step = c.stepped + AUTO_STEP;
            let look = c.refreshed + AUTO_WARMUP_STEP;
            let warming = self.estimated.contains(&false) && look < c.began + AUTO_WARMUP;
            if warming { look.min(step) } else { step }
        });
        match (scheduled, self.retry_at) {
            (Some(at), Some(retry)) => Some(at.max(retry)),
            (at, retry) => at.or(retry),
        }
    }

    /// Whether a refresh is due at `now`.
    pub fn is_due(&self, now: Instant) -> bool {
        self.due().is_none_or(|due| due <= now)
    }

    /// Takes the cumulative histograms at `now`, one per backend of `ids`
    /// (in that order), and returns, per position, the delay to put in
    /// force (`None`: keep the one in force). Call it when `due()`;
    /// `ceiling_ns` bounds delays.
    pub fn refresh(
        &mut self,
        now: Instant,
        ids: &[u32],
        cumulative: Vec<Vec<u64>>,
        ceiling_ns: u64,
    ) -> Vec<Option<u64>> {
        let n = cumulative.len();
        self.retry_at = None;
        let Some(clock) = self.clock.as_mut().filter(|_| self.ids == ids) else {
            // Begins (or the backends changed): the ceiling until estimated.
            self.history = VecDeque::from([cumulative]);
            self.clock = Some(Clock {
                began: now,
                stepped: now,
                refreshed: now,
            });
            self.estimated = vec![false; n];
            self.own = vec![None; n];
            self.ids = ids.to_vec();
            return vec![Some(ceiling_ns); n];
        };
        clock.refreshed = now;
        let full_step = now.duration_since(clock.stepped) >= AUTO_STEP;
        if full_step {
            clock.stepped = now;
        }
        let newest = if full_step {
            self.history.push_back(cumulative);
            while self.history.len() > AUTO_WINDOW_STEPS + 1 {
                self.history.pop_front();
            }
            &self.history[self.history.len() - 1]
        } else {
            &cumulative
        };
        let oldest = &self.history[0];
        let mut looked = vec![false; n];
        for i in 0..n {
            // Between steps only backends without an estimate are looked at.
            if !full_step && self.estimated[i] {
                continue;
            }
            let recent: Vec<u64> = newest[i]
                .iter()
                .zip(&oldest[i])
                .map(|(n, o)| n.saturating_sub(*o))
                .collect();
            let delay = auto_delay_ns(&recent, ceiling_ns);
            self.estimated[i] |= delay.is_some();
            // A full step replaces the estimate (gone if the window had too
            // few replies); a warm-up look only adds one.
            if full_step || delay.is_some() {
                looked[i] = self.own[i] != delay || delay.is_some();
                self.own[i] = delay;
            }
        }
        group_delays(ids, &self.own, &looked)
    }
}

/// The delay each backend's reads get: the least own estimate in its
/// group (`ids` are backend ids, `group * 8 + position`), so that a
/// member slow for a while (a throttled replica, whose p95 is its stalls)
/// does not make its reads wait that long before a copy leaves. `None`
/// (keep the one in force) for a backend whose group had no estimate
/// looked at (`looked`) this time, or has none at all.
pub fn group_delays(ids: &[u32], own: &[Option<u64>], looked: &[bool]) -> Vec<Option<u64>> {
    let group = |i: usize| selector_common::split_backend_id(ids[i]).0;
    (0..ids.len())
        .map(|i| {
            let mates = (0..ids.len()).filter(|&j| group(j) == group(i));
            if !mates.clone().any(|j| looked[j]) {
                return None;
            }
            mates.filter_map(|j| own[j]).min()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use selector_common::{hedge::AUTO_MIN_SAMPLES, latency};

    const CEILING: u64 = 50_000_000;
    const IDS: [u32; 2] = [4, 9];

    /// Cumulative histograms of two backends with `a` and `b` replies of
    /// 1 ms each.
    fn replies(a: u64, b: u64) -> Vec<Vec<u64>> {
        let mut h = vec![vec![0u64; latency::LATENCY_BUCKETS as usize]; 2];
        let bucket = latency::bucket(1_000_000) as usize;
        h[0][bucket] = a;
        h[1][bucket] = b;
        h
    }

    #[test]
    fn a_backend_gets_its_first_delay_within_a_warmup_step_of_enough_replies() {
        let t0 = Instant::now();
        let mut auto = AutoDelays::default();
        assert!(!auto.begun() && auto.is_due(t0));
        assert_eq!(
            auto.refresh(t0, &IDS, replies(0, 0), CEILING),
            vec![Some(CEILING); 2]
        );
        assert!(!auto.is_due(t0 + AUTO_WARMUP_STEP / 2));
        assert!(auto.begun());
        assert_eq!(auto.due(), Some(t0 + AUTO_WARMUP_STEP));
        // Too few replies yet: nothing changes.
        let t1 = t0 + AUTO_WARMUP_STEP;
        assert_eq!(
            auto.refresh(t1, &IDS, replies(AUTO_MIN_SAMPLES - 1, 0), CEILING),
            vec![None, None]
        );
        // Enough for backend 0, 20 ms after `auto` began, not a step later.
        let t2 = t1 + AUTO_WARMUP_STEP;
        let delays = auto.refresh(t2, &IDS, replies(AUTO_MIN_SAMPLES, 0), CEILING);
        let first = delays[0].expect("backend 0 estimated during the warm-up");
        assert!((1_000_000..=1_250_000).contains(&first), "{first}");
        assert_eq!(delays[1], None);
        // Backend 1 has none yet: still looked at every warm-up step...
        assert_eq!(auto.due(), Some(t2 + AUTO_WARMUP_STEP));
        // ...and backend 0 is left alone until the next full step.
        let t3 = t2 + AUTO_WARMUP_STEP;
        assert_eq!(
            auto.refresh(t3, &IDS, replies(100, 5), CEILING),
            vec![None, None]
        );
    }

    #[test]
    fn the_warmup_ends_when_every_backend_is_estimated_or_after_its_limit() {
        let t0 = Instant::now();
        let mut auto = AutoDelays::default();
        auto.refresh(t0, &IDS, replies(0, 0), CEILING);
        let t1 = t0 + AUTO_WARMUP_STEP;
        let delays = auto.refresh(t1, &IDS, replies(50, 50), CEILING);
        assert!(delays.iter().all(Option::is_some));
        assert_eq!(auto.due(), Some(t0 + AUTO_STEP));

        // A backend no read goes to: looked at every warm-up step for
        // AUTO_WARMUP, then only at full steps.
        let mut idle = AutoDelays::default();
        idle.refresh(t0, &IDS, replies(0, 0), CEILING);
        let mut now = t0;
        let (mut looks, mut steps) = (0, 0);
        while now < t0 + 3 * AUTO_WARMUP {
            let gap = idle.due().unwrap() - now;
            if now + AUTO_WARMUP_STEP < t0 + AUTO_WARMUP {
                assert_eq!(gap, AUTO_WARMUP_STEP);
                looks += 1;
            } else if now >= t0 + AUTO_WARMUP {
                assert_eq!(gap, AUTO_STEP);
                steps += 1;
            }
            now += gap;
            idle.refresh(now, &IDS, replies(50, 0), CEILING);
        }
        assert!(looks > 90 && steps >= 8, "{looks} {steps}");
    }

    #[test]
    fn steady_state_delays_are_the_p95_over_the_window() {
        let t0 = Instant::now();
        let mut auto = AutoDelays::default();
        auto.refresh(t0, &IDS, replies(0, 0), CEILING);
        let mut now = t0;
        let mut total = 0;
        // Five full steps of 100 replies of 1 ms each.
        for _ in 0..5 {
            now += AUTO_STEP;
            total += 100;
            let d = auto.refresh(now, &IDS, replies(total, total), CEILING);
            assert!(
                d.iter()
                    .all(|d| d.is_some_and(|d| (1_000_000..=1_250_000).contains(&d)))
            );
        }
        assert_eq!(auto.history.len(), AUTO_WINDOW_STEPS + 1);
        // No replies over a whole window: the delays in force are kept.
        for _ in 0..AUTO_WINDOW_STEPS {
            now += AUTO_STEP;
            auto.refresh(now, &IDS, replies(total, total), CEILING);
        }
        assert_eq!(
            auto.refresh(now + AUTO_STEP, &IDS, replies(total, total), CEILING),
            vec![None, None]
        );
    }

    #[test]
    fn a_reset_or_a_change_of_backends_begins_anew() {
        let t0 = Instant::now();
        let mut auto = AutoDelays::default();
        auto.refresh(t0, &IDS, replies(0, 0), CEILING);
        auto.reset();
        assert!(!auto.begun());
        assert_eq!(auto.due(), None);
        assert!(auto.is_due(t0));
        auto.refresh(t0, &IDS, replies(0, 0), CEILING);
        assert!(auto.tracks(&IDS) && !auto.tracks(&[4, 5]));
        let t1 = t0 + AUTO_WARMUP_STEP;
        let d = auto.refresh(t1, &IDS, replies(50, 50), CEILING);
        assert!(d.iter().all(Option::is_some));
        // As many backends but another one: begins anew at the ceiling.
        let t2 = t0 + AUTO_STEP;
        assert_eq!(
            auto.refresh(t2, &[4, 5], replies(100, 100), CEILING),
            vec![Some(CEILING); 2]
        );
        assert!(auto.tracks(&[4, 5]));
        let three = vec![vec![0u64; latency::LATENCY_BUCKETS as usize]; 3];
        assert_eq!(
            auto.refresh(t2 + AUTO_STEP, &[4, 5, 6], three, CEILING),
            vec![Some(CEILING); 3]
        );
    }

    #[test]
    fn a_failed_read_is_retried_a_step_later_not_at_once() {
        let t0 = Instant::now();
        let mut auto = AutoDelays::default();
        auto.failed(t0);
        assert_eq!(auto.due(), Some(t0 + AUTO_STEP));
        assert!(!auto.is_due(t0 + AUTO_WARMUP_STEP));
        auto.refresh(t0 + AUTO_STEP, &IDS, replies(0, 0), CEILING);
        assert_eq!(auto.due(), Some(t0 + AUTO_STEP + AUTO_WARMUP_STEP));
        // While warming up too: the retry, not the next warm-up look.
        let t1 = t0 + AUTO_STEP + AUTO_WARMUP_STEP;
        auto.failed(t1);
        assert_eq!(auto.due(), Some(t1 + AUTO_STEP));
    }

    #[test]
    fn a_slow_member_gets_its_groups_least_delay() {
        // Backends 0 and 1 of group 0 (ids 0, 1), backend 0 of group 1 (8).
        let ids = [0, 1, 8];
        let own = [Some(60_000_000), Some(300_000), Some(5_000_000)];
        assert_eq!(
            group_delays(&ids, &own, &[true, false, false]),
            [Some(300_000), Some(300_000), None]
        );
        assert_eq!(
            group_delays(&ids, &own, &[false, false, true]),
            [None, None, Some(5_000_000)]
        );
        // A group with no estimate keeps what is in force.
        assert_eq!(
            group_delays(&ids, &[None, None, Some(1)], &[true, true, true]),
            [None, None, Some(1)]
        );
        // Through a refresh: a throttled member's replies (60 ms) and a
        // fast one's (1 ms) in one group.
        let t0 = Instant::now();
        let mut auto = AutoDelays::default();
        let mut h = vec![vec![0u64; latency::LATENCY_BUCKETS as usize]; 2];
        auto.refresh(t0, &[0, 1], h.clone(), CEILING);
        h[0][latency::bucket(60_000_000) as usize] = 100;
        h[1][latency::bucket(1_000_000) as usize] = 100;
        let delays = auto.refresh(t0 + AUTO_STEP, &[0, 1], h, CEILING);
        assert_eq!(delays[0], delays[1]);
        assert!(delays[0].unwrap() <= 1_250_000, "{delays:?}");
    }
}
