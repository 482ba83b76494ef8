//! The reference programs of the per-packet cost benchmark: only the work
//! a request tracker cannot avoid, to measure the selector's paths against.
//! A request: find the client socket and the request id, one hash insert
//! of its send time. A reply: the same parse, one lookup, one delete. No
//! backend check, no policy, no counters, no rewrite. The per-packet cost
//! runs them with BPF_PROG_TEST_RUN; the closed-loop throughput attaches
//! them (the reply's TC variant) as the floor of any request tracker on
//! those hooks. Their map holds one entry unless the benchmark sizes it
//! (`bench::REFERENCE`).

use aya_ebpf::{helpers::bpf_ktime_get_ns, macros::map, maps::HashMap};
use selector_common::{Endpoint, InflightKey};

use selector_ebpf::access::{ETH_LEN, IPV4_LEN, Packet, UDP_LEN, read_bytes};

/// Key -> send time (ns).
#[map]
pub static REFERENCE: HashMap<InflightKey, u64> = HashMap::with_max_entries(1, 0);

/// Ethernet, an option-less IPv4 header, UDP and a 16-bit request id.
const SPAN: usize = ETH_LEN + IPV4_LEN + UDP_LEN + 2;

/// Which end of the datagram is the client.
#[derive(Clone, Copy)]
pub enum Client {
    Source,
    Destination,
}

/// The key of an Ethernet + IPv4 (no options) + UDP packet whose payload
/// starts with a 16-bit id; anything else is not the reference's case.
#[inline(always)]
pub fn key(pkt: &impl Packet, client: Client) -> Option<InflightKey> {
    let h: [u8; SPAN] = read_bytes(pkt, 0).ok()?;
    if h[12] != 0x08 || h[13] != 0x00 || h[ETH_LEN] != 0x45 || h[ETH_LEN + 9] != 17 {
        return None;
    }
    let (addr_at, port_at) = match client {
        Client::Source => (ETH_LEN + 12, ETH_LEN + IPV4_LEN),
        Client::Destination => (ETH_LEN + 16, ETH_LEN + IPV4_LEN + 2),
    };
    let id = ETH_LEN + IPV4_LEN + UDP_LEN;
    Some(InflightKey {
        client_addr: Endpoint::ipv4(
            [h[addr_at], h[addr_at + 1], h[addr_at + 2], h[addr_at + 3]],
            0,
        )
        .addr,
        client_port: u16::from_be_bytes([h[port_at], h[port_at + 1]]),
        _pad: 0,
        group: 0,
        request_id: u64::from(u16::from_be_bytes([h[id], h[id + 1]])),
    })
}

/// One insert of the request's send time.
#[inline(always)]
pub fn request(pkt: &impl Packet) {
    if let Some(k) = key(pkt, Client::Source) {
        let _ = REFERENCE.insert(k, unsafe { bpf_ktime_get_ns() }, 0);
    }
}

/// One lookup and, when found, one delete.
#[inline(always)]
pub fn reply(pkt: &impl Packet) {
    if let Some(k) = key(pkt, Client::Destination)
        && unsafe { REFERENCE.get(k) }.is_some()
    {
        let _ = REFERENCE.remove(k);
    }
}
