//! The maps. Each has a fixed bound; what happens when one is full is decided
//! where it is written (the in-flight table: the request passes untracked).

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, PerCpuArray},
};
use selector_common::{
    BackendStats, Config, DEFAULT_INFLIGHT_MAX, Endpoint, Group, GroupCounters, GroupExpired,
    InflightEntry, InflightKey, MAX_BACKENDS, MAX_GROUP_MEMBERS, MAX_GROUPS,
    latency::LATENCY_BUCKETS, split_backend_id,
};

use crate::rewrite::Target;

#[map]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

/// Backend endpoint -> backend id (`group * 8 + position`).
#[map]
pub static BACKENDS: HashMap<Endpoint, u32> = HashMap::with_max_entries(MAX_BACKENDS, 0);

#[map]
pub static GROUPS: Array<Group> = Array::with_max_entries(MAX_GROUPS, 0);

/// Issued/completed per group member, kernel-written with atomic adds.
#[map]
pub static PENDING: Array<GroupCounters> = Array::with_max_entries(MAX_GROUPS, 0);

/// Requests per group member the agent expired; the agent is the only writer.
#[map]
pub static EXPIRED: Array<GroupExpired> = Array::with_max_entries(MAX_GROUPS, 0);

/// Outstanding requests. The agent resizes it (`--inflight-max`) at load.
#[map]
pub static INFLIGHT: HashMap<InflightKey, InflightEntry> =
    HashMap::with_max_entries(DEFAULT_INFLIGHT_MAX, 0);

/// Per backend id.
#[map]
pub static STATS: PerCpuArray<BackendStats> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// `backend id * LATENCY_BUCKETS + bucket` -> responses.
#[map]
pub static LATENCY: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(MAX_BACKENDS * LATENCY_BUCKETS, 0);

/// Where backend `id` listens, as a rewrite target.
#[inline(always)]
pub fn backend_target(id: u32) -> Option<Target> {
    let (group, position) = split_backend_id(id);
    let e = GROUPS.get(group)?.endpoints[position % MAX_GROUP_MEMBERS];
    Some(Target {
        addr: e.ipv4_octets()?,
        port: e.port,
    })
}
