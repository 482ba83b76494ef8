//! The maps. Each has a fixed bound; what happens when one is full is decided
//! where it is written (the in-flight table: the request passes untracked).

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, PerCpuArray},
};
use selector_common::{
    BackendEntry, BackendStats, Config, DEFAULT_INFLIGHT_MAX, Endpoint, Group, InflightEntry,
    InflightKey, MAX_BACKENDS, MAX_GROUPS, PendingCounters, latency::LATENCY_BUCKETS,
};

#[map]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

/// Backend endpoint -> backend index.
#[map]
pub static BACKENDS: HashMap<Endpoint, u32> = HashMap::with_max_entries(MAX_BACKENDS, 0);

#[map]
pub static BACKEND_TABLE: Array<BackendEntry> = Array::with_max_entries(MAX_BACKENDS, 0);

#[map]
pub static GROUPS: Array<Group> = Array::with_max_entries(MAX_GROUPS, 0);

/// Issued/completed per backend, kernel-written with atomic adds.
#[map]
pub static PENDING: Array<PendingCounters> = Array::with_max_entries(MAX_BACKENDS, 0);

/// Requests per backend the agent expired; the agent is the only writer.
#[map]
pub static EXPIRED: Array<u64> = Array::with_max_entries(MAX_BACKENDS, 0);

/// Outstanding requests. The agent resizes it (`--inflight-max`) at load.
#[map]
pub static INFLIGHT: HashMap<InflightKey, InflightEntry> =
    HashMap::with_max_entries(DEFAULT_INFLIGHT_MAX, 0);

#[map]
pub static STATS: PerCpuArray<BackendStats> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// `backend * LATENCY_BUCKETS + bucket` -> responses.
#[map]
pub static LATENCY: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(MAX_BACKENDS * LATENCY_BUCKETS, 0);
