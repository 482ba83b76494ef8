//! Validated configuration. Everything is checked here, before anything is
//! loaded or attached, so a bad flag never leaves a half-configured host.
//! (Just over 500 lines of code: the settings, their checks and the
//! parsers of their values.)

use std::{
    collections::HashMap,
    fmt,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use anyhow::Result;

use crate::config::{defaults::RunDefaults, tunables::Tunables};
use selector_common::{Descriptor, MAX_GROUP_MEMBERS, MAX_GROUPS, backend_id};
pub use selector_common::{MAX_TIMEOUT_MS, OnOverload};
use serde::{Deserialize, Serialize};

/// `selector run`'s default heartbeat bound is this many sweep periods...
pub const HEARTBEAT_SWEEPS: u32 = 4;
/// ... but at least this: the sweep shares the agent's loop with status
/// requests, scrapes and reloads, and a busy host can hold it back for a
/// few hundred ms; steering must not stop while the agent lives.
pub const MIN_DEFAULT_HEARTBEAT_BOUND: Duration = Duration::from_secs(1);
/// ... and at most this (issue 20: a gone agent is noticed within 5 s).
pub const MAX_DEFAULT_HEARTBEAT_BOUND: Duration = Duration::from_secs(5);

/// How often `selector run` sweeps (and so writes its heartbeat): often
/// enough that an expiry is at most a quarter timeout late and the
/// heartbeat never older than a quarter of its bound while the agent runs.
pub fn sweep_period(interval: Duration, timeout: Duration, heartbeat_bound: Duration) -> Duration {
    let mut period = interval.min(timeout / 4);
    if !heartbeat_bound.is_zero() {
        period = period.min(heartbeat_bound / 4);
    }
    period.max(Duration::from_millis(1))
}

/// `--heartbeat-bound` when not given: a few sweep periods, within
/// [`MIN_DEFAULT_HEARTBEAT_BOUND`] and [`MAX_DEFAULT_HEARTBEAT_BOUND`].
pub fn default_heartbeat_bound(interval: Duration, timeout: Duration) -> Duration {
    (sweep_period(interval, timeout, Duration::ZERO) * HEARTBEAT_SWEEPS)
        .clamp(MIN_DEFAULT_HEARTBEAT_BOUND, MAX_DEFAULT_HEARTBEAT_BOUND)
}

/// Where the reply path attaches (`--ingress`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IngressMode {
    /// XDP on the interface (native, or generic where the driver has none).
    Xdp,
    /// TC ingress.
    Tc,
    /// TC ingress on virtual devices (veth, bridge, vlan, ...), native XDP
    /// on a driver's device (TC ingress if the driver has none), chosen at
    /// attach.
    // `crate::host::interface::auto_ingress`; never in force once attached.
    Auto,
}

impl IngressMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Xdp => "xdp",
            Self::Tc => "tc",
            Self::Auto => "auto",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Xdp, Self::Tc, Self::Auto]
            .into_iter()
            .find(|m| m.name() == name)
    }
}

impl IngressMode {
    /// The reply path asked for; `None` for `auto`, decided at attach.
    pub fn fixed(self) -> Option<ReplyPath> {
        match self {
            Self::Xdp => Some(ReplyPath::Xdp),
            Self::Tc => Some(ReplyPath::Tc),
            Self::Auto => None,
        }
    }
}

/// Where the reply path is attached: `--ingress` resolved for the
/// interface (never `auto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyPath {
    Xdp,
    Tc,
}

impl ReplyPath {
    pub fn name(self) -> &'static str {
        match self {
            Self::Xdp => "xdp",
            Self::Tc => "tc",
        }
    }
}

/// The request protocol, as far as the descriptor tells it (`--proto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// memcached UDP: 16-bit request id in the frame header; reads are get/gets.
    Memcached,
    /// DNS: 16-bit message id; every query is a read; only a standard query
    /// with one question is tracked.
    Dns,
    /// Set with --req-id-offset, --req-id-len and optionally --read-prefix.
    Custom,
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Self::Memcached => "memcached",
            Self::Dns => "dns",
            Self::Custom => "custom",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Memcached, Self::Dns, Self::Custom]
            .into_iter()
            .find(|p| p.name() == name)
    }

    /// The descriptor of memcached or DNS; custom needs its options
    /// (`Options::descriptor`), and gets memcached's here.
    pub fn descriptor(self) -> Descriptor {
        match self {
            Self::Dns => Descriptor::dns(),
            Self::Memcached | Self::Custom => Descriptor::memcached(),
        }
    }

    /// Whether the kernel can build this protocol's error reply (`reject`).
    pub fn has_error_reply(self) -> bool {
        self != Self::Custom
    }
}

/// What the agent runs with.
#[derive(Clone, Debug)]
pub struct Settings {
    pub iface: String,
    /// Replica groups, members in preference order.
    pub groups: Vec<Vec<SocketAddr>>,
    /// What `selector set` changes while attached.
    pub tunables: Tunables,
    pub descriptor: Descriptor,
    /// In-flight entries older than this are expired by the sweep.
    pub timeout: Duration,
    pub inflight_max: u32,
    pub ingress: IngressMode,
    /// The skb mark bit carried by the selector's own re-sent requests.
    pub mark: u32,
    /// How long after a request completed or expired a late reply to a
    /// redirected read is still rewritten.
    pub grace: Duration,
    /// How old the agent's heartbeat may get before the programs take it
    /// for gone and move no read (`Config::agent_alive`); zero: never.
    pub heartbeat_bound: Duration,
    /// `--eject-after`, `--eject-base`, `--eject-max`, `--max-ejected`.
    pub ejection: crate::config::ejection::EjectionSettings,
}

/// What a validation error is about, so that a caller can point at where
/// the value came from (a flag, or a line of the config file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SettingKey {
    /// A flag of `selector run`, named without its dashes (also its key in
    /// the config file).
    Flag(&'static str),
    /// The protocol descriptor as a whole (`--proto` and its options).
    Descriptor,
    /// The list of groups as a whole.
    Groups,
    /// Group `n` (from 0, in order).
    Group(usize),
    /// Member `m` of group `n` (both from 0).
    Member(usize, usize),
}

/// A setting that fails validation. Displayed in the flags' words
/// (`--threshold must be at least 1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid {
    pub key: SettingKey,
    /// What is wrong, without the flag's name for [`SettingKey::Flag`].
    pub problem: String,
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.key {
            SettingKey::Flag(flag) => write!(f, "--{flag} {}", self.problem),
            _ => f.write_str(&self.problem),
        }
    }
}

impl std::error::Error for Invalid {}

/// Fails with an [`Invalid`] about `key`.
pub fn invalid<T>(key: SettingKey, problem: impl Into<String>) -> Result<T> {
    Err(Invalid {
        key,
        problem: problem.into(),
    }
    .into())
}

/// One backend as the maps will hold it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendPlan {
    /// Backend id: `group * 8 + position`.
    pub index: u32,
    pub addr: SocketAddr,
    pub group: u32,
}

impl fmt::Display for BackendPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.addr)
    }
}

/// Refuses what cannot be an interface's name (Linux's rule: 1 to 15
/// bytes, no `/`, not `.` or `..`): it names files (control sockets, pins).
pub fn check_iface_name(iface: &str) -> Result<()> {
    if iface.is_empty() || iface.len() > 15 || iface.contains('/') || iface == "." || iface == ".."
    {
        anyhow::bail!("bad interface name '{iface}'");
    }
    Ok(())
}

impl Settings {
    /// Settings with every default of `selector run`; change fields with
    /// struct-update syntax (`Settings { timeout, ..Settings::new(..) }`),
    /// tunables with [`Self::tuned`].
    pub fn new(iface: impl Into<String>, groups: Vec<Vec<SocketAddr>>) -> Self {
        let d = RunDefaults::default();
        Self {
            iface: iface.into(),
            groups,
            tunables: d.tunables,
            descriptor: d.protocol.descriptor(),
            timeout: d.timeout,
            inflight_max: d.inflight_max,
            ingress: d.ingress,
            mark: d.mark,
            grace: d.timeout,
            // Off here, unlike `selector run`'s default: only an agent that
            // sweeps on a schedule keeps a heartbeat, and a `Selector`
            // driven by hand (tests, benchmarks) may not sweep at all.
            heartbeat_bound: Duration::ZERO,
            ejection: Default::default(),
        }
    }

    /// The protocol whose error reply the kernel can build, from the
    /// descriptor's reject kind.
    pub fn protocol(&self) -> Protocol {
        match self.descriptor.reject_kind {
            selector_common::descriptor::REJECT_MEMCACHED => Protocol::Memcached,
            selector_common::descriptor::REJECT_DNS => Protocol::Dns,
            _ => Protocol::Custom,
        }
    }

    /// What is valid but likely a mistake, one sentence each (`run` logs
    /// them, `check` prints them): a group of one member has nowhere to
    /// move a read.
    pub fn warnings(&self) -> Vec<String> {
        self.groups
            .iter()
            .enumerate()
            .filter(|(_, members)| members.len() == 1)
            .map(|(g, members)| {
                format!(
                    "group {} has one member ({}): its reads are counted but can never be moved",
                    g + 1,
                    members[0]
                )
            })
            .collect()
    }

    /// "1 group", "3 groups": how many, for the summary lines.
    pub fn groups_phrase(&self) -> String {
        match self.groups.len() {
            1 => "1 group".into(),
            n => format!("{n} groups"),
        }
    }

    /// Checks everything and numbers the backends (group order, member order).
    pub fn plan(&self) -> Result<Vec<BackendPlan>> {
        if self.iface.is_empty() {
            return invalid(SettingKey::Flag("iface"), "is required");
        }
        if self.groups.is_empty() {
            return invalid(SettingKey::Groups, "at least one --group is required");
        }
        if self.groups.len() > MAX_GROUPS as usize {
            return invalid(
                SettingKey::Groups,
                format!(
                    "at most {MAX_GROUPS} groups are supported, got {}",
                    self.groups.len()
                ),
            );
        }
        self.check_tunables()?;
        if let Err(e) = self.descriptor.validate() {
            return invalid(
                SettingKey::Descriptor,
                format!("bad protocol descriptor: {e}"),
            );
        }
        check_millis("timeout", self.timeout)?;
        check_millis("grace", self.grace)?;
        if !self.heartbeat_bound.is_zero() {
            check_millis("heartbeat-bound", self.heartbeat_bound)?;
        }
        self.ejection.check()?;
        if self.inflight_max == 0 || self.inflight_max > selector_common::MAX_INFLIGHT_MAX {
            return invalid(
                SettingKey::Flag("inflight-max"),
                format!(
                    "must be 1 to {} (the table takes 256 bytes per request)",
                    selector_common::MAX_INFLIGHT_MAX
                ),
            );
        }
        if self.mark.count_ones() != 1 {
            return invalid(
                SettingKey::Flag("mark"),
                format!("must have exactly one bit set, got {:#010x}", self.mark),
            );
        }
        self.number_backends()
    }

    /// These settings with `change` made to their tunables (for settings
    /// built in code: `Settings::new(..).tuned(|t| t.threshold = 1)`).
    pub fn tuned(mut self, change: impl FnOnce(&mut Tunables)) -> Self {
        change(&mut self.tunables);
        self
    }

    /// Checks what `selector set` can change at run time.
    pub fn check_tunables(&self) -> Result<()> {
        self.tunables.check(self.timeout, self.protocol())
    }

    fn number_backends(&self) -> Result<Vec<BackendPlan>> {
        let mut seen: HashMap<SocketAddr, usize> = HashMap::new();
        let mut plan = Vec::new();
        for (g, members) in self.groups.iter().enumerate() {
            if members.is_empty() {
                return invalid(SettingKey::Group(g), format!("group {} is empty", g + 1));
            }
            if members.len() > MAX_GROUP_MEMBERS {
                return invalid(
                    SettingKey::Group(g),
                    format!(
                        "group {} has {} members; at most {MAX_GROUP_MEMBERS} are supported",
                        g + 1,
                        members.len()
                    ),
                );
            }
            for (position, addr) in members.iter().enumerate() {
                let member = SettingKey::Member(g, position);
                if addr.is_ipv4() != members[0].is_ipv4() {
                    // One family per group: a read is steered only within
                    // its own family's header.
                    return invalid(
                        member,
                        format!(
                            "group {} mixes IPv4 and IPv6 members ({} and {addr}); \
                             a group is one address family",
                            g + 1,
                            members[0]
                        ),
                    );
                }
                if addr.port() == 0 {
                    return invalid(member, format!("backend {addr} has port 0"));
                }
                if let IpAddr::V6(ip) = addr.ip() {
                    if ip.to_ipv4_mapped().is_some() {
                        // The kernel sees such a member's packets as IPv4.
                        return invalid(
                            member,
                            format!("backend {addr} is IPv4-mapped: write it as a.b.c.d:port"),
                        );
                    }
                    if ip.is_unicast_link_local() {
                        // A member is one address without a zone; the
                        // route to a link-local one needs its interface.
                        return invalid(
                            member,
                            format!(
                                "backend {addr} is link-local: use a global or unique local address"
                            ),
                        );
                    }
                }
                let broadcast = matches!(addr.ip(), IpAddr::V4(ip) if ip.is_broadcast());
                if addr.ip().is_unspecified()
                    || broadcast
                    || addr.ip().is_multicast()
                    || addr.ip().is_loopback()
                {
                    return invalid(member, format!("backend {addr} is not a unicast address"));
                }
                if let Some(other) = seen.insert(*addr, g) {
                    if other == g {
                        return invalid(
                            member,
                            format!("backend {addr} appears twice in group {}", g + 1),
                        );
                    }
                    return invalid(
                        member,
                        format!(
                            "backend {addr} is in group {} and group {}",
                            other + 1,
                            g + 1
                        ),
                    );
                }
                plan.push(BackendPlan {
                    index: backend_id(g as u32, position),
                    addr: *addr,
                    group: g as u32,
                });
            }
        }
        Ok(plan)
    }
}

/// A duration flag given in milliseconds: 1..=MAX_TIMEOUT_MS.
fn check_millis(flag: &'static str, value: Duration) -> Result<()> {
    if value < Duration::from_millis(1) {
        return invalid(SettingKey::Flag(flag), "must be at least 1 ms");
    }
    if value > Duration::from_millis(MAX_TIMEOUT_MS) {
        return invalid(
            SettingKey::Flag(flag),
            format!(
                "must be at most {MAX_TIMEOUT_MS} ms (one hour), got {}",
                value.as_millis()
            ),
        );
    }
    Ok(())
}

/// Whether a group's members are IPv6 (a group is one family).
pub fn is_ipv6_group(members: &[SocketAddr]) -> bool {
    members.first().is_some_and(SocketAddr::is_ipv6)
}

/// Parses `A:P,B:P,...`, each `a.b.c.d:port` or `[IPv6]:port`.
pub fn parse_group(s: &str) -> Result<Vec<SocketAddr>, String> {
    s.split(',')
        .map(|m| {
            let m = m.trim();
            m.parse::<SocketAddr>()
                .map_err(|_| format!("'{m}' is not an IPv4 address:port or an [IPv6 address]:port"))
        })
        .collect()
}

/// Parses a duration in milliseconds, fractions allowed (`2`, `0.5`),
/// rounded to whole microseconds.
pub fn parse_millis(s: &str) -> Result<Duration, String> {
    let ms: f64 = s
        .parse()
        .map_err(|_| format!("'{s}' is not a number of milliseconds"))?;
    millis(ms).ok_or_else(|| format!("'{s}' is not a number of milliseconds"))
}

/// `ms` milliseconds rounded to whole microseconds; None if negative, not
/// finite, or too long.
pub fn millis(ms: f64) -> Option<Duration> {
    if !ms.is_finite() || ms < 0.0 {
        return None;
    }
    let us = (ms * 1000.0).round();
    (us <= u64::MAX as f64).then(|| Duration::from_micros(us as u64))
}

/// Parses a number given in decimal or as `0x` hex (mark bits read better in hex).
pub fn parse_u32(s: &str) -> Result<u32, String> {
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|_| format!("'{s}' is not a 32-bit number (decimal or 0x hex)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use selector_common::{Policy, TieBreak};

    #[test]
    fn a_group_of_one_member_is_warned_of_and_groups_are_counted_in_words() {
        let addr = |s: &str| -> SocketAddr { s.parse().unwrap() };
        let one = Settings::new("eth0", vec![vec![addr("10.0.0.1:53")]]);
        assert_eq!(
            one.warnings(),
            ["group 1 has one member (10.0.0.1:53): its reads are counted but can never be moved"]
        );
        assert_eq!(one.groups_phrase(), "1 group");
        let two = Settings::new(
            "eth0",
            vec![
                vec![addr("10.0.0.1:53"), addr("10.0.0.2:53")],
                vec![addr("10.0.1.1:53")],
            ],
        );
        assert_eq!(two.warnings().len(), 1);
        assert!(two.warnings()[0].starts_with("group 2 has one member"));
        assert_eq!(two.groups_phrase(), "2 groups");
        assert!(two.plan().is_ok(), "valid, only warned of");
    }

    /// Each enum's one name: on the wire, in the config file, as a flag
    /// value and in `name()` (what status and the kernel's logs print).
    #[test]
    fn enum_names_agree_everywhere() {
        use clap::ValueEnum;
        fn check<T: ValueEnum + Serialize + for<'de> Deserialize<'de> + PartialEq + fmt::Debug>(
            all: &[T],
            name: fn(&T) -> &'static str,
        ) {
            for v in all {
                let wire = serde_json::to_string(v).unwrap();
                assert_eq!(wire, format!("\"{}\"", name(v)));
                assert_eq!(&serde_json::from_str::<T>(&wire).unwrap(), v);
                assert_eq!(v.to_possible_value().unwrap().get_name(), name(v));
            }
        }
        check(Policy::value_variants(), |p| p.name());
        check(TieBreak::value_variants(), |t| t.name());
        check(OnOverload::value_variants(), |o| o.name());
        check(IngressMode::value_variants(), |i| i.name());
        check(Protocol::value_variants(), |p| p.name());
    }

    #[test]
    fn the_sweep_keeps_the_heartbeat_within_a_quarter_of_its_bound() {
        let ms = Duration::from_millis;
        assert_eq!(sweep_period(ms(1000), ms(1000), Duration::ZERO), ms(250));
        assert_eq!(sweep_period(ms(100), ms(1000), Duration::ZERO), ms(100));
        assert_eq!(sweep_period(ms(1000), ms(1000), ms(300)), ms(75));
        assert_eq!(sweep_period(ms(10_000), ms(60_000), ms(5000)), ms(1250));
        assert_eq!(sweep_period(ms(1), ms(1), ms(1)), ms(1), "at least 1 ms");
        // A few sweep periods, within 1 s and 5 s.
        assert_eq!(default_heartbeat_bound(ms(1000), ms(1000)), ms(1000));
        assert_eq!(default_heartbeat_bound(ms(1000), ms(4000)), ms(4000));
        assert_eq!(default_heartbeat_bound(ms(100), ms(200)), ms(1000));
        assert_eq!(default_heartbeat_bound(ms(10_000), ms(60_000)), ms(5000));
    }

    fn settings(groups: &[&str]) -> Settings {
        Settings::new(
            "eth0",
            groups.iter().map(|g| parse_group(g).unwrap()).collect(),
        )
        .tuned(|t| t.threshold = 1)
    }

    fn err(s: &Settings) -> String {
        s.plan().unwrap_err().to_string()
    }

    /// What the error of `plan` is about.
    fn key(s: &Settings) -> SettingKey {
        s.plan().unwrap_err().downcast::<Invalid>().unwrap().key
    }

    #[test]
    fn errors_name_the_setting_they_are_about() {
        let mut s = settings(&["10.0.0.1:1", "10.0.0.2:1,10.0.0.1:1"]);
        assert_eq!(key(&s), SettingKey::Member(1, 1));
        assert_eq!(err(&s), "backend 10.0.0.1:1 is in group 1 and group 2");
        s = settings(&["10.0.0.1:1", "10.0.0.2:0"]);
        assert_eq!(key(&s), SettingKey::Member(1, 0));
        s.groups[1].clear();
        assert_eq!(key(&s), SettingKey::Group(1));
        s = settings(&["10.0.0.1:1"]);
        s.tunables.threshold = 0;
        assert_eq!(key(&s), SettingKey::Flag("threshold"));
        assert_eq!(err(&s), "--threshold must be at least 1");
        s.tunables.threshold = 1;
        s.grace = Duration::ZERO;
        assert_eq!(key(&s), SettingKey::Flag("grace"));
        assert_eq!(key(&settings(&[])), SettingKey::Groups);
        assert_eq!(IngressMode::from_name("tc"), Some(IngressMode::Tc));
        assert_eq!(Protocol::from_name("dns"), Some(Protocol::Dns));
        assert_eq!(Protocol::from_name("http"), None);
    }

    #[test]
    fn defaults_match_the_command_line() {
        let s = settings(&["10.0.0.1:1"]);
        assert_eq!(s.timeout, RunDefaults::default().timeout);
        assert_eq!(s.grace, s.timeout);
        assert_eq!(s.mark, selector_common::MARK_REDIRECTED);
        assert_eq!(
            (s.tunables.max_pending, s.tunables.max_pending_client),
            (0, 0)
        );
        assert_eq!(s.tunables.on_overload, OnOverload::Pass);
        assert_eq!(s.protocol(), Protocol::Memcached);
        assert!(s.plan().is_ok());
    }

    #[test]
    fn numbers_backends_in_group_order() {
        let p = settings(&["10.0.0.1:1,10.0.0.2:1", "10.0.0.3:1"])
            .plan()
            .unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!((p[1].index, p[1].group), (1, 0));
        assert_eq!((p[2].index, p[2].group), (8, 1));
        assert_eq!(p[1].addr, "10.0.0.2:1".parse().unwrap());
    }

    #[test]
    fn rejects_duplicates_and_shared_backends() {
        assert!(err(&settings(&["10.0.0.1:1,10.0.0.1:1"])).contains("twice"));
        assert!(err(&settings(&["10.0.0.1:1", "10.0.0.1:1"])).contains("group 1 and group 2"));
        // Same address, other port: a different backend.
        assert!(settings(&["10.0.0.1:1,10.0.0.1:2"]).plan().is_ok());
    }

    #[test]
    fn ipv6_groups_next_to_ipv4_ones_but_never_mixed() {
        let p = settings(&["[fd77::1]:11211,[fd77::2]:11211", "10.0.0.3:1"])
            .plan()
            .unwrap();
        assert_eq!(p[1].addr, "[fd77::2]:11211".parse().unwrap());
        assert_eq!(p[2].group, 1);
        let e = err(&settings(&["10.0.0.1:1,[fd77::2]:1"]));
        assert!(e.contains("mixes IPv4 and IPv6"), "{e}");
        assert!(err(&settings(&["[::1]:1"])).contains("not a unicast"));
        assert!(err(&settings(&["[fe80::1]:1"])).contains("link-local"));
        assert!(err(&settings(&["[::ffff:10.0.0.1]:1"])).contains("IPv4-mapped"));
        assert!(err(&settings(&["[ff02::1]:1"])).contains("not a unicast"));
    }

    #[test]
    fn rejects_oversized_groups() {
        let nine: Vec<String> = (1..=9).map(|i| format!("10.0.0.{i}:1")).collect();
        assert!(err(&settings(&[&nine.join(",")])).contains("at most 8"));
        let eight = nine[..8].join(",");
        assert!(settings(&[&eight]).plan().is_ok());
    }

    #[test]
    fn rejects_missing_and_bad_values() {
        let mut s = settings(&["10.0.0.1:1"]);
        s.iface.clear();
        assert!(err(&s).contains("--iface"));
        assert!(err(&settings(&[])).contains("--group"));
        let mut s = settings(&["10.0.0.1:1"]);
        s.inflight_max = selector_common::MAX_INFLIGHT_MAX + 1;
        assert!(err(&s).contains("--inflight-max"));
        s.inflight_max = 0;
        assert!(err(&s).contains("--inflight-max"));
        let mut s = settings(&["10.0.0.1:1"]);
        s.tunables.threshold = 0;
        assert!(err(&s).contains("--threshold"));
        s.tunables.policy = Policy::Observe;
        assert!(s.plan().is_ok());
        assert!(err(&settings(&["10.0.0.1:0"])).contains("port 0"));
        assert!(err(&settings(&["0.0.0.0:1"])).contains("unicast"));
        let mut s = settings(&["10.0.0.1:1"]);
        s.descriptor.id_len = 0;
        assert!(err(&s).contains("descriptor"));
        for bad in [Duration::ZERO, Duration::from_millis(MAX_TIMEOUT_MS + 1)] {
            let s = settings(&["10.0.0.1:1"]).tuned(|t| {
                t.budget = bad;
            });
            assert!(err(&s).contains("--budget"), "{bad:?}");
        }
        let s = settings(&["10.0.0.1:1"]).tuned(|t| {
            t.budget = Duration::from_millis(MAX_TIMEOUT_MS);
        });
        assert_eq!(s.tunables.budget_us(), 3_600_000_000);
    }

    #[test]
    fn milliseconds_parse_with_fractions() {
        assert_eq!(parse_millis("2"), Ok(Duration::from_millis(2)));
        assert_eq!(parse_millis("0.25"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_millis("0.0004"), Ok(Duration::ZERO));
        for bad in ["-1", "NaN", "inf", "2ms", ""] {
            assert!(parse_millis(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn timeout_and_grace_are_bounded_milliseconds() {
        let base = settings(&["10.0.0.1:1"]);
        let max = Duration::from_millis(MAX_TIMEOUT_MS);
        for (timeout, grace, flag) in [
            (Duration::ZERO, base.grace, "--timeout"),
            (max + Duration::from_millis(1), base.grace, "--timeout"),
            (Duration::from_micros(999), base.grace, "--timeout"),
            (base.timeout, Duration::ZERO, "--grace"),
            (base.timeout, max + Duration::from_millis(1), "--grace"),
        ] {
            let s = Settings {
                timeout,
                grace,
                ..base.clone()
            };
            let e = err(&s);
            assert!(e.starts_with(flag), "{timeout:?} {grace:?}: {e}");
        }
        let s = Settings {
            timeout: max,
            grace: max,
            ..base.clone()
        };
        assert!(s.plan().is_ok());
        // The bound keeps the kernel's nanosecond arithmetic far from wrapping.
        assert!(u64::try_from(max.as_nanos()).unwrap() < u64::MAX / 2);
    }

    #[test]
    fn mark_must_be_one_bit() {
        let base = settings(&["10.0.0.1:1"]);
        for bad in [0, 3, 0x0180_0000, u32::MAX] {
            let s = Settings {
                mark: bad,
                ..base.clone()
            };
            assert!(err(&s).contains("exactly one bit"), "{bad:#x}");
        }
        for good in [1, 0x8000_0000, selector_common::MARK_REDIRECTED] {
            let s = Settings {
                mark: good,
                ..base.clone()
            };
            assert!(s.plan().is_ok(), "{good:#x}");
        }
    }

    #[test]
    fn reject_needs_a_protocol_with_an_error_reply() {
        let base = settings(&["10.0.0.1:1"]).tuned(|t| {
            t.on_overload = OnOverload::Reject;
        });
        assert!(base.plan().is_ok());
        let dns = Settings {
            descriptor: Descriptor::dns(),
            ..base.clone()
        };
        assert!(dns.plan().is_ok());
        let custom = Settings {
            descriptor: Descriptor::custom(4, 4, 0, b"GET").unwrap(),
            ..base.clone()
        };
        assert_eq!(custom.protocol(), Protocol::Custom);
        assert!(err(&custom).contains("--on-overload reject needs --proto memcached or dns"));
        for other in [OnOverload::Pass, OnOverload::Drop] {
            let s = custom.clone().tuned(|t| {
                t.on_overload = other;
            });
            assert!(s.plan().is_ok());
        }
    }

    #[test]
    fn overload_names_round_trip() {
        for o in [OnOverload::Pass, OnOverload::Drop, OnOverload::Reject] {
            assert_eq!(OnOverload::from_name(o.name()), Some(o));
        }
        assert_eq!(OnOverload::from_name("throttle"), None);
    }

    #[test]
    fn numbers_parse_in_decimal_and_hex() {
        assert_eq!(parse_u32("16777216"), Ok(0x0100_0000));
        assert_eq!(parse_u32("0x01000000"), Ok(0x0100_0000));
        assert_eq!(parse_u32("0X10"), Ok(16));
        assert!(parse_u32("0x1_0000_0000").is_err());
        assert!(parse_u32("4294967296").is_err());
        assert!(parse_u32("bit24").unwrap_err().contains("'bit24'"));
    }

    #[test]
    fn parse_group_reports_the_bad_member() {
        assert_eq!(parse_group("10.0.0.1:1, 10.0.0.2:2").unwrap().len(), 2);
        assert!(
            parse_group("10.0.0.1:1,nope")
                .unwrap_err()
                .contains("'nope'")
        );
        assert!(parse_group("10.0.0.1").is_err());
        assert_eq!(
            parse_group("[fd77::1]:11211,[fd77::2]:11212").unwrap()[1],
            "[fd77::2]:11212".parse().unwrap()
        );
        assert!(parse_group("fd77::1:11211").unwrap_err().contains("[IPv6"));
    }
}
