//! `selector run`: attach, steer until a signal or --duration, stop
//! gracefully, detach and print the totals.

use std::{net::SocketAddrV4, time::Duration};

use anyhow::Result;
use tokio::{
    signal::unix::{Signal, SignalKind, signal},
    time::{Instant, MissedTickBehavior, interval, sleep, sleep_until},
};

use super::{
    RunArgs,
    control_server::{ControlCall, ControlServer},
};
use crate::{Selector, control::SettingsInForce, neighbours, sys, telemetry};

/// How often a stopping agent checks whether the redirected reads are done.
const STOP_POLL: Duration = Duration::from_millis(20);

/// Attaches, then sweeps and prints until a signal or the duration ends;
/// then stops steering, waits for the redirected reads in flight, and detaches.
pub async fn run(args: RunArgs) -> Result<()> {
    let settings = args.settings()?;
    crate::preflight::check_host()?;
    settings.check_interface()?;
    // Handlers first: a signal during attach still ends in a clean stop.
    let mut signals = StopSignals::new()?;
    let mut control = ControlServer::bind(&settings.iface)?;
    let selector = Selector::attach(&settings)?;
    let mut agent = Agent::new(selector, &args)?;
    agent.steer(&mut signals, &mut control, args.duration).await;
    agent.stop(&mut signals, &mut control).await?;
    agent.detach()
}

/// SIGINT and SIGTERM, either of which asks the agent to stop.
struct StopSignals {
    interrupt: Signal,
    terminate: Signal,
}

impl StopSignals {
    fn new() -> Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

/// The attached selector and what the loops around it need.
struct Agent {
    selector: Selector,
    /// The backends' next hops the agent keeps resolved.
    neighbours: neighbours::ManagedNeighbours,
    interval: Duration,
    sweep_every: Duration,
    quiet: bool,
    /// The snapshot of the last table print, for interval rates.
    last: telemetry::Snapshot,
}

impl Agent {
    /// Has the backends' next hops kept resolved and prints the attached line.
    fn new(selector: Selector, args: &RunArgs) -> Result<Self> {
        let settings = &selector.settings;
        let addrs: Vec<SocketAddrV4> = selector.backends.iter().map(|b| b.addr).collect();
        let (neighbours, unresolved) =
            neighbours::keep_resolved(&addrs, Duration::from_millis(500))?;
        println!(
            "selector: attached to {} ({} ingress), {} backends in {} groups, {}, timeout {} ms, grace {} ms, mark {:#010x}",
            settings.iface,
            settings.ingress.name(),
            addrs.len(),
            settings.groups.len(),
            SettingsInForce::from(settings).tunables(),
            settings.timeout.as_millis(),
            settings.grace.as_millis(),
            settings.mark,
        );
        if !unresolved.is_empty() {
            println!(
                "selector: next hop not resolved yet for {unresolved:?} (the first redirect to them waits for resolution)"
            );
        }
        let interval = Duration::from_millis(args.interval);
        // Sweep often enough that an expiry is at most a quarter timeout late.
        let sweep_every = interval
            .min(settings.timeout / 4)
            .max(Duration::from_millis(1));
        let last = selector.snapshot()?;
        Ok(Self {
            selector,
            neighbours,
            interval,
            sweep_every,
            quiet: args.quiet,
            last,
        })
    }

    /// Steers until a signal or the end of `duration` (seconds).
    async fn steer(
        &mut self,
        signals: &mut StopSignals,
        control: &mut ControlServer,
        duration: Option<f64>,
    ) {
        let mut sweep_tick = interval(self.sweep_every);
        let mut print_tick = ticks_after(self.interval);
        let until_deadline = async {
            match duration {
                Some(secs) => sleep(Duration::from_secs_f64(secs)).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(until_deadline);
        loop {
            tokio::select! {
                _ = signals.recv() => return,
                _ = &mut until_deadline => return,
                _ = sweep_tick.tick() => self.sweep(),
                call = control.next_call() => self.answer(call, false),
                _ = print_tick.tick() => self.print_table(),
            }
        }
    }

    /// Stops making redirects, then waits, sweeping as usual, until no
    /// redirected read is in flight or timeout + grace has passed: a detach
    /// now would leave their replies unrewritten, and the application drops
    /// a reply from a replica it did not ask. A second signal cuts it short.
    async fn stop(&mut self, signals: &mut StopSignals, control: &mut ControlServer) -> Result<()> {
        self.selector.stop_steering()?;
        let mut waiting = self.selector.redirected_in_flight()? + self.selector.hedges_in_flight();
        print_stopping(waiting);
        if waiting == 0 {
            return Ok(());
        }
        let settings = &self.selector.settings;
        let give_up = sleep_until(Instant::now() + settings.timeout + settings.grace);
        tokio::pin!(give_up);
        let mut sweep_tick = interval(self.sweep_every);
        let mut poll_tick = interval(STOP_POLL);
        let mut print_tick = ticks_after(self.interval);
        loop {
            tokio::select! {
                _ = signals.recv() => {
                    println!("selector: second signal: detaching with {waiting} redirected reads in flight");
                    return Ok(());
                }
                _ = &mut give_up => {
                    println!("selector: timeout and grace passed: detaching with {waiting} redirected reads in flight");
                    return Ok(());
                }
                _ = sweep_tick.tick() => self.sweep(),
                _ = poll_tick.tick() => {
                    waiting = self.selector.redirected_in_flight()? + self.selector.hedges_in_flight();
                    if waiting == 0 {
                        return Ok(());
                    }
                }
                call = control.next_call() => self.answer(call, true),
                _ = print_tick.tick() => print_stopping(waiting),
            }
        }
    }

    /// A last sweep, the totals, and the detach (dropping the selector).
    fn detach(self) -> Result<()> {
        let Self {
            mut selector,
            neighbours,
            ..
        } = self;
        selector.sweep(sys::monotonic_ns())?;
        let end = selector.snapshot()?;
        let totals = telemetry::totals(&selector.backends, &end);
        println!(
            "selector: detaching from {}; totals:",
            selector.settings.iface
        );
        print!("{}", telemetry::render_summary(&totals));
        print!(
            "{}",
            telemetry::render_footer(
                end.inflight,
                &totals,
                &telemetry::passed_counts(&end.passed)
            )
        );
        if selector.settings.hedging.enabled() {
            let counts: Vec<_> = totals.iter().map(|t| (t.backend, t.hedges)).collect();
            print!(
                "{}",
                crate::hedging::render(&selector.settings.hedging, &counts)
            );
        }
        drop(selector);
        neighbours.release();
        Ok(())
    }

    fn sweep(&mut self) {
        // A failed sweep is retried next tick; the data path goes on.
        if let Err(e) = self.selector.sweep(sys::monotonic_ns()) {
            log::warn!("sweep failed: {e:#}");
        }
        if let Err(e) = self.selector.refresh_hedge_delays() {
            log::warn!("reading latencies for --hedge-after auto failed: {e:#}");
        }
        self.selector.flush_kernel_logs();
    }

    fn answer(&mut self, call: ControlCall, stopping: bool) {
        call.answer(&mut self.selector, stopping);
    }

    fn print_table(&mut self) {
        let now = match self.selector.snapshot() {
            Ok(now) => now,
            Err(e) => {
                log::warn!("reading the maps failed: {e:#}");
                return;
            }
        };
        if !self.quiet {
            let mut table = telemetry::render_table(&self.selector.backends, &self.last, &now);
            if self.selector.settings.hedging.enabled() {
                table +=
                    &crate::hedging::render_interval(&self.selector.backends, &self.last, &now);
            }
            println!("{table}");
        }
        self.last = now;
    }
}

fn print_stopping(waiting: usize) {
    println!("selector: stopping: {waiting} redirected reads in flight");
}

/// An interval whose first tick is one period from now (tokio's fires at once).
fn ticks_after(period: Duration) -> tokio::time::Interval {
    let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticks
}
