//! Reading an array, or a per-CPU array, in a few system calls
//! (BPF_MAP_LOOKUP_BATCH) instead of one per element: the latency
//! histograms alone are 512 backends x 96 buckets, and one lookup each made
//! the agent's per-interval snapshot cost more than everything else it
//! does; the per-backend counters are 512 more each; and the ejection
//! check, every 10 ms, reads every group's drained members.

use std::os::fd::{AsFd as _, AsRawFd as _};

use anyhow::{Context as _, Result, bail};
use aya::maps::Map;

use crate::host::sys::lookup_batch;

/// Elements asked for per call.
const CHUNK: u32 = 4096;

/// The kernel's possible CPUs (per-CPU values come for each), read once:
/// the file behind it was read on every call, 512 times per snapshot.
fn possible_cpus() -> Result<usize> {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if let Some(&n) = CPUS.get() {
        return Ok(n);
    }
    let n = aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?;
    Ok(*CPUS.get_or_init(|| n))
}

/// Elements `first..first + len` of the per-CPU array of `u64`s behind
/// `map`, each summed over CPUs.
pub fn sum_u64(map: &Map, first: u32, len: u32) -> Result<Vec<u64>> {
    let mut out = Vec::with_capacity(len as usize);
    for_each(map, first, len, |_, per_cpu: &[u64]| {
        out.push(per_cpu.iter().sum());
    })?;
    Ok(out)
}

/// Calls `f` with each element `first..first + len` of the array of `T`s
/// behind `map`: its index and its value on every CPU (a per-CPU array),
/// or its one value (an array).
pub fn for_each<T: Copy + Default>(
    map: &Map,
    first: u32,
    len: u32,
    mut f: impl FnMut(u32, &[T]),
) -> Result<()> {
    let (data, cpus) = match map {
        Map::PerCpuArray(data) => {
            // The kernel lays per-CPU values out at 8-byte strides.
            if !size_of::<T>().is_multiple_of(8) {
                bail!("per-CPU values of {} bytes", size_of::<T>());
            }
            (data, possible_cpus()?)
        }
        // Values come back to back at the map's value size: `T`'s, as the
        // loader and the pins' shape check make sure.
        Map::Array(data) => (data, 1),
        _ => bail!("not an array"),
    };
    let fd = data.fd().as_fd().as_raw_fd();
    // Buffers for one call, no larger than asked for: a histogram of 96
    // buckets is read on its own, 512 times per snapshot under load.
    let chunk = CHUNK.min(len.max(1));
    let mut keys = vec![0u32; chunk as usize];
    let mut values = vec![T::default(); chunk as usize * cpus];
    // An array's batch cursor is the last key read; none: from key 0.
    let mut cursor = first.checked_sub(1);
    let mut seen = 0u32;
    while seen < len {
        let want = chunk.min(len - seen);
        // SAFETY: room for `want` keys and `want` values on every CPU.
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
        for per_cpu in values.chunks_exact(cpus).take(filled.min(want as usize)) {
            f(first + seen, per_cpu);
            seen += 1;
        }
        if done || filled == 0 {
            break;
        }
        cursor = Some(next);
    }
    if seen < len {
        bail!("BPF_MAP_LOOKUP_BATCH returned {seen} of {len} elements");
    }
    Ok(())
}

/// Bytes of one element's value as the batch calls lay it out: the value
/// (an array), or one 8-byte-rounded value per possible CPU (a per-CPU
/// array).
#[cfg(feature = "testing")]
pub(crate) fn element_bytes(value_size: u32, per_cpu: bool) -> Result<usize> {
    Ok(if per_cpu {
        (value_size as usize).next_multiple_of(8) * possible_cpus()?
    } else {
        value_size as usize
    })
}

/// Tests only (`crate::datapath::recycle`): writes zeros over every element of an array or per-CPU array, in a few
/// system calls (BPF_MAP_UPDATE_BATCH), whatever its value type.
#[cfg(feature = "testing")]
pub fn zero(map: &Map) -> Result<()> {
    use crate::host::sys::update_batch;
    let (data, per_cpu) = match map {
        Map::PerCpuArray(data) => (data, true),
        Map::Array(data) => (data, false),
        _ => bail!("not an array"),
    };
    let info = data.info()?;
    let value = element_bytes(info.value_size(), per_cpu)?;
    let fd = data.fd().as_fd().as_raw_fd();
    let entries = info.max_entries();
    let chunk = CHUNK.min(entries.max(1));
    let zeros = vec![0u8; chunk as usize * value];
    let mut first = 0;
    while first < entries {
        let count = chunk.min(entries - first);
        let keys: Vec<u32> = (first..first + count).collect();
        // SAFETY: `count` keys, and `count` zeroed values of the map's size.
        unsafe { update_batch(fd, keys.as_ptr().cast(), zeros.as_ptr(), count) }
            .context("BPF_MAP_UPDATE_BATCH")?;
        first += count;
    }
    Ok(())
}
