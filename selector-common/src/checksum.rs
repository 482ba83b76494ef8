//! Internet checksum arithmetic (RFC 1071, incremental update per RFC 1624).
//! The XDP path rewrites with these; the TC path uses the kernel helpers,
//! and tests check both against full recomputation.

/// Adds 16-bit big-endian words of `bytes` into a 32-bit accumulator.
/// An odd trailing byte is padded with zero, as the checksum requires.
pub fn sum_words(mut acc: u32, bytes: &[u8]) -> u32 {
    let mut chunks = bytes.chunks_exact(2);
    for c in &mut chunks {
        acc = acc.wrapping_add(u32::from(u16::from_be_bytes([c[0], c[1]])));
        acc = (acc & 0xffff) + (acc >> 16);
    }
    if let [last] = chunks.remainder() {
        acc = acc.wrapping_add(u32::from(*last) << 8);
    }
    acc
}

/// Folds a 32-bit accumulator to 16 bits with end-around carry.
pub fn fold(mut acc: u32) -> u16 {
    acc = (acc & 0xffff) + (acc >> 16);
    acc = (acc & 0xffff) + (acc >> 16);
    acc as u16
}

/// Full checksum of `bytes` (the value to store in a header field that was
/// zero while summing).
pub fn checksum(bytes: &[u8]) -> u16 {
    !fold(sum_words(0, bytes))
}

/// RFC 1624 eqn. 3: the checksum after one 16-bit word changes from `old`
/// to `new`: `HC' = ~(~HC + ~m + m')`.
#[inline(always)]
pub fn replace_u16(check: u16, old: u16, new: u16) -> u16 {
    let acc = u32::from(!check) + u32::from(!old) + u32::from(new);
    !fold(acc)
}

/// The checksum after a 32-bit field (an IPv4 address) changes.
#[inline(always)]
pub fn replace_u32(check: u16, old: u32, new: u32) -> u16 {
    let c = replace_u16(check, (old >> 16) as u16, (new >> 16) as u16);
    replace_u16(c, old as u16, new as u16)
}

/// UDP over IPv4: a zero checksum means "none" and stays zero; a computed
/// zero is sent as 0xffff (RFC 768).
#[inline(always)]
pub fn udp_replace_u32(check: u16, old: u32, new: u32) -> u16 {
    if check == 0 {
        return 0;
    }
    match replace_u32(check, old, new) {
        0 => 0xffff,
        c => c,
    }
}

#[inline(always)]
pub fn udp_replace_u16(check: u16, old: u16, new: u16) -> u16 {
    if check == 0 {
        return 0;
    }
    match replace_u16(check, old, new) {
        0 => 0xffff,
        c => c,
    }
}

/// How the one's complement sum changes when the bytes `old` become `new`
/// (RFC 1624: the sum of `~m + m'` over each 16-bit word), folded. One
/// value for a whole 16-byte IPv6 address, the same as `bpf_csum_diff`
/// computes (in network order).
#[inline(always)]
pub fn diff<const N: usize>(old: &[u8; N], new: &[u8; N]) -> u16 {
    let mut acc = 0u32;
    let mut i = 0;
    while i + 1 < N {
        acc += u32::from(!u16::from_be_bytes([old[i], old[i + 1]]));
        acc += u32::from(u16::from_be_bytes([new[i], new[i + 1]]));
        acc = (acc & 0xffff) + (acc >> 16);
        i += 2;
    }
    fold(acc)
}

/// Adds two folded diffs.
#[inline(always)]
pub fn add_diffs(a: u16, b: u16) -> u16 {
    fold(u32::from(a) + u32::from(b))
}

/// The checksum after a change whose `diff` is given: `~(~HC + diff)`.
#[inline(always)]
pub fn apply_diff(check: u16, diff: u16) -> u16 {
    !fold(u32::from(!check) + u32::from(diff))
}

/// UDP over IPv6: the checksum is mandatory, so a computed zero is sent
/// as 0xffff (RFC 8200 8.1). The caller never passes a received zero (such
/// a datagram is invalid and passed untouched).
#[inline(always)]
pub fn udp6_apply_diff(check: u16, diff: u16) -> u16 {
    match apply_diff(check, diff) {
        0 => 0xffff,
        c => c,
    }
}

/// Full UDP-over-IPv6 checksum (pseudo header + segment with a zeroed
/// checksum field); never zero.
pub fn udp_ipv6_checksum(src: [u8; 16], dst: [u8; 16], segment: &[u8]) -> u16 {
    let mut acc = sum_words(0, &src);
    acc = sum_words(acc, &dst);
    acc = sum_words(acc, &(segment.len() as u32).to_be_bytes());
    acc = acc.wrapping_add(17);
    acc = sum_words(acc, segment);
    match !fold(acc) {
        0 => 0xffff,
        c => c,
    }
}

/// UDP-over-IPv6 checksum of a datagram made whole here (ports, length and
/// payload all known): the kernel's memcached reject reply.
#[inline(always)]
/// `addresses`: `sum_words` over the source and destination addresses.
pub fn udp6_datagram_checksum<const N: usize>(
    addresses: u32,
    ports: [u16; 2],
    payload: &[u8; N],
) -> u16 {
    let len = (8 + N) as u32;
    let mut acc = addresses;
    // The length counts twice: in the pseudo header and the UDP header.
    acc += 2 * len + 17 + u32::from(ports[0]) + u32::from(ports[1]);
    acc = sum_words(acc, payload);
    match !fold(acc) {
        0 => 0xffff,
        c => c,
    }
}

/// Full UDP-over-IPv4 checksum (pseudo header + segment with a zeroed
/// checksum field), for tests and fixtures.
pub fn udp_ipv4_checksum(src: [u8; 4], dst: [u8; 4], segment: &[u8]) -> u16 {
    let mut acc = sum_words(0, &src);
    acc = sum_words(acc, &dst);
    acc = acc.wrapping_add(17);
    acc = acc.wrapping_add(segment.len() as u32);
    acc = sum_words(acc, segment);
    match !fold(acc) {
        0 => 0xffff,
        c => c,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // RFC 1071 section 3 example words.
    #[test]
    fn rfc1071_example() {
        let bytes = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(fold(sum_words(0, &bytes)), 0xddf2);
        assert_eq!(checksum(&bytes), !0xddf2);
    }

    fn ipv4_header(src: [u8; 4], dst: [u8; 4]) -> [u8; 20] {
        let mut h = [
            0x45, 0, 0, 40, 0x12, 0x34, 0x40, 0, 64, 17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ];
        h[12..16].copy_from_slice(&src);
        h[16..20].copy_from_slice(&dst);
        let c = checksum(&h);
        h[10..12].copy_from_slice(&c.to_be_bytes());
        h
    }

    #[test]
    fn a_valid_header_sums_to_zero() {
        let h = ipv4_header([10, 0, 0, 1], [10, 0, 0, 2]);
        assert_eq!(checksum(&h), 0);
    }

    #[test]
    fn incremental_address_change_matches_recomputation() {
        for (old, new) in [
            ([10, 0, 0, 10], [10, 0, 0, 11]),
            ([10, 77, 0, 10], [192, 168, 255, 254]),
            ([255, 255, 255, 255], [0, 0, 0, 0]),
            ([0, 0, 0, 1], [255, 255, 0, 0]),
        ] {
            let before = ipv4_header([10, 0, 0, 1], old);
            let after = ipv4_header([10, 0, 0, 1], new);
            let c = u16::from_be_bytes([before[10], before[11]]);
            let updated = replace_u32(c, u32::from_be_bytes(old), u32::from_be_bytes(new));
            // Incremental and full results may differ only as +0/-0.
            let full = u16::from_be_bytes([after[10], after[11]]);
            assert!(
                updated == full || (updated, full) == (0xffff, 0) || (updated, full) == (0, 0xffff)
            );
        }
    }

    fn udp_segment(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
        let mut s = Vec::new();
        s.extend_from_slice(&sport.to_be_bytes());
        s.extend_from_slice(&dport.to_be_bytes());
        s.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        s.extend_from_slice(&[0, 0]);
        s.extend_from_slice(payload);
        s
    }

    extern crate std;
    use std::vec::Vec;

    #[test]
    fn udp_incremental_source_rewrite_matches_recomputation() {
        let payload = b"\x00\x01\x00\x00\x00\x01\x00\x00VALUE foo 0 3\r\nbar\r\nEND\r\n";
        let (client, primary, replica) = ([10, 77, 0, 1], [10, 77, 0, 10], [10, 77, 0, 12]);
        let from_replica = udp_segment(11212, 40000, payload);
        let c = udp_ipv4_checksum(replica, client, &from_replica);
        let mut c2 = udp_replace_u32(c, u32::from_be_bytes(replica), u32::from_be_bytes(primary));
        c2 = udp_replace_u16(c2, 11212, 11211);
        let from_primary = udp_segment(11211, 40000, payload);
        assert_eq!(c2, udp_ipv4_checksum(primary, client, &from_primary));
        // And the rewritten datagram verifies: summing with the checksum gives 0.
        let mut seg = from_primary.clone();
        seg[6..8].copy_from_slice(&c2.to_be_bytes());
        let mut acc = sum_words(0, &primary);
        acc = sum_words(acc, &client);
        acc += 17 + seg.len() as u32;
        assert_eq!(!fold(sum_words(acc, &seg)), 0);
    }

    #[test]
    fn udp_zero_checksum_means_none_and_stays_zero() {
        assert_eq!(udp_replace_u32(0, 1, 2), 0);
        assert_eq!(udp_replace_u16(0, 1, 2), 0);
    }

    #[test]
    fn udp_computed_zero_is_sent_as_all_ones() {
        // Choose a change that makes the raw incremental result 0.
        let check = 0x1234u16;
        let old = 0x0000u16;
        // ~(~check + ~old + new) == 0  <=>  ~check + 0xffff + new == 0xffff (mod fold)
        let new = check.wrapping_sub(0); // ~check + new folds to 0xffff when new == check
        assert_eq!(replace_u16(check, old, new), 0);
        assert_eq!(udp_replace_u16(check, old, new), 0xffff);
    }

    fn v6(last: u16) -> [u8; 16] {
        let mut a = [0xfd, 0x77, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        a[14..].copy_from_slice(&last.to_be_bytes());
        a
    }

    #[test]
    fn ipv6_address_and_port_diff_matches_recomputation() {
        let payload = b"\x00\x01\x00\x00\x00\x01\x00\x00VALUE foo 0 3\r\nbar\r\nEND\r\n";
        let client = v6(1);
        for (replica, primary) in [
            (v6(0x12), v6(0x10)),
            ([0xff; 16], [0; 16]),
            (
                [
                    0x20, 0x01, 0x0d, 0xb8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                ],
                v6(0xffff),
            ),
        ] {
            let from_replica = udp_segment(11212, 40000, payload);
            let c = udp_ipv6_checksum(replica, client, &from_replica);
            let d = add_diffs(
                diff(&replica, &primary),
                diff(&11212u16.to_be_bytes(), &11211u16.to_be_bytes()),
            );
            let updated = udp6_apply_diff(c, d);
            let from_primary = udp_segment(11211, 40000, payload);
            assert_eq!(updated, udp_ipv6_checksum(primary, client, &from_primary));
        }
    }

    #[test]
    fn ipv6_rewrite_never_produces_zero() {
        // ~(~check + d) is zero exactly for d == check; the UDP form sends
        // 0xffff instead, which verifies the same.
        let check = 0x1234u16;
        let d = check;
        assert_eq!(apply_diff(check, d), 0);
        assert_eq!(udp6_apply_diff(check, d), 0xffff);
        // And a full checksum that sums to zero is sent as 0xffff.
        let seg = udp_segment(1, 2, b"");
        let c = udp_ipv6_checksum([0; 16], [0; 16], &seg);
        assert_ne!(c, 0);
    }

    #[test]
    fn a_datagram_made_whole_sums_like_the_generic_checksum() {
        let payload = *b"\x12\x34\x00\x00\x00\x01\x00\x00SERVER_ERROR overloaded\r\n";
        let (src, dst) = (v6(0x10), v6(1));
        let seg = udp_segment(11211, 40000, &payload);
        assert_eq!(
            udp6_datagram_checksum(
                sum_words(sum_words(0, &src), &dst),
                [11211, 40000],
                &payload
            ),
            udp_ipv6_checksum(src, dst, &seg)
        );
    }

    #[test]
    fn diff_of_no_change_changes_nothing() {
        let a = v6(0x42);
        for check in [1u16, 0x8000, 0xfffe] {
            assert_eq!(apply_diff(check, diff(&a, &a)), check);
        }
        // 0xffff may come out as the other zero, which UDP over IPv6 never sends.
        assert_eq!(udp6_apply_diff(0xffff, diff(&a, &a)), 0xffff);
    }

    #[test]
    fn odd_length_is_zero_padded() {
        assert_eq!(sum_words(0, &[0xab]), 0xab00);
        assert_eq!(sum_words(0, &[0x01, 0x02, 0x03]), 0x0102 + 0x0300);
    }
}
