//! Whether the agent's programs are still attached to its interface, for
//! `/readyz`: the egress program in the interface's TCX egress chain, and
//! the reply path's program in its TCX ingress chain or as its XDP
//! program. Links of a deleted (or deleted and re-created) interface are
//! gone with it, and then nothing steers, though the agent runs on.
//!
//! Only ids are compared, with capabilities the agent has: aya's
//! `query_tcx` opens every attached program by id, which takes
//! CAP_SYS_ADMIN, so the TCX chains are read with BPF_PROG_QUERY itself
//! (CAP_NET_ADMIN). Legacy tc filters (kernels without TCX) are not
//! checked.

use std::io;

use anyhow::{Context as _, Result};
use selector_common::programs;

use crate::{
    config::settings::ReplyPath, datapath::Selector, host::interface, host::neighbours::Netlink,
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

/// A TCX chain of an interface.
#[derive(Clone, Copy, Debug)]
pub enum TcxSide {
    Ingress,
    Egress,
}

/// The bpf(2) command and attach types (linux/bpf.h).
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;
/// The most programs a chain is read with; the agent's is among the few.
const MAX_CHAIN: usize = 64;

/// The ids of the programs in `ifindex`'s TCX chain on `side`.
pub fn tcx_program_ids(ifindex: u32, side: TcxSide) -> io::Result<Vec<u32>> {
    let mut ids = [0u32; MAX_CHAIN];
    // `bpf_attr.query`: target_ifindex, attach_type, query_flags,
    // attach_flags (u32 each), prog_ids (u64 pointer), prog_cnt (u32), then
    // prog_attach_flags, link_ids, link_attach_flags and revision (u64s,
    // left 0).
    let mut attr = [0u64; 8];
    let attach_type = match side {
        TcxSide::Ingress => BPF_TCX_INGRESS,
        TcxSide::Egress => BPF_TCX_EGRESS,
    };
    attr[0] = u64::from(ifindex) | (u64::from(attach_type) << 32);
    attr[2] = ids.as_mut_ptr() as u64;
    attr[3] = MAX_CHAIN as u64;
    // SAFETY: attr is a bpf_attr prefix of the size given, and prog_ids
    // points at MAX_CHAIN writable u32s, the count it says.
    unsafe { crate::host::sys::bpf(BPF_PROG_QUERY, &mut attr) }?;
    // The kernel writes back how many it copied (at most MAX_CHAIN).
    let count = (attr[3] as u32 as usize).min(MAX_CHAIN);
    Ok(ids[..count].to_vec())
}
