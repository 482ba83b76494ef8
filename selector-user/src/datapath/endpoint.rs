//! A backend's address as the maps key it ([`Endpoint`]), and back.

use std::net::SocketAddr;

use selector_common::Endpoint;

/// The address an [`Endpoint`] holds.
pub fn addr_of(e: &Endpoint) -> SocketAddr {
    match e.ipv4_octets() {
        Some(o) => SocketAddr::new(std::net::Ipv4Addr::from(o).into(), e.port),
        None => SocketAddr::new(std::net::Ipv6Addr::from(e.addr).into(), e.port),
    }
}

pub fn endpoint(addr: SocketAddr) -> Endpoint {
    match addr.ip() {
        std::net::IpAddr::V4(ip) => Endpoint::ipv4(ip.octets(), addr.port()),
        std::net::IpAddr::V6(ip) => Endpoint::new(ip.octets(), addr.port()),
    }
}
