//! Protocol descriptors: where a request id sits in a UDP payload and how a
//! read is recognised. Readers are closures over payload offsets so the same
//! code walks a host slice in tests and a bounds-checked packet in the kernel.

/// Longest request id, in bytes.
pub const MAX_ID_LEN: u8 = 8;
/// Longest read prefix, in bytes.
pub const MAX_PREFIX_LEN: u8 = 16;
/// Offsets plus lengths stay below this, which also bounds kernel packet reads.
pub const MAX_DESCRIPTOR_SPAN: u16 = 256;
/// Longest no-reply marker, in bytes.
pub const MAX_NO_REPLY_LEN: u8 = 8;
/// Longest error marker, in bytes.
pub const MAX_ERROR_LEN: u8 = 8;

/// Replies are never classified as errors.
pub const ERROR_NONE: u8 = 0;
/// DNS: a response (QR 1) with rcode FORMERR, SERVFAIL, NOTIMP or REFUSED
/// (RFC 1035 4.1.1). NXDOMAIN is an answer, not a failure of the server.
pub const ERROR_DNS: u8 = 1;
/// The reply, in one datagram, holds MARKER at `error_offset`: memcached's
/// `SERVER_ERROR` (its preset), or a custom protocol's `--error-marker`.
pub const ERROR_PREFIX: u8 = 2;

/// How a request that expects no reply is recognised (it is then neither
/// tracked nor steered: nothing would ever complete it).
pub const NO_REPLY_NONE: u8 = 0;
/// The first line (up to CR or LF) ends with ` MARKER` (memcached `noreply`).
pub const NO_REPLY_LINE_END: u8 = 1;
/// The payload holds MARKER at `no_reply_offset`.
pub const NO_REPLY_PREFIX: u8 = 2;

/// No protocol error can be built: `--on-overload reject` is refused.
pub const REJECT_NONE: u8 = 0;
/// memcached: the request's frame header, then `SERVER_ERROR overloaded`.
pub const REJECT_MEMCACHED: u8 = 1;
/// DNS: the query turned into a SERVFAIL response with the same id.
pub const REJECT_DNS: u8 = 2;

/// Which datagrams to a member are requests (tracked, counted pending,
/// steerable). Anything else passes untouched: a local sender could
/// otherwise make a healthy member look loaded with datagrams no server
/// answers as a request. `REQUEST_ANY`: every datagram holding the id.
pub const REQUEST_ANY: u8 = 0;
/// DNS (RFC 1035 4.1.1): a whole 12-byte header, QR 0 (a query), opcode
/// QUERY, exactly one question.
pub const REQUEST_DNS_QUERY: u8 = 1;
/// memcached's UDP frame header as a request carries it: sequence 0, one
/// datagram, reserved 0 (memcached itself refuses multi-datagram requests).
pub const REQUEST_MEMCACHED: u8 = 2;
/// The DNS header's length.
pub const DNS_HEADER_LEN: usize = 12;
/// memcached's UDP frame header's length.
pub const MEMCACHED_HEADER_LEN: usize = 8;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub id_offset: u16,
    pub id_len: u8,
    /// 0: every request is a read.
    pub prefix_len: u8,
    pub prefix_offset: u16,
    pub _pad: u16,
    pub prefix: [u8; MAX_PREFIX_LEN as usize],
    /// `NO_REPLY_*`.
    pub no_reply_kind: u8,
    pub no_reply_len: u8,
    /// Where the marker (prefix kind) or the line search (line-end kind) starts.
    pub no_reply_offset: u16,
    /// 1: replies may span datagrams, each carrying memcached's frame header
    /// (sequence number and datagram count after the request id).
    pub multi_datagram: u8,
    /// `REJECT_*`: which protocol error the kernel can answer with.
    pub reject_kind: u8,
    /// `REQUEST_*`: which datagrams are requests at all.
    pub request_kind: u8,
    pub _pad2: u8,
    pub no_reply: [u8; MAX_NO_REPLY_LEN as usize],
    /// `ERROR_*`: which replies are errors (failures of the replica).
    pub error_kind: u8,
    pub error_len: u8,
    pub error_offset: u16,
    pub _pad3: u32,
    pub error: [u8; MAX_ERROR_LEN as usize],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DescriptorError {
    IdLength,
    PrefixLength,
    NoReplyLength,
    ErrorLength,
    OutOfRange,
}

impl core::fmt::Display for DescriptorError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::IdLength => write!(f, "request id length must be 1..={MAX_ID_LEN} bytes"),
            Self::PrefixLength => write!(f, "read prefix must be at most {MAX_PREFIX_LEN} bytes"),
            Self::NoReplyLength => {
                write!(f, "no-reply marker must be 1..={MAX_NO_REPLY_LEN} bytes")
            }
            Self::ErrorLength => {
                write!(f, "error marker must be 1..={MAX_ERROR_LEN} bytes")
            }
            Self::OutOfRange => write!(
                f,
                "request id and read prefix must end within the first {MAX_DESCRIPTOR_SPAN} payload bytes"
            ),
        }
    }
}

impl Descriptor {
    /// memcached's UDP frame header: a 16-bit request id at offset 0, then
    /// 6 more header bytes, then the ASCII command. `get` also matches `gets`.
    pub const fn memcached() -> Self {
        let mut prefix = [0u8; MAX_PREFIX_LEN as usize];
        prefix[0] = b'g';
        prefix[1] = b'e';
        prefix[2] = b't';
        Self {
            id_offset: 0,
            id_len: 2,
            prefix_len: 3,
            prefix_offset: 8,
            _pad: 0,
            prefix,
            no_reply_kind: NO_REPLY_LINE_END,
            no_reply_len: 7,
            no_reply_offset: 8,
            multi_datagram: 1,
            reject_kind: REJECT_MEMCACHED,
            request_kind: REQUEST_MEMCACHED,
            _pad2: 0,
            no_reply: *b"noreply\0",
            // `SERVER_ERROR ...` after the frame header. `ERROR` and
            // `CLIENT_ERROR` are the request's fault, which every replica
            // would answer alike: not a failure of this one.
            error_kind: ERROR_PREFIX,
            error_len: 8,
            error_offset: MEMCACHED_HEADER_LEN as u16,
            _pad3: 0,
            error: *b"SERVER_E",
        }
    }

    /// DNS: the 16-bit message id at offset 0; every query is a read, and
    /// only a standard query with one question is a request.
    pub const fn dns() -> Self {
        Self {
            id_offset: 0,
            id_len: 2,
            prefix_len: 0,
            prefix_offset: 0,
            _pad: 0,
            prefix: [0; MAX_PREFIX_LEN as usize],
            no_reply_kind: NO_REPLY_NONE,
            no_reply_len: 0,
            no_reply_offset: 0,
            multi_datagram: 0,
            reject_kind: REJECT_DNS,
            request_kind: REQUEST_DNS_QUERY,
            _pad2: 0,
            no_reply: [0; MAX_NO_REPLY_LEN as usize],
            error_kind: ERROR_DNS,
            error_len: 0,
            error_offset: 0,
            _pad3: 0,
            error: [0; MAX_ERROR_LEN as usize],
        }
    }

    /// A custom descriptor, checked.
    pub fn custom(
        id_offset: u16,
        id_len: u8,
        prefix_offset: u16,
        read_prefix: &[u8],
    ) -> Result<Self, DescriptorError> {
        if read_prefix.len() > MAX_PREFIX_LEN as usize {
            return Err(DescriptorError::PrefixLength);
        }
        let mut prefix = [0u8; MAX_PREFIX_LEN as usize];
        prefix[..read_prefix.len()].copy_from_slice(read_prefix);
        let d = Self {
            id_offset,
            id_len,
            prefix_len: read_prefix.len() as u8,
            prefix_offset,
            prefix,
            reject_kind: REJECT_NONE,
            // Nothing is known of the protocol's header.
            request_kind: REQUEST_ANY,
            error_kind: ERROR_NONE,
            ..Self::dns()
        };
        d.validate()?;
        Ok(d)
    }

    /// Requests holding `marker` at `offset` expect no reply.
    pub fn with_no_reply_prefix(
        mut self,
        offset: u16,
        marker: &[u8],
    ) -> Result<Self, DescriptorError> {
        if marker.is_empty() || marker.len() > MAX_NO_REPLY_LEN as usize {
            return Err(DescriptorError::NoReplyLength);
        }
        self.no_reply = [0; MAX_NO_REPLY_LEN as usize];
        self.no_reply[..marker.len()].copy_from_slice(marker);
        self.no_reply_len = marker.len() as u8;
        self.no_reply_offset = offset;
        self.no_reply_kind = NO_REPLY_PREFIX;
        self.validate()?;
        Ok(self)
    }

    /// Replies holding `marker` at `offset` are errors (failures of the
    /// replica that sent them).
    pub fn with_error_marker(
        mut self,
        offset: u16,
        marker: &[u8],
    ) -> Result<Self, DescriptorError> {
        if marker.is_empty() || marker.len() > MAX_ERROR_LEN as usize {
            return Err(DescriptorError::ErrorLength);
        }
        self.error = [0; MAX_ERROR_LEN as usize];
        self.error[..marker.len()].copy_from_slice(marker);
        self.error_len = marker.len() as u8;
        self.error_offset = offset;
        self.error_kind = ERROR_PREFIX;
        self.validate()?;
        Ok(self)
    }

    pub fn validate(&self) -> Result<(), DescriptorError> {
        if self.error_kind == ERROR_PREFIX
            && (self.error_len == 0 || self.error_len > MAX_ERROR_LEN)
        {
            return Err(DescriptorError::ErrorLength);
        }
        if self.error_kind == ERROR_PREFIX
            && u32::from(self.error_offset) + u32::from(self.error_len)
                > u32::from(MAX_DESCRIPTOR_SPAN)
        {
            return Err(DescriptorError::OutOfRange);
        }
        if self.id_len == 0 || self.id_len > MAX_ID_LEN {
            return Err(DescriptorError::IdLength);
        }
        if self.prefix_len > MAX_PREFIX_LEN {
            return Err(DescriptorError::PrefixLength);
        }
        if self.no_reply_kind != NO_REPLY_NONE
            && (self.no_reply_len == 0 || self.no_reply_len > MAX_NO_REPLY_LEN)
        {
            return Err(DescriptorError::NoReplyLength);
        }
        if self.no_reply_kind == NO_REPLY_PREFIX
            && u32::from(self.no_reply_offset) + u32::from(self.no_reply_len)
                > u32::from(MAX_DESCRIPTOR_SPAN)
        {
            return Err(DescriptorError::OutOfRange);
        }
        let id_end = u32::from(self.id_offset) + u32::from(self.id_len);
        let prefix_end = u32::from(self.prefix_offset) + u32::from(self.prefix_len);
        if id_end > u32::from(MAX_DESCRIPTOR_SPAN) || prefix_end > u32::from(MAX_DESCRIPTOR_SPAN) {
            return Err(DescriptorError::OutOfRange);
        }
        Ok(())
    }

    /// The request id, big-endian, or `None` if the payload is too short or
    /// the descriptor is invalid.
    #[inline(always)]
    pub fn request_id(&self, byte_at: impl Fn(usize) -> Option<u8>) -> Option<u64> {
        let len = self.id_len as usize;
        if len == 0 || len > MAX_ID_LEN as usize {
            return None;
        }
        let base = (self.id_offset % MAX_DESCRIPTOR_SPAN) as usize;
        let mut id = 0u64;
        let mut i = 0;
        while i < MAX_ID_LEN as usize {
            if i < len {
                id = (id << 8) | u64::from(byte_at(base + i)?);
            }
            i += 1;
        }
        Some(id)
    }

    /// Whether the payload is a request the protocol defines (see
    /// `REQUEST_*`). A few fixed byte reads and no loop, so it costs the
    /// kernel program's verifier little.
    #[inline(always)]
    pub fn is_request(&self, byte_at: impl Fn(usize) -> Option<u8>) -> bool {
        match self.request_kind {
            REQUEST_DNS_QUERY => {
                // Byte 2: QR (bit 7) then the opcode (bits 6-3), both 0;
                // bytes 4-5: QDCOUNT, big-endian.
                byte_at(DNS_HEADER_LEN - 1).is_some()
                    && matches!(byte_at(2), Some(flags) if flags & 0xf8 == 0)
                    && byte_at(4) == Some(0)
                    && byte_at(5) == Some(1)
            }
            // After the 16-bit request id: sequence, datagram count and
            // reserved, each 16 bits, big-endian.
            REQUEST_MEMCACHED => {
                byte_at(2) == Some(0)
                    && byte_at(3) == Some(0)
                    && byte_at(4) == Some(0)
                    && byte_at(5) == Some(1)
                    && byte_at(6) == Some(0)
                    && byte_at(MEMCACHED_HEADER_LEN - 1) == Some(0)
            }
            _ => true,
        }
    }

    /// Whether the payload is a read: no prefix configured, or it starts with
    /// the prefix at the prefix offset.
    #[inline(always)]
    pub fn is_read(&self, byte_at: impl Fn(usize) -> Option<u8>) -> bool {
        let len = self.prefix_len as usize;
        if len > MAX_PREFIX_LEN as usize {
            return false;
        }
        let base = (self.prefix_offset % MAX_DESCRIPTOR_SPAN) as usize;
        let mut i = 0;
        while i < MAX_PREFIX_LEN as usize {
            if i < len && byte_at(base + i) != Some(self.prefix[i]) {
                return false;
            }
            i += 1;
        }
        true
    }
}

impl Descriptor {
    /// Whether the request expects no reply, so nothing would complete it.
    /// `word_at(i)`: the 8 payload bytes from `i`, when all 8 are in the
    /// datagram; `byte_at` reads the last few. `merge` returns its argument;
    /// the kernel passes it through memory the verifier does not track, so
    /// the scan's many ways out continue as one state (see
    /// [`first_line_end`]).
    #[inline(always)]
    pub fn expects_no_reply(
        &self,
        byte_at: impl Fn(usize) -> Option<u8>,
        word_at: impl Fn(usize) -> Option<[u8; 8]>,
        merge: impl Fn(usize) -> usize,
    ) -> bool {
        let len = self.no_reply_len as usize;
        if len == 0 || len > MAX_NO_REPLY_LEN as usize {
            return false;
        }
        let base = (self.no_reply_offset % MAX_DESCRIPTOR_SPAN) as usize;
        match self.no_reply_kind {
            NO_REPLY_PREFIX => self.marker_at(&byte_at, base, len),
            NO_REPLY_LINE_END => match first_line_end(&byte_at, word_at, base, merge) {
                // The first line ends with ` MARKER`.
                Some(end) => {
                    end > base + len
                        && byte_at(end - len - 1) == Some(b' ')
                        && self.marker_at(&byte_at, end - len, len)
                }
                None => false,
            },
            _ => false,
        }
    }

    #[inline(always)]
    fn marker_at(&self, byte_at: &impl Fn(usize) -> Option<u8>, at: usize, len: usize) -> bool {
        let mut j = 0;
        while j < MAX_NO_REPLY_LEN as usize {
            if j < len && byte_at(at + j) != Some(self.no_reply[j]) {
                return false;
            }
            j += 1;
        }
        true
    }

    /// Whether a reply is an error (`ERROR_*`): a failure of the replica
    /// that sent it, as a lost request is. `word_at(i)`: the 8 payload
    /// bytes from `i`, when all 8 are in the datagram. `whole`: the reply
    /// is one datagram (a marker is looked for only there: a later datagram
    /// of a long value could hold any bytes). Two word reads and mask
    /// arithmetic, no branch per byte (the reply path's verifier cost).
    /// A marker is found only with 8 payload bytes from its offset.
    #[inline(always)]
    pub fn is_error_reply(&self, word_at: impl Fn(usize) -> Option<[u8; 8]>, whole: bool) -> bool {
        match self.error_kind {
            ERROR_DNS => {
                // The whole 12-byte header: byte 2 holds QR (bit 7), byte 3
                // the rcode (bits 3-0).
                let (Some(head), Some(_)) = (word_at(0), word_at(DNS_HEADER_LEN - 8)) else {
                    return false;
                };
                let rcode = head[3] & 0x0f;
                // FORMERR 1, SERVFAIL 2, NOTIMP 4, REFUSED 5.
                head[2] & 0x80 != 0 && (0b11_0110u32 >> rcode) & 1 != 0
            }
            ERROR_PREFIX => {
                let len = (self.error_len % (MAX_ERROR_LEN + 1)) as u32;
                let base = (self.error_offset % MAX_DESCRIPTOR_SPAN) as usize;
                let Some(w) = word_at(base) else {
                    return false;
                };
                let mask =
                    (u64::MAX >> (64 - 8 * len).min(63)) & u64::from(len != 0).wrapping_neg();
                let diff = (u64::from_le_bytes(w) ^ u64::from_le_bytes(self.error)) & mask;
                whole && len != 0 && diff == 0
            }
            _ => false,
        }
    }

    /// (sequence number, datagram count) of a reply datagram: (0, 1) unless
    /// the protocol splits replies (memcached's frame header: two 16-bit
    /// fields after the request id). A count of 0 is read as 1.
    #[inline(always)]
    pub fn reply_datagram(&self, byte_at: impl Fn(usize) -> Option<u8>) -> (u16, u16) {
        if self.multi_datagram == 0 {
            return (0, 1);
        }
        let base = (self.id_offset % MAX_DESCRIPTOR_SPAN) as usize + 2;
        let word =
            |i: usize| -> Option<u16> { Some(u16::from_be_bytes([byte_at(i)?, byte_at(i + 1)?])) };
        match (word(base), word(base + 2)) {
            (Some(seq), Some(total)) if total > 1 => (seq, total),
            _ => (0, 1),
        }
    }
}

/// Offset of the first CR or LF at or after `from`, within the descriptor
/// span and the datagram. Eight bytes a step, and whichever step the scan
/// leaves at, it goes on through `merge` (identity) as one value: a
/// byte-by-byte scan, or a verifier state per way out of it, is more than
/// Linux 6.1's verifier walks ("the sequence of 8193 jumps is too
/// complex", or a million instructions).
#[inline(always)]
pub fn first_line_end(
    byte_at: &impl Fn(usize) -> Option<u8>,
    word_at: impl Fn(usize) -> Option<[u8; 8]>,
    from: usize,
    merge: impl Fn(usize) -> usize,
) -> Option<usize> {
    const SPAN: usize = MAX_DESCRIPTOR_SPAN as usize;
    /// Set on a found line end; clear: where the whole words ended.
    const FOUND: usize = 2 * SPAN;
    let mut i = from;
    let mut at = None;
    while i + 8 <= SPAN {
        let Some(word) = word_at(i) else {
            break;
        };
        if let Some(k) = first_crlf_in(word) {
            at = Some(i + k);
            break;
        }
        i += 8;
    }
    let merged = merge(match at {
        Some(end) => FOUND | end,
        None => i,
    });
    if merged & FOUND != 0 {
        return Some(merged % SPAN);
    }
    // Fewer than 8 bytes left in the datagram or the span.
    let i = merged % FOUND;
    let mut j = 0;
    while j < 8 {
        if i + j >= SPAN {
            return None;
        }
        match byte_at(i + j)? {
            b'\r' | b'\n' => return Some(i + j),
            _ => {}
        }
        j += 1;
    }
    None
}

/// Index of the first CR or LF among 8 bytes, without a branch per byte.
#[inline(always)]
pub fn first_crlf_in(bytes: [u8; 8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let word = u64::from_le_bytes(bytes);
    // The high bit of each byte that is zero; a byte above a zero may be
    // flagged too (a borrow), never one below, so the lowest flag is exact.
    let zero = |x: u64| x.wrapping_sub(ONES) & !x & HIGHS;
    let found = zero(word ^ (ONES * u64::from(b'\r'))) | zero(word ^ (ONES * u64::from(b'\n')));
    if found == 0 {
        return None;
    }
    // 1 << 8k for the lowest flagged byte k; the multiply brings k to the
    // top byte (no count-trailing-zeros instruction in BPF).
    let lowest = (found & found.wrapping_neg()) >> 7;
    Some((lowest.wrapping_mul(0x0001_0203_0405_0607) >> 56) as usize)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::{vec, vec::Vec};

    fn reader(payload: &[u8]) -> impl Fn(usize) -> Option<u8> + '_ {
        |i| payload.get(i).copied()
    }

    fn words(payload: &[u8]) -> impl Fn(usize) -> Option<[u8; 8]> + '_ {
        |i| payload.get(i..i + 8).map(|w| w.try_into().unwrap())
    }

    fn no_reply(d: &Descriptor, payload: &[u8]) -> bool {
        d.expects_no_reply(reader(payload), words(payload), |x| x)
    }

    #[test]
    fn the_first_crlf_of_eight_bytes_is_found_wherever_it_is() {
        for at in 0..8 {
            for end in [b'\r', b'\n'] {
                let mut w = *b"abcdefgh";
                w[at] = end;
                assert_eq!(first_crlf_in(w), Some(at), "{w:?}");
                // A later CR or LF, and bytes that borrow (0x00, 0x0b, 0x0c,
                // 0x0e), change nothing.
                for later in at + 1..8 {
                    for b in [b'\r', b'\n', 0, 0x0b, 0x0c, 0x0e, 0xff] {
                        let mut v = w;
                        v[later] = b;
                        assert_eq!(first_crlf_in(v), Some(at), "{v:?}");
                    }
                }
            }
        }
        assert_eq!(first_crlf_in(*b"\x00\x0b\x0c\x0e\x09\x8d\x8a\xff"), None);
    }

    #[test]
    fn the_line_end_scan_agrees_with_a_byte_by_byte_scan() {
        // Every line end position and payload length around the 8-byte
        // steps, from several starting offsets.
        for len in 0..40 {
            for end in 0..=len {
                let mut p: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
                if end < len {
                    p[end] = if end % 2 == 0 { b'\r' } else { b'\n' };
                }
                for from in 0..10 {
                    let naive = (from..p.len()).find(|&i| p[i] == b'\r' || p[i] == b'\n');
                    assert_eq!(
                        first_line_end(&reader(&p), words(&p), from, |x| x),
                        naive,
                        "len {len} end {end} from {from}"
                    );
                }
            }
        }
        // Not past the span.
        let mut long = vec![b'x'; MAX_DESCRIPTOR_SPAN as usize + 8];
        long[MAX_DESCRIPTOR_SPAN as usize + 2] = b'\n';
        assert_eq!(first_line_end(&reader(&long), words(&long), 0, |x| x), None);
    }

    const MC_GET: &[u8] = b"\x12\x34\x00\x00\x00\x01\x00\x00get foo\r\n";
    const MC_GETS: &[u8] = b"\xab\xcd\x00\x00\x00\x01\x00\x00gets foo\r\n";
    const MC_SET: &[u8] = b"\x00\x07\x00\x00\x00\x01\x00\x00set foo 0 0 1\r\nx\r\n";

    #[test]
    fn memcached_id_and_reads() {
        let d = Descriptor::memcached();
        d.validate().unwrap();
        assert_eq!(d.request_id(reader(MC_GET)), Some(0x1234));
        assert_eq!(d.request_id(reader(MC_GETS)), Some(0xabcd));
        assert!(d.is_read(reader(MC_GET)));
        assert!(d.is_read(reader(MC_GETS)));
        assert!(!d.is_read(reader(MC_SET)));
        assert_eq!(d.request_id(reader(MC_SET)), Some(7));
    }

    #[test]
    fn memcached_short_payloads() {
        let d = Descriptor::memcached();
        assert_eq!(d.request_id(reader(b"\x12")), None);
        // Header only: has an id but no command, so not a read.
        assert!(!d.is_read(reader(&MC_GET[..8])));
        assert!(!d.is_read(reader(&MC_GET[..10])));
    }

    #[test]
    fn dns_every_query_is_a_read() {
        let d = Descriptor::dns();
        let q = b"\xbe\xef\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00";
        assert_eq!(d.request_id(reader(q)), Some(0xbeef));
        assert!(d.is_read(reader(q)));
        assert!(d.is_read(reader(b"")));
    }

    /// A standard query for `a.` IN A, id 0xbeef, RD set: 12-byte header,
    /// then the question.
    const DNS_QUERY: &[u8] =
        b"\xbe\xef\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x01a\x00\x00\x01\x00\x01";

    #[test]
    fn dns_only_a_standard_query_with_one_question_is_a_request() {
        let d = Descriptor::dns();
        assert!(d.is_request(reader(DNS_QUERY)));
        // The bare header is enough; so is an EDNS query (ARCOUNT 1).
        assert!(d.is_request(reader(&DNS_QUERY[..12])));
        let edns = b"\xbe\xef\x01\x00\x00\x01\x00\x00\x00\x00\x00\x01";
        assert!(d.is_request(reader(edns)));
        // The AD and CD bits of a query are not the opcode.
        let ad_cd = b"\xbe\xef\x01\x30\x00\x01\x00\x00\x00\x00\x00\x00";
        assert!(d.is_request(reader(ad_cd)));

        let untracked: [(&str, &[u8]); 9] = [
            ("2 bytes", b"\xbe\xef"),
            ("11 bytes", b"\xbe\xef\x01\x00\x00\x01\x00\x00\x00\x00\x00"),
            ("empty", b""),
            (
                "QR=1 (a response)",
                b"\xbe\xef\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00",
            ),
            (
                "opcode NOTIFY (4)",
                b"\xbe\xef\x20\x00\x00\x01\x00\x00\x00\x00\x00\x00",
            ),
            (
                "opcode UPDATE (5)",
                b"\xbe\xef\x28\x00\x00\x01\x00\x00\x00\x00\x00\x00",
            ),
            (
                "opcode IQUERY (1)",
                b"\xbe\xef\x08\x00\x00\x01\x00\x00\x00\x00\x00\x00",
            ),
            (
                "QDCOUNT 0",
                b"\xbe\xef\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00",
            ),
            (
                "QDCOUNT 2",
                b"\xbe\xef\x01\x00\x00\x02\x00\x00\x00\x00\x00\x00",
            ),
        ];
        for (what, payload) in untracked {
            assert!(!d.is_request(reader(payload)), "{what} is no request");
        }
        // QDCOUNT 256 differs from 1 only in the high byte.
        let qd256 = b"\xbe\xef\x01\x00\x01\x01\x00\x00\x00\x00\x00\x00";
        assert!(!d.is_request(reader(qd256)));
    }

    #[test]
    fn memcached_only_a_single_datagram_request_frame_is_a_request() {
        let d = Descriptor::memcached();
        assert!(d.is_request(reader(MC_GET)));
        assert!(d.is_request(reader(MC_SET)));
        // The header alone is a request (memcached answers it with an error).
        assert!(d.is_request(reader(&MC_GET[..8])));
        let untracked: [(&str, &[u8]); 7] = [
            ("2 bytes", b"\x12\x34"),
            ("7 bytes", b"\x12\x34\x00\x00\x00\x01\x00"),
            ("sequence 1", b"\x12\x34\x00\x01\x00\x01\x00\x00get foo\r\n"),
            (
                "sequence 256",
                b"\x12\x34\x01\x00\x00\x01\x00\x00get foo\r\n",
            ),
            ("total 0", b"\x12\x34\x00\x00\x00\x00\x00\x00get foo\r\n"),
            ("total 2", b"\x12\x34\x00\x00\x00\x02\x00\x00get foo\r\n"),
            ("reserved 1", b"\x12\x34\x00\x00\x00\x01\x00\x01get foo\r\n"),
        ];
        for (what, payload) in untracked {
            assert!(!d.is_request(reader(payload)), "{what} is no request");
        }
        let total_257 = b"\x12\x34\x00\x00\x01\x01\x00\x00get foo\r\n";
        assert!(!d.is_request(reader(total_257)));
        let reserved_256 = b"\x12\x34\x00\x00\x00\x01\x01\x00get foo\r\n";
        assert!(!d.is_request(reader(reserved_256)));
    }

    #[test]
    fn a_custom_descriptor_takes_every_datagram_with_an_id_as_a_request() {
        let d = Descriptor::custom(0, 2, 0, b"").unwrap();
        assert_eq!(d.request_kind, REQUEST_ANY);
        assert!(d.is_request(reader(b"\xbe\xef")));
        assert!(d.is_request(reader(b"\xbe\xef\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00")));
    }

    #[test]
    fn custom_offsets_and_lengths() {
        let d = Descriptor::custom(4, 4, 0, b"R").unwrap();
        let p = b"R...\x01\x02\x03\x04tail";
        assert_eq!(d.request_id(reader(p)), Some(0x0102_0304));
        assert!(d.is_read(reader(p)));
        assert!(!d.is_read(reader(b"W...\x01\x02\x03\x04")));
        let wide = Descriptor::custom(0, 8, 0, b"").unwrap();
        assert_eq!(
            wide.request_id(reader(&[1, 2, 3, 4, 5, 6, 7, 8, 9])),
            Some(0x0102_0304_0506_0708)
        );
    }

    #[test]
    fn memcached_noreply_is_recognised_on_the_first_line_only() {
        let d = Descriptor::memcached();
        let set_noreply = b"\x00\x07\x00\x00\x00\x01\x00\x00set foo 0 0 1 noreply\r\nx\r\n";
        let del_noreply = b"\x00\x07\x00\x00\x00\x01\x00\x00delete foo noreply\r\n";
        assert!(no_reply(&d, set_noreply));
        assert!(no_reply(&d, del_noreply));
        assert!(!no_reply(&d, MC_SET));
        assert!(!no_reply(&d, MC_GET));
        // The word in the data block, or glued to the key, does not count.
        let in_data = b"\x00\x07\x00\x00\x00\x01\x00\x00set foo 0 0 9\r\n noreply\r\n";
        assert!(!no_reply(&d, in_data));
        let glued = b"\x00\x07\x00\x00\x00\x01\x00\x00delete foonoreply\r\n";
        assert!(!no_reply(&d, glued));
        // No line end within the payload: a reply is expected.
        let cut = b"\x00\x07\x00\x00\x00\x01\x00\x00delete foo noreply";
        assert!(!no_reply(&d, cut));
        assert!(!no_reply(&Descriptor::dns(), del_noreply));
    }

    #[test]
    fn custom_no_reply_prefix() {
        let d = Descriptor::custom(0, 4, 4, b"R")
            .unwrap()
            .with_no_reply_prefix(5, b"!")
            .unwrap();
        assert!(no_reply(&d, b"\0\0\0\x01W!"));
        assert!(!no_reply(&d, b"\0\0\0\x01R?"));
        assert!(!no_reply(&d, b"\0\0\0\x01W"));
        assert_eq!(
            Descriptor::dns().with_no_reply_prefix(0, b""),
            Err(DescriptorError::NoReplyLength)
        );
        assert_eq!(
            Descriptor::dns().with_no_reply_prefix(255, b"ab"),
            Err(DescriptorError::OutOfRange)
        );
    }

    #[test]
    fn memcached_reply_datagrams() {
        let d = Descriptor::memcached();
        assert_eq!(
            d.reply_datagram(reader(b"\x12\x34\x00\x02\x00\x05\x00\x00")),
            (2, 5)
        );
        assert_eq!(
            d.reply_datagram(reader(b"\x12\x34\x00\x00\x00\x01\x00\x00")),
            (0, 1)
        );
        assert_eq!(
            d.reply_datagram(reader(b"\x12\x34\x00\x00\x00\x00\x00\x00")),
            (0, 1)
        );
        assert_eq!(d.reply_datagram(reader(b"\x12\x34")), (0, 1));
        assert_eq!(
            Descriptor::dns().reply_datagram(reader(b"\x12\x34\x00\x02\x00\x05")),
            (0, 1)
        );
    }

    #[test]
    fn dns_error_replies_are_formerr_servfail_notimp_and_refused() {
        let d = Descriptor::dns();
        let reply = |flags: u8, rcode: u8| {
            let mut r = DNS_QUERY.to_vec();
            r[2] = flags;
            r[3] = 0x80 | rcode;
            r
        };
        for (rcode, error) in [
            (0, false), // NOERROR
            (1, true),  // FORMERR
            (2, true),  // SERVFAIL
            (3, false), // NXDOMAIN: an answer
            (4, true),  // NOTIMP
            (5, true),  // REFUSED
            (6, false), // YXDOMAIN
            (9, false), // NOTAUTH
        ] {
            assert_eq!(
                d.is_error_reply(words(&reply(0x81, rcode)), true),
                error,
                "{rcode}"
            );
        }
        // A query (QR 0) carrying rcode bits is no reply; a short one neither.
        assert!(!d.is_error_reply(words(&reply(0x01, 5)), true));
        assert!(!d.is_error_reply(words(&reply(0x81, 5)[..11]), true));
        assert!(
            !Descriptor::custom(0, 2, 0, b"")
                .unwrap()
                .is_error_reply(words(&reply(0x81, 2)), true)
        );
    }

    #[test]
    fn memcached_server_error_is_an_error_and_client_errors_are_not() {
        let d = Descriptor::memcached();
        let reply = |body: &[u8]| {
            let mut r = b"\x12\x34\x00\x00\x00\x01\x00\x00".to_vec();
            r.extend_from_slice(body);
            r
        };
        assert!(d.is_error_reply(words(&reply(b"SERVER_ERROR out of memory\r\n")), true));
        assert!(d.is_error_reply(words(&reply(b"SERVER_ERROR overloaded\r\n")), true));
        for fine in [
            &b"VALUE foo 0 1\r\nx\r\nEND\r\n"[..],
            b"END\r\n",
            b"ERROR\r\n",
            b"CLIENT_ERROR bad command line format\r\n",
            b"SERVER_",
            b"",
        ] {
            assert!(!d.is_error_reply(words(&reply(fine)), true), "{fine:?}");
        }
        // A datagram of a reply in several: never looked at.
        assert!(!d.is_error_reply(words(&reply(b"SERVER_ERROR x\r\n")), false));
    }

    #[test]
    fn custom_error_marker() {
        let d = Descriptor::custom(0, 2, 0, b"")
            .unwrap()
            .with_error_marker(2, b"ERR")
            .unwrap();
        assert!(d.is_error_reply(words(b"\0\x01ERR!....."), true));
        assert!(d.is_error_reply(words(b"\0\x01ERRERRER"), true));
        assert!(!d.is_error_reply(words(b"\0\x01ERx!....."), true));
        assert!(!d.is_error_reply(words(b"\0\x01OK!......"), true));
        // Fewer than 8 bytes from the offset: not looked at.
        assert!(!d.is_error_reply(words(b"\0\x01ERR!"), true));
        let eight = Descriptor::custom(0, 2, 0, b"")
            .unwrap()
            .with_error_marker(2, b"12345678")
            .unwrap();
        assert!(eight.is_error_reply(words(b"\0\x0112345678"), true));
        assert!(!eight.is_error_reply(words(b"\0\x0112345679"), true));
        assert_eq!(
            Descriptor::dns().with_error_marker(0, b""),
            Err(DescriptorError::ErrorLength)
        );
        assert_eq!(
            Descriptor::dns().with_error_marker(0, b"123456789"),
            Err(DescriptorError::ErrorLength)
        );
        assert_eq!(
            Descriptor::dns().with_error_marker(250, b"1234567"),
            Err(DescriptorError::OutOfRange)
        );
    }

    #[test]
    fn custom_rejects_bad_descriptors() {
        assert_eq!(
            Descriptor::custom(0, 0, 0, b""),
            Err(DescriptorError::IdLength)
        );
        assert_eq!(
            Descriptor::custom(0, 9, 0, b""),
            Err(DescriptorError::IdLength)
        );
        assert_eq!(
            Descriptor::custom(0, 2, 0, &[b'x'; 17]),
            Err(DescriptorError::PrefixLength)
        );
        assert_eq!(
            Descriptor::custom(255, 2, 0, b""),
            Err(DescriptorError::OutOfRange)
        );
        assert_eq!(
            Descriptor::custom(0, 2, 250, b"abcdefg"),
            Err(DescriptorError::OutOfRange)
        );
        assert!(Descriptor::custom(254, 2, 240, &[b'x'; 16]).is_ok());
    }
}
