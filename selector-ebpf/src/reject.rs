//! `--on-overload reject`: the request is turned into the protocol's error
//! reply in place and handed to this device's ingress, so the application
//! fails fast and no replica sees the read.
//!
//! The reply swaps the Ethernet, IP and UDP addresses (which leaves the IP
//! header checksum and the UDP pseudo-header sum unchanged). Over IPv4 it
//! sends UDP checksum 0 ("none"), so no payload sum is needed. Over IPv6 a
//! checksum is mandatory: the memcached reply, whose every byte is known,
//! gets a full one; the DNS reply changes one word of the query, which the
//! checksum helper adjusts. It carries the mark bit, which TC ingress
//! clears without counting it as a backend's reply.

use aya_ebpf::{
    bindings::{BPF_F_INGRESS, BPF_F_MARK_MANGLED_0},
    helpers::generated::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use selector_common::{
    Config, checksum,
    descriptor::{REJECT_DNS, REJECT_MEMCACHED},
    reject::{MEMCACHED_REJECT_LEN, dns_servfail_flags, memcached_reject},
};

use crate::{
    TC_CONTINUE,
    packet::{Datagram, IPV4_LEN, IPV6_LEN, UDP_LEN, read_bytes},
};

/// Rewrites the request into its reject reply and returns the verdict that
/// delivers it to the client; a protocol without an error reply passes.
#[inline(always)]
pub fn answer(
    ctx: &TcContext,
    config: &Config,
    dgram: &Datagram,
    request_id: u64,
) -> Result<i32, ()> {
    match config.descriptor.reject_kind {
        REJECT_MEMCACHED => memcached(ctx, dgram, request_id as u16)?,
        REJECT_DNS => dns(ctx, dgram)?,
        _ => return Ok(TC_CONTINUE),
    }
    swap_addresses(ctx, dgram)?;
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark(mark | config.mark);
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    Ok(unsafe { bpf_redirect(ifindex, u64::from(BPF_F_INGRESS)) } as i32)
}

#[inline(always)]
fn store<T>(ctx: &TcContext, offset: usize, bytes: &T) -> Result<(), ()> {
    ctx.store(offset, bytes, 0).map_err(|_| ())
}

#[inline(always)]
fn swap_addresses(ctx: &TcContext, dgram: &Datagram) -> Result<(), ()> {
    let l = dgram.ip.layout;
    let macs: [u8; 12] = read_bytes(ctx, 0)?;
    let ports: [u8; 4] = read_bytes(ctx, l.udp())?;
    let m = [
        macs[6], macs[7], macs[8], macs[9], macs[10], macs[11], macs[0], macs[1], macs[2], macs[3],
        macs[4], macs[5],
    ];
    let p = [ports[2], ports[3], ports[0], ports[1]];
    if l.v6 {
        store(ctx, 0, &m)?;
        // Four bytes at a time: two whole addresses would not fit the
        // egress program's stack.
        let mut i = 0;
        while i < 16 {
            let src: [u8; 4] = read_bytes(ctx, l.ip_src() + i)?;
            let dst: [u8; 4] = read_bytes(ctx, l.ip_dst() + i)?;
            store(ctx, l.ip_src() + i, &dst)?;
            store(ctx, l.ip_dst() + i, &src)?;
            i += 4;
        }
        // The checksum (already final) does not change with the order.
        return store(ctx, l.udp(), &p);
    }
    let ips: [u8; 8] = read_bytes(ctx, l.ip_src())?;
    // Explicit indices: no slice lengths for the verifier to doubt.
    let a = [
        ips[4], ips[5], ips[6], ips[7], ips[0], ips[1], ips[2], ips[3],
    ];
    store(ctx, 0, &m)?;
    store(ctx, l.ip_src(), &a)?;
    store(ctx, l.udp(), &p)?;
    store(ctx, l.udp_check(), &[0u8; 2])
}

/// The frame header and `SERVER_ERROR overloaded`, resizing the packet.
#[inline(always)]
fn memcached(ctx: &TcContext, dgram: &Datagram, request_id: u16) -> Result<(), ()> {
    let l = dgram.ip.layout;
    let udp_len = UDP_LEN + MEMCACHED_REJECT_LEN;
    let reply = memcached_reject(request_id);
    if l.v6 {
        let rc = unsafe { bpf_skb_change_tail(ctx.skb.skb, (l.l4 + udp_len) as u32, 0) };
        if rc != 0 {
            return Err(());
        }
        // Everything after the fixed header is extension headers and UDP.
        let payload_len = (l.l4 - l.l3 - IPV6_LEN + udp_len) as u16;
        store(ctx, l.l3 + 4, &payload_len.to_be_bytes())?;
        store(ctx, l.udp() + 4, &(udp_len as u16).to_be_bytes())?;
        store(ctx, l.payload(), &reply)?;
        // The pseudo header's addresses (their order does not matter).
        let mut addresses = 0u32;
        let mut i = 0;
        while i < 32 {
            let w: [u8; 4] = read_bytes(ctx, l.ip_src() + i)?;
            addresses = checksum::sum_words(addresses, &w);
            i += 4;
        }
        let ports = [dgram.dst_port, dgram.src_port];
        let check = checksum::udp6_datagram_checksum(addresses, ports, &reply);
        return store(ctx, l.udp_check(), &check.to_be_bytes());
    }
    let ip_len = IPV4_LEN + udp_len;
    let old_ip_len = (dgram.ip.end - l.l3) as u16;
    let rc = unsafe { bpf_skb_change_tail(ctx.skb.skb, (l.l3 + ip_len) as u32, 0) };
    if rc != 0 {
        return Err(());
    }
    let check: [u8; 2] = read_bytes(ctx, l.ip_check())?;
    let check = checksum::replace_u16(u16::from_be_bytes(check), old_ip_len, ip_len as u16);
    store(ctx, l.l3 + 2, &(ip_len as u16).to_be_bytes())?;
    store(ctx, l.ip_check(), &check.to_be_bytes())?;
    store(ctx, l.udp() + 4, &(udp_len as u16).to_be_bytes())?;
    store(ctx, l.payload(), &reply)
}

/// The query with QR set and RCODE SERVFAIL.
#[inline(always)]
fn dns(ctx: &TcContext, dgram: &Datagram) -> Result<(), ()> {
    let l = dgram.ip.layout;
    let flags_at = l.payload() + 2;
    let flags: [u8; 2] = read_bytes(ctx, flags_at)?;
    let new_flags = dns_servfail_flags(u16::from_be_bytes(flags)).to_be_bytes();
    store(ctx, flags_at, &new_flags)?;
    if !l.v6 {
        // Sent with checksum 0 ("none") by `swap_addresses`.
        return Ok(());
    }
    ctx.l4_csum_replace(
        l.udp_check(),
        u64::from(u16::from_ne_bytes(flags)),
        u64::from(u16::from_ne_bytes(new_flags)),
        u64::from(BPF_F_MARK_MANGLED_0) | 2,
    )
    .map_err(|_| ())
}
