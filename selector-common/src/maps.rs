//! Keys and values of the BPF maps. All `#[repr(C)]` with explicit padding so
//! the kernel and the agent agree on every byte.

/// Most replica groups.
pub const MAX_GROUPS: u32 = 64;
/// Most members of one replica group.
pub const MAX_GROUP_MEMBERS: usize = 8;
/// Most backends. A backend's id is `group * MAX_GROUP_MEMBERS + position`,
/// so the kernel finds a backend's group and its counters without lookups.
pub const MAX_BACKENDS: u32 = MAX_GROUPS * MAX_GROUP_MEMBERS as u32;
/// The default skb mark bit the egress program sets on a packet it sent on
/// again (a redirected request, a reject reply turned back to ingress), so
/// it recognises its own packet on the second pass and clears the bit there.
/// `--mark` picks another bit.
pub const MARK_REDIRECTED: u32 = 0x0100_0000;
/// Slots of the per-client pending table (`CLIENT_PENDING`). Client sockets
/// are hashed into it; two sockets sharing a slot share its bound.
pub const CLIENT_SLOTS: u32 = 65_536;

/// Words of the `MEMBER_PORTS` bitmap: one bit per UDP port.
pub const PORT_WORDS: u32 = 65_536 / 64;

/// Port `port`'s bit in `MEMBER_PORTS`: (word, bit within it).
pub const fn member_port_bit(port: u16) -> (u32, u64) {
    ((port / 64) as u32, 1 << (port % 64))
}

/// Entries of the per-CPU `SCRATCH` map (two words each): one for the
/// programs' merges of verifier states, two for the reply path's match.
pub const SCRATCH_ENTRIES: u32 = 3;

/// The reply path's per-CPU working memory (the `REPLY_SCRATCH` map, one
/// entry): values it hands to map helpers and scans by pointer, kept out of
/// the program's 512-byte stack, which the reply path nearly fills.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplyScratch {
    /// The in-flight key of the reply being matched.
    pub key: InflightKey,
    /// A fragment series' key and entry, for `FRAGMENTS`.
    pub series: crate::fragments::FragmentKey,
    pub entry: crate::fragments::FragmentEntry,
}

/// Longest request timeout the agent accepts (one hour): far from where the
/// nanosecond arithmetic could wrap.
pub const MAX_TIMEOUT_MS: u64 = 3_600_000;

/// Default size of the in-flight table (entries, not bytes).
pub const DEFAULT_INFLIGHT_MAX: u32 = 65_536;
/// Largest `--inflight-max`: 16 Mi slots of 64 bytes, 1 GiB.
pub const MAX_INFLIGHT_MAX: u32 = 4_194_304;

/// Set in a `BACKENDS` value while a member removed by a reload finishes
/// its requests: egress treats its address as no backend (nothing new is
/// tracked or steered to or from it), the reply path still completes and
/// rewrites the requests in flight. The agent deletes the entry once none
/// is left.
pub const BACKEND_RETIRING: u32 = 1 << 31;

/// The id of the member at `position` of `group`.
pub const fn backend_id(group: u32, position: usize) -> u32 {
    group * MAX_GROUP_MEMBERS as u32 + position as u32
}

/// (group, position) of a backend id.
pub const fn split_backend_id(id: u32) -> (u32, usize) {
    (
        id / MAX_GROUP_MEMBERS as u32,
        (id % MAX_GROUP_MEMBERS as u32) as usize,
    )
}

/// Map names, as the agent's kernel object declares them. The kernel's
/// `#[map]` takes a static's own name (it accepts no constant), so a unit
/// test of selector-user checks the object against `ALL` (with
/// `hedge::names::ALL`): every map here, none other.
pub mod names {
    pub const CONFIG: &str = "CONFIG";
    pub const BACKENDS: &str = "BACKENDS";
    pub const GROUPS: &str = "GROUPS";
    pub const COUNTERS: &str = "COUNTERS";
    pub const CLIENT_PENDING: &str = "CLIENT_PENDING";
    pub const INFLIGHT: &str = "INFLIGHT";
    pub const INFLIGHT_MARKS: &str = "INFLIGHT_MARKS";
    pub const SEQUENCE: &str = "SEQUENCE";
    pub const STATS: &str = "STATS";
    pub const PASSED: &str = "PASSED";
    /// `bpf_skb_pull_data` calls, by direction (`Direction as u32`).
    pub const PULLED: &str = "PULLED";
    pub const LATENCY: &str = "LATENCY";
    pub const FRAGMENTS: &str = "FRAGMENTS";
    pub const NEXT_HOPS: &str = "NEXT_HOPS";
    pub const SERVICE: &str = "SERVICE";
    pub const HEALTH: &str = "HEALTH";
    pub const SCRATCH: &str = "SCRATCH";
    /// A bit per UDP port, set for every port a `BACKENDS` entry has.
    pub const MEMBER_PORTS: &str = "MEMBER_PORTS";
    /// The reply path's working memory (never pinned: nothing in it
    /// outlives a packet).
    pub const REPLY_SCRATCH: &str = "REPLY_SCRATCH";

    /// Every map above.
    pub const ALL: [&str; 19] = [
        CONFIG,
        BACKENDS,
        MEMBER_PORTS,
        GROUPS,
        COUNTERS,
        CLIENT_PENDING,
        INFLIGHT,
        INFLIGHT_MARKS,
        SEQUENCE,
        STATS,
        PASSED,
        PULLED,
        LATENCY,
        FRAGMENTS,
        NEXT_HOPS,
        SERVICE,
        HEALTH,
        SCRATCH,
        REPLY_SCRATCH,
    ];
}

/// Program names, as the agent's kernel object declares them (checked as
/// `names` are).
pub mod programs {
    pub const EGRESS: &str = "selector_egress";
    pub const INGRESS_XDP: &str = "selector_ingress";
    pub const INGRESS_TC: &str = "selector_ingress_tc";

    /// Every program above.
    pub const ALL: [&str; 3] = [EGRESS, INGRESS_XDP, INGRESS_TC];
}

/// The names in the per-packet cost benchmark's kernel object
/// (`selector-bench`), which the agent's object holds none of.
pub mod bench {
    /// Empty programs, the baselines for per-packet cost measurements.
    pub const BASELINE_TC: &str = "selector_baseline_tc";
    pub const BASELINE_XDP: &str = "selector_baseline_xdp";
    /// The least work of a request tracker (one hash insert per request,
    /// one lookup and one delete per reply), for per-packet cost ratios.
    pub const REFERENCE_REQUEST: &str = "selector_reference_request";
    pub const REFERENCE_REPLY: &str = "selector_reference_reply";
    /// The reference reply on TC ingress, for attaching beside the
    /// reference request on real traffic (the closed-loop floor).
    pub const REFERENCE_REPLY_TC: &str = "selector_reference_reply_tc";
    /// The reference programs' hash map.
    pub const REFERENCE: &str = "REFERENCE";

    /// Every program above.
    pub const PROGRAMS: [&str; 5] = [
        BASELINE_TC,
        BASELINE_XDP,
        REFERENCE_REQUEST,
        REFERENCE_REPLY,
        REFERENCE_REPLY_TC,
    ];
    /// Every map above.
    pub const MAPS: [&str; 1] = [REFERENCE];
}

/// An IP endpoint. Addresses are 16 bytes in network order, IPv4 as
/// IPv4-mapped IPv6 (`::ffff:a.b.c.d`), so IPv6 needs no new key layout.
/// The port is in host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad: u16,
}

impl Endpoint {
    pub const fn ipv4(octets: [u8; 4], port: u16) -> Self {
        let mut addr = [0u8; 16];
        addr[10] = 0xff;
        addr[11] = 0xff;
        addr[12] = octets[0];
        addr[13] = octets[1];
        addr[14] = octets[2];
        addr[15] = octets[3];
        Self {
            addr,
            port,
            _pad: 0,
        }
    }

    /// `addr`: IPv6, or IPv4-mapped.
    pub const fn new(addr: [u8; 16], port: u16) -> Self {
        Self {
            addr,
            port,
            _pad: 0,
        }
    }

    /// The IPv4 address if this endpoint is IPv4-mapped.
    pub fn ipv4_octets(&self) -> Option<[u8; 4]> {
        let prefix = [0u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];
        if self.addr[..12] == prefix {
            Some([self.addr[12], self.addr[13], self.addr[14], self.addr[15]])
        } else {
            None
        }
    }
}

/// How to send to a backend without a second pass through egress: the
/// Ethernet addresses of its next hop and of the interface, while the agent
/// knows them. `ifindex` 0 (or another device's) means unknown: the request
/// goes through `bpf_redirect_neigh` instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NextHopMac {
    pub dst: [u8; 6],
    pub src: [u8; 6],
    pub ifindex: u32,
}

/// A replica group: members in preference order, and which may be chosen.
/// One lookup gives the kernel everything it needs to choose and rewrite.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Group {
    pub endpoints: [Endpoint; MAX_GROUP_MEMBERS],
    pub len: u32,
    /// Bit `p` set: member `p` is active. Clear: drained, never chosen.
    pub active: u32,
}

/// Requests issued to, completed by and expired at each member of a group.
/// The kernel adds to `issued` and `completed`; the agent's sweep adds to
/// `expired`. All adds are atomic, in memory both sides map (the map is
/// `BPF_F_MMAPABLE`), and each happens right after the compare-and-swap that
/// decides who accounts for a request, so nothing can fail in between.
/// A member's pending count is `issued - completed - expired`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupCounters {
    pub issued: [u64; MAX_GROUP_MEMBERS],
    pub completed: [u64; MAX_GROUP_MEMBERS],
    pub expired: [u64; MAX_GROUP_MEMBERS],
}

/// The service time of each member of a group (`crate::service`), kept by
/// the reply path; the agent reads it through mmap for `status`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupService {
    /// Recent time per completed request, ns (0: not measured yet).
    pub service_ns: [u64; MAX_GROUP_MEMBERS],
    /// CLOCK_MONOTONIC of the member's last completion (0: none yet).
    pub last_completion_ns: [u64; MAX_GROUP_MEMBERS],
}

/// Outlier ejection state of a group (`crate::ejection`), shared through
/// mmap. Every change is atomic.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupHealth {
    /// Bit `p`: member `p` is ejected (never chosen); bit `8 + p`: half-open
    /// with its probe not taken. The agent sets and clears them; egress
    /// takes a probe by compare-and-swap (`ejection::take_probe`).
    pub bits: u64,
    /// Failures in a row per member: an error reply adds one (reply path),
    /// so does an expired request (the agent's sweep); a good reply sets 0.
    pub failures: [u64; MAX_GROUP_MEMBERS],
    /// Good replies per member, ever (the agent sees a probe succeed).
    pub good: [u64; MAX_GROUP_MEMBERS],
}

/// Pending requests of member `position`. The three counters are read
/// while other CPUs update them, so a reader can see a completion whose issue
/// it missed; the difference saturates at zero instead of wrapping to a
/// huge count for that one decision. The counters themselves stay exact.
#[inline(always)]
pub fn pending(counters: &GroupCounters, position: usize) -> u64 {
    let p = position % MAX_GROUP_MEMBERS;
    pending_of(
        counters.issued[p],
        counters.completed[p],
        counters.expired[p],
    )
}

/// `issued - completed - expired`, saturating at zero.
#[inline(always)]
pub fn pending_of(issued: u64, completed: u64, expired: u64) -> u64 {
    issued.saturating_sub(completed).saturating_sub(expired)
}

/// Identifies one outstanding request: who asked, which group, which id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct InflightKey {
    pub client_addr: [u8; 16],
    pub client_port: u16,
    pub _pad: u16,
    pub group: u32,
    pub request_id: u64,
}

impl InflightKey {
    pub fn ipv4(client: [u8; 4], client_port: u16, group: u32, request_id: u64) -> Self {
        Self::new(
            Endpoint::ipv4(client, 0).addr,
            client_port,
            group,
            request_id,
        )
    }

    /// `client` is an IPv6 address, or IPv4-mapped for an IPv4 client.
    pub fn new(client: [u8; 16], client_port: u16, group: u32, request_id: u64) -> Self {
        Self {
            client_addr: client,
            client_port,
            _pad: 0,
            group,
            request_id,
        }
    }
}

/// Per-backend counters, one copy per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct BackendStats {
    /// Requests the application addressed to this backend (as primary).
    pub requests: u64,
    /// Responses from this backend that completed an in-flight request.
    pub responses: u64,
    /// Requests addressed here that were sent to another replica.
    pub redirected_away: u64,
    /// Requests addressed elsewhere that were sent here.
    pub redirected_to: u64,
    /// Requests addressed here that passed untracked (no free slot).
    pub untracked: u64,
    /// Requests addressed here that expect no reply (memcached `noreply`):
    /// passed untouched, never counted as pending.
    pub no_reply: u64,
    /// Requests addressed here reusing the id of a request in flight to
    /// another member (the application's own failover; passed untouched).
    pub id_collisions: u64,
    /// Responses from this backend that matched no in-flight request
    /// (duplicate, from the wrong replica, or after the grace period).
    pub unmatched_responses: u64,
    /// Reply datagrams from this backend that arrived after their request
    /// completed or expired, within the grace period: rewritten, not counted.
    pub late_responses: u64,
    /// Reads addressed here with every eligible member at `--max-pending`
    /// (or the client over `--max-pending-client`), by what was done.
    pub overload_passed: u64,
    pub overload_dropped: u64,
    pub overload_rejected: u64,
    /// Requests redirected here and sent straight to its next hop's known
    /// Ethernet address; the rest of `redirected_to` went through
    /// `bpf_redirect_neigh` (a second pass through egress).
    #[cfg_attr(feature = "user", serde(default))]
    pub redirected_direct: u64,
    /// Replies from this backend that completed a request with an error
    /// (`Descriptor::is_error_reply`): failures, as expiries are.
    #[cfg_attr(feature = "user", serde(default))]
    pub error_replies: u64,
    /// ... of which to reads moved here from another primary: the errors
    /// the selector caused.
    #[cfg_attr(feature = "user", serde(default))]
    pub error_replies_moved: u64,
    /// Reply datagrams from this backend to an older instance of a request
    /// id while the application waits on a newer one with the same id (the
    /// id reused): dropped, not delivered as the newer one's answer (their
    /// counts end as any reply's; see `inflight::rank`).
    #[cfg_attr(feature = "user", serde(default))]
    pub stale_replies: u64,
}

impl BackendStats {
    pub fn add(&mut self, other: &Self) {
        self.requests += other.requests;
        self.responses += other.responses;
        self.redirected_away += other.redirected_away;
        self.redirected_to += other.redirected_to;
        self.untracked += other.untracked;
        self.no_reply += other.no_reply;
        self.id_collisions += other.id_collisions;
        self.unmatched_responses += other.unmatched_responses;
        self.late_responses += other.late_responses;
        self.overload_passed += other.overload_passed;
        self.overload_dropped += other.overload_dropped;
        self.overload_rejected += other.overload_rejected;
        self.redirected_direct += other.redirected_direct;
        self.error_replies += other.error_replies;
        self.error_replies_moved += other.error_replies_moved;
        self.stale_replies += other.stale_replies;
    }
}

/// Why a packet passed untouched, counted per direction in `PASSED`
/// (index `direction * PASS_REASONS + reason`). A packet that passes here
/// changes no other counter.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassReason {
    /// Not Ethernet (optionally VLAN-tagged) carrying IPv4 or IPv6 and UDP.
    NotIpUdp = 0,
    /// An IP fragment that is not part of a reply being rewritten.
    Fragment = 1,
    /// Something a receiver would drop or no application could send: IP
    /// options, a bad IP header checksum, a total length longer than the
    /// frame, an inconsistent UDP length, a source or destination that is
    /// not unicast (over IPv6 also an IPv4-mapped one; checked for UDP
    /// only, so multicast of other protocols is `NotIpUdp`).
    BadHeader = 2,
    /// Not to (egress) or from (ingress) a configured backend.
    NotBackend = 3,
    /// Too short to hold the request id.
    NoRequestId = 4,
    /// IPv6 with an extension header the parser does not walk (anything
    /// but hop-by-hop, routing and destination options, or a routing
    /// header with segments left), or more of them, or longer, than it
    /// walks. An upper-layer protocol other than UDP is `NotIpUdp`.
    ExtensionHeader = 5,
    /// UDP over IPv6 with checksum 0: invalid there (RFC 8200 8.1), so it
    /// is neither trusted nor rewritten.
    ZeroChecksum = 6,
    /// A GSO skb to a backend (egress only): several datagrams, each a
    /// request of its own, of which only the first's id is readable, and
    /// which a rewrite would move together.
    Segmented = 7,
    /// To a member, but not a request of its protocol (`Descriptor::
    /// is_request`: for DNS a standard query with one question, for
    /// memcached a single-datagram request frame): no server answers it as
    /// one, so counted pending it would only make the member look loaded.
    NotRequest = 8,
    /// A request to a member carrying a VLAN tag (in the frame, or in the
    /// skb's metadata), egress only: it comes from a VLAN device above the
    /// attached one, whose replicas' next hops are on that VLAN, so a
    /// steered copy could not be sent on correctly. Attach to the VLAN
    /// device itself to steer its reads.
    VlanTagged = 9,
}

pub const PASS_REASONS: u32 = 10;

impl PassReason {
    pub const ALL: [PassReason; PASS_REASONS as usize] = [
        PassReason::NotIpUdp,
        PassReason::Fragment,
        PassReason::BadHeader,
        PassReason::NotBackend,
        PassReason::NoRequestId,
        PassReason::ExtensionHeader,
        PassReason::ZeroChecksum,
        PassReason::Segmented,
        PassReason::NotRequest,
        PassReason::VlanTagged,
    ];

    /// The name in status output and metrics.
    pub fn name(self) -> &'static str {
        match self {
            PassReason::NotIpUdp => "not_ip_udp",
            PassReason::Fragment => "fragment",
            PassReason::BadHeader => "bad_header",
            PassReason::NotBackend => "not_backend",
            PassReason::NoRequestId => "no_request_id",
            PassReason::ExtensionHeader => "extension_header",
            PassReason::ZeroChecksum => "zero_checksum",
            PassReason::Segmented => "segmented",
            PassReason::NotRequest => "not_request",
            PassReason::VlanTagged => "vlan_tagged",
        }
    }
}

/// Which program counted a pass.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Egress = 0,
    Ingress = 1,
}

impl Direction {
    pub fn name(self) -> &'static str {
        match self {
            Direction::Egress => "egress",
            Direction::Ingress => "ingress",
        }
    }
}

/// Index into `PASSED`.
#[inline(always)]
pub const fn pass_index(direction: Direction, reason: PassReason) -> u32 {
    direction as u32 * PASS_REASONS + reason as u32
}

/// What a read gets when its primary and every eligible replica are at
/// `max_pending` (or its client is over `max_pending_client`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(
    feature = "user",
    derive(clap::ValueEnum, serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum OnOverload {
    /// Sent as chosen and counted (default).
    Pass = 0,
    /// Dropped in the kernel and counted; the application times out.
    Drop = 1,
    /// Answered at once from the kernel with the protocol's error
    /// (memcached `SERVER_ERROR`, DNS SERVFAIL), never reaching a replica.
    Reject = 2,
}

impl OnOverload {
    pub fn name(self) -> &'static str {
        match self {
            OnOverload::Pass => "pass",
            OnOverload::Drop => "drop",
            OnOverload::Reject => "reject",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [OnOverload::Pass, OnOverload::Drop, OnOverload::Reject]
            .into_iter()
            .find(|o| o.name() == name)
    }

    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(OnOverload::Pass),
            1 => Some(OnOverload::Drop),
            2 => Some(OnOverload::Reject),
            _ => None,
        }
    }
}

/// Tunables, one entry in `CONFIG`; the agent may rewrite it at run time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// `Policy as u32`.
    pub policy: u32,
    pub threshold: u32,
    /// Pending requests per backend at which it is full (0: no bound).
    pub max_pending: u32,
    /// Pending requests per client socket at which it is full (0: no bound).
    pub max_pending_client: u32,
    /// `OnOverload as u32`.
    pub on_overload: u32,
    /// The skb mark bit of the selector's own re-sent packets.
    pub mark: u32,
    /// In-flight slots minus one (the slot count is a power of two).
    pub inflight_mask: u32,
    /// 0: steer as the policy says. 1: draining for shutdown: no new
    /// redirects (retransmits of redirected reads still follow their first copy).
    pub steering_off: u32,
    /// `TieBreak as u32`: how every policy picks among equal members.
    pub tie_break: u32,
    /// Latency policy: microseconds of expected wait over the best member
    /// at which a read leaves its primary.
    pub budget_us: u32,
    pub descriptor: crate::Descriptor,
    /// CLOCK_MONOTONIC ns (`bpf_ktime_get_ns`) of the agent's last sweep:
    /// its heartbeat. Written alone, through mmap, by every sweep.
    pub heartbeat_ns: u64,
    /// Heartbeat age beyond which the programs take the agent for gone
    /// (0: never): see [`Config::agent_alive`].
    pub heartbeat_bound_ns: u64,
}

impl Config {
    /// Whether the agent's heartbeat is recent enough, at `now_ns`, for the
    /// programs to act on the pending counts. Only the agent's sweep
    /// expires lost requests: with no agent their counts stay forever, and
    /// a member with a few lost reads would look loaded for good. So when
    /// this is false the programs fail open: reads go where the
    /// application sent them (no move, no overload bound, no hedge), still
    /// tracked and counted, and replies to reads moved earlier are still
    /// rewritten. A heartbeat ahead of `now_ns` (written between the
    /// program's clock read and its load) is fresh.
    #[inline(always)]
    pub fn agent_alive(&self, now_ns: u64) -> bool {
        self.heartbeat_bound_ns == 0
            || now_ns.saturating_sub(self.heartbeat_ns) <= self.heartbeat_bound_ns
    }
}

/// A backend's address as the maps key it, and back (the agent's side).
#[cfg(feature = "user")]
mod socket_addr {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

    use super::Endpoint;

    impl From<SocketAddr> for Endpoint {
        fn from(addr: SocketAddr) -> Self {
            match addr.ip() {
                IpAddr::V4(ip) => Endpoint::ipv4(ip.octets(), addr.port()),
                IpAddr::V6(ip) => Endpoint::new(ip.octets(), addr.port()),
            }
        }
    }

    impl Endpoint {
        /// The address this endpoint holds.
        pub fn socket_addr(&self) -> SocketAddr {
            match self.ipv4_octets() {
                Some(o) => SocketAddr::new(Ipv4Addr::from(o).into(), self.port),
                None => SocketAddr::new(Ipv6Addr::from(self.addr).into(), self.port),
            }
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all are repr(C), Copy, with explicit padding and no pointers.
    unsafe impl aya::Pod for Endpoint {}
    unsafe impl aya::Pod for Group {}
    unsafe impl aya::Pod for NextHopMac {}
    unsafe impl aya::Pod for GroupCounters {}
    unsafe impl aya::Pod for GroupService {}
    unsafe impl aya::Pod for GroupHealth {}
    unsafe impl aya::Pod for InflightKey {}
    unsafe impl aya::Pod for crate::inflight::InflightSlot {}
    unsafe impl aya::Pod for BackendStats {}
    unsafe impl aya::Pod for Config {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[cfg(feature = "user")]
    #[test]
    fn an_endpoint_holds_its_socket_address() {
        for addr in ["10.0.0.1:11211", "[fd77::1]:53"] {
            let addr: std::net::SocketAddr = addr.parse().unwrap();
            assert_eq!(Endpoint::from(addr).socket_addr(), addr);
        }
        let v4: std::net::SocketAddr = "10.0.0.1:11211".parse().unwrap();
        assert_eq!(Endpoint::from(v4), Endpoint::ipv4([10, 0, 0, 1], 11211));
    }

    #[test]
    fn every_port_has_its_own_bit() {
        let mut seen = [0u64; PORT_WORDS as usize];
        for port in 0..=u16::MAX {
            let (word, bit) = member_port_bit(port);
            assert_eq!(bit.count_ones(), 1);
            assert_eq!(seen[word as usize] & bit, 0, "{port}");
            seen[word as usize] |= bit;
        }
        assert!(seen.iter().all(|&w| w == u64::MAX));
        assert_eq!(member_port_bit(53), (0, 1 << 53));
        assert_eq!(member_port_bit(11211), (175, 1 << 11));
    }

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<Endpoint>(), 20);
        assert_eq!(size_of::<Group>(), 20 * 8 + 8);
        assert_eq!(size_of::<GroupCounters>(), 192);
        assert_eq!(size_of::<InflightKey>(), 32);
        assert_eq!(size_of::<GroupService>(), 128);
        // The heartbeat words 8-byte aligned after the descriptor, and the
        // whole a multiple of 8 (the agent maps the value).
        assert_eq!(size_of::<crate::Descriptor>(), 56);
        assert_eq!(size_of::<Config>(), 40 + 56 + 16);
        assert_eq!(core::mem::offset_of!(Config, heartbeat_ns), 96);
        assert_eq!(size_of::<GroupHealth>(), 8 + 64 + 64);
    }

    #[test]
    fn the_agent_is_alive_while_its_heartbeat_is_within_the_bound() {
        let s = 1_000_000_000;
        let config = |heartbeat_ns, heartbeat_bound_ns| Config {
            heartbeat_ns,
            heartbeat_bound_ns,
            ..Config::default()
        };
        let c = config(100 * s, s);
        assert!(c.agent_alive(100 * s));
        assert!(c.agent_alive(101 * s), "at the bound");
        assert!(!c.agent_alive(101 * s + 1), "past it");
        assert!(!c.agent_alive(u64::MAX));
        // Written after the program read its clock: not stale.
        assert!(c.agent_alive(99 * s));
        // Bound 0: never taken for gone, whatever the heartbeat.
        assert!(config(0, 0).agent_alive(u64::MAX));
        assert!(config(100 * s, 0).agent_alive(1000 * s));
        // Never written, bound set: stale once the clock passes the bound.
        assert!(!config(0, s).agent_alive(100 * s));
    }

    #[test]
    fn ipv4_mapped_round_trip() {
        let e = Endpoint::ipv4([10, 1, 2, 3], 11211);
        assert_eq!(e.ipv4_octets(), Some([10, 1, 2, 3]));
        assert_eq!(&e.addr[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        let mut v6 = e;
        v6.addr[0] = 0x20;
        assert_eq!(v6.ipv4_octets(), None);
    }

    #[test]
    fn pending_is_issued_minus_completed_minus_expired() {
        let mut c = GroupCounters::default();
        c.issued[2] = 10;
        c.completed[2] = 6;
        c.expired[2] = 3;
        assert_eq!(pending(&c, 2), 1);
        c.expired[2] = 4;
        assert_eq!(pending(&c, 2), 0);
        // A torn read (a completion seen before its issue) is not u64::MAX.
        c.expired[2] = 5;
        assert_eq!(pending(&c, 2), 0);
        assert_eq!(pending(&c, 1), 0);
    }

    #[test]
    fn backend_ids_encode_group_and_position() {
        assert_eq!(backend_id(0, 0), 0);
        assert_eq!(backend_id(3, 5), 29);
        assert_eq!(split_backend_id(29), (3, 5));
        assert_eq!(
            split_backend_id(backend_id(MAX_GROUPS - 1, 7)),
            (MAX_GROUPS - 1, 7)
        );
        assert_eq!(backend_id(MAX_GROUPS - 1, 7), MAX_BACKENDS - 1);
    }
}
