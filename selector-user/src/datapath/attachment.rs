//! Whether the agent's programs are still attached to its interface, for
//! `/readyz`: the egress program in the interface's TCX egress chain, and
//! the reply path's program in its TCX ingress chain or as its XDP
//! program. Links of a deleted (or deleted and re-created) interface are
//! gone with it, and then nothing steers, though the agent runs on.
//!
//! Only ids are compared, with capabilities the agent has
//! ([`crate::host::tcx`]). Legacy tc filters (kernels without TCX) are
//! not checked.

use anyhow::{Context as _, Result};
use selector_common::programs;

use crate::{
    config::settings::ReplyPath,
    datapath::Selector,
    host::interface,
    host::neighbours::Netlink,
    host::tcx::{TcxSide, program_ids as tcx_program_ids},
};

/// What of the selector is not attached to its interface (empty: all is).
pub fn missing(selector: &Selector) -> Result<Vec<String>> {
    let iface = &selector.settings.iface;
    let Ok(ifindex) = interface::index(iface) else {
        return Ok(vec![format!("interface {iface} is gone")]);
    };
    let id = |name: &str| -> Result<u32> {
        let program = selector
            .ebpf()
            .program(name)
            .with_context(|| format!("program {name} missing from the object"))?;
        Ok(program.info()?.id())
    };
    // Legacy tc filters are not listed here (no TCX chain to read): taken
    // as attached.
    let legacy = selector.tc_attach == Some(crate::host::tc_attach::TcAttach::Netlink);
    let in_tcx = |attach: TcxSide, id: u32| -> Result<bool> {
        if legacy {
            return Ok(true);
        }
        let attached = tcx_program_ids(ifindex, attach)
            .with_context(|| format!("querying the TCX programs of {iface}"))?;
        Ok(attached.contains(&id))
    };
    let mut missing = Vec::new();
    if !in_tcx(TcxSide::Egress, id(programs::EGRESS)?)? {
        missing.push(format!(
            "the request path (TC egress) is not attached to {iface}"
        ));
    }
    let reply_path = match selector.reply_path {
        ReplyPath::Xdp => {
            Netlink::open()?.xdp_program(ifindex)? == Some(id(programs::INGRESS_XDP)?)
        }
        _ => in_tcx(TcxSide::Ingress, id(programs::INGRESS_TC)?)?,
    };
    if !reply_path {
        missing.push(format!(
            "the reply path ({} ingress) is not attached to {iface}",
            selector.reply_path.name()
        ));
    }
    Ok(missing)
}
