//! A memory of slowness (issue 37): the count rule forgets a replica that
//! stalls ten times a second (a CFS-throttled pod) as soon as its queue
//! drains, and even moves reads *to* it then, since nothing pending looks
//! best. Here each member carries a peak-sensitive moving average of how
//! slow it has been (Finagle's and Linkerd's peak EWMA): a sample above it
//! is taken at once, one below pulls it down by half every
//! [`HALF_LIFE_NS`]. A sample is the mean latency of the member's
//! completions since the last step, or, while reads wait on it with no
//! completion, how long that has lasted (a stall is seen while it lasts,
//! not when it ends).
//!
//! A member whose score exceeds the group's fastest measured member's by
//! [`SLOW_RATIO_PERCENT`] and [`SLOW_FLOOR_NS`] is *slow*: the policy does
//! not choose it while an eligible member is not slow (its reads go to the
//! best of those at once, and none are moved to it;
//! [`crate::ejection::eligible`]). It stays slow until single reads,
//! probes, find it fast [`PROBES_TO_RECOVER`] times in a row: the first
//! once its score has faded below the limit and [`PROBE_FIRST_NS`] has
//! passed, then after a backoff doubling up to [`PROBE_MOST_NS`] while
//! probes find it slow, so a recovered primary regains its reads within
//! seconds (data affinity) and a still-slow one costs a read every few
//! seconds. A member slow again soon after it recovered (its probes fell
//! in the share of each period a throttled pod runs) must pass twice the
//! probes the next time, up to [`MAX_RELAPSES`] doublings: each relapse
//! strands the reads sent to it before the stall is seen.
//!
//! The agent runs [`step_group`] every few milliseconds on what the kernel
//! counted and writes the slow and probe bits of the group's health word;
//! the kernel only reads them, and takes a probe with the same
//! compare-and-swap as a half-open member's.

use crate::MAX_GROUP_MEMBERS;

/// A sample below the score pulls it half way down in this long.
pub const HALF_LIFE_NS: u64 = 500_000_000;
/// Slow: a score over this share of the fastest member's ...
pub const SLOW_RATIO_PERCENT: u64 = 150;
/// ... and over the fastest member's by this much: differences under it
/// are not worth leaving a primary (its cache) for, and a healthy member
/// whose reads wait a scheduling hiccup (a millisecond on a busy host) is
/// not slow.
pub const SLOW_FLOOR_NS: u64 = 2_000_000;
/// A member's score counts as the group's measure of "fast" for this long
/// after its last sample.
pub const MEASURED_FOR_NS: u64 = 5_000_000_000;
/// The first probe of a slow member, after it became slow.
pub const PROBE_FIRST_NS: u64 = 500_000_000;
/// The longest wait between probes.
pub const PROBE_MOST_NS: u64 = 4_000_000_000;
/// Probes in a row that must find a slow member fast before it is fast
/// again. A CPU-throttled replica answers most single reads fast: its
/// cgroup runs out of quota in some periods, not all (on this machine,
/// memcached at a quota of 30% with a busy process stalled about one read
/// in five), so a short run of fast probes is no proof: five in a row come
/// a third of the time, and each relapse doubles the run it must pass
/// next ([`probes_to_recover`]).
pub const PROBES_TO_RECOVER: u32 = 5;
/// Slow again within this long of recovering is a relapse ...
pub const RELAPSE_WINDOW_NS: u64 = 10_000_000_000;
/// ... and each doubles the probes the next recovery takes, this many
/// times at most (5, 10, 20, 40, 80: 80 probes take 12 to 20 seconds).
pub const MAX_RELAPSES: u32 = 4;

/// The fast probes in a row a member slow after `relapses` relapses must
/// pass to be fast again.
pub const fn probes_to_recover(relapses: u32) -> u32 {
    let r = if relapses < MAX_RELAPSES {
        relapses
    } else {
        MAX_RELAPSES
    };
    PROBES_TO_RECOVER << r
}

/// The wait after a probe that found it fast before the next: longer than
/// a CFS period (100 ms), so the next falls in another, plus up to
/// [`PROBE_JITTER_NS`], so that probes do not keep one phase of the
/// period (the share a throttled pod runs in).
pub const PROBE_AGAIN_NS: u64 = 150_000_000;
pub const PROBE_JITTER_NS: u64 = 100_000_000;

/// A wait under [`PROBE_JITTER_NS`] drawn from `now_ns` (mixed: the low
/// bits of a step's time are no draw of their own).
const fn jitter(now_ns: u64) -> u64 {
    crate::inflight::mix(now_ns.wrapping_add(0x9e37_79b9_7f4a_7c15)) % PROBE_JITTER_NS
}
/// A latency sample is the mean of at least this many replies ...
pub const SAMPLE_REPLIES: u64 = 8;
/// ... or of those of this long a window (a slow member's probe is one
/// reply; a stall is sampled apart, every step, while it lasts).
pub const SAMPLE_WINDOW_NS: u64 = 100_000_000;

/// Whether `replies` counted over `window_ns` make a latency sample: single
/// replies of a busy member would make the peak-sensitive score follow
/// their noise.
pub const fn sample_ready(replies: u64, window_ns: u64) -> bool {
    replies >= SAMPLE_REPLIES || (replies > 0 && window_ns >= SAMPLE_WINDOW_NS)
}

/// A wait shorter than this is no sample of its own (its reply's latency
/// will be): a healthy member's reads wait a couple of milliseconds now
/// and then on a busy host (DNS through glibc on this machine: about one
/// lookup in a thousand), and each such wait would mark it slow until its
/// probes. A stall (a throttled period, a pause, a loss) lasts longer.
pub const MIN_STALL_NS: u64 = 5_000_000;

/// A member not measured for this long while its group has reads gets one
/// (its explore bit): a primary slow for good is only found slow against
/// replicas that were measured, and the count rule may move it none.
pub const EXPLORE_AFTER_NS: u64 = 2_000_000_000;

/// `value` after `elapsed_ns` of halving every [`HALF_LIFE_NS`]: whole
/// halvings by shifts, the rest of one by the quadratic through 2^0, 2^-1
/// with 2^-f's slope at 0 (within 1% of the exponential, and right when
/// compounded over steps of a few milliseconds).
pub const fn decayed(value: u64, elapsed_ns: u64) -> u64 {
    let halvings = elapsed_ns / HALF_LIFE_NS;
    if halvings >= 64 {
        return 0;
    }
    let v = (value >> halvings) as u128;
    // In microseconds, so that v times the scale fits 128 bits.
    let h = (HALF_LIFE_NS / 1000) as u128;
    let f = ((elapsed_ns % HALF_LIFE_NS) / 1000) as u128;
    // 1 - ln2 f + (1/2 - (1 - ln2)) f^2, f = part / h, in 1/10^4.
    let keep = 10_000 * h * h - 6_931 * f * h + 1_931 * f * f;
    (v * keep / (10_000 * h * h)) as u64
}

/// The peak EWMA after `elapsed_ns` and `sample` (none: nothing was
/// measured, the score decays towards 0).
pub const fn next_score(score: u64, sample: Option<u64>, elapsed_ns: u64) -> u64 {
    match sample {
        Some(x) if x >= score => x,
        Some(x) => x + decayed(score - x, elapsed_ns),
        None => decayed(score, elapsed_ns),
    }
}

/// The score over which a member is slow, given the fastest measured
/// member's.
pub const fn limit(fastest_ns: u64) -> u64 {
    let by_ratio = fastest_ns.saturating_mul(SLOW_RATIO_PERCENT) / 100;
    let by_floor = fastest_ns.saturating_add(SLOW_FLOOR_NS);
    if by_ratio > by_floor {
        by_ratio
    } else {
        by_floor
    }
}

/// What the agent saw of a member since the group's last step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    /// Mean latency of the requests it completed since (none completed:
    /// `None`).
    pub latency_ns: Option<u64>,
    /// How long requests have waited on it with no completion (0: none
    /// pending, or one completed since the last step).
    pub stalled_ns: u64,
    /// Active and not ejected: a member the policy may choose.
    pub eligible: bool,
    /// Its slow-probe bit is still set (offered, not taken by a read).
    pub probe_offered: bool,
    /// Its explore bit is still set.
    pub explore_offered: bool,
}

impl Seen {
    /// The sample this step: the worse of the two measures, if any (a
    /// wait under [`MIN_STALL_NS`] is none).
    pub const fn sample(&self) -> Option<u64> {
        let stalled = if self.stalled_ns >= MIN_STALL_NS {
            self.stalled_ns
        } else {
            0
        };
        match self.latency_ns {
            Some(l) if l >= stalled => Some(l),
            _ if stalled > 0 => Some(stalled),
            _ => None,
        }
    }
}

/// A slow member's probe.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Probe {
    /// None offered; the next at `at_ns`.
    #[default]
    Waiting,
    /// Offered: the kernel lets one read through.
    Offered,
    /// A read took it; its result is awaited.
    Taken,
}

/// Where a member stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Standing {
    #[default]
    Fine,
    Slow {
        /// When the next probe may be offered, and the backoff that set it.
        next_probe_ns: u64,
        backoff_ns: u64,
        probe: Probe,
    },
}

/// The agent's memory of one member.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    pub score_ns: u64,
    /// When it was last measured (0: never).
    pub measured_ns: u64,
    pub standing: Standing,
    /// Probes in a row that found it fast while slow.
    pub fast_probes: u32,
    /// When its probes last found it fast again (0: never).
    pub recovered_ns: u64,
    /// Times in a row it was slow again within [`RELAPSE_WINDOW_NS`] of
    /// recovering (see [`probes_to_recover`]).
    pub relapses: u32,
}

impl Memory {
    pub const fn is_slow(&self) -> bool {
        matches!(self.standing, Standing::Slow { .. })
    }
}

/// What a step changed, for the health word and the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Became slow: set its slow bit.
    Slow {
        position: usize,
        score_ns: u64,
        fastest_ns: u64,
    },
    /// Offer a probe: set its slow-probe bit.
    ProbeOffered { position: usize },
    /// Its probe found it slow still: the next after `backoff_ns`.
    ProbeSlow {
        position: usize,
        sample_ns: u64,
        backoff_ns: u64,
    },
    /// Fast again (its probe), or no longer comparable (no fast member
    /// measured, or it left the choice): clear its slow and probe bits.
    Fine { position: usize, sample_ns: u64 },
}

/// The most events one step returns: one per member.
pub const MAX_EVENTS: usize = MAX_GROUP_MEMBERS;

/// Events of one step, in member order.
#[derive(Clone, Copy, Debug, Default)]
pub struct Events {
    items: [Option<Event>; MAX_EVENTS],
    len: usize,
}

impl Events {
    fn push(&mut self, e: Event) {
        if self.len < MAX_EVENTS {
            self.items[self.len] = Some(e);
            self.len += 1;
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = Event> + '_ {
        self.items[..self.len].iter().flatten().copied()
    }
}

/// The fastest score among eligible members that are not slow and were
/// measured within [`MEASURED_FOR_NS`] of `now_ns`.
pub fn fastest(memory: &[Memory], seen: &[Seen], now_ns: u64) -> Option<u64> {
    memory
        .iter()
        .zip(seen)
        .filter(|(m, s)| {
            s.eligible
                && !m.is_slow()
                && m.measured_ns != 0
                && now_ns.saturating_sub(m.measured_ns) <= MEASURED_FOR_NS
        })
        .map(|(m, _)| m.score_ns)
        .min()
}

/// One step of a group's members at `now_ns`, `elapsed_ns` after the last.
pub fn step_group(memory: &mut [Memory], seen: &[Seen], now_ns: u64, elapsed_ns: u64) -> Events {
    let n = memory.len().min(seen.len()).min(MAX_GROUP_MEMBERS);
    let (memory, seen) = (&mut memory[..n], &seen[..n]);
    for (m, s) in memory.iter_mut().zip(seen) {
        let sample = s.sample();
        // With no sample a slow member's memory fades every step (towards
        // a probe); any other's holds, the last measure of its speed, and
        // its next sample weighs by the time since that measure.
        if m.is_slow() {
            m.score_ns = next_score(m.score_ns, sample, elapsed_ns);
        } else if sample.is_some() {
            let since = match m.measured_ns {
                0 => elapsed_ns,
                at => now_ns.saturating_sub(at),
            };
            m.score_ns = next_score(m.score_ns, sample, since);
        }
        if sample.is_some() {
            m.measured_ns = now_ns;
        }
    }
    let fastest = fastest(memory, seen, now_ns);
    let mut events = Events::default();
    for (position, (m, s)) in memory.iter_mut().zip(seen).enumerate() {
        let sample = s.sample();
        match (m.standing, fastest) {
            (Standing::Fine, Some(fastest_ns)) => {
                if s.eligible && sample.is_some() && m.score_ns > limit(fastest_ns) {
                    let relapsed = m.recovered_ns != 0
                        && now_ns.saturating_sub(m.recovered_ns) <= RELAPSE_WINDOW_NS;
                    m.relapses = if relapsed {
                        (m.relapses + 1).min(MAX_RELAPSES)
                    } else {
                        0
                    };
                    m.standing = Standing::Slow {
                        next_probe_ns: now_ns + PROBE_FIRST_NS,
                        backoff_ns: PROBE_FIRST_NS,
                        probe: Probe::Waiting,
                    };
                    events.push(Event::Slow {
                        position,
                        score_ns: m.score_ns,
                        fastest_ns,
                    });
                }
            }
            (Standing::Fine, None) => {}
            (Standing::Slow { .. }, None) => {
                // Nothing fast to compare with: slowness ranks members,
                // and there is no ranking.
                m.standing = Standing::Fine;
                events.push(Event::Fine {
                    position,
                    sample_ns: sample.unwrap_or(m.score_ns),
                });
            }
            (
                Standing::Slow {
                    next_probe_ns,
                    backoff_ns,
                    probe,
                },
                Some(fastest_ns),
            ) => {
                let probe = match probe {
                    Probe::Offered if !s.probe_offered => Probe::Taken,
                    other => other,
                };
                match probe {
                    // Probed once its memory has faded below the limit:
                    // a probe sooner could not show it fast.
                    Probe::Waiting
                        if now_ns >= next_probe_ns && m.score_ns <= limit(fastest_ns) =>
                    {
                        m.standing = Standing::Slow {
                            next_probe_ns,
                            backoff_ns,
                            probe: Probe::Offered,
                        };
                        events.push(Event::ProbeOffered { position });
                    }
                    Probe::Taken => {
                        let slow = limit(fastest_ns);
                        // The probe's reply, or a wait already too long.
                        let verdict = match (s.latency_ns, sample) {
                            (Some(_), Some(x)) => Some(x),
                            (None, Some(x)) if x > slow => Some(x),
                            _ => None,
                        };
                        match verdict {
                            Some(x)
                                if x <= slow
                                    && m.fast_probes + 1 >= probes_to_recover(m.relapses) =>
                            {
                                m.standing = Standing::Fine;
                                m.fast_probes = 0;
                                m.recovered_ns = now_ns;
                                events.push(Event::Fine {
                                    position,
                                    sample_ns: x,
                                });
                            }
                            Some(x) if x <= slow => {
                                // Fast this once: a throttled member is, in
                                // the part of each period it runs. Another
                                // probe, in another period.
                                m.fast_probes += 1;
                                m.standing = Standing::Slow {
                                    next_probe_ns: now_ns + PROBE_AGAIN_NS + jitter(now_ns),
                                    backoff_ns,
                                    probe: Probe::Waiting,
                                };
                            }
                            Some(x) => {
                                m.fast_probes = 0;
                                let backoff_ns = (backoff_ns * 2).min(PROBE_MOST_NS);
                                m.standing = Standing::Slow {
                                    next_probe_ns: now_ns + backoff_ns,
                                    backoff_ns,
                                    probe: Probe::Waiting,
                                };
                                events.push(Event::ProbeSlow {
                                    position,
                                    sample_ns: x,
                                    backoff_ns,
                                });
                            }
                            None => {
                                m.standing = Standing::Slow {
                                    next_probe_ns,
                                    backoff_ns,
                                    probe,
                                }
                            }
                        }
                    }
                    _ => {
                        m.standing = Standing::Slow {
                            next_probe_ns,
                            backoff_ns,
                            probe,
                        }
                    }
                }
            }
        }
    }
    events
}

/// The members to offer a read to, as explore bits' positions: eligible,
/// not slow, not measured for [`EXPLORE_AFTER_NS`] and none offered yet,
/// while another member of the group was measured that recently (its
/// group has reads).
pub fn to_explore(memory: &[Memory], seen: &[Seen], now_ns: u64) -> u8 {
    let recent =
        |m: &Memory| m.measured_ns != 0 && now_ns.saturating_sub(m.measured_ns) <= EXPLORE_AFTER_NS;
    if !memory.iter().any(recent) {
        return 0;
    }
    memory
        .iter()
        .zip(seen)
        .enumerate()
        .take(MAX_GROUP_MEMBERS)
        .filter(|(_, (m, s))| s.eligible && !m.is_slow() && !recent(m) && !s.explore_offered)
        .fold(0, |mask, (p, _)| mask | 1 << p)
}

/// The slow and slow-probe bits of a group's health word as `memory`
/// says they should be.
pub fn bits(memory: &[Memory]) -> u64 {
    memory
        .iter()
        .enumerate()
        .fold(0, |word, (p, m)| match m.standing {
            Standing::Fine => word,
            Standing::Slow { probe, .. } => {
                let offered = if probe == Probe::Offered {
                    crate::ejection::slow_probe_bit(p)
                } else {
                    0
                };
                word | crate::ejection::slow_bit(p) | offered
            }
        })
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;
    use crate::ejection::{eligible, slow_bit, slow_probe_bit, take_probe};

    const MS: u64 = 1_000_000;
    const STEP: u64 = 10 * MS;

    fn fast(latency_ns: u64) -> Seen {
        Seen {
            latency_ns: Some(latency_ns),
            eligible: true,
            ..Seen::default()
        }
    }

    fn idle() -> Seen {
        Seen {
            eligible: true,
            ..Seen::default()
        }
    }

    #[test]
    fn the_score_takes_peaks_at_once_and_halves_every_half_life() {
        assert_eq!(next_score(100, Some(5_000), STEP), 5_000);
        assert_eq!(next_score(8_000, None, HALF_LIFE_NS), 4_000);
        assert_eq!(next_score(8_000, None, 2 * HALF_LIFE_NS), 2_000);
        assert_eq!(next_score(8_000, Some(0), HALF_LIFE_NS), 4_000);
        assert_eq!(next_score(8_000, Some(2_000), HALF_LIFE_NS), 5_000);
        // Half a half-life: within 6% of 1/sqrt(2).
        let half = decayed(1_000_000, HALF_LIFE_NS / 2) as f64 / 1e6;
        assert!(
            (half - core::f64::consts::FRAC_1_SQRT_2).abs() < 0.05,
            "{half}"
        );
        // Monotonic in time, never negative, no overflow.
        let mut last = u64::MAX;
        for t in (0..70 * HALF_LIFE_NS).step_by((HALF_LIFE_NS / 7) as usize) {
            let d = decayed(u64::MAX, t);
            assert!(d <= last, "at {t}");
            last = d;
        }
        assert_eq!(decayed(u64::MAX, 64 * HALF_LIFE_NS), 0);
        assert_eq!(decayed(0, 3), 0);
    }

    #[test]
    fn a_sample_after_a_quiet_while_weighs_by_the_time_since_the_last() {
        // A replica measured once at 12 ms (a first read's neighbour
        // lookup), then 2 s later at 5 ms: its score follows the new
        // measure (4 half-lives), not one step's worth of decay.
        let mut memory = [Memory::default(); 2];
        step_group(&mut memory, &[fast(10 * MS), fast(12 * MS)], STEP, STEP);
        let later = STEP + 4 * HALF_LIFE_NS;
        step_group(&mut memory, &[fast(10 * MS), fast(5 * MS)], later, STEP);
        let expected = 5 * MS + 7 * MS / 16;
        assert!(memory[1].score_ns.abs_diff(expected) < 50_000, "{memory:?}");
    }

    #[test]
    fn slow_means_over_both_the_ratio_and_the_floor() {
        assert_eq!(limit(200_000), 2_200_000);
        assert_eq!(limit(2 * MS), 4 * MS);
        assert_eq!(limit(20 * MS), 30 * MS);
        assert_eq!(limit(u64::MAX), u64::MAX);
    }

    #[test]
    fn a_stall_is_a_sample_while_it_lasts() {
        let s = Seen {
            stalled_ns: 30 * MS,
            ..fast(MS)
        };
        assert_eq!(s.sample(), Some(30 * MS));
        assert_eq!(fast(MS).sample(), Some(MS));
        assert_eq!(idle().sample(), None);
        // A short wait is no sample: its reply's latency will be.
        let hiccup = Seen {
            stalled_ns: 3 * MS,
            ..idle()
        };
        assert_eq!(hiccup.sample(), None);
        assert_eq!(
            Seen {
                latency_ns: Some(MS),
                ..hiccup
            }
            .sample(),
            Some(MS)
        );
    }

    /// A throttled primary (position 0): stalls of 70 ms every 100 ms while
    /// it gets reads, replicas fast. Returns the memory after `steps`.
    fn run(memory: &mut [Memory; 3], from_ns: u64, steps: u64, primary: impl Fn(u64) -> Seen) {
        for i in 0..steps {
            let now = from_ns + i * STEP;
            let seen = [primary(now), fast(200_000), fast(250_000)];
            step_group(memory, &seen, now, STEP);
        }
    }

    #[test]
    fn a_member_that_stalls_is_slow_and_stays_so_while_its_probes_find_it_slow() {
        let mut memory = [Memory::default(); 3];
        // Healthy at first: 300 us against 200 us is within the floor.
        run(&mut memory, STEP, 50, |_| fast(300_000));
        assert!(memory.iter().all(|m| !m.is_slow()));
        // It stalls: 20 ms with a read waiting and no completion.
        let now = 51 * STEP;
        let stalled = Seen {
            stalled_ns: 20 * MS,
            ..idle()
        };
        let events = step_group(&mut memory, &[stalled, fast(200_000), idle()], now, STEP);
        assert_eq!(
            events.iter().collect::<Vec<_>>(),
            [Event::Slow {
                position: 0,
                score_ns: 20 * MS,
                fastest_ns: 200_000
            }]
        );
        assert_eq!(bits(&memory), slow_bit(0));
        // While slow and unmeasured its score fades; the probe comes once
        // it is under the limit (20 ms to 2.2 ms: 3.2 half-lives), not at
        // PROBE_FIRST_NS already.
        let mut offered_at = 0;
        for i in 1..=600 {
            let t = now + i * STEP;
            let e = step_group(&mut memory, &[idle(), fast(200_000), idle()], t, STEP);
            if e.iter().any(|e| e == Event::ProbeOffered { position: 0 }) {
                offered_at = t;
                break;
            }
        }
        let waited = offered_at - now;
        assert!(
            (1_500 * MS..=1_700 * MS).contains(&waited),
            "offered after {waited} ns"
        );
        assert!(memory[0].score_ns <= limit(200_000));
        assert_eq!(bits(&memory), slow_bit(0) | slow_probe_bit(0));
        // The kernel takes it (bit cleared); the read waits 0.5 ms: not a
        // verdict yet; at 30 ms it is one.
        let taken = |stalled_ns| Seen {
            stalled_ns,
            ..idle()
        };
        let t = offered_at + STEP;
        assert_eq!(
            step_group(&mut memory, &[taken(0), fast(200_000), idle()], t, STEP)
                .iter()
                .count(),
            0
        );
        let t = t + STEP;
        assert_eq!(
            step_group(
                &mut memory,
                &[taken(500_000), fast(200_000), idle()],
                t,
                STEP
            )
            .iter()
            .count(),
            0
        );
        let t = t + STEP;
        let e = step_group(
            &mut memory,
            &[taken(30 * MS), fast(200_000), idle()],
            t,
            STEP,
        );
        assert_eq!(
            e.iter().collect::<Vec<_>>(),
            [Event::ProbeSlow {
                position: 0,
                sample_ns: 30 * MS,
                backoff_ns: 2 * PROBE_FIRST_NS
            }]
        );
        assert_eq!(bits(&memory), slow_bit(0));
        // The backoff doubles with each slow probe, up to PROBE_MOST_NS.
        let mut t = t;
        let mut backoffs = Vec::new();
        while backoffs.len() < 5 {
            t += STEP;
            let offered = matches!(
                memory[0].standing,
                Standing::Slow {
                    probe: Probe::Offered,
                    ..
                }
            );
            let primary = if offered { taken(30 * MS) } else { idle() };
            for e in step_group(&mut memory, &[primary, fast(200_000), idle()], t, STEP).iter() {
                if let Event::ProbeSlow { backoff_ns, .. } = e {
                    backoffs.push(backoff_ns);
                }
            }
        }
        assert_eq!(
            backoffs,
            [4, 8, 8, 8, 8].map(|k| k * PROBE_FIRST_NS).to_vec(),
            "{memory:?}"
        );
    }

    #[test]
    fn a_probe_that_finds_it_fast_ends_its_slowness() {
        let mut memory = [Memory::default(); 3];
        run(&mut memory, STEP, 5, |_| fast(200_000));
        let now = 6 * STEP;
        step_group(
            &mut memory,
            &[fast(50 * MS), fast(200_000), idle()],
            now,
            STEP,
        );
        assert!(memory[0].is_slow());
        let mut t = now;
        while !matches!(
            memory[0].standing,
            Standing::Slow {
                probe: Probe::Offered,
                ..
            }
        ) {
            t += STEP;
            step_group(&mut memory, &[idle(), fast(200_000), idle()], t, STEP);
        }
        // Taken, then answered in 250 us: slow still, until the fifth
        // probe in a row does as well, each in another CFS period.
        let (_, answered) = probe_until_fast(&mut memory, t);
        assert_eq!(answered.len(), PROBES_TO_RECOVER as usize);
        assert!(answered.windows(2).all(|w| w[1] - w[0] >= PROBE_AGAIN_NS));
        assert_eq!(bits(&memory), 0);
    }

    /// Steps a slow primary (position 0 of three) whose every probe is
    /// answered in 250 us until it is fast; (the time then, the times its
    /// probes were answered).
    fn probe_until_fast(memory: &mut [Memory; 3], mut t: u64) -> (u64, Vec<u64>) {
        let taken = Seen {
            probe_offered: false,
            ..fast(250_000)
        };
        let mut answered = Vec::new();
        while memory[0].is_slow() {
            t += STEP;
            let primary = if offering(&memory[0]) { taken } else { idle() };
            if primary == taken {
                answered.push(t);
            }
            let e = step_group(memory, &[primary, fast(200_000), idle()], t, STEP);
            if !memory[0].is_slow() {
                assert_eq!(
                    e.iter().collect::<Vec<_>>(),
                    [Event::Fine {
                        position: 0,
                        sample_ns: 250_000
                    }]
                );
            }
        }
        (t, answered)
    }

    /// A throttled member whose probes fell in the share of each period it
    /// runs is slow again at once: each relapse within the window doubles
    /// the probes its next recovery takes (up to the cap); one a while
    /// after its recovery is a fresh slowness.
    #[test]
    fn a_member_slow_again_soon_after_recovering_takes_twice_the_probes() {
        let mut memory = [Memory::default(); 3];
        run(&mut memory, STEP, 5, |_| fast(200_000));
        let mut t = 6 * STEP;
        let mut needed = Vec::new();
        for fine_for in [STEP, STEP, STEP, STEP, STEP, RELAPSE_WINDOW_NS + STEP] {
            // Fine this long (measured all along), then a stall.
            let fine_until = t + fine_for;
            while t < fine_until {
                t += STEP;
                step_group(&mut memory, &[fast(200_000); 3], t, STEP);
            }
            t += STEP;
            step_group(
                &mut memory,
                &[fast(50 * MS), fast(200_000), idle()],
                t,
                STEP,
            );
            assert!(memory[0].is_slow(), "{memory:?}");
            let (end, answered) = probe_until_fast(&mut memory, t);
            needed.push(answered.len() as u32);
            t = end;
        }
        let p = PROBES_TO_RECOVER;
        assert_eq!(needed, [p, 2 * p, 4 * p, 8 * p, 16 * p, p], "{memory:?}");
        assert_eq!(probes_to_recover(MAX_RELAPSES + 3), 16 * p);
    }

    fn offering(m: &Memory) -> bool {
        matches!(
            m.standing,
            Standing::Slow {
                probe: Probe::Offered,
                ..
            }
        )
    }

    #[test]
    fn a_throttled_member_whose_probes_are_fast_by_turns_stays_slow() {
        let mut memory = [Memory::default(); 2];
        step_group(&mut memory, &[fast(200_000), fast(200_000)], STEP, STEP);
        step_group(&mut memory, &[fast(60 * MS), fast(200_000)], 2 * STEP, STEP);
        let mut t = 2 * STEP;
        let mut probes = 0;
        for _ in 0..6_000 {
            t += STEP;
            let primary = if offering(&memory[0]) {
                probes += 1;
                // Two fast, then one that waits out a throttled period.
                let latency = if probes % 3 == 0 { 60 * MS } else { 250_000 };
                Seen {
                    probe_offered: false,
                    ..fast(latency)
                }
            } else {
                idle()
            };
            step_group(&mut memory, &[primary, fast(200_000)], t, STEP);
            assert!(memory[0].is_slow(), "recovered after probe {probes}");
        }
        // A minute: a probe every few seconds, not every step.
        assert!((6..=60).contains(&probes), "{probes} probes");
    }

    #[test]
    fn an_offered_probe_not_yet_taken_decides_nothing() {
        let mut memory = [Memory::default(); 2];
        step_group(&mut memory, &[fast(200_000), fast(200_000)], STEP, STEP);
        step_group(&mut memory, &[fast(40 * MS), fast(200_000)], 2 * STEP, STEP);
        let offered = Seen {
            probe_offered: true,
            ..idle()
        };
        let mut t = 2 * STEP;
        for _ in 0..600 {
            t += STEP;
            step_group(&mut memory, &[offered, fast(200_000)], t, STEP);
        }
        assert_eq!(bits(&memory), slow_bit(0) | slow_probe_bit(0));
    }

    #[test]
    fn without_a_fast_member_measured_nothing_is_slow() {
        // Only the primary measured (the replicas get nothing): it cannot
        // be slower than itself, however slow.
        let mut memory = [Memory::default(); 3];
        let e = step_group(&mut memory, &[fast(80 * MS), idle(), idle()], STEP, STEP);
        assert_eq!(e.iter().count(), 0);
        // A slow member whose comparison is gone (its group idle beyond
        // MEASURED_FOR_NS) is released.
        step_group(
            &mut memory,
            &[fast(80 * MS), fast(MS), idle()],
            2 * STEP,
            STEP,
        );
        assert!(memory[0].is_slow());
        let later = 2 * STEP + MEASURED_FOR_NS + STEP;
        let e = step_group(
            &mut memory,
            &[idle(), idle(), idle()],
            later,
            MEASURED_FOR_NS,
        );
        assert!(matches!(
            e.iter().next(),
            Some(Event::Fine { position: 0, .. })
        ));
        assert_eq!(bits(&memory), 0);
    }

    #[test]
    fn a_member_out_of_the_choice_is_neither_fast_nor_made_slow() {
        let mut memory = [Memory::default(); 2];
        let ejected = |l| Seen {
            eligible: false,
            ..fast(l)
        };
        // The ejected member's low score is no measure of fast ...
        step_group(&mut memory, &[fast(5 * MS), ejected(100_000)], STEP, STEP);
        assert_eq!(bits(&memory), 0);
        // ... nor is its high one made slow.
        step_group(
            &mut memory,
            &[fast(200_000), ejected(90 * MS)],
            2 * STEP,
            STEP,
        );
        assert_eq!(bits(&memory), 0);
    }

    #[test]
    fn members_no_read_went_to_lately_are_explored_while_the_group_has_reads() {
        let mut memory = [Memory::default(); 3];
        // Nothing measured: an idle group explores nothing.
        assert_eq!(to_explore(&memory, &[idle(); 3], STEP), 0);
        // The primary measured, the replicas never: both offered one read.
        step_group(&mut memory, &[fast(10 * MS), idle(), idle()], STEP, STEP);
        assert_eq!(to_explore(&memory, &[idle(); 3], STEP), 0b110);
        // Not while offered, nor when ejected or drained.
        let offered = Seen {
            explore_offered: true,
            ..idle()
        };
        let out = Seen {
            eligible: false,
            ..idle()
        };
        assert_eq!(to_explore(&memory, &[idle(), offered, out], STEP), 0);
        // Measured by the explored read: left alone for EXPLORE_AFTER_NS.
        step_group(
            &mut memory,
            &[fast(10 * MS), fast(5 * MS), idle()],
            2 * STEP,
            STEP,
        );
        assert_eq!(to_explore(&memory, &[idle(); 3], 2 * STEP), 0b100);
        let later = 2 * STEP + EXPLORE_AFTER_NS + STEP;
        step_group(&mut memory, &[fast(10 * MS), idle(), idle()], later, STEP);
        assert_eq!(to_explore(&memory, &[idle(); 3], later), 0b110);
        // The 2x slower primary is slow against the explored replica.
        assert!(memory[0].is_slow(), "{memory:?}");
    }

    #[test]
    fn an_explore_bit_sends_one_read_to_its_member() {
        use crate::ejection::{explore_bit, explored};
        // No bit: the policy's choice.
        assert_eq!(explored(0, 0b111, 0), 0);
        // Member 2's bit: a read for 0 goes to 2, once taken no more.
        let word = explore_bit(2);
        assert_eq!(explored(0, 0b111, word), 2);
        assert_eq!(take_probe(word, 2), Some(0));
        // The chosen member's own bit: this read measures it.
        assert_eq!(explored(1, 0b111, explore_bit(1) | explore_bit(2)), 1);
        // Only an eligible member (slow, ejected or drained ones are not).
        assert_eq!(explored(0, 0b011, word), 0);
        assert_eq!(explored(0, 0b111, explore_bit(1) | explore_bit(2)), 1);
        // A slow member's offered probe draws a read too (it is eligible
        // while offered), whatever the read's primary.
        let probing = slow_bit(2) | slow_probe_bit(2);
        let usable = eligible(0b111, probing);
        assert_eq!(explored(0, usable, probing), 2);
        assert_eq!(explored(0, eligible(0b111, slow_bit(2)), slow_bit(2)), 0);
        // Every position, every chosen member: the first wanted one.
        for want in 0u64..256 {
            for chosen in 0..MAX_GROUP_MEMBERS {
                let word = want << crate::ejection::EXPLORE_SHIFT;
                let expected = if want == 0 || want & (1 << chosen) != 0 {
                    chosen
                } else {
                    want.trailing_zeros() as usize
                };
                assert_eq!(explored(chosen, 0xff, word), expected, "{want:#b} {chosen}");
            }
        }
    }

    #[test]
    fn the_policy_skips_slow_members_unless_all_are() {
        let usable = 0b111;
        assert_eq!(eligible(usable, 0), 0b111);
        assert_eq!(eligible(usable, slow_bit(0)), 0b110);
        // A slow member with its probe offered may be chosen.
        assert_eq!(eligible(usable, slow_bit(0) | slow_probe_bit(0)), 0b111);
        // Every usable member slow: all of them.
        let all = slow_bit(0) | slow_bit(1) | slow_bit(2);
        assert_eq!(eligible(usable, all), 0b111);
        // Ejected members are out either way; slow ones among the rest.
        let ejected = crate::ejection::ejected_bit(1);
        assert_eq!(eligible(usable, ejected | slow_bit(0)), 0b100);
        assert_eq!(eligible(usable, ejected | slow_bit(0) | slow_bit(2)), 0b101);
        // A slow bit on a member outside `usable` changes nothing.
        assert_eq!(eligible(0b011, slow_bit(2)), 0b011);
    }

    #[test]
    fn taking_a_slow_probe_makes_the_member_slow_again() {
        let word = slow_bit(1) | slow_probe_bit(1);
        let taken = take_probe(word, 1).unwrap();
        assert_eq!(taken, slow_bit(1));
        assert_eq!(eligible(0b11, taken), 0b01);
        assert_eq!(take_probe(taken, 1), None);
        // A half-open member's probe is unchanged: ejected again.
        let half_open = crate::ejection::probe_bit(0);
        assert_eq!(
            take_probe(half_open, 0),
            Some(crate::ejection::ejected_bit(0))
        );
    }
}
