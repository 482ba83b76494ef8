//! The maps. Each has a fixed bound and a defined behaviour when full:
//! - `INFLIGHT` (slots): no free slot in a key's probe window, the request
//!   passes untracked and is counted (`INFLIGHT_MARKS` has a bit per slot);
//! - `FRAGMENTS` (LRU): the least recently used fragment series is
//!   forgotten; its later fragments then pass unrewritten, counted, as any
//!   lost fragment would (series also end with their last fragment and
//!   after `FRAGMENT_TTL_NS`);
//! - `HEDGE_EVENTS` (ring buffer): no room, the read is not hedged, counted
//!   (`ring_full`);
//! - the arrays are indexed by ids the agent bounds at configuration.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use selector_common::{
    BackendStats, CLIENT_SLOTS, Config, DEFAULT_INFLIGHT_MAX, Direction, Endpoint, Group,
    GroupCounters, GroupHealth, GroupService, MAX_BACKENDS, MAX_GROUP_MEMBERS, MAX_GROUPS,
    NextHopMac, PASS_REASONS, PORT_WORDS, PassReason, ReplyScratch, SCRATCH_ENTRIES,
    fragments::{FRAGMENTS_MAX, FragmentEntry, FragmentKey},
    hedge::{self, HedgeConfig, HedgeStats},
    inflight::{InflightSlot, mark_words, slots_for},
    latency::LATENCY_BUCKETS,
    member_port_bit,
    opaque::opaque_usize,
    pass_index, split_backend_id,
};

use crate::rewrite::Target;

/// Shared with the agent through mmap, so both sides use atomic
/// instructions on the same memory.
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// Mapped by the agent, which writes its heartbeat word alone on every
/// sweep (the rest of the value only through map updates).
#[map]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// Backend endpoint -> backend id (`group * 8 + position`).
#[map]
pub static BACKENDS: HashMap<Endpoint, u32> = HashMap::with_max_entries(MAX_BACKENDS, 0);

/// A bit per UDP port (`selector_common::member_port_bit`), set by the
/// agent for every port a `BACKENDS` entry has before the entry is added
/// (and left set when it goes: a superset). A datagram whose member-side
/// port has no bit is no member's, known without hashing its endpoint.
#[map]
pub static MEMBER_PORTS: Array<u64> = Array::with_max_entries(PORT_WORDS, 0);

#[map]
pub static GROUPS: Array<Group> = Array::with_max_entries(MAX_GROUPS, 0);

/// Issued, completed and expired requests per group member.
#[map]
pub static COUNTERS: Array<GroupCounters> = Array::with_max_entries(MAX_GROUPS, BPF_F_MMAPABLE);

/// Service time per group member (`selector_common::service`), updated on
/// every completion; read by egress under the latency policy.
#[map]
pub static SERVICE: Array<GroupService> = Array::with_max_entries(MAX_GROUPS, BPF_F_MMAPABLE);

/// Outlier ejection per group (`selector_common::ejection`): the agent's
/// ejected and probe bits, the reply path's failures in a row and good
/// replies.
#[map]
pub static HEALTH: Array<GroupHealth> = Array::with_max_entries(MAX_GROUPS, BPF_F_MMAPABLE);

/// Pending requests per client socket, hashed into `CLIENT_SLOTS` slots.
#[map]
pub static CLIENT_PENDING: Array<u64> = Array::with_max_entries(CLIENT_SLOTS, BPF_F_MMAPABLE);

/// Outstanding requests (see `selector_common::inflight`). The agent sizes
/// it from `--inflight-max` at load.
#[map]
pub static INFLIGHT: Array<InflightSlot> =
    Array::with_max_entries(slots_for(DEFAULT_INFLIGHT_MAX), BPF_F_MMAPABLE);

/// One bit per `INFLIGHT` slot: set by the inserter once it holds the slot,
/// cleared by the agent's sweep (see `selector_common::inflight`), which
/// visits only marked slots. Sized with `INFLIGHT`.
#[map]
pub static INFLIGHT_MARKS: Array<u64> =
    Array::with_max_entries(mark_words(slots_for(DEFAULT_INFLIGHT_MAX)), BPF_F_MMAPABLE);

/// Per-CPU scratch words the programs write and read back so the verifier
/// forgets what it knew of them (see `egress::forget`): entry 0 for that,
/// entries `MATCH_SCRATCH..` for the reply path's match
/// (`inflight::match_reply`).
#[map]
pub static SCRATCH: PerCpuArray<[u64; 2]> = PerCpuArray::with_max_entries(SCRATCH_ENTRIES, 0);

/// The reply path's working memory (`selector_common::ReplyScratch`).
#[map]
pub static REPLY_SCRATCH: PerCpuArray<ReplyScratch> = PerCpuArray::with_max_entries(1, 0);

/// The reply path's working memory of this CPU (never missing).
#[inline(always)]
pub fn reply_scratch() -> Option<&'static mut ReplyScratch> {
    // SAFETY: a per-CPU element, not shared while the program runs.
    REPLY_SCRATCH.get_ptr_mut(0).map(|p| unsafe { &mut *p })
}

/// The first of the two `SCRATCH` entries of `inflight::match_reply`.
pub const MATCH_SCRATCH: u32 = 1;
const _: () = assert!(MATCH_SCRATCH + 2 <= SCRATCH_ENTRIES);

/// Per-CPU request counter: with the CPU id, a unique request instance number.
#[map]
pub static SEQUENCE: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Per backend id.
#[map]
pub static STATS: PerCpuArray<BackendStats> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// Packets passed untouched, by direction and reason.
#[map]
pub static PASSED: PerCpuArray<u64> = PerCpuArray::with_max_entries(2 * PASS_REASONS, 0);

/// Packets whose skb was pulled (`bpf_skb_pull_data`: bytes moved from
/// page fragments into the linear part, the head copied first when it is
/// shared), by direction (`Direction as u32`).
#[map]
pub static PULLED: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);

/// `backend id * LATENCY_BUCKETS + bucket` -> responses.
#[map]
pub static LATENCY: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(MAX_BACKENDS * LATENCY_BUCKETS, 0);

/// IP-fragmented replies being rewritten (`selector_common::fragments`).
#[map]
pub static FRAGMENTS: LruHashMap<FragmentKey, FragmentEntry> =
    LruHashMap::with_max_entries(FRAGMENTS_MAX, 0);

/// Backend id -> its next hop's Ethernet addresses, kept by the agent (a
/// missing or zeroed entry: unknown, so the request takes the
/// `bpf_redirect_neigh` path).
#[map]
pub static NEXT_HOPS: Array<NextHopMac> = Array::with_max_entries(MAX_BACKENDS, 0);

/// A member position as an index into a per-group array in a map value,
/// masked where it is used: the compiler drops a mask it can prove changes
/// nothing, and Linux 6.1's verifier, which tracks bounds through fewer
/// paths and spills than newer ones, then sees an unbounded offset ("R0
/// unbounded memory access").
#[inline(always)]
pub fn member_index(position: usize) -> usize {
    opaque_usize(position) % MAX_GROUP_MEMBERS
}

/// Where backend `id` listens, as a rewrite target.
#[inline(always)]
pub fn backend_target(id: u32) -> Option<Target> {
    let (group, position) = split_backend_id(id);
    let e = GROUPS.get(group)?.endpoints[member_index(position)];
    Some(Target {
        addr: e.addr,
        port: e.port,
    })
}

/// Whether some member may listen on UDP port `port` (`MEMBER_PORTS`).
#[inline(always)]
pub fn may_be_member_port(port: u16) -> bool {
    let (word, bit) = member_port_bit(port);
    MEMBER_PORTS.get(word).is_none_or(|w| w & bit != 0)
}

#[inline(always)]
pub fn config() -> Option<&'static Config> {
    CONFIG.get(0)
}

/// Counts one packet passed untouched.
#[inline(always)]
pub fn count_pass(direction: Direction, reason: PassReason) {
    if let Some(c) = PASSED.get_ptr_mut(pass_index(direction, reason)) {
        unsafe { *c += 1 };
    }
}

/// Counts one pull (see `PULLED`).
#[inline(always)]
pub fn count_pull(direction: Direction) {
    if let Some(c) = PULLED.get_ptr_mut(direction as u32) {
        unsafe { *c += 1 };
    }
}

/// The hedging switch the agent writes.
#[map]
pub static HEDGE_CONFIG: Array<HedgeConfig> = Array::with_max_entries(1, 0);

/// Tracked reads handed to the agent's hedge timer (`selector_common::hedge`).
#[map]
pub static HEDGE_EVENTS: RingBuf = RingBuf::with_byte_size(hedge::RING_BYTES, 0);

/// Per backend id: hedges won and lost, loser replies dropped, reads not
/// handed over.
#[map]
pub static HEDGE_STATS: PerCpuArray<HedgeStats> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);
