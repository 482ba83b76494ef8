//! Response path (XDP, or TC ingress): complete the in-flight request and
//! make a redirected reply look like it came from the primary.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use selector_common::{
    BACKEND_RETIRING, Direction, Endpoint, InflightKey, PassReason,
    inflight::{PHASE_LINGER, PHASE_LIVE, key_hashes, phase},
    split_backend_id,
};

use crate::{
    accounting,
    inflight::{self, Seen},
    maps::{BACKENDS, FRAGMENTS, FragmentKey, backend_target, config, count_pass},
    packet::{self, Datagram, Ipv4, Packet},
    rewrite::{Rewrite, Side},
};

pub fn try_ingress<C: Packet + Rewrite>(ctx: &C) -> Result<(), ()> {
    let ip = match packet::parse_ipv4(ctx) {
        Ok(ip) => ip,
        Err(reason) => return pass(reason),
    };
    if ip.fragment && !ip.first_fragment {
        return later_fragment(ctx, &ip);
    }
    let dgram = match packet::parse_udp(ctx, ip, true) {
        Ok(d) => d,
        Err(reason) => return pass(reason),
    };
    let src = Endpoint::ipv4(dgram.ip.src, dgram.src_port);
    let Some(backend) = (unsafe { BACKENDS.get(src) }).copied() else {
        return pass(PassReason::NotBackend);
    };
    // A member being removed still completes the requests it was sent.
    let backend = backend & !BACKEND_RETIRING;
    let config = config().ok_or(())?;
    let byte = |i| dgram.payload_byte(ctx, i);
    let Some(request_id) = config.descriptor.request_id(byte) else {
        return pass(PassReason::NoRequestId);
    };
    let (group, _) = split_backend_id(backend);
    // The reply is addressed to the client that asked.
    let key = InflightKey::ipv4(dgram.ip.dst, dgram.dst_port, group, request_id);
    // Only the backend the request went to can complete it.
    let hashes = key_hashes(&key);
    let went_here = |s: &Seen| s.chosen == backend;
    let seen = if let Some(live) = inflight::find(
        &key,
        hashes.home,
        config.inflight_mask,
        PHASE_LIVE,
        went_here,
    ) {
        complete(ctx, config, &dgram, hashes.client_slot, &live, backend)
    } else if let Some(linger) = inflight::find(
        &key,
        hashes.home,
        config.inflight_mask,
        PHASE_LINGER,
        went_here,
    ) {
        // Completed or expired, within the grace period: rewrite only.
        accounting::count(backend, |s| &mut s.late_responses);
        linger
    } else {
        accounting::count(backend, |s| &mut s.unmatched_responses);
        return Ok(());
    };
    let primary = seen.primary;
    if primary != backend {
        let target = backend_target(primary).ok_or(())?;
        ctx.rewrite(dgram.ip.layout, Side::Source, target)?;
        if dgram.ip.fragment {
            remember_fragments(&dgram, target.addr);
        }
    }
    Ok(())
}

#[inline(always)]
fn pass(reason: PassReason) -> Result<(), ()> {
    count_pass(Direction::Ingress, reason);
    Ok(())
}

/// A reply datagram for a live request: completes it once every datagram
/// of the reply has arrived. Whoever moves the slot out of `LIVE` (this
/// path or the agent's sweep) accounts for it, exactly once.
#[inline(always)]
fn complete<C: Packet>(
    ctx: &C,
    config: &selector_common::Config,
    dgram: &Datagram,
    client_slot: u32,
    live: &Seen,
    backend: u32,
) -> Seen {
    let (seq, total) = config
        .descriptor
        .reply_datagram(|i| dgram.payload_byte(ctx, i));
    if !inflight::datagram_arrived(live.index, seq, total) {
        // More datagrams to come: the request stays pending.
        return *live;
    }
    if inflight::cas(live.index, live.state, inflight::claimed_state(live)) {
        accounting::add_completed(backend);
        accounting::client_add(client_slot, false);
        accounting::count(backend, |s| &mut s.responses);
        let now = unsafe { bpf_ktime_get_ns() };
        accounting::record_latency(backend, now.saturating_sub(live.sent_ns));
    } else if phase(live.state) == PHASE_LIVE {
        // The sweep expired it a moment ago: a late reply, still rewritten.
        accounting::count(backend, |s| &mut s.late_responses);
    }
    *live
}

/// The later fragments of a rewritten reply carry no UDP header: they are
/// known by (source, destination, IP id).
#[inline(always)]
fn remember_fragments(dgram: &Datagram, primary_addr: [u8; 4]) {
    let key = fragment_key(&dgram.ip);
    let _ = FRAGMENTS.insert(key, primary_addr, 0);
}

#[inline(always)]
fn fragment_key(ip: &Ipv4) -> FragmentKey {
    FragmentKey {
        src: ip.src,
        dst: ip.dst,
        id: ip.id,
        _pad: 0,
    }
}

#[inline(always)]
fn later_fragment<C: Packet + Rewrite>(ctx: &C, ip: &Ipv4) -> Result<(), ()> {
    let Some(primary_addr) = (unsafe { FRAGMENTS.get(fragment_key(ip)) }).copied() else {
        return pass(PassReason::Fragment);
    };
    ctx.rewrite_fragment_source(ip.layout, primary_addr)
}
