//! What `/healthz` and `/readyz` on the metrics endpoint answer.
//!
//! The agent's owner loop (`crate::agent::run`) records in a [`Health`] when it
//! turns, when a sweep completes, whether the programs are attached (checked
//! every second, see [`crate::datapath::attachment`]),
//! whether the last reload was refused and whether it is stopping; the
//! endpoint reads a copy and decides with the pure functions [`liveness`]
//! and [`readiness`]:
//! - live: the loop has turned within [`LIVENESS_BOUND`] (it turns at least
//!   every 100 ms, for the next hops);
//! - ready: the programs are attached, a sweep completed within
//!   [`READY_SWEEP_PERIODS`] sweep periods (at least [`READY_SWEEP_FLOOR`]),
//!   the configuration file's settings are in force (the last reload was
//!   not refused), and the agent is not stopping.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// Longest time the owner loop may go without turning and still be live.
pub const LIVENESS_BOUND: Duration = Duration::from_secs(10);
/// A sweep is recent within this many sweep periods ...
pub const READY_SWEEP_PERIODS: u32 = 5;
/// ... and never less than this (a 1 ms period on a busy host jitters).
pub const READY_SWEEP_FLOOR: Duration = Duration::from_secs(1);

/// What the owner loop last recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthState {
    /// When the owner loop last turned.
    pub last_turn: Instant,
    /// Why the programs are not attached to the interface; `None` when
    /// they are.
    pub not_attached: Option<String>,
    /// When the last sweep completed without error.
    pub last_sweep: Option<Instant>,
    /// How often the loop sweeps.
    pub sweep_period: Duration,
    /// Why the last reload was refused; the previous configuration runs.
    pub reload_refused: Option<String>,
    /// The agent has stopped steering and is on its way out.
    pub stopping: bool,
}

impl HealthState {
    /// Not attached yet, not swept yet, the loop just turned.
    pub fn new(now: Instant, sweep_period: Duration) -> Self {
        Self {
            last_turn: now,
            not_attached: Some("the agent has not attached yet".into()),
            last_sweep: None,
            sweep_period,
            reload_refused: None,
            stopping: false,
        }
    }
}

/// An answer to a probe: healthy or not, and a short text saying why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub ok: bool,
    pub body: String,
}

/// `/healthz`: the owner loop is turning.
pub fn liveness(state: &HealthState, now: Instant) -> Verdict {
    let since = now.saturating_duration_since(state.last_turn);
    if since <= LIVENESS_BOUND {
        Verdict {
            ok: true,
            body: "ok: the agent's loop is turning\n".into(),
        }
    } else {
        Verdict {
            ok: false,
            body: format!(
                "not live: the agent's loop has not turned for {} ms (bound {} ms)\n",
                since.as_millis(),
                LIVENESS_BOUND.as_millis()
            ),
        }
    }
}

/// How recent the last sweep must be for [`readiness`].
pub fn sweep_bound(sweep_period: Duration) -> Duration {
    (sweep_period * READY_SWEEP_PERIODS).max(READY_SWEEP_FLOOR)
}

/// `/readyz`: attached, swept recently, the configuration in force, not
/// stopping; else everything that is missing, one per line.
pub fn readiness(state: &HealthState, now: Instant) -> Verdict {
    let mut missing = Vec::new();
    if state.stopping {
        missing.push("stopping: the agent no longer steers".to_string());
    }
    if let Some(why) = &state.not_attached {
        missing.push(why.clone());
    }
    let bound = sweep_bound(state.sweep_period);
    match state.last_sweep {
        None => missing.push("no sweep completed yet".to_string()),
        Some(at) if now.saturating_duration_since(at) > bound => missing.push(format!(
            "no sweep completed for {} ms (bound {} ms)",
            now.saturating_duration_since(at).as_millis(),
            bound.as_millis()
        )),
        Some(_) => {}
    }
    if let Some(why) = &state.reload_refused {
        missing.push(format!(
            "configuration not applied: the last reload was refused ({why}); the previous one runs"
        ));
    }
    if missing.is_empty() {
        Verdict {
            ok: true,
            body: "ready: attached, swept recently, configuration applied\n".into(),
        }
    } else {
        Verdict {
            ok: false,
            body: format!("not ready: {}\n", missing.join("; ")),
        }
    }
}

/// The state shared between the owner loop (writer) and the endpoint.
#[derive(Clone, Debug)]
pub struct Health(Arc<Mutex<HealthState>>);

impl Health {
    pub fn new(sweep_period: Duration) -> Self {
        Self(Arc::new(Mutex::new(HealthState::new(
            Instant::now(),
            sweep_period,
        ))))
    }

    /// Changes the state (a poisoned lock still holds a usable state).
    pub fn update(&self, change: impl FnOnce(&mut HealthState)) {
        change(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// The loop turned now.
    pub fn turned(&self) {
        self.update(|s| s.last_turn = Instant::now());
    }

    /// A sweep completed now.
    pub fn swept(&self) {
        self.update(|s| s.last_sweep = Some(Instant::now()));
    }

    pub fn state(&self) -> HealthState {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: Duration = Duration::from_millis(250);

    fn running(now: Instant) -> HealthState {
        HealthState {
            not_attached: None,
            last_sweep: Some(now - PERIOD),
            ..HealthState::new(now - Duration::from_millis(50), PERIOD)
        }
    }

    #[test]
    fn a_running_agent_is_live_and_ready() {
        let now = Instant::now() + Duration::from_secs(60);
        let state = running(now);
        assert!(liveness(&state, now).ok);
        let ready = readiness(&state, now);
        assert!(ready.ok, "{ready:?}");
        assert!(ready.body.starts_with("ready"), "{ready:?}");
    }

    #[test]
    fn a_stale_sweep_makes_it_unready_but_not_dead() {
        let now = Instant::now() + Duration::from_secs(60);
        // 5 periods of 250 ms: 1.25 s.
        let state = HealthState {
            last_sweep: Some(now - Duration::from_millis(1300)),
            ..running(now)
        };
        let ready = readiness(&state, now);
        assert!(!ready.ok);
        assert_eq!(
            ready.body,
            "not ready: no sweep completed for 1300 ms (bound 1250 ms)\n"
        );
        assert!(liveness(&state, now).ok);
        let just = HealthState {
            last_sweep: Some(now - Duration::from_millis(1250)),
            ..running(now)
        };
        assert!(readiness(&just, now).ok);
        // A tiny sweep period is held to the floor.
        assert_eq!(sweep_bound(Duration::from_millis(1)), READY_SWEEP_FLOOR);
    }

    #[test]
    fn each_missing_condition_is_named() {
        let now = Instant::now() + Duration::from_secs(60);
        let starting = HealthState::new(now, PERIOD);
        let ready = readiness(&starting, now);
        assert!(!ready.ok);
        assert_eq!(
            ready.body,
            "not ready: the agent has not attached yet; no sweep completed yet\n"
        );
        let gone = HealthState {
            not_attached: Some("interface eth0 is gone".into()),
            ..running(now)
        };
        let ready = readiness(&gone, now);
        assert_eq!(
            (ready.ok, ready.body.as_str()),
            (false, "not ready: interface eth0 is gone\n")
        );
        let refused = HealthState {
            reload_refused: Some("x.toml:3: threshold: must be at least 1".into()),
            ..running(now)
        };
        let ready = readiness(&refused, now);
        assert!(!ready.ok);
        assert!(
            ready
                .body
                .contains("configuration not applied: the last reload was refused (x.toml:3"),
            "{ready:?}"
        );
        let stopping = HealthState {
            stopping: true,
            ..running(now)
        };
        let ready = readiness(&stopping, now);
        assert!(!ready.ok && ready.body.contains("stopping"), "{ready:?}");
    }

    #[test]
    fn a_loop_that_stopped_turning_is_not_live() {
        let now = Instant::now() + Duration::from_secs(60);
        let state = HealthState {
            last_turn: now - Duration::from_secs(11),
            ..running(now)
        };
        let live = liveness(&state, now);
        assert!(!live.ok);
        assert_eq!(
            live.body,
            "not live: the agent's loop has not turned for 11000 ms (bound 10000 ms)\n"
        );
        let edge = HealthState {
            last_turn: now - LIVENESS_BOUND,
            ..running(now)
        };
        assert!(liveness(&edge, now).ok);
    }
}
