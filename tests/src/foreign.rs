//! Another component's eBPF programs beside the selector's, as a node has
//! them: a CNI's or an observability agent's TCX program (`return
//! TCX_NEXT`, named `foreign_tcx`), attached by a BPF link held here.

use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use anyhow::{Context as _, Result};

use crate::netns::Namespace;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
pub const BPF_TCX_INGRESS: u32 = 46;
pub const BPF_TCX_EGRESS: u32 = 47;
/// The program's name, as `bpftool` and the kernel show it.
pub const FOREIGN_NAME: &str = "foreign_tcx";

/// bpf(2) for a command that returns a descriptor.
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<OwnedFd> {
    // SAFETY: each caller passes a bpf_attr prefix valid for `cmd`.
    let fd = unsafe { selector_user::host::sys::bpf(cmd, attr) }?;
    // SAFETY: a descriptor the kernel just gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `r0 = -1 (TCX_NEXT); exit`: passes every packet on down the chain.
fn load_pass_program() -> std::io::Result<OwnedFd> {
    // Two instructions: BPF_ALU64|BPF_MOV|BPF_K into r0, then BPF_EXIT.
    let insns: [u64; 2] = [0xffff_ffff_0000_00b7, 0x0000_0000_0000_0095];
    let license = c"GPL";
    // prog_type, insn_cnt, insns, license, log_level, log_size, log_buf,
    // kern_version, prog_flags, prog_name[16] (at byte 48), prog_ifindex,
    // expected_attach_type.
    let mut attr = [0u8; 72];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_SCHED_CLS.to_ne_bytes());
    attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    attr[48..48 + FOREIGN_NAME.len()].copy_from_slice(FOREIGN_NAME.as_bytes());
    bpf(BPF_PROG_LOAD, &mut attr)
}

/// Another component's pass-through program on an interface's TCX
/// ingress and egress, attached while this lives.
pub struct ForeignTcx {
    _program: OwnedFd,
    _links: Vec<OwnedFd>,
}

impl ForeignTcx {
    /// Loads it and links it to `iface` in `ns`, both directions.
    pub fn attach(ns: &Namespace, iface: &str) -> Result<Self> {
        let iface = iface.to_owned();
        ns.run(move || -> Result<Self> {
            let ifindex = selector_user::host::interface::index(&iface)?;
            let program = load_pass_program().context("loading the foreign TCX program")?;
            let mut links = Vec::new();
            for attach_type in [BPF_TCX_INGRESS, BPF_TCX_EGRESS] {
                // prog_fd, target_ifindex, attach_type, flags, then the
                // tcx options (relative fd/id, expected revision) left 0.
                let mut attr = [0u32; 8];
                attr[0] = program.as_raw_fd() as u32;
                attr[1] = ifindex;
                attr[2] = attach_type;
                links.push(
                    bpf(BPF_LINK_CREATE, &mut attr)
                        .with_context(|| format!("linking the foreign program to {iface}"))?,
                );
            }
            Ok(Self {
                _program: program,
                _links: links,
            })
        })?
    }
}

/// The names of the programs in `iface`'s TCX chains in `ns` (egress,
/// then ingress), read with full root.
pub fn tcx_program_names(ns: &Namespace, iface: &str) -> Vec<String> {
    use aya::programs::{SchedClassifier, TcAttachType};
    let iface = iface.to_owned();
    ns.run(move || {
        [TcAttachType::Egress, TcAttachType::Ingress]
            .into_iter()
            .flat_map(|side| {
                SchedClassifier::query_tcx(&iface, side)
                    .map(|(_, p)| p)
                    .unwrap_or_default()
            })
            .filter_map(|p| p.name_as_str().map(str::to_owned))
            .collect()
    })
    .unwrap()
}
