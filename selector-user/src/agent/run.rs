//! The agent's owner loop (`selector run`): attach, steer until a signal or --duration, stop
//! gracefully, detach and print the totals. With `--pin` the agent leaves
//! everything attached and pinned when it exits, for the next agent to adopt.
//!
//! Over 500 lines: the owner loop is one `select!` over signals, the
//! control socket, reloads, sweeps, hedge refreshes, ejection checks and
//! printing, and its start and stop sequences; each branch calls into the
//! module that owns the concern.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result, bail};
use tokio::{
    signal::unix::{Signal, SignalKind, signal},
    time::{Instant, MissedTickBehavior, interval, sleep, sleep_until},
};

use crate::{
    agent::endpoint::{MetricsServer, Source, Sources},
    agent::health::Health,
    agent::reload::{Reloader, describe},
    agent::sd_notify::Notifier,
    agent::{
        control_server::{ControlCall, ControlServer},
        render,
    },
    api::{NetnsInfo, RoutedElsewhere},
    config::file::Options,
    config::file::RunConfig,
    config::settings::sweep_period,
    datapath::Selector,
    datapath::next_hops::NextHops,
    datapath::regroup::{GroupChanges, GroupTable},
    host::neighbours,
    host::netns::NetNs,
    host::route_events::RouteEvents,
    host::sys,
    telemetry,
};

/// How often the next hops' Ethernet addresses are re-read when the
/// kernel's announcements of changes (`host::route_events`) are not to be
/// had: a neighbour that changes is followed within this.
const NEXT_HOP_REFRESH: Duration = Duration::from_millis(100);

/// With the announcements, the next hops are re-read when they say so, and
/// this often besides (a backstop: none is known to be lost unannounced).
const NEXT_HOP_BACKSTOP: Duration = Duration::from_secs(5);

/// How often the agent checks that its programs are still attached.
const ATTACHMENT_CHECK: Duration = Duration::from_secs(1);

/// How often outlier ejection looks at the failure counts while something
/// is in motion (a failure counted, a member failing, ejected or
/// half-open): a replica answering errors is ejected within this of its
/// Nth error in a row (reading a few shared words per group, no system
/// call but one map read per group).
const EJECTION_CHECK: Duration = Duration::from_millis(10);
/// How often it looks while nothing is (`Selector::ejection_settled`): the
/// reply path marks a member failing on its own, so only the bookkeeping
/// waits; and every wakeup of an idle agent costs a busy host's other
/// traffic (100 a second cost TCP bulk about 3% on a 2-CPU VM).
const EJECTION_IDLE_CHECK: Duration = Duration::from_millis(250);
/// How often the memory of slowness measures the members while reads
/// flow (`crate::datapath::slowness`): a stall is seen within two of
/// these, and a probe's result within one.
const SLOWNESS_CHECK: Duration = Duration::from_millis(10);
/// ... and while nothing moves (no request issued or completed, none slow).
const SLOWNESS_IDLE_CHECK: Duration = Duration::from_millis(250);
/// How often a stopping agent checks whether the redirected reads are done.
const STOP_POLL: Duration = Duration::from_millis(20);

/// Whether the agent serves one attachment (the process is the agent) or
/// is one of several attachments of one agent (`selector run
/// --attachment`), each on a thread of its own.
pub enum Role {
    Alone,
    Member(Member),
}

/// An attachment of an agent serving several.
pub struct Member {
    /// Its name in the metrics (`attachment` label) and the probes.
    pub label: String,
    /// Where it registers with the agent's one metrics endpoint.
    pub sources: Sources,
    /// What the agent asks of all its attachments (it takes the signals
    /// for all).
    pub stop: tokio::sync::watch::Receiver<Stops>,
}

/// The agent's word to its attachments: stop steering (a signal, or
/// another attachment ended), and how many signals came, of which one that
/// comes while an attachment waits for its redirected reads cuts the wait
/// short, as for an agent of one attachment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stops {
    pub all: bool,
    pub signals: u32,
}

/// Attaches, then sweeps and prints until a signal or the duration ends;
/// then stops steering, waits for the redirected reads in flight, and detaches.
/// `config_file` and `flags` are what a reload reads again.
pub async fn run(config: RunConfig, config_file: Option<PathBuf>, flags: Options) -> Result<()> {
    run_as(config, config_file, flags, Role::Alone).await
}

/// [`run`], as `role` says: a member enters its namespace on its own
/// thread, serves its metrics and probes through the agent's endpoint, and
/// stops also when told.
pub async fn run_as(
    mut config: RunConfig,
    config_file: Option<PathBuf>,
    flags: Options,
    role: Role,
) -> Result<()> {
    let netns = match &config.netns {
        Some(path) => Some(NetNs::open(path)?),
        None => None,
    };
    if let (Some(ns), Some(dir)) = (&netns, &config.pin) {
        bail!(
            "--netns {} with --pin {}: not supported (pins are named by interface, and pods' interfaces share names); run without --pin",
            ns.path().display(),
            dir.display()
        );
    }
    crate::host::preflight::check_host()?;
    // Bound before entering --netns: the metrics and probes are served in
    // the namespace the agent was started in.
    let metrics = match (&role, config.metrics_addr) {
        (Role::Alone, Some(addr)) => Some(MetricsServer::bind(addr).await?),
        _ => None,
    };
    // From here on, every interface named and socket opened is the
    // namespace's (see `crate::host::netns`).
    let netns_info = match &netns {
        Some(ns) => {
            match role {
                Role::Alone => ns.enter()?,
                Role::Member(_) => ns.enter_this_thread()?,
            }
            Some(NetnsInfo {
                path: ns.path().display().to_string(),
                id: ns.id()?,
            })
        }
        None => None,
    };
    match &netns_info {
        Some(ns) => crate::host::interface::check(&config.settings)
            .with_context(|| format!("in the network namespace of --netns {}", ns.path))?,
        None => crate::host::interface::check(&config.settings)?,
    }
    // CAP_NET_RAW serves hedging's raw sockets only: opened now, in the
    // namespace the agent steers, and kept for whenever hedging is on (at
    // start or after a reload); then the capability goes, before any
    // thread starts (capabilities are per thread).
    let can_hedge = crate::host::preflight::has_capability(crate::host::preflight::CAP_NET_RAW)?;
    if can_hedge {
        let s = &config.settings;
        crate::hedging::wire::HedgeSockets::open_at_start(&s.iface, s.mark)?;
        crate::host::preflight::drop_capability(crate::host::preflight::CAP_NET_RAW)?;
    } else if let Some(warning) = config.without_implied_hedging() {
        log::warn!("{warning}");
    }
    let settings = &config.settings;
    // Handlers first: a signal during attach still ends in a clean stop.
    let mut signals = match &role {
        Role::Alone => StopSignals::os()?,
        Role::Member(member) => StopSignals::Told {
            stops: member.stop.clone(),
            signals_seen: 0,
        },
    };
    // SIGHUP reloads the config file (and no longer ends the process).
    let mut hangups = signal(SignalKind::hangup())?;
    let mut control = ControlServer::bind(&settings.iface)?;
    let (mut selector, groups) = match &config.pin {
        Some(dir) => Selector::attach_pinned(settings, dir, &config.group_names)?,
        None => (
            Selector::attach(settings)?,
            GroupChanges::none(GroupTable::from_start(
                &settings.groups,
                &config.group_names,
            )),
        ),
    };
    selector.netns = netns_info;
    let reloader = Reloader::new(config_file, flags, &config, groups.table.clone(), can_hedge);
    // systemd hears from an agent of one attachment only (the agent's
    // READY would otherwise come from each).
    let notifier = match role {
        Role::Alone => Notifier::from_env(),
        Role::Member(_) => Notifier::default(),
    };
    let mut agent = Agent::new(selector, reloader, &config, notifier)?;
    // Scrapes are answered by the main loop, like `selector status`, at
    // most once per `SCRAPE_REUSE` however many arrive.
    if let Some(metrics) = metrics {
        log::info!(
            "metrics at http://{}/metrics (probes: /healthz, /readyz)",
            metrics.local_addr()?
        );
        let sources = Sources::alone();
        sources.add(Source::of_caller(
            None,
            control.local_caller(),
            agent.health.clone(),
        ));
        tokio::spawn(metrics.serve_sources(sources));
    }
    if let Role::Member(member) = &role {
        member.sources.add(Source::of_caller(
            Some(member.label.clone()),
            control.local_caller(),
            agent.health.clone(),
        ));
    }
    if !groups.is_empty() {
        // Adopted pins whose groups an earlier agent's reloads had changed.
        log::info!("groups applied over the pinned ones: {}", describe(&groups));
    }
    agent.notifier.ready(&agent.summary());
    let failure = agent
        .steer(
            &mut signals,
            &mut hangups,
            &mut control,
            config.duration.and_then(crate::config::file::run_duration),
        )
        .await;
    agent.health.update(|h| h.stopping = true);
    if agent.selector.pinned().is_some() {
        // Pinned: the programs steer on, and the next agent sweeps.
        agent
            .notifier
            .stopping("exiting: the pinned programs steer on");
        agent.leave_pinned()?;
    } else {
        agent
            .notifier
            .stopping("stopping: waiting for the redirected reads in flight");
        agent.stop(&mut signals, &mut control).await?;
        agent.detach()?;
    }
    // A failure ends the run like a signal, then exits non-zero.
    failure.map_or(Ok(()), Err)
}

/// What asks the agent to stop: SIGINT or SIGTERM, or for an attachment of
/// several, the agent's word ([`Stops`]).
enum StopSignals {
    Os {
        interrupt: Signal,
        terminate: Signal,
    },
    Told {
        stops: tokio::sync::watch::Receiver<Stops>,
        /// The signals already accounted for.
        signals_seen: u32,
    },
}

impl StopSignals {
    fn os() -> Result<Self> {
        Ok(Self::Os {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// Until asked to stop steering (a stop asked before, while attaching
    /// say, is taken at once).
    async fn recv(&mut self) {
        match self {
            Self::Os { .. } => self.signal().await,
            Self::Told {
                stops,
                signals_seen,
            } => {
                let seen = *signals_seen;
                if let Ok(asked) = stops.wait_for(|s| s.all || s.signals > seen).await {
                    *signals_seen = asked.signals;
                }
            }
        }
    }

    /// The signals so far are the one that stopped steering, or came
    /// before the wait for the redirected reads: only a later one cuts it
    /// short ([`Self::signal`]).
    fn draining(&mut self) {
        if let Self::Told {
            stops,
            signals_seen,
        } = self
        {
            *signals_seen = stops.borrow().signals;
        }
    }

    /// Until a signal (for an attachment of several, one the agent passes
    /// on after [`Self::draining`]); not another attachment's end.
    async fn signal(&mut self) {
        match self {
            Self::Os {
                interrupt,
                terminate,
            } => {
                tokio::select! {
                    _ = interrupt.recv() => {}
                    _ = terminate.recv() => {}
                }
            }
            Self::Told {
                stops,
                signals_seen,
            } => {
                let seen = *signals_seen;
                match stops.wait_for(|s| s.signals > seen).await {
                    Ok(asked) => *signals_seen = asked.signals,
                    // The agent is gone: no signal will be passed on.
                    Err(_) => std::future::pending().await,
                }
            }
        }
    }
}

/// The attached selector and what the loops around it need.
struct Agent {
    selector: Selector,
    /// The backends' next hops the agent keeps resolved.
    neighbours: neighbours::ManagedNeighbours,
    /// Their Ethernet addresses, as published to the kernel.
    next_hops: NextHops,
    /// The kernel's announcements of neighbour and route changes, taken
    /// by the owner loop (None: not subscribed, the loop polls).
    route_events: Option<RouteEvents>,
    /// When the next hops were last re-read.
    next_hops_read_at: Instant,
    /// The config file, start flags and group tables, for reloads.
    reloader: Reloader,
    interval: Duration,
    sweep_every: Duration,
    quiet: bool,
    /// Whether tables (live and final) are printed at all.
    tables: bool,
    /// The snapshot at the end of the last interval, for interval rates.
    last: telemetry::Snapshot,
    /// The interval tails so far, for the table, status and metrics.
    tails: telemetry::TailHistory,
    /// What `/healthz` and `/readyz` read.
    health: Health,
    /// systemd's notification socket (`Type=notify`), if any.
    notifier: Notifier,
    /// The last attachment check failed (warned once).
    attachment_unknown: bool,
}

impl Agent {
    /// Has the backends' next hops kept resolved and prints the attached line.
    fn new(
        mut selector: Selector,
        reloader: Reloader,
        config: &RunConfig,
        notifier: Notifier,
    ) -> Result<Self> {
        let addrs: Vec<SocketAddr> = selector.backends.iter().map(|b| b.addr).collect();
        let (neighbours, unresolved) =
            neighbours::keep_resolved(&addrs, Duration::from_millis(500))?;
        // Published before the agent says it is attached: from then on
        // every redirect to a resolved next hop takes the direct path.
        let mut next_hops = NextHops::new(&selector.settings.iface)?;
        // Subscribed before the first read, so no change falls between.
        let ifindex = crate::host::interface::index(&selector.settings.iface)?;
        let route_events = RouteEvents::subscribe(ifindex)
            .inspect_err(|e| {
                log::warn!(
                    "next hops re-read every {} ms: {e:#}",
                    NEXT_HOP_REFRESH.as_millis()
                )
            })
            .ok();
        next_hops.refresh(&mut selector)?;
        let settings = &selector.settings;
        let pinned = match selector.pinned() {
            Some(dir) if selector.adopted() => {
                format!(", adopted the pins under {}", dir.display())
            }
            Some(dir) => format!(", pinned under {}", dir.display()),
            None => String::new(),
        };
        let why = selector
            .ingress_choice
            .as_ref()
            .map_or(String::new(), |c| format!("; {c}"));
        let tc = selector.tc_attach.map_or("", |t| t.name());
        let netns = selector.netns.as_ref().map_or(String::new(), |n| {
            format!(" in netns {} ({})", n.path, n.id)
        });
        log::info!(
            "attached to {}{netns} ({} ingress, tc by {tc}{why}), {} backends in {}, {}, timeout {} ms, grace {} ms, mark {:#010x}{pinned}",
            settings.iface,
            selector.reply_path.name(),
            addrs.len(),
            settings.groups_phrase(),
            settings.tunables.describe(),
            settings.timeout.as_millis(),
            settings.grace.as_millis(),
            settings.mark,
        );
        // After the start line, which scripts wait for.
        for warning in settings.warnings() {
            log::warn!("{warning}");
        }
        if !unresolved.is_empty() {
            log::info!(
                "next hop not resolved yet for {unresolved:?} (the first redirect to them waits for resolution)"
            );
        }
        warn_routed_elsewhere(&[], &selector.routed_elsewhere, &settings.iface);
        let interval = config.interval;
        let sweep_every = sweep_period(interval, settings.timeout, settings.heartbeat_bound);
        let last = selector.snapshot()?;
        let health = Health::new(sweep_every);
        health.update(|h| h.not_attached = None);
        Ok(Self {
            selector,
            neighbours,
            next_hops,
            route_events,
            next_hops_read_at: Instant::now(),
            reloader,
            interval,
            sweep_every,
            quiet: config.quiet,
            tables: config.tables,
            last,
            tails: telemetry::TailHistory::default(),
            health,
            notifier,
            attachment_unknown: false,
        })
    }

    /// One line for systemd's `STATUS=`: what is steered and how.
    fn summary(&self) -> String {
        let settings = &self.selector.settings;
        format!(
            "steering {}: {} backends in {}, {}",
            settings.iface,
            self.selector.backends.len(),
            settings.groups_phrase(),
            settings.tunables.describe()
        )
    }

    /// Steers until a signal or the end of `duration`, or until the
    /// agent fails (returned).
    async fn steer(
        &mut self,
        signals: &mut StopSignals,
        hangups: &mut Signal,
        control: &mut ControlServer,
        duration: Option<Duration>,
    ) -> Option<anyhow::Error> {
        let mut sweep_tick = interval(self.sweep_every);
        let mut interval_tick = ticks_after(self.interval);
        let mut route_events = self.route_events.take();
        // A re-read the announcements asked for, not yet made.
        let mut next_hops_due_at: Option<Instant> = None;
        let mut next_hop_tick = ticks_after(match route_events {
            Some(_) => NEXT_HOP_BACKSTOP,
            None => NEXT_HOP_REFRESH,
        });
        let mut watchdog_tick = self.notifier.watchdog_period().map(ticks_after);
        let mut attachment_tick = ticks_after(ATTACHMENT_CHECK);
        let mut ejection_period = self.ejection_period();
        let mut ejection_tick = ticks_after(ejection_period);
        let mut slowness_period = SLOWNESS_CHECK;
        let mut slowness_tick = ticks_after(slowness_period);
        let until_deadline = async {
            match duration {
                Some(duration) => sleep(duration).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(until_deadline);
        loop {
            self.health.turned();
            // `--hedge-after auto`: the delays follow the latencies, first
            // every few ms until estimated (`hedge_auto`); no timer without.
            let hedge_refresh = self.selector.hedge_refresh_due();
            let until_hedge_refresh = async {
                match hedge_refresh {
                    Some(at) => sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            let route_changes = async {
                match route_events.as_mut() {
                    Some(events) => events.changed().await,
                    None => std::future::pending().await,
                }
            };
            let next_hops_due = async {
                match next_hops_due_at {
                    Some(at) => sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = signals.recv() => return None,
                _ = &mut until_deadline => return None,
                _ = until_hedge_refresh => self.refresh_hedge_delays(),
                _ = sweep_tick.tick() => {
                    if let Some(failure) = self.hedge_failure() {
                        return Some(failure);
                    }
                    self.sweep();
                    // At once: a member whose expiries just made it
                    // failing would otherwise get the reads the expiries
                    // made room for until the next check.
                    self.check_ejection();
                    self.retire_finished();
                }
                call = control.next_call() => {
                    // Checked first, so no status says hedging is on once
                    // it has failed: answered as a stopping agent does.
                    let failure = self.hedge_failure();
                    if self.answer(call, failure.is_some()) {
                        sweep_tick = interval(self.sweep_every);
                    }
                    if failure.is_some() {
                        return failure;
                    }
                }
                _ = hangups.recv() => {
                    match self.reload() {
                        Ok(message) => log::info!("{message}"),
                        Err(e) => log::info!("reload refused, running configuration kept: {e:#}"),
                    }
                    sweep_tick = interval(self.sweep_every);
                }
                _ = interval_tick.tick() => self.end_interval(),
                _ = next_hop_tick.tick() => self.refresh_next_hops(),
                changes = route_changes => {
                    if changes.routes {
                        self.next_hops.routes_changed();
                    }
                    // At once, unless the last re-read was this recent: a
                    // storm of announcements (a routing daemon's) costs one
                    // re-read per period.
                    let at = self.next_hops_read_at + NEXT_HOP_REFRESH;
                    next_hops_due_at = Some(next_hops_due_at.map_or(at, |due| due.min(at)));
                }
                _ = next_hops_due => {
                    next_hops_due_at = None;
                    self.refresh_next_hops();
                }
                _ = tick_if_some(&mut watchdog_tick) => self.notifier.watchdog(),
                _ = attachment_tick.tick() => self.check_attachment(),
                _ = ejection_tick.tick() => self.check_ejection(),
                _ = slowness_tick.tick() => self.check_slowness(),
            }
            let period = self.ejection_period();
            if period != ejection_period {
                ejection_period = period;
                ejection_tick = ticks_after(period);
            }
            let period = if self.selector.slowness_settled() {
                SLOWNESS_IDLE_CHECK
            } else {
                SLOWNESS_CHECK
            };
            if period != slowness_period {
                slowness_period = period;
                slowness_tick = ticks_after(period);
            }
        }
    }

    /// The ejection check's period now: short while something is in
    /// motion, long while nothing is; never longer than the sweep's.
    fn ejection_period(&self) -> Duration {
        let period = if self.selector.ejection_settled() {
            EJECTION_IDLE_CHECK
        } else {
            EJECTION_CHECK
        };
        period.min(self.sweep_every)
    }

    /// Outlier ejection's step (`crate::datapath::ejection`), its events logged.
    fn check_ejection(&mut self) {
        for line in self.selector.check_ejection(sys::monotonic_ns()) {
            log::info!("{line}");
        }
    }

    /// The memory of slowness's step (`crate::datapath::slowness`), its
    /// events logged.
    fn check_slowness(&mut self) {
        for line in self.selector.check_slowness(sys::monotonic_ns()) {
            log::info!("{line}");
        }
    }

    /// Stops making redirects, then waits, sweeping as usual, until no
    /// redirected read is in flight or timeout + grace has passed: a detach
    /// now would leave their replies unrewritten, and the application drops
    /// a reply from a replica it did not ask. A second signal cuts it short.
    async fn stop(&mut self, signals: &mut StopSignals, control: &mut ControlServer) -> Result<()> {
        signals.draining();
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
        let mut watchdog_tick = self.notifier.watchdog_period().map(ticks_after);
        loop {
            self.health.turned();
            tokio::select! {
                _ = signals.signal() => {
                    log::info!("second signal: detaching with {waiting} redirected reads in flight");
                    return Ok(());
                }
                _ = &mut give_up => {
                    log::info!("timeout and grace passed: detaching with {waiting} redirected reads in flight");
                    return Ok(());
                }
                _ = sweep_tick.tick() => self.sweep(),
                _ = poll_tick.tick() => {
                    waiting = self.selector.redirected_in_flight()? + self.selector.hedges_in_flight();
                    if waiting == 0 {
                        return Ok(());
                    }
                }
                call = control.next_call() => {
                    self.answer(call, true);
                }
                _ = print_tick.tick() => print_stopping(waiting),
                _ = tick_if_some(&mut watchdog_tick) => self.notifier.watchdog(),
            }
        }
    }

    /// A last sweep, the totals, and the detach (dropping the selector).
    fn detach(self) -> Result<()> {
        let iface = self.selector.settings.iface.clone();
        self.exit(&format!("detaching from {iface}; totals:"), true)
    }

    /// With `--pin`: a last sweep and the totals; the links and maps stay
    /// pinned (dropping the selector closes this agent's descriptors only),
    /// and so do the managed neighbour entries the pinned programs rely on.
    fn leave_pinned(self) -> Result<()> {
        let s = &self.selector.settings;
        let dir = self.selector.pinned().map(|d| d.display().to_string());
        let line = format!(
            "exiting, leaving {} steered by the programs pinned under {} (`selector detach --iface {}` with the same --pin removes them); totals so far:",
            s.iface,
            dir.unwrap_or_default(),
            s.iface
        );
        // No agent will follow neighbour changes: redirects take the
        // neighbour subsystem until the next agent publishes them again.
        let mut agent = self;
        if let Err(e) = agent.next_hops.forget_all(&mut agent.selector) {
            log::warn!("forgetting the next hops failed: {e:#}");
        }
        agent.exit(&line, false)
    }

    /// `release_neighbours`: delete the neighbour entries the agent marked
    /// managed (nothing steers once it has gone).
    fn exit(self, headline: &str, release_neighbours: bool) -> Result<()> {
        let Self {
            mut selector,
            neighbours,
            tails,
            tables,
            ..
        } = self;
        selector.sweep(sys::monotonic_ns())?;
        let end = selector.snapshot()?;
        let totals = telemetry::totals(&selector.backends, &end, &tails);
        log::info!("{headline}");
        if !tables {
            drop(selector);
            if release_neighbours {
                neighbours.release();
            }
            return Ok(());
        }
        let mut summary = render::render_summary(&totals);
        summary += &render::render_footer(
            end.inflight,
            &totals,
            &telemetry::passed_counts(&end.passed),
        );
        if selector.settings.tunables.hedging.enabled() {
            let counts: Vec<_> = totals.iter().map(|t| (t.backend, t.hedges)).collect();
            summary += &render::render_hedging(&selector.settings.tunables.hedging, &counts);
        }
        crate::host::stdout::print_table(&summary);
        drop(selector);
        if release_neighbours {
            neighbours.release();
        }
        Ok(())
    }

    /// Records for `/readyz` whether the programs are still attached, and
    /// says so (and tells systemd's `STATUS=`) when that changes.
    fn check_attachment(&mut self) {
        let missing = match crate::datapath::attachment::missing(&self.selector) {
            Ok(missing) => missing,
            // Said once; readiness keeps the last answer.
            Err(e) if self.attachment_unknown => {
                log::debug!("checking the attachment failed: {e:#}");
                return;
            }
            Err(e) => {
                log::warn!("checking the attachment failed: {e:#}");
                self.attachment_unknown = true;
                return;
            }
        };
        self.attachment_unknown = false;
        let now = (!missing.is_empty()).then(|| missing.join("; "));
        let before = self.health.state().not_attached;
        if now != before {
            let status = match &now {
                Some(why) => format!("not steering: {why}"),
                None => self.summary(),
            };
            log::info!("{status}");
            self.notifier.status(&status);
        }
        self.health.update(|h| h.not_attached = now);
    }

    /// A dead hedge thread, as the error the agent exits with. Why exit:
    /// a panic there is a bug whose state is unknown, and an agent that
    /// runs on without hedging needs someone to notice; exiting non-zero
    /// (after the usual stop) has the supervisor restart it with hedging
    /// as configured (the unit's Restart=on-failure), pinned programs
    /// steering on meanwhile.
    fn hedge_failure(&mut self) -> Option<anyhow::Error> {
        let why = self.selector.hedge_thread_failure()?;
        log::error!("the hedge thread failed ({why}): hedging is off; stopping");
        Some(anyhow::anyhow!(
            "the hedge thread failed ({why}); stopped, to be restarted"
        ))
    }

    fn refresh_next_hops(&mut self) {
        self.next_hops_read_at = Instant::now();
        let before = self.selector.routed_elsewhere.clone();
        // On failure the entries stay as they were; the next tick retries.
        if let Err(e) = self.next_hops.refresh(&mut self.selector) {
            log::warn!("refreshing the next hops failed: {e:#}");
        }
        warn_routed_elsewhere(
            &before,
            &self.selector.routed_elsewhere,
            &self.selector.settings.iface,
        );
    }

    fn refresh_hedge_delays(&mut self) {
        // On failure the delays in force stay; the next due time retries.
        if let Err(e) = self.selector.refresh_hedge_delays() {
            log::warn!("reading latencies for --hedge-after auto failed: {e:#}");
        }
    }

    fn sweep(&mut self) {
        // A failed sweep is retried next tick; the data path goes on.
        match self.selector.sweep(sys::monotonic_ns()) {
            Ok(_) => self.health.swept(),
            Err(e) => log::warn!("sweep failed: {e:#}"),
        }
        self.selector.flush_kernel_logs();
    }

    /// Answers a control request; true if it was a reload that applied.
    fn answer(&mut self, call: ControlCall, stopping: bool) -> bool {
        let reloading = call.is_reload() && !stopping;
        if reloading {
            self.notifier.reloading();
        }
        let reloaded = call.answer(
            &mut self.selector,
            &mut self.reloader,
            &self.tails,
            stopping,
        );
        if reloaded {
            self.after_reload();
        }
        if reloading {
            self.reload_done();
        }
        reloaded
    }

    /// Re-reads the config file and applies it (SIGHUP).
    fn reload(&mut self) -> Result<String> {
        self.notifier.reloading();
        let outcome = self.reloader.reload(&mut self.selector);
        if outcome.is_ok() {
            self.after_reload();
        }
        self.reload_done();
        outcome
    }

    /// After a reload, applied or refused: readiness says whether the
    /// file's configuration is in force, and systemd hears it is done.
    fn reload_done(&mut self) {
        let refused = self.reloader.record.refused.clone();
        let status = match &refused {
            None => self.summary(),
            Some(_) => format!(
                "{} (last reload refused: previous configuration kept)",
                self.summary()
            ),
        };
        self.health.update(|h| h.reload_refused = refused);
        self.notifier.ready(&status);
    }

    /// The loop's derived state follows a reload: backends, sweep period,
    /// quiet, the snapshot rates are taken against.
    fn after_reload(&mut self) {
        self.after_groups_changed();
        self.quiet = self.reloader.quiet;
        let s = &self.selector.settings;
        self.sweep_every = sweep_period(self.interval, s.timeout, s.heartbeat_bound);
        let sweep_every = self.sweep_every;
        self.health.update(|h| h.sweep_period = sweep_every);
        let addrs: Vec<SocketAddr> = self.selector.backends.iter().map(|b| b.addr).collect();
        match self
            .neighbours
            .keep_resolved(&addrs, Duration::from_millis(100))
        {
            Ok(unresolved) if !unresolved.is_empty() => {
                log::info!("next hop not resolved yet for {unresolved:?}")
            }
            Ok(_) => {}
            Err(e) => log::warn!("resolving the backends' next hops: {e:#}"),
        }
        self.refresh_next_hops();
    }

    /// Forgets removed members whose requests are done.
    fn retire_finished(&mut self) {
        match self.reloader.retire_finished(&mut self.selector) {
            Ok(retired) if retired.is_empty() => {}
            Ok(retired) => {
                log::info!("removed {retired:?}: their requests have finished");
                self.after_groups_changed();
            }
            Err(e) => log::warn!("retiring removed members failed: {e:#}"),
        }
    }

    /// The table's rates compare snapshots backend by backend: start over.
    fn after_groups_changed(&mut self) {
        match self.selector.snapshot() {
            Ok(now) => self.last = now,
            Err(e) => log::warn!("reading the maps failed: {e:#}"),
        }
    }

    /// Records the interval's tail blame and, unless quiet, prints the table.
    fn end_interval(&mut self) {
        let now = match self.selector.snapshot() {
            Ok(now) => now,
            Err(e) => {
                log::warn!("reading the maps failed: {e:#}");
                return;
            }
        };
        self.tails
            .record(telemetry::IntervalTail::between(&self.last, &now));
        if self.tables && !self.quiet {
            let drained = self.selector.drained().unwrap_or_default();
            let states = render::state_labels(&self.selector.backends, &now.ejection, &drained);
            let mut table = render::render_table(
                &self.selector.backends,
                &self.last,
                &now,
                &self.tails,
                &states,
            );
            if self.selector.settings.tunables.hedging.enabled() {
                table +=
                    &render::render_hedging_interval(&self.selector.backends, &self.last, &now);
            }
            table.push('\n');
            crate::host::stdout::print_table(&table);
        }
        self.last = now;
    }
}

/// Says which members' routes now leave by another interface than the
/// attached one, and which came back: the programs see no request to such
/// a member, so it is never counted (it looks idle, the least loaded) and
/// requests addressed to it are never steered.
fn warn_routed_elsewhere(before: &[RoutedElsewhere], now: &[RoutedElsewhere], iface: &str) {
    for r in now.iter().filter(|r| !before.contains(r)) {
        log::warn!(
            "the route to {} leaves by {}, not {iface}: the selector does not see requests to it (its pending count stays 0); attach to {} or fix the route",
            r.backend,
            r.iface,
            r.iface
        );
    }
    for r in before
        .iter()
        .filter(|r| !now.iter().any(|n| n.backend == r.backend))
    {
        log::info!("the route to {} leaves by {iface} again", r.backend);
    }
}

fn print_stopping(waiting: usize) {
    log::info!("stopping: {waiting} redirected reads in flight");
}

/// The next tick of an optional interval; never without one.
async fn tick_if_some(ticks: &mut Option<tokio::time::Interval>) {
    match ticks {
        Some(ticks) => {
            ticks.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// An interval whose first tick is one period from now (tokio's fires at once).
fn ticks_after(period: Duration) -> tokio::time::Interval {
    let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticks
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `wait` ends within a moment.
    async fn ends<F: std::future::Future>(wait: F) -> bool {
        tokio::time::timeout(Duration::from_millis(50), wait)
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn an_attachment_stops_when_told_and_only_a_later_signal_cuts_its_drain_short() {
        let (agent, told) = tokio::sync::watch::channel(Stops::default());
        let mut signals = StopSignals::Told {
            stops: told,
            signals_seen: 0,
        };
        assert!(!ends(signals.recv()).await, "nothing asked yet");
        // Another attachment ended: steering stops ...
        agent.send_modify(|s| s.all = true);
        assert!(ends(signals.recv()).await);
        // ... but the wait for the redirected reads is not cut short by it.
        signals.draining();
        assert!(!ends(signals.signal()).await);
        agent.send_modify(|s| s.signals += 1);
        assert!(ends(signals.signal()).await, "a signal cuts it short");

        // Stopped by a signal: that one does not cut the drain short too.
        let (agent, told) = tokio::sync::watch::channel(Stops::default());
        let mut signals = StopSignals::Told {
            stops: told,
            signals_seen: 0,
        };
        agent.send_modify(|s| {
            s.all = true;
            s.signals = 1;
        });
        assert!(ends(signals.recv()).await);
        signals.draining();
        assert!(!ends(signals.signal()).await);
        agent.send_modify(|s| s.signals = 2);
        assert!(ends(signals.signal()).await);

        // Steering ended by itself (its duration); a stop asked meanwhile
        // by another attachment's end cuts nothing short.
        let (agent, told) = tokio::sync::watch::channel(Stops::default());
        let mut signals = StopSignals::Told {
            stops: told,
            signals_seen: 0,
        };
        signals.draining();
        agent.send_modify(|s| s.all = true);
        assert!(!ends(signals.signal()).await);
    }
}
