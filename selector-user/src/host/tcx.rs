//! An interface's TCX chains, read with the capabilities the agent runs
//! with (CAP_NET_ADMIN and CAP_BPF, not CAP_SYS_ADMIN): the programs' ids
//! by BPF_PROG_QUERY itself, where aya's `query_tcx` also opens every
//! program by id, which takes CAP_SYS_ADMIN and so fails as soon as
//! another component (a CNI, an observability agent) has a program there.

use std::{
    io,
    os::fd::{FromRawFd as _, OwnedFd},
};

/// A TCX chain of an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcxSide {
    Ingress,
    Egress,
}

/// The bpf(2) commands and attach types (linux/bpf.h).
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;
/// The most programs a chain is read with; the agent's is among the few.
const MAX_CHAIN: usize = 64;

/// The ids of the programs in `ifindex`'s TCX chain on `side`. A kernel
/// without TCX (before 6.6) refuses the attach type: EINVAL.
pub fn program_ids(ifindex: u32, side: TcxSide) -> io::Result<Vec<u32>> {
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

/// Whether this kernel has TCX chains on `ifindex`: a query there
/// succeeds; EINVAL (the attach type unknown) is no; any other error
/// (a missing capability) is the caller's to report.
pub fn offered(ifindex: u32) -> io::Result<bool> {
    match program_ids(ifindex, TcxSide::Ingress) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The name the program of `id` was loaded with (the kernel keeps 15
/// characters). Opening a program by id takes CAP_SYS_ADMIN: EPERM
/// without it; ENOENT once it is gone.
pub fn program_name(id: u32) -> io::Result<String> {
    // prog_id, next_id, open_flags.
    let mut get = [id, 0, 0];
    // SAFETY: a bpf_attr prefix for BPF_PROG_GET_FD_BY_ID.
    let fd = unsafe { crate::host::sys::bpf(BPF_PROG_GET_FD_BY_ID, &mut get) }?;
    // SAFETY: a descriptor the kernel just gave us, owned from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // `bpf_prog_info` up to its name: type, id, tag[8], jited_prog_len,
    // xlated_prog_len, jited_prog_insns, xlated_prog_insns, load_time,
    // created_by_uid, nr_map_ids, map_ids, then name[16] at byte 64.
    let mut info = [0u8; 80];
    // bpf_fd, info_len, info (u64 pointer).
    let mut attr = [0u64; 2];
    use std::os::fd::AsRawFd as _;
    attr[0] = u64::from(fd.as_raw_fd() as u32) | ((info.len() as u64) << 32);
    attr[1] = info.as_mut_ptr() as u64;
    // SAFETY: info is writable for the length given.
    unsafe { crate::host::sys::bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr) }?;
    let name = &info[64..80];
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}
