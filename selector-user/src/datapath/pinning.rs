//! Pinning: `selector run --pin DIR` keeps the maps and links on a bpf
//! filesystem so the kernel programs outlive the agent, a later agent with
//! the same DIR adopts them, and `selector detach` removes them.
//!
//! Layout, one directory per interface (agents in different network
//! namespaces need different DIRs):
//!
//! ```text
//! DIR/IF/maps/CONFIG ... NEXT_HOPS   every map of the object (aya's log map aside)
//! DIR/IF/links/egress                the TCX egress link
//! DIR/IF/links/ingress_xdp | ingress_tc
//! DIR/IF/progs/egress, progs/ingress the programs the links run (for inspection)
//! ```
//!
//! The maps are reused through `EbpfLoader::map_pin_path`, which aya 0.14
//! applies to any map it names, declared pinned or not: the kernel object
//! stays as it is, and an agent without `--pin` gets private maps as before.
//! aya does not check that a pinned map fits the object, so
//! [`PinDir::check_adoptable`] does, before anything is loaded.

use std::{
    collections::HashMap as StdHashMap,
    ffi::CString,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    os::{fd::AsFd as _, unix::ffi::OsStrExt as _},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    maps::{Array, Map, MapData, MapInfo, MapType},
    programs::{
        ProgramInfo, SchedClassifier, TcAttachType,
        links::{FdLink, LinkType, PinnedLink},
        loaded_links, loaded_programs,
    },
};
use selector_common::{
    BackendStats, CLIENT_SLOTS, Config, Endpoint, Group, GroupCounters, GroupService, MAX_BACKENDS,
    MAX_GROUP_MEMBERS, MAX_GROUPS, NextHopMac, PASS_REASONS,
    fragments::{FRAGMENTS_MAX, FragmentEntry, FragmentKey},
    hedge,
    inflight::{InflightSlot, PHASE_LIVE, mark_words, phase, slots_for},
    latency::LATENCY_BUCKETS,
    names,
};

use crate::{
    api,
    config::settings::{IngressMode, Settings},
    datapath::attachment::{TcxSide, tcx_program_ids},
    host::shared::{SharedArray, load},
    host::sys,
};

/// Where `--pin` without a value pins.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/selector";

/// `statfs` type of a bpf filesystem.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Maps private to each load: aya-log's records, the read-only constants
/// (`.rodata*`, frozen at load) and the map of the benchmark's reference
/// programs, which are never attached. Anything else holds state.
pub fn is_private_map(name: &str) -> bool {
    name == "AYA_LOGS" || name.starts_with(".rodata") || name == selector_common::names::REFERENCE
}

/// A link the selector pins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkSlot {
    Egress,
    IngressXdp,
    IngressTc,
}

impl LinkSlot {
    pub fn file(self) -> &'static str {
        match self {
            Self::Egress => "egress",
            Self::IngressXdp => "ingress_xdp",
            Self::IngressTc => "ingress_tc",
        }
    }

    pub fn ingress(mode: IngressMode) -> Self {
        match mode {
            IngressMode::Xdp => Self::IngressXdp,
            // `auto` is resolved before anything is attached; TC is what it
            // picks when unsure.
            IngressMode::Tc | IngressMode::Auto => Self::IngressTc,
        }
    }

    const ALL: [Self; 3] = [Self::Egress, Self::IngressXdp, Self::IngressTc];
}

/// What a pinned map must look like to be reused by this build.
struct Shape {
    name: &'static str,
    map_type: MapType,
    key_size: usize,
    value_size: usize,
    max_entries: u32,
}

/// Every map the selector pins, with its shape under `inflight_max`. The
/// sizes are those of the `selector-common` types the kernel object's maps
/// are declared with (`selector-ebpf/src/maps.rs`); a loaded map missing
/// here fails the pinned load (see `loader`), so the two stay in step.
fn shapes(inflight_max: u32) -> [Shape; 18] {
    let shape = |name, map_type, key_size, value_size, max_entries| Shape {
        name,
        map_type,
        key_size,
        value_size,
        max_entries,
    };
    let u32s = size_of::<u32>();
    let u64s = size_of::<u64>();
    [
        shape(names::CONFIG, MapType::Array, u32s, size_of::<Config>(), 1),
        shape(
            names::BACKENDS,
            MapType::Hash,
            size_of::<Endpoint>(),
            u32s,
            MAX_BACKENDS,
        ),
        shape(
            names::GROUPS,
            MapType::Array,
            u32s,
            size_of::<Group>(),
            MAX_GROUPS,
        ),
        shape(
            names::COUNTERS,
            MapType::Array,
            u32s,
            size_of::<GroupCounters>(),
            MAX_GROUPS,
        ),
        shape(
            names::CLIENT_PENDING,
            MapType::Array,
            u32s,
            u64s,
            CLIENT_SLOTS,
        ),
        shape(
            names::INFLIGHT,
            MapType::Array,
            u32s,
            size_of::<InflightSlot>(),
            slots_for(inflight_max),
        ),
        shape(
            names::INFLIGHT_MARKS,
            MapType::Array,
            u32s,
            u64s,
            mark_words(slots_for(inflight_max)),
        ),
        shape(names::SEQUENCE, MapType::PerCpuArray, u32s, u64s, 1),
        shape(
            names::SERVICE,
            MapType::Array,
            u32s,
            size_of::<GroupService>(),
            MAX_GROUPS,
        ),
        shape(names::SCRATCH, MapType::PerCpuArray, u32s, 2 * u64s, 1),
        shape(
            names::STATS,
            MapType::PerCpuArray,
            u32s,
            size_of::<BackendStats>(),
            MAX_BACKENDS,
        ),
        shape(
            names::PASSED,
            MapType::PerCpuArray,
            u32s,
            u64s,
            2 * PASS_REASONS,
        ),
        shape(
            names::LATENCY,
            MapType::PerCpuArray,
            u32s,
            u64s,
            MAX_BACKENDS * LATENCY_BUCKETS,
        ),
        shape(
            names::FRAGMENTS,
            MapType::LruHash,
            size_of::<FragmentKey>(),
            size_of::<FragmentEntry>(),
            FRAGMENTS_MAX,
        ),
        shape(
            names::NEXT_HOPS,
            MapType::Array,
            u32s,
            size_of::<NextHopMac>(),
            MAX_BACKENDS,
        ),
        shape(
            hedge::names::CONFIG,
            MapType::Array,
            u32s,
            size_of::<hedge::HedgeConfig>(),
            1,
        ),
        // A ring buffer has no keys or values; its size is its entries.
        shape(
            hedge::names::EVENTS,
            MapType::RingBuf,
            0,
            0,
            hedge::RING_BYTES,
        ),
        shape(
            hedge::names::STATS,
            MapType::PerCpuArray,
            u32s,
            size_of::<hedge::HedgeStats>(),
            MAX_BACKENDS,
        ),
    ]
}

/// Names of the maps the selector pins.
pub fn pinned_map_names() -> Vec<&'static str> {
    shapes(1).iter().map(|s| s.name).collect()
}

/// The pin directory of one interface, `DIR/IF`.
#[derive(Clone, Debug)]
pub struct PinDir {
    root: PathBuf,
}

impl PinDir {
    /// For `run --pin DIR`: makes sure DIR is on a bpf filesystem (DIR may
    /// itself be a bpffs mount; else, when DIR is under /sys/fs/bpf and no
    /// bpffs is there, mounting one, mode 0700), and creates `DIR/IF` and
    /// its subdirectories.
    pub fn prepare(dir: &Path, iface: &str) -> Result<Self> {
        ensure_bpffs(dir)?;
        let pins = Self::at(dir, iface)?;
        for sub in ["maps", "links", "progs"] {
            let path = pins.root.join(sub);
            std::fs::create_dir_all(&path)
                .with_context(|| format!("creating {}", path.display()))?;
        }
        Ok(pins)
    }

    /// For `detach --pin DIR`: `DIR/IF` as it is (it may hold nothing).
    pub fn at(dir: &Path, iface: &str) -> Result<Self> {
        if iface.is_empty() || iface.contains('/') || iface == "." || iface == ".." {
            bail!("bad interface name '{iface}'");
        }
        Ok(Self {
            root: dir.join(iface),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn map_path(&self, name: &str) -> PathBuf {
        self.root.join("maps").join(name)
    }

    pub fn link_path(&self, slot: LinkSlot) -> PathBuf {
        self.root.join("links").join(slot.file())
    }

    pub fn prog_path(&self, name: &str) -> PathBuf {
        self.root.join("progs").join(name)
    }

    /// Whether an earlier agent left maps here: this agent adopts them.
    pub fn has_maps(&self) -> bool {
        pinned_map_names()
            .iter()
            .any(|name| self.map_path(name).exists())
    }

    /// Checks that the pinned state can be adopted with `settings`: every
    /// map has this build's shape (the in-flight table the size
    /// `--inflight-max` asks for), the groups are the same, and the ingress
    /// link is of the kind `--ingress` asks for. `groups` is what the agent
    /// would write to `GROUPS` (drain bits aside).
    pub fn check_adoptable(
        &self,
        settings: &Settings,
        groups: &StdHashMap<u32, Group>,
    ) -> Result<()> {
        let detach_first = format!(
            "to start afresh, run `selector detach --iface {} --pin {}` first (it stops steering and removes the pins)",
            settings.iface,
            self.root.parent().unwrap_or(Path::new("/")).display()
        );
        for shape in shapes(settings.inflight_max) {
            let path = self.map_path(shape.name);
            if !path.exists() {
                bail!(
                    "{} holds some of the selector's maps but not {}: {detach_first}",
                    self.root.display(),
                    shape.name
                );
            }
            let info = MapInfo::from_pin(&path)
                .with_context(|| format!("opening the pinned map {}", path.display()))?;
            let found = (
                info.map_type().ok(),
                info.key_size() as usize,
                info.value_size() as usize,
            );
            if found != (Some(shape.map_type), shape.key_size, shape.value_size) {
                bail!(
                    "the pinned map {} has another layout than this build's ({:?}, key {} bytes, value {} bytes; this build: {:?}, {}, {}): {detach_first}",
                    shape.name,
                    found.0,
                    found.1,
                    found.2,
                    shape.map_type,
                    shape.key_size,
                    shape.value_size
                );
            }
            if info.max_entries() != shape.max_entries {
                if shape.name == names::INFLIGHT {
                    bail!(
                        "--inflight-max differs from the pinned agent's: its in-flight table has {} slots, --inflight-max {} needs {}: {detach_first}",
                        info.max_entries(),
                        settings.inflight_max,
                        shape.max_entries
                    );
                }
                bail!(
                    "the pinned map {} has {} entries, this build {}: {detach_first}",
                    shape.name,
                    info.max_entries(),
                    shape.max_entries
                );
            }
        }
        let wanted = LinkSlot::ingress(settings.ingress);
        for other in [LinkSlot::IngressXdp, LinkSlot::IngressTc] {
            if other != wanted && self.link_path(other).exists() {
                bail!(
                    "--ingress differs from the pinned agent's: its reply path is pinned as {} ({}): {detach_first}",
                    other.file(),
                    self.link_path(other).display()
                );
            }
        }
        let pinned = pinned_groups(&self.map_path(names::GROUPS))?;
        // No group at all: an agent stopped before it wrote its tables.
        let configured = pinned.iter().any(|g| g.len != 0);
        for g in (0..MAX_GROUPS).filter(|_| configured) {
            let want = groups.get(&g).copied().unwrap_or_default();
            let have = pinned.get(g as usize).copied().unwrap_or_default();
            if want.endpoints != have.endpoints || want.len != have.len {
                bail!(
                    "--group differs from the pinned agent's: group {} is {} there, {} here: {detach_first}",
                    g + 1,
                    render_group(&have),
                    render_group(&want)
                );
            }
        }
        Ok(())
    }

    /// The drain bits of the pinned groups (adopted with them).
    pub fn pinned_active(&self) -> Result<Vec<u32>> {
        Ok(pinned_groups(&self.map_path(names::GROUPS))?
            .iter()
            .map(|g| g.active)
            .collect())
    }

    /// The link pinned at `slot`, if any, checked to be attached to
    /// `iface` in this network namespace (a pin made in another namespace
    /// or for an interface since re-created is refused).
    pub fn pinned_link(&self, slot: LinkSlot, iface: &str) -> Result<Option<FdLink>> {
        let path = self.link_path(slot);
        if !path.exists() {
            return Ok(None);
        }
        let link: FdLink = PinnedLink::from_pin(&path)
            .with_context(|| format!("opening the pinned link {}", path.display()))?
            .into();
        let program = link.info()?.program_id();
        if slot != LinkSlot::IngressXdp {
            let side = if slot == LinkSlot::Egress {
                TcxSide::Egress
            } else {
                TcxSide::Ingress
            };
            // Ids only: opening the programs by id (aya's `query_tcx`)
            // takes CAP_SYS_ADMIN, which the agent runs without.
            let attached = tcx_program_ids(crate::host::interface::index(iface)?, side)
                .with_context(|| format!("querying the TCX programs of {iface}"))?;
            if !attached.contains(&program) {
                bail!(
                    "the link pinned at {} is not attached to {iface} in this network namespace (pinned for another namespace, or the interface was re-created); run `selector detach --iface {iface} --pin DIR` first",
                    path.display()
                );
            }
        }
        Ok(Some(link))
    }

    /// Pins `link` at `slot`.
    pub fn pin_link(&self, slot: LinkSlot, link: FdLink) -> Result<()> {
        let path = self.link_path(slot);
        link.pin(&path)
            .with_context(|| format!("pinning the link at {}", path.display()))?;
        Ok(())
    }

    /// Pins `program` as `progs/NAME`, replacing an earlier agent's.
    pub fn pin_program(&self, program: &mut aya::programs::Program, name: &str) -> Result<()> {
        let path = self.prog_path(name);
        remove_if_present(&path)?;
        program
            .pin(&path)
            .with_context(|| format!("pinning the program at {}", path.display()))
    }
}

fn remove_if_present(path: &Path) -> Result<bool> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| format!("removing {}", path.display())),
    }
}

fn pinned_groups(path: &Path) -> Result<Vec<Group>> {
    let data = MapData::from_pin(path).with_context(|| format!("opening {}", path.display()))?;
    let groups: Array<_, Group> = Array::try_from(Map::Array(data))?;
    (0..MAX_GROUPS)
        .map(|g| Ok(groups.get(&g, 0)?))
        .collect::<Result<_>>()
}

fn render_group(g: &Group) -> String {
    if g.len == 0 {
        return "absent".into();
    }
    g.endpoints[..(g.len as usize).min(MAX_GROUP_MEMBERS)]
        .iter()
        .map(|e| match e.ipv4_octets() {
            Some(o) => SocketAddr::new(std::net::Ipv4Addr::from(o).into(), e.port).to_string(),
            None => SocketAddr::new(std::net::Ipv6Addr::from(e.addr).into(), e.port).to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn statfs_type(path: &Path) -> Option<i64> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: a valid path and a zeroed statfs for the kernel to fill.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0).then_some(st.f_type)
}

/// Whether a bpf filesystem is mounted at `path` (per /proc/self/mounts).
fn bpffs_mounted_at(path: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mounts").is_ok_and(|mounts| {
        mounts.lines().any(|l| {
            let mut f = l.split_whitespace();
            let (_, at, kind) = (f.next(), f.next(), f.next());
            at == path.to_str() && kind == Some("bpf")
        })
    })
}

/// Whether this process shares the mount namespace of PID 1.
fn in_initial_mount_namespace() -> bool {
    let ino = |p: &str| std::fs::metadata(p).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
    matches!((ino("/proc/self/ns/mnt"), ino("/proc/1/ns/mnt")), (Ok(a), Ok(b)) if a == b)
}

/// Makes sure `dir` is (or will be created) on a bpf filesystem.
fn ensure_bpffs(dir: &Path) -> Result<()> {
    if !dir.is_absolute() {
        bail!("--pin needs an absolute path, got {}", dir.display());
    }
    // The deepest existing ancestor decides which filesystem DIR is on: a
    // bpffs mounted at DIR itself (a pod given only its own directory of
    // the host's bpffs) or anywhere above it needs nothing mounted here.
    let on_bpffs = |dir: &Path| {
        let existing = dir
            .ancestors()
            .find(|p| p.exists())
            .unwrap_or(Path::new("/"));
        (
            statfs_type(existing) == Some(BPF_FS_MAGIC),
            existing.to_path_buf(),
        )
    };
    let sys_bpf = Path::new("/sys/fs/bpf");
    if dir.starts_with(sys_bpf) && !on_bpffs(dir).0 && !bpffs_mounted_at(sys_bpf) {
        if !in_initial_mount_namespace() {
            // `ip netns exec`, for one, runs commands in a mount namespace of
            // their own with a fresh /sys: a bpffs mounted there would go
            // away with the agent, and the pins with it.
            bail!(
                "no bpf filesystem at /sys/fs/bpf, and this process has a mount namespace of its own (as under `ip netns exec`): one mounted here would vanish with the agent and take the pins with it; mount one where it outlives the agent (e.g. `mount -t bpf bpf /sys/fs/bpf` on the host, or `mount -t bpf bpf /run/selector-bpf`) and pass a directory on it"
            );
        }
        std::fs::create_dir_all(sys_bpf).context("creating /sys/fs/bpf")?;
        let (src, kind, target) = (c"bpf", c"bpf", c"/sys/fs/bpf");
        // Root's alone, as systemd mounts it: the pins hold the steering.
        let options = c"mode=0700";
        // SAFETY: valid NUL-terminated strings.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                kind.as_ptr(),
                0,
                options.as_ptr().cast(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("mounting bpffs at /sys/fs/bpf");
        }
        println!("selector: mounted a bpf filesystem at /sys/fs/bpf (mode 0700)");
    }
    let (on, existing) = on_bpffs(dir);
    if !on {
        bail!(
            "--pin {}: {} is not on a bpf filesystem (bpffs); pass a directory under /sys/fs/bpf or under another bpffs mount",
            dir.display(),
            existing.display()
        );
    }
    Ok(())
}

/// Whether an agent serves the control socket of `iface` in this network
/// namespace.
pub fn agent_running(iface: &str) -> Result<bool> {
    let address = api::address(iface)?;
    Ok(std::os::unix::net::UnixListener::bind_addr(&address)
        .is_err_and(|e| e.kind() == std::io::ErrorKind::AddrInUse))
}

/// Names of the selector's programs (the kernel keeps 15 characters).
fn is_selector_program(p: &ProgramInfo) -> bool {
    p.name_as_str().is_some_and(|n| n.starts_with("selector_"))
}

/// The selector programs attached to `iface` through TCX in direction
/// `attach`. Empty on kernels without TCX.
pub fn tcx_programs_at(iface: &str, attach: TcAttachType) -> Vec<ProgramInfo> {
    match SchedClassifier::query_tcx(iface, attach) {
        Ok((_, programs)) => programs.into_iter().filter(is_selector_program).collect(),
        Err(e) => {
            log::debug!("TCX query of {iface}: {e}");
            Vec::new()
        }
    }
}

/// The selector programs attached to `iface` through TCX (egress, then
/// ingress).
pub fn tcx_programs_on(iface: &str) -> Result<Vec<ProgramInfo>> {
    let mut out = tcx_programs_at(iface, TcAttachType::Egress);
    out.extend(tcx_programs_at(iface, TcAttachType::Ingress));
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
            let Ok(entries) = std::fs::read_dir(self.root.join(sub)) else {
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
            let dir = self.root.join(sub);
            if dir.exists() {
                std::fs::remove_dir(&dir).with_context(|| format!("removing {}", dir.display()))?;
            }
        }
        std::fs::remove_dir(&self.root).with_context(|| {
            format!(
                "removing {} (something else is in it?)",
                self.root.display()
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

/// Issues one bpf(2) command with a 16-byte attribute.
fn bpf(cmd: libc::c_long, attr: &[u32; 4]) -> libc::c_long {
    // SAFETY: attr is a valid bpf_attr prefix of the given size.
    unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_ptr(), size_of_val(attr) as u32) }
}

/// BPF_OBJ_GET: a descriptor for a pinned object (needs no CAP_SYS_ADMIN,
/// unlike getting one by id).
fn open_pinned(path: &Path) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd as _;
    let name = CString::new(path.as_os_str().as_bytes())?;
    // pathname (u64), bpf_fd, file_flags.
    let attr: [u64; 2] = [name.as_ptr() as u64, 0];
    // SAFETY: attr is a valid bpf_attr prefix; name outlives the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            attr.as_ptr(),
            size_of_val(&attr) as u32,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("BPF_OBJ_GET");
    }
    // SAFETY: a descriptor the kernel just gave us, owned from here on.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// BPF_LINK_DETACH: the link stays (pins and holders keep it) but no longer
/// attaches its program, at once (dropping a link's last reference detaches
/// it only later, from a work queue).
fn detach_link(link: &std::os::fd::OwnedFd) -> Result<()> {
    use std::os::fd::AsRawFd as _;
    if bpf(BPF_LINK_DETACH, &[link.as_raw_fd() as u32, 0, 0, 0]) < 0 {
        return Err(std::io::Error::last_os_error()).context("BPF_LINK_DETACH");
    }
    Ok(())
}

/// BPF_LINK_GET_FD_BY_ID (CAP_SYS_ADMIN), then [`detach_link`].
fn force_detach_link(id: u32) -> Result<()> {
    use std::os::fd::FromRawFd as _;
    let fd = bpf(BPF_LINK_GET_FD_BY_ID, &[id, 0, 0, 0]);
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("BPF_LINK_GET_FD_BY_ID");
    }
    // SAFETY: a descriptor the kernel just gave us, owned from here on.
    detach_link(&unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}
