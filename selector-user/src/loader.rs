//! Loading, configuring and attaching the kernel programs. `Selector::attach`
//! either returns a fully configured, attached selector or fails with nothing
//! left attached (dropping the `Ebpf` detaches whatever did attach).

use std::{collections::HashMap as StdHashMap, net::SocketAddrV4, os::fd::AsFd as _};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, PerCpuArray},
    programs::{SchedClassifier, TcAttachType, Xdp, XdpMode, tc},
    util::KernelVersion,
};
use log::debug;
use selector_common::{
    BackendStats, CLIENT_SLOTS, Config, Direction, Endpoint, Group, GroupCounters, MAX_GROUPS,
    PassReason, Policy,
    inflight::{InflightSlot, PHASE_LIVE, phase, slots_for},
    names, pass_index, programs, split_backend_id,
};

use crate::{
    EBPF_OBJECT,
    settings::{BackendPlan, IngressMode, Settings},
    shared::{SharedArray, load},
};

/// A loaded, configured and attached selector. Dropping it detaches.
pub struct Selector {
    ebpf: Ebpf,
    // Must outlive the programs: dropping it closes the log map.
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    pub settings: Settings,
    pub backends: Vec<BackendPlan>,
    /// The in-flight slots, shared with the kernel.
    pub(crate) slots: SharedArray<InflightSlot>,
    /// Issued/completed/expired per group, shared with the kernel.
    pub(crate) counters: SharedArray<GroupCounters>,
    /// Pending per client-socket slot, shared with the kernel.
    pub(crate) clients: SharedArray<u64>,
    /// Shutting down: no new redirects.
    steering_off: bool,
    /// Requests planted by `plant_inflight` (their instance numbers).
    pub(crate) planted: u64,
    /// The hedge thread and its settings.
    pub(crate) hedging: crate::hedging::Hedging,
}

pub(crate) fn endpoint(addr: SocketAddrV4) -> Endpoint {
    Endpoint::ipv4(addr.ip().octets(), addr.port())
}

/// Maps the shared array map `name` of `len` elements.
fn share<T>(ebpf: &Ebpf, name: &str, len: u32) -> Result<SharedArray<T>> {
    let Some(aya::maps::Map::Array(data)) = ebpf.map(name) else {
        bail!("array map {name} missing from the object");
    };
    SharedArray::map(data.fd().as_fd(), len as usize).with_context(|| format!("mapping {name}"))
}

fn interface_index(iface: &str) -> Result<u32> {
    let name = std::ffi::CString::new(iface).map_err(|_| anyhow!("bad interface name"))?;
    // SAFETY: valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        bail!("interface '{iface}' not found");
    }
    Ok(index)
}

impl Selector {
    /// Validates `settings`, loads the programs, fills the maps and attaches.
    pub fn attach(settings: &Settings) -> Result<Self> {
        interface_index(&settings.iface)?;
        let mut selector = Self::load(settings)?;
        // The reply path goes first, so a redirect never goes out before
        // its reply can be rewritten. Order matters at a SIGKILL too: the
        // dying process's links are released last-opened first (task work
        // runs in reverse), so egress, opened last, stops redirecting before
        // ingress goes (measured: 7-27 of 6,000 replies lost the other way
        // round, 0 this way). Steering stays off until both are in place.
        selector.steering_off = true;
        selector.write_config()?;
        selector.attach_programs()?;
        selector.steering_off = false;
        selector.write_config()?;
        Ok(selector)
    }

    /// Validates `settings`, loads the programs into the kernel and fills the
    /// maps, without attaching (packet-fixture tests and benchmarks run the
    /// programs with BPF_PROG_TEST_RUN).
    pub fn load(settings: &Settings) -> Result<Self> {
        let backends = settings.plan()?;
        let slot_count = slots_for(settings.inflight_max);
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(names::INFLIGHT, slot_count)
            .load(EBPF_OBJECT)
            .context("loading the kernel programs")?;
        let slots = share(&ebpf, names::INFLIGHT, slot_count)?;
        let counters = share(&ebpf, names::COUNTERS, MAX_GROUPS)?;
        let clients = share(&ebpf, names::CLIENT_PENDING, CLIENT_SLOTS)?;
        let logger = match aya_log::EbpfLogger::init_with_logger(&mut ebpf, log::logger()) {
            Ok(l) => Some(l),
            Err(e) => {
                debug!("kernel logging unavailable: {e}");
                None
            }
        };
        let mut selector = Self {
            ebpf,
            logger,
            settings: settings.clone(),
            backends,
            slots,
            counters,
            clients,
            steering_off: false,
            planted: 0,
            hedging: Default::default(),
        };
        selector.write_tables()?;
        for name in [programs::EGRESS, programs::INGRESS_TC] {
            let p: &mut SchedClassifier = selector.program_mut(name)?.try_into()?;
            p.load()?;
        }
        let p: &mut Xdp = selector.program_mut(programs::INGRESS_XDP)?.try_into()?;
        p.load()?;
        Ok(selector)
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
            let mut by_group: StdHashMap<u32, Group> = StdHashMap::new();
            for b in &backends {
                let g = by_group.entry(b.group).or_default();
                g.endpoints[g.len as usize] = endpoint(b.addr);
                g.active |= 1 << g.len;
                g.len += 1;
            }
            for (index, group) in by_group {
                groups.set(index, group, 0)?;
            }
        }
        // The lookup table last: from here on the programs act on backends.
        let mut index: HashMap<_, Endpoint, u32> =
            HashMap::try_from(self.map_mut(names::BACKENDS)?)?;
        for b in &backends {
            index.insert(endpoint(b.addr), b.index, 0)?;
        }
        Ok(())
    }

    fn attach_programs(&mut self) -> Result<()> {
        let iface = self.settings.iface.clone();
        if KernelVersion::current().is_ok_and(|v| v < KernelVersion::new(6, 6, 0)) {
            // Netlink TC needs clsact; TCX (6.6+) does not. An existing one is fine.
            let _ = tc::qdisc_add_clsact(&iface);
        }
        match self.settings.ingress {
            IngressMode::Xdp => {
                let ingress: &mut Xdp = self.program_mut(programs::INGRESS_XDP)?.try_into()?;
                ingress
                    .attach(&iface, XdpMode::Default)
                    .with_context(|| format!("attaching XDP to {iface} (try --ingress tc)"))?;
            }
            IngressMode::Tc => {
                let ingress: &mut SchedClassifier =
                    self.program_mut(programs::INGRESS_TC)?.try_into()?;
                ingress
                    .attach(&iface, TcAttachType::Ingress)
                    .with_context(|| format!("attaching TC ingress to {iface}"))?;
            }
        }
        let egress: &mut SchedClassifier = self.program_mut(programs::EGRESS)?.try_into()?;
        egress
            .attach(&iface, TcAttachType::Egress)
            .with_context(|| format!("attaching TC egress to {iface}"))?;
        Ok(())
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
        let value = Config {
            policy: s.policy as u32,
            threshold: s.threshold,
            max_pending: s.max_pending,
            max_pending_client: s.max_pending_client,
            on_overload: s.on_overload as u32,
            mark: s.mark,
            inflight_mask: self.slots.len() as u32 - 1,
            steering_off: u32::from(self.steering_off),
            descriptor: s.descriptor,
        };
        let mut config: Array<_, Config> = Array::try_from(self.map_mut(names::CONFIG)?)?;
        config.set(0, value, 0)?;
        Ok(())
    }

    /// Changes policy and threshold while running.
    pub fn set_policy(&mut self, policy: Policy, threshold: u32) -> Result<()> {
        self.settings.policy = policy;
        self.settings.threshold = threshold;
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
    pub fn drained(&self) -> Result<Vec<SocketAddrV4>> {
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

    /// Pending requests per backend (`issued - completed - expired`).
    pub fn pending(&self) -> Result<Vec<u64>> {
        Ok(self
            .accounting()?
            .into_iter()
            .map(|(issued, completed, expired)| {
                selector_common::pending_of(issued, completed, expired)
            })
            .collect())
    }

    /// (issued, completed, expired) per backend: the raw counters behind
    /// `pending`, for checking that none drifted.
    pub fn accounting(&self) -> Result<Vec<(u64, u64, u64)>> {
        Ok(self
            .backends
            .iter()
            .map(|b| {
                let (group, position) = split_backend_id(b.index);
                let c = self.counters.ptr(group as usize);
                // SAFETY: fields of a live shared element, 8-byte aligned.
                unsafe {
                    (
                        load(&raw mut (*c).issued[position]),
                        load(&raw mut (*c).completed[position]),
                        load(&raw mut (*c).expired[position]),
                    )
                }
            })
            .collect())
    }

    /// Per-backend statistics summed over CPUs.
    pub fn stats(&self) -> Result<Vec<BackendStats>> {
        let stats: PerCpuArray<_, BackendStats> = PerCpuArray::try_from(self.map(names::STATS)?)?;
        self.backends
            .iter()
            .map(|b| {
                let mut total = BackendStats::default();
                for s in stats.get(&b.index, 0)?.iter() {
                    total.add(s);
                }
                Ok(total)
            })
            .collect()
    }

    /// Latency histogram buckets per backend, summed over CPUs.
    pub fn latency(&self) -> Result<Vec<Vec<u64>>> {
        use selector_common::latency::LATENCY_BUCKETS;
        let hist: PerCpuArray<_, u64> = PerCpuArray::try_from(self.map(names::LATENCY)?)?;
        self.backends
            .iter()
            .map(|b| {
                (0..LATENCY_BUCKETS)
                    .map(|i| Ok(hist.get(&(b.index * LATENCY_BUCKETS + i), 0)?.iter().sum()))
                    .collect()
            })
            .collect()
    }

    /// Copies of the requests in flight now (`LIVE` slots).
    pub fn inflight(&self) -> Result<Vec<InflightSlot>> {
        let mut out = Vec::new();
        for i in 0..self.slots.len() {
            // SAFETY: the state word of a live shared element.
            let state = unsafe { load(&raw mut (*self.slots.ptr(i)).state) };
            if phase(state) == PHASE_LIVE && state != 0 {
                let slot = self.slots.read(i);
                if slot.state == state {
                    out.push(slot);
                }
            }
        }
        Ok(out)
    }

    /// Packets passed untouched, by direction and reason, summed over CPUs.
    pub fn passed(&self) -> Result<Vec<(Direction, PassReason, u64)>> {
        let passed: PerCpuArray<_, u64> = PerCpuArray::try_from(self.map(names::PASSED)?)?;
        let mut out = Vec::new();
        for direction in [Direction::Egress, Direction::Ingress] {
            for reason in PassReason::ALL {
                let n = passed.get(&pass_index(direction, reason), 0)?.iter().sum();
                out.push((direction, reason, n));
            }
        }
        Ok(out)
    }

    /// Passes kernel log records (rare events only) to the logger.
    pub fn flush_kernel_logs(&mut self) {
        if let Some(l) = self.logger.as_mut() {
            l.flush();
        }
    }

    /// Backend index of `addr`, if configured.
    pub fn backend_index(&self, addr: SocketAddrV4) -> Option<u32> {
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
