//! Loading, configuring and attaching the kernel programs. `Selector::attach`
//! either returns a fully configured, attached selector or fails with nothing
//! left attached (dropping the `Ebpf` detaches whatever did attach).
//! `Selector::attach_pinned` keeps maps and links under a pin directory
//! instead, or adopts those an earlier agent left there (see `pinning`).
//!
//! Over 500 lines: the `Selector` handle and its life (load, fill, attach
//! or adopt, write the config, the heartbeat, drain) are one sequence
//! whose steps share private state; reading counters (`snapshot`), group
//! changes (`regroup`), the sweep, hedges and ejection live apart.

use std::{
    collections::HashMap as StdHashMap,
    net::SocketAddr,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader, VerifierLogLevel,
    maps::{Array, HashMap},
    programs::{ProgramError, SchedClassifier, TcAttachType, Xdp, XdpMode, links::FdLink},
};
use log::debug;
use selector_common::{
    CLIENT_SLOTS, Config, Endpoint, Group, GroupCounters, GroupHealth, GroupService, MAX_GROUPS,
    Policy,
    inflight::{InflightSlot, mark_words, slots_for},
    member_port_bit, names, programs, split_backend_id,
};

use crate::{
    config::settings::{BackendPlan, IngressMode, ReplyPath, Settings},
    datapath::EBPF_OBJECT,
    datapath::pinning::{self, LinkSlot, PinDir},
    datapath::regroup::{GroupChanges, GroupTable, plan_groups},
    host::shared::{SharedArray, atomic, load},
    host::tc_attach::TcAttach,
    host::tcx::TcxSide,
};

/// A loaded, configured and attached selector. Dropping it detaches.
pub struct Selector {
    pub(crate) ebpf: Ebpf,
    // Must outlive the programs: dropping it closes the log map.
    pub(crate) logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    pub settings: Settings,
    pub backends: Vec<BackendPlan>,
    /// The in-flight slots, shared with the kernel.
    pub(crate) slots: SharedArray<InflightSlot>,
    /// One bit per slot that may be occupied (`crate::datapath::marks`).
    pub(crate) marks: SharedArray<u64>,
    /// Issued/completed/expired per group, shared with the kernel.
    pub(crate) counters: SharedArray<GroupCounters>,
    /// Pending per client-socket slot, shared with the kernel.
    pub(crate) clients: SharedArray<u64>,
    /// Service times per group, kept by the kernel.
    pub(crate) service: SharedArray<GroupService>,
    /// Outlier ejection per group, shared with the kernel.
    pub(crate) health: SharedArray<GroupHealth>,
    /// The agent's side of ejection (`crate::datapath::ejection`).
    pub(crate) ejection: crate::datapath::ejection::Ejection,
    /// The agent's memory of slowness (`crate::datapath::slowness`).
    pub(crate) slowness: crate::datapath::slowness::Slowness,
    /// The kernel's config, mapped for the heartbeat word alone.
    config: SharedArray<Config>,
    /// Shutting down: no new redirects.
    steering_off: bool,
    /// Requests planted by `plant_inflight` (their instance numbers).
    #[cfg(feature = "testing")]
    pub(crate) planted: u64,
    /// When each mark word next needs the sweep (`crate::datapath::sweep`).
    pub(crate) sweep_schedule: crate::datapath::sweep::SweepSchedule,
    /// Where maps and links are pinned (`--pin`); `None`: private to this agent.
    pub(crate) pins: Option<PinDir>,
    /// The maps were an earlier agent's, adopted from `pins`.
    adopted: bool,
    /// Adopting: the config keeps the earlier agent's heartbeat until the
    /// start has succeeded, so a start that fails half-way leaves the
    /// programs failing open at that heartbeat's bound, as they would have.
    heartbeat_held: bool,
    /// The latency histograms last read, by backend id (`Self::latency`).
    pub(crate) latency_cache: std::sync::Mutex<
        std::collections::HashMap<u32, crate::datapath::snapshot::CachedHistogram>,
    >,
    /// Why the reply path is where it is, when `--ingress auto` chose it.
    pub ingress_choice: Option<String>,
    /// Where the reply path is (or, before attaching, will be) attached;
    /// `settings.ingress` is what was asked for.
    pub reply_path: ReplyPath,
    /// How the TC programs attach on this kernel (probed at attach).
    pub tc_attach: Option<TcAttach>,
    /// The hedge thread and its settings.
    pub(crate) hedging: crate::hedging::Hedging,
    /// The network namespace attached in, with `--netns` (set by `run`).
    pub netns: Option<crate::api::NetnsInfo>,
    /// Members whose route leaves by another interface than
    /// `settings.iface`, as [`crate::datapath::next_hops::NextHops`] last found.
    pub routed_elsewhere: Vec<crate::api::RoutedElsewhere>,
}

/// What `GROUPS` holds for `backends`: per group index, members in order,
/// all active.
fn group_table(backends: &[BackendPlan]) -> StdHashMap<u32, Group> {
    let mut by_group: StdHashMap<u32, Group> = StdHashMap::new();
    for b in backends {
        let g = by_group.entry(b.group).or_default();
        g.endpoints[g.len as usize] = Endpoint::from(b.addr);
        g.active |= 1 << g.len;
        g.len += 1;
    }
    by_group
}

/// The program a link slot runs.
fn program_of(slot: LinkSlot) -> &'static str {
    match slot {
        LinkSlot::Egress => programs::EGRESS,
        LinkSlot::IngressXdp => programs::INGRESS_XDP,
        LinkSlot::IngressTc => programs::INGRESS_TC,
    }
}

/// Its name under `progs/`.
fn pin_name(slot: LinkSlot) -> &'static str {
    match slot {
        LinkSlot::Egress => "egress",
        _ => "ingress",
    }
}

/// The verifier log a rejected load reports: its error and statistics,
/// not the instruction-by-instruction trace (megabytes that an operator
/// cannot use, and minutes to produce on a slow machine or an emulated
/// one); `SELECTOR_VERIFIER_LOG=verbose` asks for the whole trace.
fn verifier_log_level() -> VerifierLogLevel {
    if std::env::var("SELECTOR_VERIFIER_LOG").is_ok_and(|v| v == "verbose") {
        VerifierLogLevel::VERBOSE | VerifierLogLevel::STATS
    } else {
        VerifierLogLevel::STATS
    }
}

/// Loads one program at most this many times while signals interrupt it.
const LOAD_ATTEMPTS: u32 = 100;

/// Runs a program load again when a signal interrupted the verifier (its
/// EAGAIN: a SIGHUP or SIGTERM while the agent starts, which the agent
/// handles once attached), never reporting that as the verifier's verdict.
fn unless_interrupted(mut load: impl FnMut() -> Result<(), ProgramError>) -> Result<()> {
    for _ in 0..LOAD_ATTEMPTS {
        match load() {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) =>
            {
                debug!("a signal interrupted the verifier; loading again");
            }
            other => return Ok(other?),
        }
    }
    // Bounded: a storm of signals must not hold a start forever.
    bail!("signals interrupted the verifier {LOAD_ATTEMPTS} times in a row; the load was given up")
}

/// Refuses to attach next to selector programs already on `iface` (left
/// pinned by an agent with `--pin`, say): both would count and steer.
fn refuse_if_attached(iface: &str) -> Result<()> {
    for side in [TcxSide::Egress, TcxSide::Ingress] {
        if !chain_seen(iface, side)?.is_empty() {
            bail!(
                "selector programs are already attached to {iface} (pinned by a `selector run --pin DIR`?): adopt them with the same --pin DIR, or remove them with `selector detach --iface {iface} [--pin DIR]`"
            );
        }
    }
    Ok(())
}

/// The selector programs in `iface`'s TCX chain `side`. Programs the
/// agent cannot name without CAP_SYS_ADMIN are taken as another
/// component's (a CNI's, an observability agent's), and said so: a second
/// agent is refused by the first's lock, and one left pinned is adopted
/// with its `--pin DIR`. Said in the debug log.
fn chain_seen(iface: &str, side: TcxSide) -> Result<Vec<u32>> {
    let chain = crate::datapath::detach::tcx_chain(crate::host::interface::index(iface)?, side)
        .with_context(|| format!("reading {iface}'s TCX chain"))?;
    if !chain.unnamed.is_empty() {
        // On every start of a node with a CNI's programs: not worth a
        // line of its own.
        log::debug!(
            "{iface}: TCX {side:?} programs {:?} are not named without CAP_SYS_ADMIN; taken as another component's, ours attach beside them",
            chain.unnamed
        );
    }
    Ok(chain.selector)
}

/// As [`refuse_if_attached`], for the TCX direction of one missing link.
fn refuse_if_attached_at(iface: &str, slot: LinkSlot) -> Result<()> {
    let side = match slot {
        LinkSlot::Egress => TcxSide::Egress,
        LinkSlot::IngressTc => TcxSide::Ingress,
        LinkSlot::IngressXdp => return Ok(()), // the kernel refuses a second XDP program
    };
    if !chain_seen(iface, side)?.is_empty() {
        bail!(
            "a selector program is attached to {iface} without a pinned link in the pin directory: run `selector detach --iface {iface}` first"
        );
    }
    Ok(())
}

/// Maps the shared array map `name` of `len` elements.
fn share<T>(ebpf: &Ebpf, name: &str, len: u32) -> Result<SharedArray<T>> {
    let Some(aya::maps::Map::Array(data)) = ebpf.map(name) else {
        bail!("array map {name} missing from the object");
    };
    SharedArray::map(data.fd().as_fd(), len as usize).with_context(|| format!("mapping {name}"))
}

/// The reply path `settings` ask for, `--ingress auto` resolved for the
/// interface (and why).
pub(crate) fn resolve_ingress(settings: &Settings) -> Result<(ReplyPath, Option<String>)> {
    if let Some(fixed) = settings.ingress.fixed() {
        return Ok((fixed, None));
    }
    let ifindex = crate::host::interface::index(&settings.iface)?;
    let kind = crate::host::neighbours::Netlink::open()?.link_kind(ifindex)?;
    // Only a driver's device depends on how TC attaches. A probe refused
    // (`selector check` unprivileged) counts as TCX here: the attach
    // probes again, and fails in words.
    let legacy_tc = kind.is_none()
        && TcAttach::probe(&settings.iface).is_ok_and(|how| how == TcAttach::Netlink);
    let (path, why) = crate::host::interface::auto_ingress(kind.as_deref(), legacy_tc);
    Ok((path, Some(why)))
}

/// The reply path of a selector loaded but not attached (fixtures run
/// both programs): the one asked for, TC for `auto`.
pub(crate) fn unattached_reply_path(settings: &Settings) -> ReplyPath {
    settings.ingress.fixed().unwrap_or(ReplyPath::Tc)
}

impl Selector {
    /// Validates `settings`, loads the programs, fills the maps and attaches.
    pub fn attach(settings: &Settings) -> Result<Self> {
        crate::host::interface::index(&settings.iface)?;
        crate::host::preflight::check_host()?;
        refuse_if_attached(&settings.iface)?;
        let (reply_path, choice) = resolve_ingress(settings)?;
        let mut selector = Self::load_with(settings, reply_path, None)?;
        selector.ingress_choice = choice;
        selector.attach_fresh()
    }

    /// As [`Self::attach`], with maps and links pinned under `dir/IFACE`.
    /// When an earlier agent pinned them there, adopts them instead: its
    /// maps are reused (counts and requests in flight carry on), this
    /// build's programs are swapped into its links atomically, and steering
    /// never stops. The groups are taken as the pinned maps hold them
    /// (after whatever reloads the earlier agent applied) and `settings`'
    /// groups applied over them as a reload would (`names`: the groups'
    /// names, to match them). Settings that shape the maps
    /// (`--inflight-max`, an explicit `--ingress`) must match; see
    /// [`PinDir::check_adoptable`]. Returns the selector and how its groups
    /// changed from the pinned ones (nothing, when it started afresh).
    pub fn attach_pinned(
        settings: &Settings,
        dir: &Path,
        names: &[Option<String>],
    ) -> Result<(Self, GroupChanges)> {
        crate::host::interface::index(&settings.iface)?;
        crate::host::preflight::check_host()?;
        if TcAttach::probe(&settings.iface)? == TcAttach::Netlink {
            // The shipped files pin, and must start on every kernel the
            // docs list.
            log::warn!(
                "not pinned under {}: pinning needs TCX links (Linux 6.6 or later), and this kernel attaches through legacy tc filters; they stay attached if the agent is killed, and the next agent replaces them (its counts start afresh)",
                dir.display()
            );
            let selector = Self::attach(settings)?;
            let table = GroupTable::from_start(&settings.groups, names);
            return Ok((selector, GroupChanges::none(table)));
        }
        let pins = PinDir::prepare(dir, &settings.iface)?;
        if pins.has_maps() {
            // `auto` adopts whichever reply path the earlier agent pinned.
            let (reply_path, choice) = match (settings.ingress, pins.pinned_reply_path()) {
                (IngressMode::Auto, Some(pinned)) => (pinned, Some("auto: as pinned".into())),
                _ => resolve_ingress(settings)?,
            };
            let mut selector = Self::load_with(settings, reply_path, Some(pins))?;
            selector.ingress_choice = choice;
            let freed = selector.free_stale_holds();
            if freed > 0 {
                log::warn!("freed {freed} in-flight slots the earlier agent was killed holding");
            }
            let pinned = selector.table_in_maps()?;
            let changes = plan_groups(&pinned, &settings.groups, names, Instant::now())
                .context("applying the groups over the pinned ones")?;
            selector.backends = pinned.backends();
            selector.apply_groups(&changes)?;
            selector.backends = changes.table.backends();
            // Hedge targets for the groups as they are now.
            selector.write_config()?;
            selector.adopt_links()?;
            // Started: from here on the heartbeat is this agent's.
            selector.heartbeat_held = false;
            selector.heartbeat();
            return Ok((selector, changes));
        }
        let (reply_path, choice) = resolve_ingress(settings)?;
        let fresh = refuse_if_attached(&settings.iface)
            .and_then(|()| Self::load_with(settings, reply_path, Some(pins.clone())))
            .map(|mut s| {
                s.ingress_choice = choice;
                s
            })
            .and_then(Self::attach_fresh);
        if fresh.is_err() {
            // Nothing of a failed start stays pinned (the next agent would
            // adopt it).
            let _ = pins.remove_all(&mut crate::datapath::detach::Removed::default());
        }
        let table = GroupTable::from_start(&settings.groups, names);
        fresh.map(|s| (s, GroupChanges::none(table)))
    }

    /// The settings as `selector status` shows them: the reply path as
    /// attached (`auto` resolved).
    pub fn settings_in_force(&self) -> crate::api::SettingsInForce {
        crate::api::SettingsInForce {
            ingress: self.reply_path.name().into(),
            ..crate::api::SettingsInForce::from(&self.settings)
        }
    }

    /// The pin directory (`DIR/IFACE`) with `--pin`.
    pub fn pinned(&self) -> Option<&Path> {
        self.pins.as_ref().map(PinDir::root)
    }

    /// Whether the maps were adopted from an earlier agent's pins.
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// Attaches the loaded programs with new links (pinned with `--pin`).
    fn attach_fresh(mut self) -> Result<Self> {
        // The reply path goes first, so a redirect never goes out before
        // its reply can be rewritten. Order matters at a SIGKILL too: the
        // dying process's links are released last-opened first (task work
        // runs in reverse), so egress, opened last, stops redirecting before
        // ingress goes (measured: 7-27 of 6,000 replies lost the other way
        // round, 0 this way). Steering stays off until both are in place.
        self.steering_off = true;
        self.write_config()?;
        self.remove_stale_filters()?;
        self.attach_programs()?;
        self.steering_off = false;
        self.write_config()?;
        Ok(self)
    }

    /// On legacy tc, the filters a killed agent left (see
    /// [`crate::host::tc_attach::remove_stale_filters`]), said in the log.
    fn remove_stale_filters(&mut self) -> Result<()> {
        let iface = self.settings.iface.clone();
        if self.tc_how(&iface)? != TcAttach::Netlink {
            return Ok(());
        }
        let removed = crate::host::tc_attach::remove_stale_filters(
            &iface,
            programs::EGRESS,
            programs::INGRESS_TC,
            self.settings.timeout,
        )?;
        if !removed.is_empty() {
            log::warn!(
                "removed {} that an agent no longer running left on {iface} (legacy tc filters outlive a killed agent)",
                removed.join(" and ")
            );
        }
        Ok(())
    }

    /// How TC programs attach to `iface` on this kernel (probed once).
    fn tc_how(&mut self, iface: &str) -> Result<TcAttach> {
        Ok(match self.tc_attach {
            Some(how) => how,
            None => *self.tc_attach.insert(TcAttach::probe(iface)?),
        })
    }

    /// Swaps this agent's programs into the links an earlier agent pinned
    /// (`BPF_LINK_UPDATE`, atomic per link; the reply path first), and
    /// attaches and pins a link that is missing. Steering goes on
    /// throughout: both programs use the same maps.
    fn adopt_links(&mut self) -> Result<()> {
        let pins = self.pins.clone().expect("adopting needs pins");
        let iface = self.settings.iface.clone();
        let ingress = LinkSlot::ingress(self.reply_path);
        let mut missing = Vec::new();
        for slot in [ingress, LinkSlot::Egress] {
            let Some(link) = pins.pinned_link(slot, &iface)? else {
                missing.push(slot);
                continue;
            };
            let name = program_of(slot);
            let updated = match slot {
                LinkSlot::IngressXdp => {
                    let p: &mut Xdp = self.program_mut(name)?.try_into()?;
                    p.attach_to_link(link.try_into()?).map(drop)
                }
                _ => {
                    let p: &mut SchedClassifier = self.program_mut(name)?.try_into()?;
                    p.attach_to_link(link.try_into()?).map(drop)
                }
            };
            updated.with_context(|| {
                format!(
                    "updating the pinned {} link (a link severed by `selector detach` without --pin, or by its interface going away, cannot be adopted: run `selector detach --iface {iface} --pin DIR` first)",
                    slot.file()
                )
            })?;
            pins.pin_program(self.program_mut(name)?, pin_name(slot))?;
        }
        for slot in missing {
            // An agent stopped between pinning its maps and its links.
            refuse_if_attached_at(&iface, slot)?;
            self.attach_one(slot)?;
        }
        Ok(())
    }

    /// Validates `settings`, loads the programs into the kernel and fills the
    /// maps, without attaching (packet-fixture tests and benchmarks run the
    /// programs with BPF_PROG_TEST_RUN).
    pub fn load(settings: &Settings) -> Result<Self> {
        Self::load_with(settings, unattached_reply_path(settings), None)
    }

    /// As [`Self::load`]; with `pins`, every map is pinned there, or taken
    /// from there when an earlier agent pinned it (after checking it fits).
    fn load_with(settings: &Settings, reply_path: ReplyPath, pins: Option<PinDir>) -> Result<Self> {
        let backends = settings.plan()?;
        let slot_count = slots_for(settings.inflight_max);
        let adopted = pins.as_ref().is_some_and(PinDir::has_maps);
        if let Some(pins) = pins.as_ref().filter(|_| adopted) {
            pins.check_adoptable(settings, reply_path)?;
        }
        let map_names = pinning::pinned_map_names();
        let map_paths: Vec<(&str, PathBuf)> = match &pins {
            Some(p) => map_names.iter().map(|n| (*n, p.map_path(n))).collect(),
            None => Vec::new(),
        };
        let mut loader = EbpfLoader::new();
        loader.verifier_log_level(verifier_log_level());
        loader.map_max_entries(names::INFLIGHT, slot_count);
        loader.map_max_entries(names::INFLIGHT_MARKS, mark_words(slot_count));
        for (name, path) in &map_paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader.load(EBPF_OBJECT).with_context(|| {
            format!(
                "loading the kernel programs on Linux {}",
                crate::host::preflight::kernel_release()
            )
        })?;
        if pins.is_some() {
            // A map added to the object but not to the pinned list would
            // silently start from zero at every restart.
            if let Some((name, _)) = ebpf
                .maps()
                .find(|(name, _)| !pinning::is_private_map(name) && !map_names.contains(name))
            {
                bail!("map {name} is not in the pinned list (pinning::shapes)");
            }
        }
        let logger = match aya_log::EbpfLogger::init_with_logger(&mut ebpf, log::logger()) {
            Ok(l) => Some(l),
            Err(e) => {
                debug!("kernel logging unavailable: {e}");
                None
            }
        };
        let mut selector =
            Self::assemble(ebpf, logger, settings, backends, reply_path, pins, adopted)?;
        selector.fill()?;
        let release = crate::host::preflight::kernel_release();
        for name in [programs::EGRESS, programs::INGRESS_TC] {
            let p: &mut SchedClassifier = selector.program_mut(name)?.try_into()?;
            unless_interrupted(|| p.load())
                .with_context(|| format!("loading {name} on Linux {release}"))?;
        }
        let p: &mut Xdp = selector.program_mut(programs::INGRESS_XDP)?.try_into()?;
        unless_interrupted(|| p.load())
            .with_context(|| format!("loading {} on Linux {release}", programs::INGRESS_XDP))?;
        Ok(selector)
    }

    /// The handle over a loaded object (its programs loaded or not): the
    /// shared maps mapped, the agent's own state fresh. `adopted`: the maps
    /// were an earlier agent's (known before the load, which pins new ones).
    pub(crate) fn assemble(
        ebpf: Ebpf,
        logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
        settings: &Settings,
        backends: Vec<BackendPlan>,
        reply_path: ReplyPath,
        pins: Option<PinDir>,
        adopted: bool,
    ) -> Result<Self> {
        let slot_count = slots_for(settings.inflight_max);
        let slots = share(&ebpf, names::INFLIGHT, slot_count)?;
        let marks = share(&ebpf, names::INFLIGHT_MARKS, mark_words(slot_count))?;
        let counters = share(&ebpf, names::COUNTERS, MAX_GROUPS)?;
        let clients = share(&ebpf, names::CLIENT_PENDING, CLIENT_SLOTS)?;
        let service = share(&ebpf, names::SERVICE, MAX_GROUPS)?;
        let health = share(&ebpf, names::HEALTH, MAX_GROUPS)?;
        let config = share(&ebpf, names::CONFIG, 1)?;
        Ok(Self {
            ebpf,
            logger,
            settings: settings.clone(),
            backends,
            slots,
            marks,
            counters,
            clients,
            service,
            health,
            ejection: Default::default(),
            slowness: Default::default(),
            config,
            steering_off: false,
            #[cfg(feature = "testing")]
            planted: 0,
            sweep_schedule: Default::default(),
            pins,
            adopted,
            heartbeat_held: adopted,
            ingress_choice: None,
            reply_path,
            tc_attach: None,
            latency_cache: Default::default(),
            hedging: Default::default(),
            netns: None,
            routed_elsewhere: Vec::new(),
        })
    }

    /// Fills the maps for the settings and starts ejection and slowness
    /// afresh; adopted maps keep the tables (see `attach_pinned`) and the
    /// ejections and slow members an earlier agent wrote.
    pub(crate) fn fill(&mut self) -> Result<()> {
        if self.adopted {
            self.write_config()?;
            let now_ns = crate::host::sys::monotonic_ns();
            self.adopt_ejection(now_ns);
            self.adopt_slowness(now_ns);
        } else {
            self.write_tables()?;
            self.reset_ejection();
            self.reset_slowness();
        }
        Ok(())
    }

    /// Attaches the program of `slot` with a new link; with pins, pins it.
    fn attach_one(&mut self, slot: LinkSlot) -> Result<()> {
        let iface = self.settings.iface.clone();
        let name = program_of(slot);
        let pinned = self.pins.is_some();
        let link: Option<FdLink> = match slot {
            LinkSlot::IngressXdp => {
                // `auto` wants native XDP only; `--ingress xdp`, whatever runs.
                let mode = match self.settings.ingress {
                    IngressMode::Auto => XdpMode::Driver,
                    _ => XdpMode::Default,
                };
                let p: &mut Xdp = self.program_mut(name)?.try_into()?;
                let id = p
                    .attach(&iface, mode)
                    .with_context(|| format!("attaching XDP to {iface} (try --ingress tc)"))?;
                if pinned {
                    Some(p.take_link(id)?.try_into()?)
                } else {
                    None
                }
            }
            _ => {
                let (attach, what) = match slot {
                    LinkSlot::Egress => (TcAttachType::Egress, "egress"),
                    _ => (TcAttachType::Ingress, "ingress"),
                };
                let how = self.tc_how(&iface)?;
                if pinned && how != TcAttach::Tcx {
                    bail!(
                        "--pin needs TCX links (Linux 6.6 or later); this kernel attaches through legacy tc filters, which cannot be pinned: run without --pin"
                    );
                }
                let p: &mut SchedClassifier = self.program_mut(name)?.try_into()?;
                let id = how
                    .attach(p, &iface, attach)
                    .with_context(|| format!("attaching TC {what} to {iface} ({how})"))?;
                if pinned {
                    Some(p.take_link(id)?.try_into()?)
                } else {
                    None
                }
            }
        };
        if let (Some(pins), Some(link)) = (self.pins.clone(), link) {
            pins.pin_link(slot, link)?;
            pins.pin_program(self.program_mut(name)?, pin_name(slot))?;
        }
        Ok(())
    }

    /// The loaded object, for tests and benchmarks that drive maps and
    /// programs directly.
    pub fn ebpf(&self) -> &Ebpf {
        &self.ebpf
    }

    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    fn write_tables(&mut self) -> Result<()> {
        self.write_config()?;
        let backends = self.backends.clone();
        {
            let mut groups: Array<_, Group> = Array::try_from(self.map_mut(names::GROUPS)?)?;
            for (index, group) in group_table(&backends) {
                groups.set(index, group, 0)?;
            }
        }
        self.add_member_ports(backends.iter().map(|b| b.addr.port()))?;
        // The lookup table last: from here on the programs act on backends.
        let mut index: HashMap<_, Endpoint, u32> =
            HashMap::try_from(self.map_mut(names::BACKENDS)?)?;
        for b in &backends {
            index.insert(Endpoint::from(b.addr), b.index, 0)?;
        }
        Ok(())
    }

    /// Sets the `MEMBER_PORTS` bits of `ports`, before a `BACKENDS` entry
    /// with one of them is added (the programs pass a datagram whose port
    /// has no bit as no member's). Bits are never cleared: a port of
    /// members since removed costs its datagrams the endpoint lookup.
    pub(crate) fn add_member_ports(&mut self, ports: impl IntoIterator<Item = u16>) -> Result<()> {
        let mut words: Array<_, u64> = Array::try_from(self.map_mut(names::MEMBER_PORTS)?)?;
        for port in ports {
            let (word, bit) = member_port_bit(port);
            let had = words.get(&word, 0)?;
            if had & bit == 0 {
                words.set(word, had | bit, 0)?;
            }
        }
        Ok(())
    }

    fn attach_programs(&mut self) -> Result<()> {
        if let Err(e) = self.attach_one(LinkSlot::ingress(self.reply_path)) {
            // `auto` chose native XDP for a driver's device; without it,
            // TC ingress.
            if self.settings.ingress != IngressMode::Auto || self.reply_path != ReplyPath::Xdp {
                return Err(e);
            }
            self.reply_path = ReplyPath::Tc;
            self.ingress_choice = Some(format!(
                "auto: {} has no native XDP ({})",
                self.settings.iface,
                e.root_cause()
            ));
            self.attach_one(LinkSlot::IngressTc)?;
        }
        self.attach_one(LinkSlot::Egress)
    }

    fn program_mut(&mut self, name: &str) -> Result<&mut aya::programs::Program> {
        self.ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} missing from the object"))
    }

    pub(crate) fn map_mut(&mut self, name: &str) -> Result<&mut aya::maps::Map> {
        self.ebpf
            .map_mut(name)
            .ok_or_else(|| anyhow!("map {name} missing from the object"))
    }

    pub(crate) fn map(&self, name: &str) -> Result<&aya::maps::Map> {
        self.ebpf
            .map(name)
            .ok_or_else(|| anyhow!("map {name} missing from the object"))
    }

    /// Writes the tunables in `settings` (and the shutdown flag) to the
    /// kernel's config; the programs read it on every packet.
    pub fn write_config(&mut self) -> Result<()> {
        self.write_hedge_config(self.steering_off)?;
        let s = &self.settings;
        let t = &s.tunables;
        let value = Config {
            policy: t.policy as u32,
            threshold: t.threshold,
            max_pending: t.max_pending,
            max_pending_client: t.max_pending_client,
            on_overload: t.on_overload as u32,
            mark: s.mark,
            inflight_mask: self.slots.len() as u32 - 1,
            steering_off: u32::from(self.steering_off),
            tie_break: t.tie_break as u32,
            budget_us: t.budget_us(),
            descriptor: s.descriptor,
            heartbeat_ns: if self.heartbeat_held {
                // SAFETY: a field of the live mapped element, 8-byte aligned.
                unsafe { load(&raw mut (*self.config.ptr(0)).heartbeat_ns) }
            } else {
                crate::host::sys::monotonic_ns()
            },
            heartbeat_bound_ns: s.heartbeat_bound.as_nanos().min(u128::from(u64::MAX)) as u64,
        };
        let mut config: Array<_, Config> = Array::try_from(self.map_mut(names::CONFIG)?)?;
        config.set(0, value, 0)?;
        Ok(())
    }

    /// Tells the programs the agent is here (`Config::agent_alive`): the
    /// heartbeat word alone, an atomic store into the mapped config, so no
    /// reader sees it torn and nothing else in the value is rewritten.
    pub fn heartbeat(&self) {
        self.set_heartbeat(crate::host::sys::monotonic_ns());
    }

    pub(crate) fn set_heartbeat(&self, ns: u64) {
        // SAFETY: a field of the live mapped element, 8-byte aligned.
        unsafe { atomic(&raw mut (*self.config.ptr(0)).heartbeat_ns) }
            .store(ns, std::sync::atomic::Ordering::SeqCst);
    }

    /// The heartbeat as the programs see it now.
    pub fn heartbeat_state(&self) -> crate::api::Heartbeat {
        // SAFETY: fields of the live mapped element, 8-byte aligned.
        let (beat, bound) = unsafe {
            let c = self.config.ptr(0);
            (
                load(&raw mut (*c).heartbeat_ns),
                load(&raw mut (*c).heartbeat_bound_ns),
            )
        };
        let config = Config {
            heartbeat_ns: beat,
            heartbeat_bound_ns: bound,
            ..Config::default()
        };
        let now = crate::host::sys::monotonic_ns();
        crate::api::Heartbeat {
            bound_ms: bound / 1_000_000,
            age_ms: now.saturating_sub(beat) / 1_000_000,
            fresh: config.agent_alive(now),
        }
    }

    /// Changes policy and threshold while running.
    pub fn set_policy(&mut self, policy: Policy, threshold: u32) -> Result<()> {
        self.settings.tunables.policy = policy;
        self.settings.tunables.threshold = threshold;
        self.write_config()
    }

    /// For shutdown: the kernel makes no new redirects from now on
    /// (retransmits of reads already redirected still follow them).
    pub fn stop_steering(&mut self) -> Result<()> {
        self.steering_off = true;
        self.write_config()
    }

    /// Redirected reads still in flight: their replies need rewriting, so
    /// the programs must stay attached until this is 0.
    pub fn redirected_in_flight(&self) -> Result<usize> {
        Ok(self
            .inflight()?
            .iter()
            .filter(|s| s.primary != s.chosen)
            .count())
    }

    /// Backends currently drained (their bit clear in their group's mask).
    pub fn drained(&self) -> Result<Vec<SocketAddr>> {
        let groups: Array<_, Group> = Array::try_from(self.map(names::GROUPS)?)?;
        let mut drained = Vec::new();
        for b in &self.backends {
            let (group, position) = split_backend_id(b.index);
            if groups.get(&group, 0)?.active & (1 << position) == 0 {
                drained.push(b.addr);
            }
        }
        Ok(drained)
    }

    /// Marks a backend drained (never chosen) or active again.
    pub fn set_drained(&mut self, id: u32, drained: bool) -> Result<()> {
        let (group, position) = split_backend_id(id);
        let mut groups: Array<_, Group> = Array::try_from(self.map_mut(names::GROUPS)?)?;
        let mut entry = groups.get(&group, 0)?;
        if drained {
            entry.active &= !(1 << position);
        } else {
            entry.active |= 1 << position;
        }
        groups.set(group, entry, 0)?;
        Ok(())
    }

    /// Passes kernel log records (rare events only) to the logger.
    pub fn flush_kernel_logs(&mut self) {
        if let Some(l) = self.logger.as_mut() {
            l.flush();
        }
    }

    /// Backend index of `addr`, if configured.
    pub fn backend_index(&self, addr: SocketAddr) -> Option<u32> {
        self.backends
            .iter()
            .find(|b| b.addr == addr)
            .map(|b| b.index)
    }

    /// Requests expired per configured backend (in `backends` order).
    pub fn expired(&self) -> Vec<u64> {
        self.accounting()
            .map(|a| a.into_iter().map(|(_, _, e)| e).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use aya::programs::ProgramError;

    use super::{LOAD_ATTEMPTS, unless_interrupted};

    fn refused(errno: i32) -> ProgramError {
        ProgramError::LoadError {
            io_error: std::io::Error::from_raw_os_error(errno),
            verifier_log: aya_obj::VerifierLog::new("processed 4347 insns".into()),
        }
    }

    #[test]
    fn an_interrupted_load_runs_again_and_is_never_reported_as_the_verifiers() {
        let mut calls = 0;
        unless_interrupted(|| {
            calls += 1;
            if calls < 3 {
                Err(refused(libc::EAGAIN))
            } else {
                Ok(())
            }
        })
        .unwrap();
        assert_eq!(calls, 3);
        let mut calls = 0;
        let err = unless_interrupted(|| {
            calls += 1;
            Err(refused(libc::EAGAIN))
        })
        .unwrap_err()
        .to_string();
        assert_eq!(calls, LOAD_ATTEMPTS);
        assert!(err.starts_with("signals interrupted the verifier"), "{err}");
        assert!(!err.contains("Verifier output"), "{err}");
        // A real refusal is the verifier's, at once.
        let mut calls = 0;
        let err = unless_interrupted(|| {
            calls += 1;
            Err(refused(libc::EACCES))
        })
        .unwrap_err();
        assert_eq!(calls, 1);
        assert!(
            format!("{err:#}").contains("processed 4347 insns"),
            "{err:#}"
        );
    }
}
