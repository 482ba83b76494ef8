//! Hedge copies on the wire: raw sockets (one per address family in use)
//! that send a UDP datagram built here, with the application's own source
//! address and port, so the replica's reply comes back to its socket. The
//! packets carry the `--mark` bit, so the egress program lets them pass
//! untouched, and leave by the selector's interface.

use std::{
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

use anyhow::{Context as _, Result};
use selector_common::checksum;

/// The raw sockets hedges are sent through.
pub struct HedgeSockets {
    v4: Option<OwnedFd>,
    v6: Option<OwnedFd>,
}

thread_local! {
    /// The sockets [`HedgeSockets::open_at_start`] opened on this thread,
    /// until hedging first starts. Per thread, as the capability that
    /// opened them and the network namespace they are in are.
    static OPENED_AT_START: std::cell::RefCell<Option<HedgeSockets>> =
        const { std::cell::RefCell::new(None) };
}

impl HedgeSockets {
    /// At the agent's start, while it holds CAP_NET_RAW (which it drops
    /// next): opens a socket of each family (IPv6's only if the host has
    /// IPv6) and keeps them for the thread that starts hedging, now or
    /// after a reload turns it on.
    pub fn open_at_start(iface: &str, mark: u32) -> Result<()> {
        let v4 = raw_socket(iface, mark, libc::AF_INET)?;
        let v6 = raw_socket(iface, mark, libc::AF_INET6)
            .inspect_err(|e| log::debug!("no IPv6 hedge socket: {e:#}"))
            .ok();
        OPENED_AT_START.set(Some(Self { v4: Some(v4), v6 }));
        Ok(())
    }

    /// For hedging's start: the sockets opened at start (checked to cover
    /// the families asked for), else new ones, which needs CAP_NET_RAW
    /// still (an agent in a test, say).
    pub fn opened_at_start_or_open(iface: &str, mark: u32, v4: bool, v6: bool) -> Result<Self> {
        let Some(opened) = OPENED_AT_START.take() else {
            return Self::open(iface, mark, v4, v6);
        };
        if v6 && opened.v6.is_none() {
            anyhow::bail!(
                "no IPv6 raw socket for hedges: the host had no IPv6 when the agent started"
            );
        }
        Ok(opened)
    }

    /// Opens a socket for each family asked for, marked with `mark` and
    /// bound to `iface`.
    pub fn open(iface: &str, mark: u32, v4: bool, v6: bool) -> Result<Self> {
        let open = |wanted: bool, family| -> Result<Option<OwnedFd>> {
            wanted.then(|| raw_socket(iface, mark, family)).transpose()
        };
        Ok(Self {
            v4: open(v4, libc::AF_INET)?,
            v6: open(v6, libc::AF_INET6)?,
        })
    }

    /// Sends `payload` from `from` to `to` (one family).
    pub fn send(&self, from: SocketAddr, to: SocketAddr, payload: &[u8]) -> std::io::Result<()> {
        let unsupported = || std::io::Error::from(std::io::ErrorKind::Unsupported);
        let packet = udp_packet(from, to, payload).ok_or_else(unsupported)?;
        let socket = match to {
            SocketAddr::V4(_) => self.v4.as_ref(),
            SocketAddr::V6(_) => self.v6.as_ref(),
        };
        send_raw(socket.ok_or_else(unsupported)?, &packet, to.ip())
    }
}

/// A raw socket of `family` (IPPROTO_RAW: the packet carries its own IP
/// header) whose packets carry `mark` and leave by `iface`.
fn raw_socket(iface: &str, mark: u32, family: libc::c_int) -> Result<OwnedFd> {
    // SAFETY: plain socket call; the result is checked.
    let fd = unsafe { libc::socket(family, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error())
            .context("opening the raw socket hedges are sent through: it needs CAP_NET_RAW when the agent starts (it opens the sockets then and drops the capability); restart the agent with it (deploy/selector-hedging.conf)");
    }
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let set = |level, name, value: &[u8]| {
        // SAFETY: value points at value.len() valid bytes.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                level,
                name,
                value.as_ptr().cast(),
                value.len() as libc::socklen_t,
            )
        };
        if rc < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    set(libc::SOL_SOCKET, libc::SO_MARK, &mark.to_ne_bytes())
        .context("setting the mark on the hedge socket (needs CAP_NET_ADMIN)")?;
    set(libc::SOL_SOCKET, libc::SO_BINDTODEVICE, iface.as_bytes())
        .with_context(|| format!("binding the hedge socket to {iface}"))?;
    Ok(fd)
}

/// A UDP datagram from `from` to `to` with its IP header and a full UDP
/// checksum; `None` when the two are of different families. Over IPv4 the
/// kernel fills the header checksum and id of a raw packet; IPv6 has
/// neither, and its UDP checksum is never zero.
pub fn udp_packet(from: SocketAddr, to: SocketAddr, payload: &[u8]) -> Option<Vec<u8>> {
    let mut udp = Vec::with_capacity(8 + payload.len());
    udp.extend_from_slice(&from.port().to_be_bytes());
    udp.extend_from_slice(&to.port().to_be_bytes());
    udp.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    udp.extend_from_slice(payload);
    let mut p = Vec::with_capacity(40 + udp.len());
    let check = match (from.ip(), to.ip()) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            p.extend_from_slice(&[0x45, 0]);
            p.extend_from_slice(&((20 + udp.len()) as u16).to_be_bytes());
            p.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0]);
            p.extend_from_slice(&src.octets());
            p.extend_from_slice(&dst.octets());
            checksum::udp_ipv4_checksum(src.octets(), dst.octets(), &udp)
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            p.extend_from_slice(&[0x60, 0, 0, 0]);
            p.extend_from_slice(&(udp.len() as u16).to_be_bytes());
            p.extend_from_slice(&[17, 64]);
            p.extend_from_slice(&src.octets());
            p.extend_from_slice(&dst.octets());
            checksum::udp_ipv6_checksum(src.octets(), dst.octets(), &udp)
        }
        _ => return None,
    };
    udp[6..8].copy_from_slice(&check.to_be_bytes());
    p.extend_from_slice(&udp);
    Some(p)
}

fn send_raw(socket: &OwnedFd, packet: &[u8], to: IpAddr) -> std::io::Result<()> {
    // SAFETY: all-zero is a valid sockaddr_in and sockaddr_in6.
    let mut v4: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut v6: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    // Port 0: with IPPROTO_RAW the packet's own header says everything.
    let (addr, len) = match to {
        IpAddr::V4(ip) => {
            v4.sin_family = libc::AF_INET as libc::sa_family_t;
            v4.sin_addr.s_addr = u32::from_ne_bytes(ip.octets());
            (
                (&raw const v4).cast::<libc::sockaddr>(),
                size_of::<libc::sockaddr_in>(),
            )
        }
        IpAddr::V6(ip) => {
            v6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            v6.sin6_addr.s6_addr = ip.octets();
            (
                (&raw const v6).cast::<libc::sockaddr>(),
                size_of::<libc::sockaddr_in6>(),
            )
        }
    };
    // SAFETY: packet and addr are valid for the lengths given.
    let rc = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            packet.as_ptr().cast(),
            packet.len(),
            0,
            addr,
            len as libc::socklen_t,
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one's-complement sum over pseudo header and UDP segment.
    fn sums_to_all_ones(src: &[u8], dst: &[u8], segment: &[u8]) -> bool {
        let mut acc = checksum::sum_words(0, src);
        acc = checksum::sum_words(acc, dst);
        acc = acc.wrapping_add(17 + segment.len() as u32);
        acc = checksum::sum_words(acc, segment);
        checksum::fold(acc) == 0xffff
    }

    #[test]
    fn hedge_packets_have_a_valid_udp_checksum() {
        let from: SocketAddr = "10.0.0.9:40000".parse().unwrap();
        let to: SocketAddr = "10.0.0.2:11211".parse().unwrap();
        let p = udp_packet(from, to, b"\0\x01\0\0\0\x01\0\0get k\r\n").unwrap();
        assert_eq!(p.len(), 20 + 8 + 15);
        assert_eq!(&p[12..16], &[10, 0, 0, 9]);
        assert_eq!(&p[16..20], &[10, 0, 0, 2]);
        assert_eq!(u16::from_be_bytes([p[22], p[23]]), 11211);
        assert!(sums_to_all_ones(&p[12..16], &p[16..20], &p[20..]));
    }

    #[test]
    fn ipv6_hedge_packets_have_a_valid_nonzero_udp_checksum() {
        let from: SocketAddr = "[fd77::1]:40000".parse().unwrap();
        let to: SocketAddr = "[fd77::11]:11212".parse().unwrap();
        let p = udp_packet(from, to, b"\0\x01\0\0\0\x01\0\0get k\r\n").unwrap();
        assert_eq!(p.len(), 40 + 8 + 15);
        assert_eq!(p[0] >> 4, 6);
        assert_eq!(u16::from_be_bytes([p[4], p[5]]), 8 + 15);
        assert_eq!((p[6], p[7]), (17, 64));
        assert_eq!(
            &p[8..24],
            &"fd77::1".parse::<std::net::Ipv6Addr>().unwrap().octets()
        );
        assert_eq!(u16::from_be_bytes([p[42], p[43]]), 11212);
        assert_ne!(&p[46..48], &[0, 0]);
        assert!(sums_to_all_ones(&p[8..24], &p[24..40], &p[40..]));
    }

    #[test]
    fn a_mixed_pair_of_families_is_no_packet() {
        let from: SocketAddr = "10.0.0.9:40000".parse().unwrap();
        let to: SocketAddr = "[fd77::11]:11212".parse().unwrap();
        assert_eq!(udp_packet(from, to, b"x"), None);
    }
}
