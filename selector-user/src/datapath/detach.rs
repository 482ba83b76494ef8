//! Taking the selector off an interface without a running agent
//! (`selector detach`): the links an agent pinned (stopping steering first
//! and waiting for the redirected reads), or any selector links and tc
//! filters left on the interface; and the TCX queries that find them.

use std::{
    collections::HashMap as StdHashMap,
    ffi::CString,
    net::{IpAddr, Ipv6Addr},
    os::{fd::AsFd as _, unix::ffi::OsStrExt as _},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    maps::{Array, Map, MapData},
    programs::{
        ProgramInfo, SchedClassifier, TcAttachType, links::LinkType, loaded_links, loaded_programs,
    },
};
use selector_common::{
    Config, Endpoint,
    inflight::{InflightSlot, PHASE_LIVE, phase},
    names,
};

use crate::{
    datapath::pinning::{LinkSlot, PinDir, remove_if_present},
    host::interface,
    host::shared::{SharedArray, load},
    host::sys,
    host::tcx::{self, TcxSide},
};

/// Names of the selector's programs (the kernel keeps 15 characters).
fn is_selector_program(p: &ProgramInfo) -> bool {
    p.name_as_str().is_some_and(|n| n.starts_with("selector_"))
}

/// The TCX chain `side` of `ifindex` as the agent can see it with its
/// capabilities: the ids of programs named as the selector's, and those
/// it could not name (opening a program by id takes CAP_SYS_ADMIN).
/// Empty on kernels without TCX.
#[derive(Debug, Default)]
pub struct TcxChain {
    pub selector: Vec<u32>,
    pub unnamed: Vec<u32>,
}

pub fn tcx_chain(ifindex: u32, side: TcxSide) -> Result<TcxChain> {
    let mut chain = TcxChain::default();
    let ids = match tcx::program_ids(ifindex, side) {
        Ok(ids) => ids,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(chain),
        Err(e) => return Err(e).context("querying a TCX chain (BPF_PROG_QUERY)"),
    };
    for id in ids {
        match tcx::program_name(id) {
            Ok(name) if name.starts_with("selector_") => chain.selector.push(id),
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => chain.unnamed.push(id),
            // Detached and freed since the query.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e).with_context(|| format!("naming TCX program {id}")),
        }
    }
    Ok(chain)
}

/// The selector programs attached to `iface` through TCX in direction
/// `attach` (empty on kernels without TCX), to detach them: this opens
/// every program of the chain, which takes CAP_SYS_ADMIN once another
/// component's program is there; a refusal is an error, never "none".
pub fn tcx_programs_at(iface: &str, attach: TcAttachType) -> Result<Vec<ProgramInfo>> {
    let side = match attach {
        TcAttachType::Egress => TcxSide::Egress,
        _ => TcxSide::Ingress,
    };
    let ifindex = interface::index(iface)?;
    let ids = match tcx::program_ids(ifindex, side) {
        Ok(ids) => ids,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("querying the TCX programs of {iface}")),
    };
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let (_, programs) = SchedClassifier::query_tcx(iface, attach).with_context(|| {
        format!("naming the TCX programs of {iface} (opening a program by id needs CAP_SYS_ADMIN)")
    })?;
    Ok(programs.into_iter().filter(is_selector_program).collect())
}

/// The selector programs attached to `iface` through TCX (egress, then
/// ingress).
pub fn tcx_programs_on(iface: &str) -> Result<Vec<ProgramInfo>> {
    let mut out = tcx_programs_at(iface, TcAttachType::Egress)?;
    out.extend(tcx_programs_at(iface, TcAttachType::Ingress)?);
    Ok(out)
}

/// What `detach` removed.
#[derive(Debug, Default)]
pub struct Removed {
    pub links: Vec<String>,
    pub maps: usize,
    pub programs: usize,
    /// Redirected reads still unanswered when the reply path went.
    pub waited_out: usize,
}

/// `selector detach --pin`: stops steering, waits up to `wait` for the
/// redirected reads in flight, unpins the egress link and then the ingress
/// link (which detaches them: nothing else holds them once no agent runs),
/// and removes every pin and `DIR/IF` itself.
pub fn detach_pinned(pins: &PinDir, wait: Duration) -> Result<Removed> {
    if !pins.root().exists() {
        bail!("nothing is pinned under {}", pins.root().display());
    }
    let mut removed = Removed::default();
    if pins.map_path(names::CONFIG).exists() && pins.map_path(names::INFLIGHT).exists() {
        stop_steering(&pins.map_path(names::CONFIG))?;
        removed.waited_out = wait_for_redirected(&pins.map_path(names::INFLIGHT), wait)?;
    }
    pins.remove_all(&mut removed)?;
    if removed.links.is_empty() && removed.maps == 0 {
        bail!(
            "nothing of the selector was pinned under {} (the empty directory is removed)",
            pins.root().display()
        );
    }
    Ok(removed)
}

impl PinDir {
    /// Unpins the links (egress first), then the programs and maps, and
    /// removes `DIR/IF`.
    pub fn remove_all(&self, removed: &mut Removed) -> Result<()> {
        for slot in LinkSlot::ALL {
            let path = self.link_path(slot);
            // Detached explicitly: the unpin alone would detach it a moment
            // later, and the caller expects it gone on return.
            if let Ok(link) = open_pinned(&path) {
                detach_link(&link).with_context(|| format!("detaching {}", path.display()))?;
            }
            if remove_if_present(&path)? {
                removed.links.push(slot.file().to_string());
            }
        }
        for sub in ["progs", "maps"] {
            let Ok(entries) = std::fs::read_dir(self.root().join(sub)) else {
                continue;
            };
            for entry in entries {
                remove_if_present(&entry?.path())?;
                if sub == "maps" {
                    removed.maps += 1;
                } else {
                    removed.programs += 1;
                }
            }
        }
        for sub in ["links", "progs", "maps"] {
            let dir = self.root().join(sub);
            if dir.exists() {
                std::fs::remove_dir(&dir).with_context(|| format!("removing {}", dir.display()))?;
            }
        }
        std::fs::remove_dir(self.root()).with_context(|| {
            format!(
                "removing {} (something else is in it?)",
                self.root().display()
            )
        })
    }
}

fn stop_steering(config: &Path) -> Result<()> {
    let data = MapData::from_pin(config)?;
    let mut config: Array<_, Config> = Array::try_from(Map::Array(data))?;
    let mut value = config.get(&0, 0)?;
    value.steering_off = 1;
    config.set(0, value, 0)?;
    Ok(())
}

/// Waits until no redirected read younger than `wait` is live in the
/// pinned in-flight table; returns how many were left when it gave up.
fn wait_for_redirected(inflight: &Path, wait: Duration) -> Result<usize> {
    let data = MapData::from_pin(inflight)?;
    let len = data.info()?.max_entries() as usize;
    let slots: SharedArray<InflightSlot> = SharedArray::map(data.fd().as_fd(), len)
        .with_context(|| format!("mapping {}", inflight.display()))?;
    let give_up = Instant::now() + wait;
    let wait_ns = wait.as_nanos() as u64;
    loop {
        let now = sys::monotonic_ns();
        let waiting = (0..slots.len())
            .filter(|&i| {
                // SAFETY: the state word of a live shared element.
                let state = unsafe { load(&raw mut (*slots.ptr(i)).state) };
                if state == 0 || phase(state) != PHASE_LIVE {
                    return false;
                }
                let s = slots.read(i);
                s.primary != s.chosen && now.saturating_sub(s.sent_ns) < wait_ns
            })
            .count();
        if waiting == 0 || Instant::now() >= give_up {
            return Ok(waiting);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `selector detach` without `--pin`: force-detaches the selector's links
/// on `iface` (TCX egress and ingress, and the XDP link whose program
/// shares the egress program's maps), pinned somewhere or not. Returns
/// what was detached, as "kind program-id".
pub fn detach_attached(iface: &str) -> Result<Vec<String>> {
    let tcx = tcx_programs_on(iface)?;
    let egress_maps: Vec<u32> = tcx
        .iter()
        .filter_map(|p| p.map_ids().ok().flatten())
        .flatten()
        .collect();
    let mut targets: Vec<(u32, &'static str)> = tcx.iter().map(|p| (p.id(), "tcx")).collect();
    if !egress_maps.is_empty() {
        let programs: StdHashMap<u32, ProgramInfo> = loaded_programs()
            .filter_map(Result::ok)
            .map(|p| (p.id(), p))
            .collect();
        for link in loaded_links().filter_map(Result::ok) {
            if link.link_type().ok() != Some(LinkType::Xdp) {
                continue;
            }
            let shares_maps = programs.get(&link.program_id()).is_some_and(|p| {
                is_selector_program(p)
                    && p.map_ids()
                        .ok()
                        .flatten()
                        .is_some_and(|ids| ids.iter().any(|id| egress_maps.contains(id)))
            });
            if shares_maps {
                targets.push((link.program_id(), "xdp"));
            }
        }
    }
    let mut done = Vec::new();
    for link in loaded_links().filter_map(Result::ok) {
        let Some((_, kind)) = targets.iter().find(|(id, _)| *id == link.program_id()) else {
            continue;
        };
        if !matches!(link.link_type(), Ok(LinkType::Tcx | LinkType::Xdp)) {
            continue;
        }
        force_detach_link(link.id())
            .with_context(|| format!("detaching link {} of {iface}", link.id()))?;
        done.push(format!("{kind} program {}", link.program_id()));
    }
    // Legacy tc filters (kernels without TCX, or SELECTOR_TC_ATTACH=netlink)
    // are found by name.
    done.extend(crate::host::tc_attach::detach_filters(
        iface,
        &[
            (selector_common::programs::EGRESS, TcAttachType::Egress),
            (selector_common::programs::INGRESS_TC, TcAttachType::Ingress),
        ],
    )?);
    if done.is_empty() && !targets.is_empty() {
        return Err(anyhow!(
            "selector programs are attached to {iface} but not through links this command can detach (netlink TC?)"
        ));
    }
    Ok(done)
}

/// The members' addresses (retiring ones too) in the `BACKENDS` map of
/// the selector pinned under `pins`, or else of the one attached to
/// `iface`: those whose next hops its agent marked managed. Read before
/// a detach drops the map; empty if there is none.
pub fn member_addresses(iface: &str, pins: Option<&PinDir>) -> Vec<IpAddr> {
    let map = match pins {
        Some(pins) => MapData::from_pin(pins.map_path(names::BACKENDS)).ok(),
        None => tcx_programs_at(iface, TcAttachType::Egress)
            .unwrap_or_else(|e| {
                log::debug!("{e:#}");
                Vec::new()
            })
            .iter()
            .filter_map(|p| p.map_ids().ok().flatten())
            .flatten()
            .filter_map(|id| MapData::from_id(id).ok())
            .find(|m| {
                m.info()
                    .is_ok_and(|i| i.name_as_str() == Some(names::BACKENDS))
            }),
    };
    let Some(backends) =
        map.and_then(|m| aya::maps::HashMap::<_, Endpoint, u32>::try_from(Map::HashMap(m)).ok())
    else {
        return Vec::new();
    };
    let mut addrs: Vec<IpAddr> = backends
        .keys()
        .filter_map(Result::ok)
        .map(|e| {
            e.ipv4_octets()
                .map_or(IpAddr::V6(Ipv6Addr::from(e.addr)), |o| IpAddr::V4(o.into()))
        })
        .collect();
    addrs.sort();
    addrs.dedup();
    addrs
}

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;
const BPF_LINK_DETACH: libc::c_long = 34;

/// BPF_OBJ_GET: a descriptor for a pinned object (needs no CAP_SYS_ADMIN,
/// unlike getting one by id).
fn open_pinned(path: &Path) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd as _;
    let name = CString::new(path.as_os_str().as_bytes())?;
    // pathname (u64), bpf_fd, file_flags.
    let mut attr: [u64; 2] = [name.as_ptr() as u64, 0];
    // SAFETY: attr is a valid bpf_attr prefix; name outlives the call.
    let fd = unsafe { sys::bpf(BPF_OBJ_GET, &mut attr) }.context("BPF_OBJ_GET")?;
    // SAFETY: a descriptor the kernel just gave us, owned from here on.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// BPF_LINK_DETACH: the link stays (pins and holders keep it) but no longer
/// attaches its program, at once (dropping a link's last reference detaches
/// it only later, from a work queue).
fn detach_link(link: &std::os::fd::OwnedFd) -> Result<()> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: link_fd, then unused fields.
    unsafe { sys::bpf(BPF_LINK_DETACH, &mut [link.as_raw_fd() as u32, 0, 0, 0]) }
        .context("BPF_LINK_DETACH")?;
    Ok(())
}

/// BPF_LINK_GET_FD_BY_ID (CAP_SYS_ADMIN), then [`detach_link`].
fn force_detach_link(id: u32) -> Result<()> {
    use std::os::fd::FromRawFd as _;
    // SAFETY: link_id, then unused fields.
    let fd = unsafe { sys::bpf(BPF_LINK_GET_FD_BY_ID, &mut [id, 0, 0, 0]) }
        .context("BPF_LINK_GET_FD_BY_ID")?;
    // SAFETY: a descriptor the kernel just gave us, owned from here on.
    detach_link(&unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}
