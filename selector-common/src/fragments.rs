//! The `FRAGMENTS` map: IP-fragmented replies being rewritten. Only the
//! first fragment of a datagram carries its UDP header, so only it can be
//! matched to a read; when it is rewritten, its series is remembered here
//! and the later fragments, known by (source, destination, IP id,
//! protocol), get the same source address.
//!
//! A series ends with its last fragment (more-fragments clear), with the
//! next first fragment of the same key (another datagram reusing the id,
//! rewritten or not), or after `FRAGMENT_TTL_NS`; the map is an LRU hash,
//! so when full the least recently used series is forgotten. A forgotten
//! or unknown series' later fragments pass untouched, counted as
//! `fragment`, and the client's reassembly fails as if a fragment were
//! lost.

/// Fragment series remembered at once.
pub const FRAGMENTS_MAX: u32 = 4096;

/// Age after which a series is forgotten: a later fragment that comes more
/// than this after its first belongs to another datagram that reuses the
/// id (IPv4's 16-bit id wraps after 65,536 datagrams between two hosts).
/// The fragments of one datagram leave back to back; one second is the
/// agent's default request timeout.
pub const FRAGMENT_TTL_NS: u64 = 1_000_000_000;

/// One fragment series. Addresses as 16 bytes (IPv4-mapped for IPv4).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FragmentKey {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    /// IPv4's 16-bit identification, or IPv6's 32-bit one.
    pub id: u32,
    /// IPv4's protocol, or the next header of IPv6's fragment header.
    pub protocol: u8,
    pub _pad: [u8; 3],
}

/// What the later fragments of a series get.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FragmentEntry {
    /// The source address to write (the primary's; IPv4-mapped for IPv4).
    pub addr: [u8; 16],
    /// `bpf_ktime_get_ns` when the first fragment was rewritten.
    pub first_ns: u64,
}

impl FragmentEntry {
    /// Whether the series is still current at `now_ns`.
    pub const fn is_current(&self, now_ns: u64) -> bool {
        now_ns.saturating_sub(self.first_ns) <= FRAGMENT_TTL_NS
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), Copy, explicit padding, no pointers.
    unsafe impl aya::Pod for super::FragmentKey {}
    unsafe impl aya::Pod for super::FragmentEntry {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<FragmentKey>(), 16 + 16 + 4 + 1 + 3);
        assert_eq!(size_of::<FragmentEntry>(), 16 + 8);
    }

    #[test]
    fn a_series_is_current_up_to_its_age() {
        let e = FragmentEntry {
            addr: [0; 16],
            first_ns: 5_000,
        };
        assert!(e.is_current(5_000));
        assert!(e.is_current(5_000 + FRAGMENT_TTL_NS));
        assert!(!e.is_current(5_001 + FRAGMENT_TTL_NS));
        // A clock read on another CPU just before the first fragment's.
        assert!(e.is_current(4_000));
    }
}
