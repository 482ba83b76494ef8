//! How the TC programs attach on this kernel: TCX links where the kernel
//! has them (Linux 6.6 and later), else legacy tc (a clsact qdisc and
//! direct-action cls_bpf filters at a priority of our own, beside any
//! other filters). Chosen by asking the kernel, not by its version.

use std::fmt;

use anyhow::{Context as _, Result, bail};
use aya::programs::{
    SchedClassifier, TcAttachType,
    links::LinkOrder,
    tc::{self, NlOptions, SchedClassifierLinkId, TcAttachOptions, TcHandle},
};

/// The legacy tc filters' priority: above (later than) the 49152 the
/// kernel gives the first filter added without one, so filters of other
/// components run first and ours sees what they let through, and fixed, so
/// a second agent on the interface is refused ("File exists").
pub const FILTER_PRIORITY: u16 = 0xc5e1;
/// Their handle within that priority.
pub const FILTER_HANDLE: TcHandle = TcHandle::new(0, 1);

/// `SELECTOR_TC_ATTACH=tcx|netlink` overrides the probe (to test the
/// legacy path on a kernel with TCX, or to keep tc tooling in charge).
pub const OVERRIDE_VAR: &str = "SELECTOR_TC_ATTACH";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcAttach {
    /// BPF links (`bpf_link` of type TCX): owned by the agent's process
    /// (or a pin), gone when the agent is.
    Tcx,
    /// cls_bpf filters on a clsact qdisc: stay attached after a crash,
    /// until `selector detach` removes them; cannot be pinned.
    Netlink,
}

impl TcAttach {
    pub fn name(self) -> &'static str {
        match self {
            TcAttach::Tcx => "tcx",
            TcAttach::Netlink => "netlink",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "tcx" => Some(TcAttach::Tcx),
            "netlink" => Some(TcAttach::Netlink),
            _ => None,
        }
    }

    /// What this kernel offers on `iface`: TCX when a TCX query succeeds
    /// there, legacy tc when the kernel refuses the attach type (before
    /// 6.6), unless overridden by [`OVERRIDE_VAR`]. Another component's
    /// TCX programs there change nothing (the query reads ids only), and a
    /// query refused otherwise (no CAP_NET_ADMIN) is an error, not a
    /// reason to fall back.
    pub fn probe(iface: &str) -> Result<Self> {
        if let Ok(name) = std::env::var(OVERRIDE_VAR) {
            return Self::from_name(&name)
                .with_context(|| format!("{OVERRIDE_VAR}={name}: expected tcx or netlink"));
        }
        let ifindex = crate::host::interface::index(iface)?;
        let offered = crate::host::tcx::offered(ifindex).with_context(|| {
            format!(
                "asking the kernel for {iface}'s TCX chains (BPF_PROG_QUERY needs CAP_NET_ADMIN)"
            )
        })?;
        Ok(if offered {
            TcAttach::Tcx
        } else {
            log::debug!("no TCX on {iface}: legacy tc filters");
            TcAttach::Netlink
        })
    }

    /// Attaches `program` to `iface` in direction `attach` this way.
    pub fn attach(
        self,
        program: &mut SchedClassifier,
        iface: &str,
        attach: TcAttachType,
    ) -> Result<SchedClassifierLinkId> {
        let options = match self {
            TcAttach::Tcx => TcAttachOptions::TcxOrder(LinkOrder::default()),
            TcAttach::Netlink => {
                // Already there (ours, or another component's): shared.
                if let Err(e) = tc::qdisc_add_clsact(iface) {
                    log::debug!("clsact qdisc on {iface}: {e}");
                }
                TcAttachOptions::Netlink(NlOptions {
                    priority: FILTER_PRIORITY,
                    handle: FILTER_HANDLE,
                    ..Default::default()
                })
            }
        };
        match program.attach_with_options(iface, attach, options) {
            Ok(id) => Ok(id),
            Err(e) if self == TcAttach::Netlink && is_exists(&e) => bail!(
                "a selector tc filter is already attached to {iface} (priority {FILTER_PRIORITY:#x}): remove it with `selector detach --iface {iface}`"
            ),
            Err(e) => Err(e.into()),
        }
    }
}

impl fmt::Display for TcAttach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn is_exists(e: &aya::programs::ProgramError) -> bool {
    let mut source: Option<&dyn std::error::Error> = Some(e);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return io.raw_os_error() == Some(libc::EEXIST);
        }
        source = err.source();
    }
    format!("{e:?}").contains("File exists")
}

/// Removes filters of ours that an agent now gone left on `iface`
/// (filters outlive their process: a SIGKILL, an OOM kill, a watchdog's
/// abort), so that a restart can attach: the caller holds the interface's
/// running lock, so no agent here made them. The request filter goes
/// first; the reads it moved get `drain` to be answered through the reply
/// filter before that goes too. What was removed.
pub fn remove_stale_filters(
    iface: &str,
    egress: &str,
    ingress: &str,
    drain: std::time::Duration,
) -> Result<Vec<String>> {
    let mut removed = detach_filters(iface, &[(egress, TcAttachType::Egress)])?;
    if !removed.is_empty() {
        std::thread::sleep(drain);
    }
    removed.extend(detach_filters(iface, &[(ingress, TcAttachType::Ingress)])?);
    Ok(removed)
}

/// Removes the selector's legacy tc filters from `iface` (both
/// directions); the names of what went.
pub fn detach_filters(iface: &str, programs: &[(&str, TcAttachType)]) -> Result<Vec<String>> {
    let mut done = Vec::new();
    for (name, attach) in programs {
        match tc::qdisc_detach_program(iface, *attach, name) {
            Ok(()) => done.push(format!("tc filter {name}")),
            Err(tc::TcError::IoError(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("removing tc filter {name} from {iface}"));
            }
        }
    }
    Ok(done)
}
