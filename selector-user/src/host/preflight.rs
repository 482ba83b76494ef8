//! What the host must offer before anything is loaded, each missing piece
//! named in one line: an architecture it is tested on, and the
//! capabilities to load programs and attach them.
//! The kernel is not judged by its version: the programs load on every
//! kernel from 6.1 (the matrix `cargo xtask test-kernels` runs), how they
//! attach is probed (`crate::host::tc_attach`), and a kernel that lacks something
//! says so when the load fails.

use anyhow::{Result, bail};

/// A capability the agent needs, and what for.
pub struct Needed {
    pub bit: u32,
    pub name: &'static str,
    pub why: &'static str,
}

/// CAP_NET_ADMIN, CAP_PERFMON and CAP_BPF: the least the agent runs with
/// (CAP_SYS_ADMIN stands in for the last two, as the kernel allows).
pub const CAPABILITIES: [Needed; 3] = [
    Needed {
        bit: 12,
        name: "CAP_NET_ADMIN",
        why: "to attach to the interface and manage neighbour entries",
    },
    Needed {
        bit: 38,
        name: "CAP_PERFMON",
        why: "for the programs' packet pointer arithmetic",
    },
    Needed {
        bit: 39,
        name: "CAP_BPF",
        why: "to create maps and load programs",
    },
];

const CAP_SYS_ADMIN: u32 = 21;
/// For hedging's raw sockets only (`crate::hedging::wire`).
pub const CAP_NET_RAW: u32 = 13;
const CAP_SETPCAP: u32 = 8;

/// Checks an effective capability set.
pub fn check(effective: u64) -> Result<()> {
    let has = |bit: u32| effective & (1 << bit) != 0;
    for cap in &CAPABILITIES {
        let covered = cap.name != "CAP_NET_ADMIN" && has(CAP_SYS_ADMIN);
        if !has(cap.bit) && !covered {
            bail!(
                "missing capability {} ({}): run as root or grant CAP_NET_ADMIN, CAP_PERFMON and CAP_BPF (see deploy/selector.service)",
                cap.name,
                cap.why
            );
        }
    }
    Ok(())
}

/// The architectures the agent is tested on: the in-flight slots' mark
/// protocol (compare-and-swap between the programs and the agent, with
/// the orderings it relies on) is checked on x86-64 only (`tests/races.rs`).
pub const TESTED_ARCHES: [&str; 1] = ["x86_64"];
/// `SELECTOR_UNTESTED_ARCH=1` runs it elsewhere anyway.
pub const UNTESTED_ARCH_VAR: &str = "SELECTOR_UNTESTED_ARCH";

/// Refuses an architecture the agent is not tested on, unless `allowed`.
pub fn check_arch(arch: &str, allowed: bool) -> Result<()> {
    if TESTED_ARCHES.contains(&arch) || allowed {
        return Ok(());
    }
    bail!(
        "{arch}: the selector is built and tested on x86-64 only (the in-flight slots' protocol between the programs and the agent is checked there); set {UNTESTED_ARCH_VAR}=1 to run it anyway"
    )
}

/// Checks this process.
pub fn check_host() -> Result<()> {
    let allowed = std::env::var_os(UNTESTED_ARCH_VAR).is_some_and(|v| v == "1");
    check_arch(std::env::consts::ARCH, allowed)?;
    check(effective_capabilities()?)
}

/// This kernel's release (`uname -r`), for messages.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|r| r.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// CapEff of this process, from /proc/self/status.
fn effective_capabilities() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .ok_or_else(|| anyhow::anyhow!("no CapEff in /proc/self/status"))
}

/// capget(2)/capset(2)'s header and one of its two data words.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// This thread's capability sets (capabilities are per thread).
fn thread_capabilities() -> Result<[CapData; 2]> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: a version 3 header and the two data words it asks for.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &raw mut header, data.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(data)
}

/// Whether this thread's effective set holds capability `bit`.
pub fn has_capability(bit: u32) -> Result<bool> {
    let data = thread_capabilities()?;
    Ok(data[(bit / 32) as usize].effective & (1 << (bit % 32)) != 0)
}

/// Gives up capability `bit` for good, before any other thread starts
/// (threads inherit their creator's sets): out of this thread's effective,
/// permitted, inheritable and ambient sets, and out of the bounding set
/// where CAP_SETPCAP allows (the unit grants no CAP_SETPCAP: there the
/// bounding set keeps it, but without it in the permitted set, and with
/// no_new_privs, nothing can raise it again).
pub fn drop_capability(bit: u32) -> Result<()> {
    let mut data = thread_capabilities()?;
    let setpcap = data[0].effective & (1 << CAP_SETPCAP) != 0;
    let (word, mask) = ((bit / 32) as usize, !(1u32 << (bit % 32)));
    data[word].effective &= mask;
    data[word].permitted &= mask;
    data[word].inheritable &= mask;
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    // SAFETY: a version 3 header and its two data words. The kernel drops
    // the capability from the ambient set with the permitted one.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    if setpcap {
        // SAFETY: plain prctl; the result is checked.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, bit as libc::c_ulong, 0, 0, 0) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_THREE: u64 = (1 << 12) | (1 << 38) | (1 << 39);

    fn err(caps: u64) -> String {
        check(caps).unwrap_err().to_string()
    }

    #[test]
    fn an_untested_architecture_is_refused_unless_asked_for() {
        assert!(check_arch("x86_64", false).is_ok());
        let refused = check_arch("aarch64", false).unwrap_err().to_string();
        assert!(
            refused.starts_with("aarch64:") && refused.contains(UNTESTED_ARCH_VAR),
            "{refused}"
        );
        assert!(check_arch("aarch64", true).is_ok());
    }

    #[test]
    fn each_missing_capability_is_named() {
        for cap in &CAPABILITIES {
            let e = err(ALL_THREE & !(1 << cap.bit));
            assert!(e.contains(cap.name), "{e}");
        }
    }

    #[test]
    fn sys_admin_covers_bpf_and_perfmon_but_not_net_admin() {
        assert!(check((1 << 21) | (1 << 12)).is_ok());
        assert!(err(1 << 21).contains("CAP_NET_ADMIN"));
    }
}
