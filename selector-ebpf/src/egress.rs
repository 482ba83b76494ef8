//! Request path (TC egress): count, choose a replica, steer.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_ns, programs::TcContext};
use aya_log_ebpf::debug;
use selector_common::{
    Config, Endpoint, InflightEntry, InflightKey, MAX_GROUP_MEMBERS, Policy, backend_id, policy,
    split_backend_id,
};

use crate::{
    accounting,
    maps::{BACKENDS, CONFIG, GROUPS, INFLIGHT},
    nexthop::{self, NextHop},
    packet::{self, Datagram, PARSE_SPAN},
    rewrite::{self, Rewrite, Side, Target},
};

pub fn try_egress(ctx: &TcContext) -> Result<(), ()> {
    // Make the headers and descriptor span readable if the skb is paged.
    let linear = ctx.data_end() - ctx.data();
    if linear < PARSE_SPAN && (ctx.len() as usize) > linear {
        let want = if (ctx.len() as usize) < PARSE_SPAN {
            ctx.len()
        } else {
            PARSE_SPAN as u32
        };
        ctx.pull_data(want).map_err(|_| ())?;
    }
    let dgram = packet::parse_ipv4_udp(ctx)?;
    let dst = Endpoint::ipv4(dgram.dst_addr, dgram.dst_port);
    let primary = *unsafe { BACKENDS.get(&dst) }.ok_or(())?;
    let (group, primary_pos) = split_backend_id(primary);
    let config = *CONFIG.get(0).ok_or(())?;

    let Some(request_id) = config.descriptor.request_id(|i| dgram.payload_byte(ctx, i)) else {
        accounting::count(primary, |s| &mut s.untracked);
        return Ok(());
    };
    let key = InflightKey {
        client_addr: Endpoint::ipv4(dgram.src_addr, 0).addr,
        client_port: dgram.src_port,
        _pad: 0,
        group,
        request_id,
    };

    // A retransmit follows the first copy and is not counted again.
    if let Some(first) = unsafe { INFLIGHT.get(&key) } {
        let chosen = first.chosen;
        if chosen != primary {
            steer(ctx, &dgram, chosen, None)?;
        }
        return Ok(());
    }

    accounting::count(primary, |s| &mut s.requests);
    let mut chosen = primary;
    if config.descriptor.is_read(|i| dgram.payload_byte(ctx, i)) {
        chosen = backend_id(group, choose_position(&config, group, primary_pos));
    }
    let mut next_hop = None;
    if chosen != primary {
        next_hop = lookup_next_hop(ctx, &dgram, chosen);
        if next_hop.is_none() {
            accounting::count(primary, |s| &mut s.nexthop_misses);
            debug!(
                ctx,
                "no next hop for backend {}: request stays on primary", chosen
            );
            chosen = primary;
        }
    }

    let entry = InflightEntry {
        primary,
        chosen,
        sent_ns: unsafe { bpf_ktime_get_ns() },
    };
    if INFLIGHT
        .insert(&key, &entry, u64::from(BPF_NOEXIST))
        .is_err()
    {
        // Table full (or a racing copy won): never block traffic.
        accounting::count(primary, |s| &mut s.untracked);
        return Ok(());
    }
    accounting::add_issued(chosen);
    if chosen != primary {
        accounting::count(primary, |s| &mut s.redirected_away);
        accounting::count(chosen, |s| &mut s.redirected_to);
        steer(ctx, &dgram, chosen, next_hop)?;
    }
    Ok(())
}

/// The endpoint of backend `id`.
#[inline(always)]
fn endpoint_of(id: u32) -> Option<([u8; 4], u16)> {
    let (group, position) = split_backend_id(id);
    let e = GROUPS.get(group)?.endpoints[position % MAX_GROUP_MEMBERS];
    Some((e.ipv4_octets()?, e.port))
}

#[inline(always)]
fn lookup_next_hop(ctx: &TcContext, dgram: &Datagram, id: u32) -> Option<NextHop> {
    let (addr, port) = endpoint_of(id)?;
    nexthop::lookup(ctx, dgram, addr, port)
}

/// Rewrites the destination to backend `chosen` and its next hop (looked
/// up here on the retransmit path, where `hop` is not known yet).
#[inline(always)]
fn steer(ctx: &TcContext, dgram: &Datagram, chosen: u32, hop: Option<NextHop>) -> Result<(), ()> {
    let (addr, port) = endpoint_of(chosen).ok_or(())?;
    let hop = match hop {
        Some(hop) => Some(hop),
        None => nexthop::lookup(ctx, dgram, addr, port),
    };
    if let Some(hop) = hop {
        rewrite::set_macs(ctx, hop.dst_mac, hop.src_mac)?;
    }
    ctx.rewrite(Side::Destination, Target { addr, port })
}

/// Applies the configured policy to the primary's group.
#[inline(always)]
fn choose_position(config: &Config, group: u32, primary_pos: usize) -> usize {
    let Some(policy) = Policy::from_u32(config.policy) else {
        return primary_pos;
    };
    let Some(load) = accounting::group_load(group) else {
        return primary_pos;
    };
    let chosen = policy::choose(policy, config.threshold, primary_pos, &load);
    if chosen < load.len {
        chosen
    } else {
        primary_pos
    }
}
