//! The system calls aya does not wrap for us.

use std::{io, os::fd::RawFd};

/// CLOCK_MONOTONIC in nanoseconds as the kernel keeps it: the clock of
/// `bpf_ktime_get_ns`, which no time namespace offsets. An agent started
/// in a time namespace (CRIU, some container runtimes) reads its own
/// clock moved by the namespace's offset; taken back here, else every
/// pending read would look that much older (or younger) and the heartbeat
/// would lie to the programs.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let own = ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128;
    (own - i128::from(monotonic_offset_ns())).max(0) as u64
}

/// This process's time namespace's CLOCK_MONOTONIC offset, ns (0 outside
/// one, or on a kernel without time namespaces); read once.
pub fn monotonic_offset_ns() -> i64 {
    static OFFSET: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *OFFSET.get_or_init(|| {
        std::fs::read_to_string("/proc/self/timens_offsets")
            .ok()
            .and_then(|text| parse_monotonic_offset(&text))
            .unwrap_or(0)
    })
}

/// The `monotonic SECS NSECS` line of `/proc/PID/timens_offsets`, in ns.
fn parse_monotonic_offset(text: &str) -> Option<i64> {
    let line = text.lines().find(|l| l.starts_with("monotonic"))?;
    let mut words = line.split_whitespace().skip(1);
    let secs: i64 = words.next()?.parse().ok()?;
    let nsecs: i64 = words.next()?.parse().ok()?;
    Some(secs * 1_000_000_000 + nsecs)
}

const BPF_MAP_LOOKUP_AND_DELETE_ELEM: libc::c_long = 21;

#[repr(C)]
struct MapElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// bpf(2) with `attr`, a `bpf_attr` prefix the kernel may write back into;
/// the command's result (a descriptor, or 0).
///
/// # Safety
/// `attr` must be a valid attribute for `cmd`, every pointer in it valid
/// for what the command reads or writes.
pub unsafe fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: as the caller promises.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            std::mem::size_of::<T>() as u32,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Atomically removes `key` from a hash map and returns what it held, or
/// `None` if it was not there. The deleted value is the one the caller
/// accounts for, so a concurrent re-insert under the same key is never
/// mistaken for the expired entry.
pub fn lookup_and_delete<K, V: Default>(map_fd: RawFd, key: &K) -> io::Result<Option<V>> {
    let mut value = V::default();
    let mut attr = MapElemAttr {
        map_fd: map_fd as u32,
        _pad: 0,
        key: key as *const K as u64,
        value: &mut value as *mut V as u64,
        flags: 0,
    };
    // SAFETY: attr points at live key/value buffers of the map's sizes.
    match unsafe { bpf(BPF_MAP_LOOKUP_AND_DELETE_ELEM, &mut attr) } {
        Ok(_) => Ok(Some(value)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

#[repr(C)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

impl BatchAttr {
    /// A batch over `count` elements of the map, no cursors.
    fn over(map_fd: RawFd, keys: u64, values: u64, count: u32) -> Self {
        Self {
            in_batch: 0,
            out_batch: 0,
            keys,
            values,
            count,
            map_fd: map_fd as u32,
            elem_flags: 0,
            flags: 0,
        }
    }
}

/// One BPF_MAP_LOOKUP_BATCH call: up to `count` keys and values from
/// `cursor` (`None`: from the start) into the buffers. Returns how many it
/// filled, the cursor to go on from, and whether the map's end was reached
/// (the kernel's ENOENT, which still fills).
///
/// # Safety
/// `keys` and `values` must have room for `count` of the map's keys and
/// values (for a per-CPU map, a value is 8-byte-rounded times the CPUs).
pub(crate) unsafe fn lookup_batch(
    map_fd: RawFd,
    cursor: Option<u32>,
    keys: *mut u8,
    values: *mut u8,
    count: u32,
) -> io::Result<(usize, u32, bool)> {
    let mut next: u32 = 0;
    let at = cursor.unwrap_or(0);
    let mut attr = BatchAttr {
        in_batch: if cursor.is_some() {
            &at as *const u32 as u64
        } else {
            0
        },
        out_batch: &mut next as *mut u32 as u64,
        ..BatchAttr::over(map_fd, keys as u64, values as u64, count)
    };
    // SAFETY: per the caller, and the attribute outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_LOOKUP_BATCH,
            &mut attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>() as u32,
        )
    };
    let err = (rc != 0).then(io::Error::last_os_error);
    // The kernel writes back how many it filled, also on ENOENT.
    let filled = unsafe { std::ptr::read_volatile(&attr.count) } as usize;
    match err {
        None => Ok((filled, next, false)),
        Some(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok((filled, next, true)),
        Some(e) => Err(e),
    }
}

#[cfg(feature = "testing")]
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
#[cfg(feature = "testing")]
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
#[cfg(feature = "testing")]
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

#[cfg(feature = "testing")]
/// One BPF_MAP_UPDATE_BATCH call: `count` keys and values from the buffers.
///
/// # Safety
/// `keys` and `values` must hold `count` of the map's keys and values (for
/// a per-CPU map, a value is 8-byte-rounded times the CPUs).
pub(crate) unsafe fn update_batch(
    map_fd: RawFd,
    keys: *const u8,
    values: *const u8,
    count: u32,
) -> io::Result<()> {
    let mut attr = BatchAttr::over(map_fd, keys as u64, values as u64, count);
    // SAFETY: per the caller, and the attribute outlives the call.
    unsafe { bpf(BPF_MAP_UPDATE_BATCH, &mut attr) }.map(drop)
}

#[cfg(feature = "testing")]
/// Deletes every key of a hash map whose keys are `key_size` bytes; how
/// many it deleted.
pub(crate) fn delete_all(map_fd: RawFd, key_size: usize) -> io::Result<usize> {
    let mut key = vec![0u8; key_size];
    let mut deleted = 0;
    loop {
        // No previous key: the map's first key, whichever remains.
        let mut attr = MapElemAttr {
            map_fd: map_fd as u32,
            _pad: 0,
            key: 0,
            value: key.as_mut_ptr() as u64,
            flags: 0,
        };
        // SAFETY: `value` is the next key's buffer, of the map's key size.
        match unsafe { bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) } {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(deleted),
            Err(e) => return Err(e),
        }
        let mut attr = MapElemAttr {
            map_fd: map_fd as u32,
            _pad: 0,
            key: key.as_ptr() as u64,
            value: 0,
            flags: 0,
        };
        // SAFETY: `key` is a key of the map's size.
        unsafe { bpf(BPF_MAP_DELETE_ELEM, &mut attr) }?;
        deleted += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_namespaces_monotonic_offset_is_read() {
        let text = "monotonic      86400         5\nboottime            0         0\n";
        assert_eq!(parse_monotonic_offset(text), Some(86_400_000_000_005));
        assert_eq!(
            parse_monotonic_offset("monotonic -3 0\nboottime 0 0\n"),
            Some(-3_000_000_000)
        );
        assert_eq!(parse_monotonic_offset(""), None);
    }
}
