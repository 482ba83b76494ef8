//! The protocol errors the kernel answers an overloaded read with
//! (`--on-overload reject`), so the application fails fast instead of
//! waiting out its timeout (CASSANDRA-15013's THROW_ON_OVERLOAD).

/// The memcached reply text after the frame header.
pub const MEMCACHED_OVERLOADED: &[u8; 25] = b"SERVER_ERROR overloaded\r\n";
/// Frame header plus text: the whole UDP payload of a memcached reject.
pub const MEMCACHED_REJECT_LEN: usize = 8 + MEMCACHED_OVERLOADED.len();

/// The UDP payload of a memcached reject for request `request_id`: the
/// request's id, datagram 0 of 1, then the error line. A copy of a
/// constant, not a zeroed buffer filled in: the compiler turns zeroing
/// into a call of `memset`, a frame that takes the egress program past
/// Linux 6.1's combined stack limit.
pub fn memcached_reject(request_id: u16) -> [u8; MEMCACHED_REJECT_LEN] {
    const TEMPLATE: [u8; MEMCACHED_REJECT_LEN] = {
        let mut out = [0u8; MEMCACHED_REJECT_LEN];
        out[5] = 1;
        let mut i = 0;
        while i < MEMCACHED_OVERLOADED.len() {
            out[8 + i] = MEMCACHED_OVERLOADED[i];
            i += 1;
        }
        out
    };
    let mut out = TEMPLATE;
    let id = request_id.to_be_bytes();
    out[0] = id[0];
    out[1] = id[1];
    out
}

/// DNS header flags of the SERVFAIL answer to a query with `query_flags`:
/// QR set, opcode and RD kept, RA set, RCODE 2 (SERVFAIL).
pub const fn dns_servfail_flags(query_flags: u16) -> u16 {
    (query_flags & 0x7900) | 0x8000 | 0x0080 | 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memcached_reject_keeps_the_id_and_is_one_datagram() {
        let p = memcached_reject(0xbeef);
        assert_eq!(&p[..8], &[0xbe, 0xef, 0, 0, 0, 1, 0, 0]);
        assert_eq!(&p[8..], b"SERVER_ERROR overloaded\r\n");
    }

    #[test]
    fn servfail_flags() {
        // A standard recursive query (RD) becomes QR|RD|RA|SERVFAIL.
        assert_eq!(dns_servfail_flags(0x0100), 0x8182);
        // An AD/CD-flagged query: those bits are not echoed.
        assert_eq!(dns_servfail_flags(0x0130), 0x8182);
        // Opcode survives (NOTIFY = 4).
        assert_eq!(dns_servfail_flags(0x2000) & 0x7800, 0x2000);
    }
}
