//! The start both paths share. A request (`Request`, TC egress) goes from
//! a client to a member, its reply (`Reply`, XDP or TC ingress) from the
//! member back to the client: the path (`Path`) says which end of a
//! datagram is which. The steps, in the order both paths take them, each
//! path doing its own work between them: the IP header (`ip`), the UDP
//! datagram (`udp`), the member's end (`Path::member_address` and
//! `member_port`) and the id it is configured under (`member_id`), the
//! request id (`request_id`), the client's address
//! (`Path::client_address`), the in-flight key (`key`) and its hashes
//! (`hashes`).
//!
//! A step that finds the packet is not its path's counts it under its pass
//! reason and returns `Err`: the entry points pass a packet untouched on
//! any error. The path is a type, not a value, so each program's code
//! holds only its own side of every step.
//!
//! The verifier's counts move with the compiler's layout of these steps,
//! not only with what they do (measured with the `verifier_cost` example):
//! the member's endpoint is built at each path rather than returned by a
//! function here, which cost the XDP reply path a quarter more verified
//! instructions; the shared `request_id` costs egress about a tenth more
//! (6.18).

use selector_common::{
    Config, Direction, Endpoint, InflightKey, PassReason,
    inflight::{KeyHashes, key_hashes},
};

use crate::{
    accounting, inflight,
    maps::{BACKENDS, count_pass, may_be_member_port},
    packet::{self, Datagram, Ip, Layout, Packet},
};

/// Which end of a datagram is the member's and which the client's.
pub trait Path {
    const DIRECTION: Direction;
    /// The member's address, as 16 bytes (IPv4-mapped for IPv4).
    fn member_address(ctx: &impl Packet, l: Layout) -> Result<[u8; 16], ()>;
    fn member_port(dgram: &Datagram) -> u16;
    /// The client's address. Read where it is needed: the egress
    /// program's stack has no room to keep it long.
    fn client_address(ctx: &impl Packet, l: Layout) -> Result<[u8; 16], ()>;
    fn client_port(dgram: &Datagram) -> u16;
    /// Starts the miss on what of the key's window the path writes soon
    /// (see `inflight::touch_home`).
    fn touch_window(home: u64, mask: u32);
}

/// TC egress: a request, from the client (source) to a member
/// (destination).
pub struct Request;

/// XDP or TC ingress: a reply, from a member (source) to the client
/// (destination).
pub struct Reply;

impl Path for Request {
    const DIRECTION: Direction = Direction::Egress;
    #[inline(always)]
    fn member_address(ctx: &impl Packet, l: Layout) -> Result<[u8; 16], ()> {
        packet::dst_address(ctx, l)
    }
    #[inline(always)]
    fn member_port(dgram: &Datagram) -> u16 {
        dgram.dst_port
    }
    #[inline(always)]
    fn client_address(ctx: &impl Packet, l: Layout) -> Result<[u8; 16], ()> {
        packet::src_address(ctx, l)
    }
    #[inline(always)]
    fn client_port(dgram: &Datagram) -> u16 {
        dgram.src_port
    }
    /// The window's first slot, where a new request most likely goes.
    #[inline(always)]
    fn touch_window(home: u64, mask: u32) {
        inflight::touch_home(home, mask);
    }
}

impl Path for Reply {
    const DIRECTION: Direction = Direction::Ingress;
    #[inline(always)]
    fn member_address(ctx: &impl Packet, l: Layout) -> Result<[u8; 16], ()> {
        packet::src_address(ctx, l)
    }
    #[inline(always)]
    fn member_port(dgram: &Datagram) -> u16 {
        dgram.src_port
    }
    #[inline(always)]
    fn client_address(ctx: &impl Packet, l: Layout) -> Result<[u8; 16], ()> {
        packet::dst_address(ctx, l)
    }
    #[inline(always)]
    fn client_port(dgram: &Datagram) -> u16 {
        dgram.dst_port
    }
    /// The mark word of the window's first slot, which the claim clears
    /// (beside the slot's own miss).
    #[inline(always)]
    fn touch_window(home: u64, mask: u32) {
        inflight::touch_home_mark(home, mask);
    }
}

/// The packet is not the path's: counted under `reason`, and passed
/// untouched by the entry point.
#[inline(always)]
pub fn pass<P: Path, T>(reason: PassReason) -> Result<T, ()> {
    count_pass(P::DIRECTION, reason);
    Err(())
}

/// Whether the packet is plainly not UDP (`packet::plainly_not_udp`):
/// counted as `NotIpUdp` then, and the entry point passes it at once,
/// before it reads anything else.
#[inline(always)]
pub fn plainly_not_udp<P: Path>(ctx: &impl Packet) -> bool {
    let not_udp = packet::plainly_not_udp(ctx);
    if not_udp {
        count_pass(P::DIRECTION, PassReason::NotIpUdp);
    }
    not_udp
}

/// The frame's IP header, its layout forgotten (`packet::forget_layout`).
#[inline(always)]
pub fn ip<P: Path>(ctx: &impl Packet) -> Result<Ip, ()> {
    match packet::parse_ip(ctx) {
        Ok(ip) => packet::forget_layout(ip).ok_or(()),
        Err(reason) => pass::<P, _>(reason),
    }
}

/// The UDP datagram of `ip`: a whole one, or on the reply path also the
/// first fragment of one (its later fragments get the rewrite it gets); a
/// fragmented request passes.
#[inline(always)]
pub fn udp<P: Path>(ctx: &impl Packet, ip: Ip) -> Result<Datagram, ()> {
    match packet::parse_udp(ctx, ip, P::DIRECTION == Direction::Ingress) {
        Ok(dgram) => Ok(dgram),
        Err(reason) => pass::<P, _>(reason),
    }
}

/// The id `member` is configured under, with its `BACKEND_RETIRING` bit
/// (`BACKENDS`); not a member, the packet passes. A port no member has
/// passes before the hash lookup: on a client host most UDP is no
/// member's (QUIC, other resolvers, media).
#[inline(always)]
pub fn member_id<P: Path>(member: Endpoint) -> Result<u32, ()> {
    if !may_be_member_port(member.port) {
        return pass::<P, _>(PassReason::NotBackend);
    }
    match unsafe { BACKENDS.get(member) } {
        Some(id) => Ok(*id),
        None => pass::<P, _>(PassReason::NotBackend),
    }
}

/// The request id the descriptor reads from the payload through `byte`
/// (`Datagram::payload_byte`, after `packet::pull_payload`); none, the
/// packet passes. The caller's `byte`: the descriptor's code is
/// instantiated once per reader, so a path that reads more with it reuses
/// that code.
#[inline(always)]
pub fn request_id<P: Path>(config: &Config, byte: impl Fn(usize) -> Option<u8>) -> Result<u64, ()> {
    match config.descriptor.request_id(byte) {
        Some(id) => Ok(id),
        None => pass::<P, _>(PassReason::NoRequestId),
    }
}

/// The in-flight key of a request: the client's address (`client`, from
/// `Path::client_address`) and port, the group, the request id.
#[inline(always)]
pub fn key<P: Path>(
    client: [u8; 16],
    dgram: &Datagram,
    group: u32,
    request_id: u64,
) -> InflightKey {
    InflightKey::new(client, P::client_port(dgram), group, request_id)
}

/// The hashes of `key`, with the misses on what the path writes soon
/// started now: the client's pending count and the key's window
/// (`Path::touch_window`).
#[inline(always)]
pub fn hashes<P: Path>(key: &InflightKey, config: &Config) -> KeyHashes {
    let hashes = key_hashes(key);
    P::touch_window(hashes.home, config.inflight_mask);
    accounting::touch_client(hashes.client_slot);
    hashes
}
