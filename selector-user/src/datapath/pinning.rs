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
    ffi::CString,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use aya::{
    maps::{MapInfo, MapType},
    programs::links::{FdLink, PinnedLink},
};
use selector_common::{
    BackendStats, CLIENT_SLOTS, Config, Endpoint, Group, GroupCounters, GroupHealth, GroupService,
    MAX_BACKENDS, MAX_GROUPS, NextHopMac, PASS_REASONS, PORT_WORDS,
    fragments::{FRAGMENTS_MAX, FragmentEntry, FragmentKey},
    hedge,
    inflight::{InflightSlot, mark_words, slots_for},
    latency::LATENCY_BUCKETS,
    names,
};

use crate::{
    config::settings::{ReplyPath, Settings},
    host::tcx::{TcxSide, program_ids as tcx_program_ids},
};

/// Where `--pin` without a value pins.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/selector";

/// `statfs` type of a bpf filesystem.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Maps private to each load: aya-log's records, the read-only constants
/// (`.rodata*`, frozen at load) and the reply path's per-packet working
/// memory. Anything else holds state.
pub fn is_private_map(name: &str) -> bool {
    name == "AYA_LOGS"
        || name.starts_with(".rodata")
        || name == selector_common::names::REPLY_SCRATCH
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

    pub fn ingress(path: ReplyPath) -> Self {
        match path {
            ReplyPath::Xdp => Self::IngressXdp,
            ReplyPath::Tc => Self::IngressTc,
        }
    }

    pub(crate) const ALL: [Self; 3] = [Self::Egress, Self::IngressXdp, Self::IngressTc];
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
fn shapes(inflight_max: u32) -> [Shape; 21] {
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
        shape(names::MEMBER_PORTS, MapType::Array, u32s, u64s, PORT_WORDS),
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
        shape(
            names::HEALTH,
            MapType::Array,
            u32s,
            size_of::<GroupHealth>(),
            MAX_GROUPS,
        ),
        shape(
            names::SCRATCH,
            MapType::PerCpuArray,
            u32s,
            2 * u64s,
            selector_common::SCRATCH_ENTRIES,
        ),
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
        shape(names::PULLED, MapType::PerCpuArray, u32s, u64s, 2),
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
        crate::config::settings::check_iface_name(iface)?;
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
    pub fn check_adoptable(&self, settings: &Settings, reply_path: ReplyPath) -> Result<()> {
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
        let wanted = LinkSlot::ingress(reply_path);
        for other in [LinkSlot::IngressXdp, LinkSlot::IngressTc] {
            if other != wanted && self.link_path(other).exists() {
                bail!(
                    "--ingress differs from the pinned agent's: its reply path is pinned as {} ({}): {detach_first}",
                    other.file(),
                    self.link_path(other).display()
                );
            }
        }
        Ok(())
    }

    /// The reply path whose link an earlier agent pinned, if one is.
    pub fn pinned_reply_path(&self) -> Option<ReplyPath> {
        [ReplyPath::Xdp, ReplyPath::Tc]
            .into_iter()
            .find(|p| self.link_path(LinkSlot::ingress(*p)).exists())
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

pub(crate) fn remove_if_present(path: &Path) -> Result<bool> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| format!("removing {}", path.display())),
    }
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
        log::info!("mounted a bpf filesystem at /sys/fs/bpf (mode 0700)");
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
