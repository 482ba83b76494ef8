//! Request path (TC egress): count, choose a replica, steer.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_ns, programs::TcContext};
use aya_log_ebpf::debug;
use selector_common::{
    BACKEND_ACTIVE, BackendEntry, Endpoint, InflightEntry, InflightKey, MAX_GROUP_MEMBERS, Policy,
    policy::{self, GroupLoad},
};

use crate::{
    accounting,
    maps::{BACKEND_TABLE, BACKENDS, CONFIG, GROUPS, INFLIGHT},
    nexthop,
    packet::{self, Datagram, PARSE_SPAN},
    rewrite::{self, Rewrite, Side, Target},
};

pub fn try_egress(ctx: &TcContext) -> Result<(), ()> {
    // Make the headers and descriptor span readable if the skb is paged.
    if ctx.data_end() - ctx.data() < PARSE_SPAN && (ctx.len() as usize) > ctx.data_end() - ctx.data() {
        let want = if (ctx.len() as usize) < PARSE_SPAN { ctx.len() } else { PARSE_SPAN as u32 };
        ctx.pull_data(want).map_err(|_| ())?;
    }
    let dgram = packet::parse_ipv4_udp(ctx)?;
    let dst = Endpoint::ipv4(dgram.dst_addr, dgram.dst_port);
    let primary = *unsafe { BACKENDS.get(&dst) }.ok_or(())?;
    let primary_entry = *BACKEND_TABLE.get(primary).ok_or(())?;
    let config = *CONFIG.get(0).ok_or(())?;

    let Some(request_id) = config
        .descriptor
        .request_id(|i| dgram.payload_byte(ctx, i))
    else {
        accounting::count(primary, |s| &mut s.untracked);
        return Ok(());
    };
    let key = InflightKey {
        client_addr: Endpoint::ipv4(dgram.src_addr, 0).addr,
        client_port: dgram.src_port,
        _pad: 0,
        group: primary_entry.group,
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
        chosen = choose_replica(&config, primary, &primary_entry);
    }
    let mut next_hop = None;
    if chosen != primary {
        let target = BACKEND_TABLE.get(chosen).ok_or(())?;
        let octets = target.endpoint.ipv4_octets().ok_or(())?;
        next_hop = nexthop::lookup(ctx, &dgram, octets, target.endpoint.port);
        if next_hop.is_none() {
            accounting::count(primary, |s| &mut s.nexthop_misses);
            debug!(ctx, "no next hop for backend {}: request stays on primary", chosen);
            chosen = primary;
        }
    }

    let entry = InflightEntry {
        primary,
        chosen,
        sent_ns: unsafe { bpf_ktime_get_ns() },
    };
    if INFLIGHT.insert(&key, &entry, u64::from(BPF_NOEXIST)).is_err() {
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

/// Rewrites the destination to backend `chosen` and its next hop (looked
/// up here on the retransmit path, where `hop` is not known yet).
#[inline(always)]
fn steer(
    ctx: &TcContext,
    dgram: &Datagram,
    chosen: u32,
    hop: Option<nexthop::NextHop>,
) -> Result<(), ()> {
    let target = BACKEND_TABLE.get(chosen).ok_or(())?;
    let addr = target.endpoint.ipv4_octets().ok_or(())?;
    let port = target.endpoint.port;
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
fn choose_replica(config: &selector_common::Config, primary: u32, entry: &BackendEntry) -> u32 {
    let Some(policy) = Policy::from_u32(config.policy) else {
        return primary;
    };
    let Some(group) = GROUPS.get(entry.group) else {
        return primary;
    };
    let mut load = GroupLoad {
        len: group.len as usize,
        ..GroupLoad::default()
    };
    let mut primary_pos = MAX_GROUP_MEMBERS;
    let mut pos = 0;
    while pos < MAX_GROUP_MEMBERS {
        if pos < load.len {
            let member = group.members[pos];
            if member == primary {
                primary_pos = pos;
            }
            load.pending[pos] = accounting::pending(member);
            if BACKEND_TABLE
                .get(member)
                .is_some_and(|b| b.state == BACKEND_ACTIVE)
            {
                load.usable |= 1 << pos;
            }
        }
        pos += 1;
    }
    let chosen_pos = policy::choose(policy, config.threshold, primary_pos, &load);
    if chosen_pos < MAX_GROUP_MEMBERS && chosen_pos < load.len {
        group.members[chosen_pos]
    } else {
        primary
    }
}
