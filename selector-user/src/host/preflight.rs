//! What the host must offer before anything is loaded, each missing piece
//! named in one line: the capabilities to load programs and attach them.
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

/// Checks this process.
pub fn check_host() -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_THREE: u64 = (1 << 12) | (1 << 38) | (1 << 39);

    fn err(caps: u64) -> String {
        check(caps).unwrap_err().to_string()
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
