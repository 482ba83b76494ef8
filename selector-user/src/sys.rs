//! The two system calls aya does not wrap for us.

use std::{io, os::fd::RawFd};

/// CLOCK_MONOTONIC in nanoseconds: the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
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

/// Atomically removes `key` from a hash map and returns what it held, or
/// `None` if it was not there. The deleted value is the one the caller
/// accounts for, so a concurrent re-insert under the same key is never
/// mistaken for the expired entry.
pub fn lookup_and_delete<K, V: Default>(map_fd: RawFd, key: &K) -> io::Result<Option<V>> {
    let mut value = V::default();
    let attr = MapElemAttr {
        map_fd: map_fd as u32,
        _pad: 0,
        key: key as *const K as u64,
        value: &mut value as *mut V as u64,
        flags: 0,
    };
    // SAFETY: attr points at live key/value buffers of the map's sizes.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_LOOKUP_AND_DELETE_ELEM,
            &attr as *const MapElemAttr,
            std::mem::size_of::<MapElemAttr>() as u32,
        )
    };
    if rc == 0 {
        return Ok(Some(value));
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENOENT) {
        Ok(None)
    } else {
        Err(err)
    }
}
