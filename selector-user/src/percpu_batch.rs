//! Reading a per-CPU array in a few system calls (BPF_MAP_LOOKUP_BATCH)
//! instead of one per element: the latency histograms alone are
//! 512 backends x 96 buckets, and one lookup each made the agent's
//! per-interval snapshot cost more than everything else it does.

use std::os::fd::{AsFd as _, AsRawFd as _};

use anyhow::{Context as _, Result, bail};
use aya::maps::Map;

use crate::sys::lookup_batch;

/// Elements asked for per call.
const CHUNK: u32 = 4096;

/// Elements `0..len` of the per-CPU array of `u64`s behind `map`, each
/// summed over CPUs.
pub fn sum_u64(map: &Map, len: u32) -> Result<Vec<u64>> {
    let Map::PerCpuArray(data) = map else {
        bail!("not a per-CPU array");
    };
    let cpus = aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?;
    let fd = data.fd().as_fd().as_raw_fd();
    let mut out = Vec::with_capacity(len as usize);
    let mut keys = vec![0u32; CHUNK as usize];
    let mut values = vec![0u64; CHUNK as usize * cpus];
    // An array's batch cursor is the next key.
    let mut cursor = None;
    while (out.len() as u32) < len {
        let want = CHUNK.min(len - out.len() as u32);
        // SAFETY: room for `want` keys and `want` per-CPU u64 values.
        let (filled, next, done) = unsafe {
            lookup_batch(
                fd,
                cursor,
                keys.as_mut_ptr().cast(),
                values.as_mut_ptr().cast(),
                want,
            )
        }
        .context("BPF_MAP_LOOKUP_BATCH")?;
        let filled = filled.min(want as usize);
        out.extend(
            values
                .chunks_exact(cpus)
                .take(filled)
                .map(|per_cpu| per_cpu.iter().sum::<u64>()),
        );
        if done || filled == 0 {
            break;
        }
        cursor = Some(next);
    }
    if (out.len() as u32) < len {
        bail!(
            "BPF_MAP_LOOKUP_BATCH returned {} of {len} elements",
            out.len()
        );
    }
    Ok(out)
}
