//! What the host must offer before anything is loaded, each missing piece
//! named in one line: a kernel with TCX links (Linux 6.6, which also brings
//! everything older the programs use: mmapable arrays, BPF atomics,
//! `bpf_redirect_neigh`, managed neighbour entries), and the capabilities to
//! load programs and attach them.

use anyhow::{Result, bail};

/// The oldest kernel the selector runs on: TCX links (6.6). Older kernels
/// would fall back to netlink TC filters, which outlive a killed agent
/// instead of failing open with it; that path is not tested, so it is refused.
pub const MIN_KERNEL: (u32, u32) = (6, 6);

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

/// Checks a kernel release (`uname -r`) and an effective capability set.
pub fn check(release: &str, effective: u64) -> Result<()> {
    let version = parse_release(release)
        .ok_or_else(|| anyhow::anyhow!("cannot read the kernel version from '{release}'"))?;
    if version < MIN_KERNEL {
        bail!(
            "the selector needs Linux {}.{} or later for TCX links; this kernel is {release}",
            MIN_KERNEL.0,
            MIN_KERNEL.1
        );
    }
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

/// Checks this host and this process.
pub fn check_host() -> Result<()> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    check(release.trim(), effective_capabilities()?)
}

/// (major, minor) of a release such as `6.18.44-fc-v657`.
fn parse_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
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

    fn err(release: &str, caps: u64) -> String {
        check(release, caps).unwrap_err().to_string()
    }

    #[test]
    fn kernels_before_6_6_are_refused_by_name() {
        assert!(check("6.6.0", ALL_THREE).is_ok());
        assert!(check("6.18.44-fc-v657", ALL_THREE).is_ok());
        assert!(check("7.0.1", ALL_THREE).is_ok());
        let e = err("6.5.13-generic", ALL_THREE);
        assert!(
            e.contains("Linux 6.6") && e.contains("6.5.13-generic"),
            "{e}"
        );
        assert!(err("5.15.0", ALL_THREE).contains("TCX"));
        assert!(err("garbage", ALL_THREE).contains("kernel version"));
    }

    #[test]
    fn each_missing_capability_is_named() {
        for cap in &CAPABILITIES {
            let e = err("6.18.0", ALL_THREE & !(1 << cap.bit));
            assert!(e.contains(cap.name), "{e}");
        }
    }

    #[test]
    fn sys_admin_covers_bpf_and_perfmon_but_not_net_admin() {
        assert!(check("6.18.0", (1 << 21) | (1 << 12)).is_ok());
        assert!(err("6.18.0", 1 << 21).contains("CAP_NET_ADMIN"));
    }
}
