//! The config file of `selector run --config FILE` (TOML), and the one path
//! by which the file and the flags become [`Settings`]: both are read into
//! [`Options`] (every field optional), the flags are laid over the file
//! field by field ([`Options::over`]), and the result is resolved and
//! checked by [`Options::resolve`] and [`Settings::plan`].
//!
//! The run-time tunables are not declared here: they are one flattened
//! [`TunablesPatch`], the same type the flags and the `set` request use.
//! Over 500 lines of code: every other key of the file is declared and
//! merged here, and the error positions computed.
//!
//! Every key is the name of a `selector run` flag without its dashes, in
//! the same unit (`timeout = 250` is `--timeout 250`); groups are
//! `[[group]]` tables with an optional `name` and `members`, which may be
//! host names (resolved here: one IPv4 address, or else one IPv6 address).
//! An error about a value the file gave names the file, the line and the
//! key.

use std::{
    collections::{BTreeSet, HashSet},
    fmt,
    net::{SocketAddr, ToSocketAddrs as _},
    ops::Range,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow};
use selector_common::Descriptor;
use serde::{Deserialize, Serialize};
use toml::de::{DeTable, DeValue};

use crate::{
    config::defaults::RunDefaults,
    config::hedge::HedgeAfter,
    config::settings::{
        IngressMode, Invalid, Protocol, SettingKey, Settings, default_heartbeat_bound, invalid,
    },
    config::tunables::TunablesPatch,
};

/// The longest `duration`, in seconds: ten years, beyond any run and well
/// within what a timer holds (`Duration::from_secs_f64` panics past 2^64 s).
pub const MAX_DURATION_SECS: f64 = 315_360_000.0;

/// `duration` (seconds) as a [`Duration`], if `selector run` takes it:
/// positive, at most [`MAX_DURATION_SECS`], a number.
pub fn run_duration(secs: f64) -> Option<Duration> {
    if !(secs > 0.0 && secs <= MAX_DURATION_SECS) {
        return None;
    }
    Duration::try_from_secs_f64(secs).ok()
}

/// Keys of the protocol descriptor; `proto` given as a flag replaces all
/// of them (see [`Options::over`]).
const DESCRIPTOR_KEYS: [&str; 9] = [
    "proto",
    "req-id-offset",
    "req-id-len",
    "read-prefix",
    "read-prefix-offset",
    "no-reply-marker",
    "no-reply-offset",
    "error-marker",
    "error-offset",
];

/// Every setting of `selector run`, each optional: what the file says or
/// what the flags say. Absent fields take the defaults in [`Options::resolve`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Options {
    pub iface: Option<String>,
    #[serde(rename = "group")]
    pub groups: Option<Vec<GroupSpec>>,
    /// The run-time tunables, under their own keys (`threshold = 2`).
    #[serde(flatten)]
    pub tunables: TunablesPatch,
    #[serde(default)]
    pub proto: Option<Protocol>,
    pub req_id_offset: Option<u16>,
    pub req_id_len: Option<u8>,
    pub read_prefix: Option<String>,
    pub read_prefix_offset: Option<u16>,
    pub no_reply_marker: Option<String>,
    pub no_reply_offset: Option<u16>,
    /// Milliseconds.
    pub timeout: Option<u64>,
    /// Milliseconds.
    pub grace: Option<u64>,
    /// Milliseconds; 0: off.
    pub heartbeat_bound: Option<u64>,
    pub mark: Option<u32>,
    pub inflight_max: Option<u32>,
    /// Milliseconds.
    pub interval: Option<u64>,
    #[serde(default)]
    pub ingress: Option<IngressMode>,
    /// Seconds.
    pub duration: Option<f64>,
    pub quiet: Option<bool>,
    /// The bpffs directory to pin under (`--pin`).
    pub pin: Option<PathBuf>,
    /// Where to serve Prometheus metrics (`--metrics-addr`).
    pub metrics_addr: Option<SocketAddr>,
    /// A resolv.conf whose nameservers form one more group (`--resolv-conf`).
    pub resolv_conf: Option<PathBuf>,
    /// The network namespace to attach in (`--netns`).
    pub netns: Option<PathBuf>,
    /// Outlier ejection (`config::ejection`): failures in a row, base and
    /// maximum milliseconds, percent of a group; a custom error marker.
    pub eject_after: Option<u32>,
    pub eject_base: Option<u64>,
    pub eject_max: Option<u64>,
    pub max_ejected: Option<u32>,
    pub error_marker: Option<String>,
    pub error_offset: Option<u16>,
}

/// One replica group: members in preference order, each `a.b.c.d:port` or
/// `host:port`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupSpec {
    pub name: Option<String>,
    pub members: Vec<String>,
}

/// What `selector run` runs with: the settings, the groups' names and the
/// agent loop's own options.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub settings: Settings,
    /// Name of each group in `settings.groups` (None: unnamed).
    pub group_names: Vec<Option<String>>,
    pub interval: Duration,
    pub duration: Option<f64>,
    pub quiet: bool,
    /// Whether the live table and the exit summary are printed (not when
    /// the log is JSON lines on the same stream).
    pub tables: bool,
    pub pin: Option<PathBuf>,
    pub metrics_addr: Option<SocketAddr>,
    /// The network namespace the interface is in (`--netns`; None: the
    /// agent's own).
    pub netns: Option<PathBuf>,
    /// `--hedge-after auto` comes from `--resolv-conf`, not from a flag or
    /// key: an agent that cannot send copies (no CAP_NET_RAW at start)
    /// runs without them instead of refusing to start.
    pub hedging_implied: bool,
}

impl RunConfig {
    /// Hedging off where only `--resolv-conf` asked for it; what to tell
    /// the operator, if it was.
    pub fn without_implied_hedging(&mut self) -> Option<String> {
        if !self.hedging_implied {
            return None;
        }
        self.hedging_implied = false;
        self.settings.tunables.hedging.after = HedgeAfter::Off;
        Some(
            "hedging off: --resolv-conf turns on --hedge-after auto, but the agent had no \
             CAP_NET_RAW at start to send the copies (deploy/selector-hedging.conf grants it); \
             say --hedge-after off to run without them quietly"
                .into(),
        )
    }
}

impl Options {
    /// `self` (the flags) laid over `file`, field by field: a field the
    /// flags give wins. `proto` carries its descriptor options with it, so
    /// `--proto dns` over a file's custom descriptor is plain DNS.
    pub fn over(self, file: Options) -> Options {
        let file = if self.proto.is_some() {
            Options {
                req_id_offset: None,
                req_id_len: None,
                read_prefix: None,
                read_prefix_offset: None,
                no_reply_marker: None,
                no_reply_offset: None,
                error_marker: None,
                error_offset: None,
                ..file
            }
        } else {
            file
        };
        Options {
            iface: self.iface.or(file.iface),
            groups: self.groups.or(file.groups),
            tunables: self.tunables.over(file.tunables),
            proto: self.proto.or(file.proto),
            req_id_offset: self.req_id_offset.or(file.req_id_offset),
            req_id_len: self.req_id_len.or(file.req_id_len),
            read_prefix: self.read_prefix.or(file.read_prefix),
            read_prefix_offset: self.read_prefix_offset.or(file.read_prefix_offset),
            no_reply_marker: self.no_reply_marker.or(file.no_reply_marker),
            no_reply_offset: self.no_reply_offset.or(file.no_reply_offset),
            timeout: self.timeout.or(file.timeout),
            grace: self.grace.or(file.grace),
            heartbeat_bound: self.heartbeat_bound.or(file.heartbeat_bound),
            mark: self.mark.or(file.mark),
            inflight_max: self.inflight_max.or(file.inflight_max),
            interval: self.interval.or(file.interval),
            ingress: self.ingress.or(file.ingress),
            duration: self.duration.or(file.duration),
            quiet: self.quiet.or(file.quiet),
            pin: self.pin.or(file.pin),
            metrics_addr: self.metrics_addr.or(file.metrics_addr),
            resolv_conf: self.resolv_conf.or(file.resolv_conf),
            netns: self.netns.or(file.netns),
            eject_after: self.eject_after.or(file.eject_after),
            eject_base: self.eject_base.or(file.eject_base),
            eject_max: self.eject_max.or(file.eject_max),
            max_ejected: self.max_ejected.or(file.max_ejected),
            error_marker: self.error_marker.or(file.error_marker),
            error_offset: self.error_offset.or(file.error_offset),
        }
    }

    /// Whether the field with this key (as in the file) is given.
    pub fn gives(&self, key: &str) -> bool {
        serde_json::to_value(self).is_ok_and(|v| {
            // The tunables serialize under their wire (snake_case) names.
            !v[key].is_null() || !v[key.replace('-', "_")].is_null()
        })
    }

    /// Every top-level key the file takes, as the file writes it: its own
    /// and the tunables' (their flags' names).
    pub fn keys() -> Vec<String> {
        let own = serde_json::to_value(Options::default()).expect("options serialize");
        let own = own.as_object().into_iter().flat_map(|o| o.keys().cloned());
        let tunables = TunablesPatch::flags().into_iter();
        own.chain(tunables.map(|flag| flag.trim_start_matches('-').to_string()))
            .collect()
    }

    /// Defaults for what is absent, host names resolved, everything
    /// checked; nothing on the host is looked at beyond the resolver.
    pub fn resolve(&self) -> Result<RunConfig> {
        let defaults = RunDefaults::default();
        let interval = self
            .interval
            .unwrap_or(defaults.interval.as_millis() as u64);
        if interval == 0 {
            return invalid(SettingKey::Flag("interval"), "must be greater than 0");
        }
        // Checked here, before anything is attached: the run loop's timer
        // takes only what `run_duration` accepts.
        if self.duration.is_some_and(|d| run_duration(d).is_none()) {
            return invalid(
                SettingKey::Flag("duration"),
                format!(
                    "must be a positive number of seconds, at most {MAX_DURATION_SECS} (ten years)"
                ),
            );
        }
        let mut specs = self.groups.clone().unwrap_or_default();
        if let Some(path) = &self.resolv_conf {
            specs.push(self.resolv_conf_group(path)?);
        }
        let mut names = HashSet::new();
        for (g, spec) in specs.iter().enumerate() {
            if let Some(name) = &spec.name
                && (name.is_empty() || !names.insert(name.as_str()))
            {
                return invalid(
                    SettingKey::Group(g),
                    format!("group name '{name}' is empty or used twice"),
                );
            }
        }
        let mut groups = Vec::new();
        for (g, spec) in specs.iter().enumerate() {
            let mut members = Vec::new();
            for (m, member) in spec.members.iter().enumerate() {
                members.push(
                    resolve_member(member)
                        .or_else(|problem| invalid(SettingKey::Member(g, m), problem))?,
                );
            }
            groups.push(members);
        }
        let timeout = self.timeout.map_or(defaults.timeout, Duration::from_millis);
        let interval_in_force = Duration::from_millis(interval);
        let iface = self.iface.clone().unwrap_or_default();
        let settings = Settings {
            descriptor: self.descriptor()?,
            timeout,
            inflight_max: self.inflight_max.unwrap_or(defaults.inflight_max),
            ingress: self.ingress.unwrap_or(defaults.ingress),
            mark: self.mark.unwrap_or(defaults.mark),
            grace: self.grace.map_or(timeout, Duration::from_millis),
            heartbeat_bound: self.heartbeat_bound.map_or_else(
                || default_heartbeat_bound(interval_in_force, timeout),
                Duration::from_millis,
            ),
            ejection: crate::config::ejection::EjectionSettings::from_options(
                self.eject_after,
                self.eject_base,
                self.eject_max,
                self.max_ejected,
            ),
            // The tunables' defaults; the patch below lays the given ones over.
            ..Settings::new(iface, groups)
        };
        // The stub resolver recipe hedges unless told not to: counts alone
        // leave each stall's first lookups waiting it out, which at a
        // host's lookup rate is the whole tail (docs/bench, "Lookups
        // through glibc's resolver").
        let hedging_implied = self.resolv_conf.is_some() && self.tunables.hedge_after.is_none();
        let mut tunables = self.tunables.apply(settings.tunables);
        if hedging_implied {
            tunables.hedging.after = HedgeAfter::Auto;
        }
        let settings = Settings {
            tunables,
            ..settings
        };
        settings.plan()?;
        Ok(RunConfig {
            settings,
            group_names: specs.iter().map(|s| s.name.clone()).collect(),
            interval: interval_in_force,
            duration: self.duration,
            quiet: self.quiet.unwrap_or(false),
            tables: true,
            pin: self.pin.clone(),
            metrics_addr: self.metrics_addr,
            netns: self.netns.clone(),
            hedging_implied,
        })
    }

    /// The nameservers of `path` as a group named `resolv.conf`.
    fn resolv_conf_group(&self, path: &Path) -> Result<GroupSpec> {
        let key = SettingKey::Flag("resolv-conf");
        if self.proto.is_some_and(|p| p != Protocol::Dns) {
            return invalid(key, "nameservers speak DNS: --proto must be dns");
        }
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) => return invalid(key, format!("reading {}: {e}", path.display())),
        };
        let (servers, skipped) = crate::config::resolv_conf::nameservers(&text);
        if servers.is_empty() {
            return invalid(key, format!("{} names no nameserver", path.display()));
        }
        let upstream = Path::new(crate::config::resolv_conf::RESOLVED_UPSTREAM);
        if let Err(e) = crate::config::resolv_conf::refuse_resolved_stub(
            path,
            &servers,
            upstream,
            upstream.exists(),
        ) {
            return invalid(key, e);
        }
        if !skipped.is_empty() {
            log::info!("{}: not used: {skipped:?}", path.display());
        }
        Ok(GroupSpec {
            name: Some("resolv.conf".into()),
            members: servers.iter().map(ToString::to_string).collect(),
        })
    }

    fn descriptor(&self) -> Result<Descriptor> {
        let descriptor_error = |problem: &str| invalid(SettingKey::Descriptor, problem);
        let custom_options = DESCRIPTOR_KEYS[1..].iter().any(|key| self.gives(key));
        // The nameservers of --resolv-conf speak DNS.
        let default = match self.resolv_conf {
            Some(_) => Protocol::Dns,
            None => RunDefaults::default().protocol,
        };
        match self.proto.unwrap_or(default) {
            Protocol::Memcached | Protocol::Dns if custom_options => descriptor_error(
                "--req-id-offset, --req-id-len, --read-prefix[-offset], --no-reply-* and --error-* need --proto custom",
            ),
            Protocol::Memcached => Ok(Descriptor::memcached()),
            Protocol::Dns => Ok(Descriptor::dns()),
            Protocol::Custom => {
                let (Some(offset), Some(len)) = (self.req_id_offset, self.req_id_len) else {
                    return descriptor_error(
                        "--proto custom needs --req-id-offset and --req-id-len",
                    );
                };
                let prefix = self.read_prefix.as_deref().unwrap_or("");
                let defaults = RunDefaults::default();
                let prefix_offset = self
                    .read_prefix_offset
                    .unwrap_or(defaults.read_prefix_offset);
                let descriptor = Descriptor::custom(offset, len, prefix_offset, prefix.as_bytes());
                let no_reply_offset = self.no_reply_offset.unwrap_or(defaults.no_reply_offset);
                let descriptor = match &self.no_reply_marker {
                    Some(marker) => descriptor
                        .and_then(|d| d.with_no_reply_prefix(no_reply_offset, marker.as_bytes())),
                    None if self.no_reply_offset.is_some() => {
                        return descriptor_error("--no-reply-offset needs --no-reply-marker");
                    }
                    None => descriptor,
                };
                let descriptor = match &self.error_marker {
                    Some(marker) => descriptor.and_then(|d| {
                        d.with_error_marker(
                            self.error_offset.unwrap_or(defaults.error_offset),
                            marker.as_bytes(),
                        )
                    }),
                    None if self.error_offset.is_some() => {
                        return descriptor_error("--error-offset needs --error-marker");
                    }
                    None => descriptor,
                };
                descriptor.or_else(|e| descriptor_error(&format!("bad protocol descriptor: {e}")))
            }
        }
    }
}

/// `a.b.c.d:port`, `[IPv6]:port`, or `host:port` resolved with the
/// system's resolver (`member_address` picks the one address).
pub fn resolve_member(member: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = member.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let malformed =
        || format!("'{member}' is not an IPv4 address:port, an [IPv6 address]:port or a host:port");
    let (host, port) = member.rsplit_once(':').ok_or_else(malformed)?;
    let port: u16 = port.parse().map_err(|_| malformed())?;
    if host.is_empty() || host.contains(':') {
        return Err(malformed());
    }
    let found = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("'{member}' does not resolve: {e}"))?;
    member_address(member, found)
}

/// The address a host name stands for: a member is one replica, so
/// exactly one IPv4 address, or without any, exactly one IPv6 address.
/// A dual-stack name is the replica's IPv4 address; to use its IPv6
/// address, name it by address.
pub fn member_address(
    member: &str,
    found: impl IntoIterator<Item = SocketAddr>,
) -> Result<SocketAddr, String> {
    let (mut v4, mut v6) = (BTreeSet::new(), BTreeSet::new());
    for addr in found {
        match addr {
            SocketAddr::V4(_) => v4.insert(addr),
            SocketAddr::V6(_) => v6.insert(addr),
        };
    }
    let (family, addrs) = if v4.is_empty() {
        ("IPv6", v6)
    } else {
        ("IPv4", v4)
    };
    let mut each = addrs.iter();
    match (each.next(), each.next()) {
        (None, _) => Err(format!("'{member}' has no IPv4 or IPv6 address")),
        (Some(one), None) => Ok(*one),
        _ => {
            let n = addrs.len();
            let list: Vec<String> = addrs.iter().map(|a| a.ip().to_string()).collect();
            Err(format!(
                "'{member}' resolves to {n} {family} addresses ({}); a member is one replica, name it by address",
                list.join(", ")
            ))
        }
    }
}

/// A config file, read and parsed (its values not yet checked).
#[derive(Clone, Debug)]
pub struct ConfigFile {
    pub path: PathBuf,
    text: String,
    pub options: Options,
}

impl ConfigFile {
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        Self::parse(path, text)
    }

    /// Parses `text` as the file at `path`. A syntax error, a value of the
    /// wrong type or an unknown key fails naming the line and the key.
    pub fn parse(path: &Path, text: String) -> Result<Self> {
        let (tree, _) = DeTable::parse_recoverable(&text);
        // The wire's snake_case names of the tunables are not the file's.
        let parsed = toml::from_str::<Options>(&text).and_then(|options| {
            match unknown_key(tree.get_ref()) {
                // Placed by `flattened_error` below.
                Some((_, message)) => Err(serde::de::Error::custom(message)),
                None => Ok(options),
            }
        });
        match parsed {
            Ok(options) => Ok(Self {
                path: path.to_owned(),
                text,
                options,
            }),
            Err(e) => {
                let spanned = e.span().filter(|span| !span.is_empty());
                let (at, message) = match spanned {
                    Some(span) => (span.start, e.message().to_string()),
                    None => flattened_error(tree.get_ref(), &text, e.message())
                        .unwrap_or((0, e.message().to_string())),
                };
                let key = key_at(tree.get_ref(), at, "").or_else(|| header_at(&text, at));
                let (line, column) = line_and_column(&text, at);
                let key = key.map(|k| format!(" {k}:")).unwrap_or_default();
                let message = message.replace('\n', " ");
                Err(anyhow!(
                    "{}:{line}:{column}:{key} {}",
                    path.display(),
                    message.trim_end()
                ))
            }
        }
    }

    /// The file with `flags` laid over it, resolved and checked. An error
    /// about a value from the file names the file, its line and its key.
    pub fn resolve_with(&self, flags: &Options) -> Result<RunConfig> {
        let merged = flags.clone().over(self.options.clone());
        merged.resolve().map_err(|e| {
            let Some(problem) = e.downcast_ref::<Invalid>() else {
                return e;
            };
            match self.locate(problem.key, flags) {
                Some(at) => anyhow!("{}:{at}: {}", self.path.display(), problem.problem),
                None => e,
            }
        })
    }

    /// Where in the file the value behind `key` is, unless the flags gave it.
    fn locate(&self, key: SettingKey, flags: &Options) -> Option<Location> {
        let (tree, _) = DeTable::parse_recoverable(&self.text);
        let tree = tree.get_ref();
        let entry = |name: &str| tree.iter().find(|(k, _)| k.get_ref() == name);
        let groups = || match entry("group")?.1.get_ref() {
            DeValue::Array(a) if !flags.gives("group") => Some(a.clone()),
            _ => None,
        };
        let (label, span) = match key {
            SettingKey::Flag(name) if !flags.gives(name) => {
                let (k, _) = entry(name)?;
                (name.to_string(), k.span())
            }
            SettingKey::Flag(_) => return None,
            SettingKey::Descriptor => {
                let name = DESCRIPTOR_KEYS
                    .iter()
                    .find(|name| !flags.gives(name) && entry(name).is_some())?;
                (name.to_string(), entry(name)?.0.span())
            }
            SettingKey::Groups => ("group".into(), entry("group")?.0.span()),
            SettingKey::Group(g) => (format!("group {}", g + 1), groups()?.get(g)?.span()),
            SettingKey::Member(g, m) => {
                let groups = groups()?;
                let DeValue::Table(group) = groups.get(g)?.get_ref() else {
                    return None;
                };
                let (_, members) = group.iter().find(|(k, _)| k.get_ref() == "members")?;
                let DeValue::Array(members) = members.get_ref() else {
                    return None;
                };
                (format!("group {} members", g + 1), members.get(m)?.span())
            }
        };
        let (line, _) = line_and_column(&self.text, span.start);
        Some(Location { line, label })
    }
}

/// The first top-level key the file does not take, where it is and what
/// is wrong with it.
fn unknown_key(table: &DeTable<'_>) -> Option<(usize, String)> {
    let known = Options::keys();
    let (key, _) = table
        .iter()
        .find(|(k, _)| !known.iter().any(|name| name == k.get_ref().as_ref()))?;
    let expected: Vec<String> = known.iter().map(|k| format!("`{k}`")).collect();
    Some((
        key.span().start,
        format!(
            "unknown field `{}`, expected one of {}",
            key.get_ref(),
            expected.join(", ")
        ),
    ))
}

/// Where an error about a flattened key (the tunables) is, and what it
/// says: toml cannot point into a flattened table, so the key is found
/// here, an unknown one by its name, a bad value by reading each tunable
/// key alone.
fn flattened_error(table: &DeTable<'_>, text: &str, message: &str) -> Option<(usize, String)> {
    if message.starts_with("unknown field `") {
        return unknown_key(table);
    }
    let values: toml::Table = text.parse().ok()?;
    table.iter().find_map(|(key, value)| {
        let alone = values
            .get(key.get_ref().as_ref())
            .map(|v| toml::Table::from_iter([(key.get_ref().to_string(), v.clone())]))?;
        // Keys that are not tunables are unknown to the patch: skipped.
        let error = TunablesPatch::deserialize(toml::Value::Table(alone))
            .err()
            .filter(|e| !e.message().starts_with("unknown field"))?;
        Some((value.span().start, error.message().to_string()))
    })
}

/// A line of the config file and the key there.
struct Location {
    line: usize,
    label: String,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.line, self.label)
    }
}

/// The innermost key whose key or value holds byte `at` (`group 2 members`
/// for a member of the second group).
fn key_at(table: &DeTable<'_>, at: usize, prefix: &str) -> Option<String> {
    let holds = |span: Range<usize>| span.contains(&at) || span.start == at;
    for (key, value) in table {
        let name = format!("{prefix}{}", key.get_ref());
        if !holds(key.span()) && !holds(value.span()) {
            continue;
        }
        return Some(match value.get_ref() {
            DeValue::Table(inner) => key_at(inner, at, &format!("{name} ")).unwrap_or(name),
            DeValue::Array(items) => items
                .iter()
                .enumerate()
                .find(|(_, item)| holds(item.span()))
                .and_then(|(i, item)| match item.get_ref() {
                    DeValue::Table(inner) => {
                        let element = format!("{name} {}", i + 1);
                        Some(key_at(inner, at, &format!("{element} ")).unwrap_or(element))
                    }
                    _ => None,
                })
                .unwrap_or(name),
            _ => name,
        });
    }
    // An array-of-tables element's span may leave out its `[[...]]` header.
    table.iter().find_map(|(key, value)| match value.get_ref() {
        DeValue::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
            let DeValue::Table(inner) = item.get_ref() else {
                return None;
            };
            let element = format!("{prefix}{} {}", key.get_ref(), i + 1);
            key_at(inner, at, &format!("{element} "))
        }),
        _ => None,
    })
}

/// `group 2` when byte `at` starts the second `[[group]]` header (where
/// toml points at a table that lacks a key).
fn header_at(text: &str, at: usize) -> Option<String> {
    let rest = text.get(at..)?;
    let name = rest
        .lines()
        .next()?
        .trim()
        .strip_prefix("[[")?
        .strip_suffix("]]")?
        .trim();
    let header = format!("[[{name}]]");
    let count = text[..at]
        .lines()
        .filter(|line| line.trim() == header)
        .count();
    Some(format!("{name} {}", count + 1))
}

/// 1-based line and column (in characters) of byte `at` in `text`.
fn line_and_column(text: &str, at: usize) -> (usize, usize) {
    let before = &text[..at.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before
        .rsplit_once('\n')
        .map_or(before, |(_, rest)| rest)
        .chars()
        .count()
        + 1;
    (line, column)
}

/// An IP literal, for tests that must not touch the resolver.
#[cfg(test)]
fn is_literal(member: &str) -> bool {
    member
        .rsplit_once(':')
        .is_some_and(|(h, _)| h.parse::<std::net::IpAddr>().is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use selector_common::{OnOverload, Policy};

    const SAMPLE: &str = include_str!("../../../deploy/selector.toml");

    fn parse(text: &str) -> Result<ConfigFile> {
        ConfigFile::parse(Path::new("sel.toml"), text.to_string())
    }

    fn err(text: &str) -> String {
        parse(text)
            .and_then(|f| f.resolve_with(&Options::default()))
            .unwrap_err()
            .to_string()
    }

    const BASE: &str = r#"iface = "eth0"
threshold = 2

[[group]]
name = "users"
members = ["10.0.0.1:11211", "10.0.0.2:11211"]
"#;

    /// BASE with `lines` at the top level, as its third line on.
    fn with(lines: &str) -> String {
        BASE.replacen("threshold = 2\n", &format!("threshold = 2\n{lines}"), 1)
    }

    #[test]
    fn the_sample_parses_and_says_every_key() {
        let file = parse(SAMPLE).unwrap();
        // Every key appears in the sample, set or commented out, so it
        // documents them all.
        for key in Options::keys() {
            let shown = SAMPLE.lines().any(|line| {
                let line = line.trim_start_matches("# ");
                line.starts_with(&format!("{key} =")) || line == format!("[[{key}]]")
            });
            assert!(shown, "the sample does not show '{key}'");
        }
        assert!(file.options.groups.as_ref().unwrap().len() >= 2);
        // Its members are literals, so this test needs no resolver.
        for group in file.options.groups.as_ref().unwrap() {
            assert!(group.members.iter().all(|m| is_literal(m)), "{group:?}");
        }
        let config = file.resolve_with(&Options::default()).unwrap();
        assert!(config.settings.plan().is_ok());
        // The settings it gives are `selector run`'s defaults, so that a
        // copy of it changes nothing an operator did not change.
        let (s, d) = (&config.settings, Settings::new("eth0", vec![]));
        assert_eq!(
            (s.tunables.policy, s.tunables.threshold, s.tunables.budget),
            (d.tunables.policy, d.tunables.threshold, d.tunables.budget)
        );
        assert_eq!(
            (s.tunables.tie_break, s.ingress),
            (d.tunables.tie_break, d.ingress)
        );
        assert_eq!((s.timeout, s.grace, s.mark), (d.timeout, d.grace, d.mark));
        assert_eq!(
            (s.inflight_max, s.tunables.on_overload),
            (d.inflight_max, d.tunables.on_overload)
        );
        assert_eq!(
            (s.tunables.max_pending, s.tunables.max_pending_client),
            (0, 0)
        );
        assert_eq!(s.tunables.hedging, d.tunables.hedging);
        assert_eq!(s.descriptor, d.descriptor);
    }

    #[test]
    fn a_file_says_what_the_flags_say() {
        let file = parse(
            r#"iface = "eth1"
policy = "absolute"
threshold = 7
max-pending = 5
on-overload = "drop"
max-pending-client = 3
proto = "custom"
req-id-offset = 4
req-id-len = 2
read-prefix = "GET"
read-prefix-offset = 1
no-reply-marker = "N!"
no-reply-offset = 6
timeout = 250
grace = 400
mark = 0x10
inflight-max = 1024
interval = 100
ingress = "tc"
duration = 2.5
quiet = true

[[group]]
members = ["10.0.0.1:1", "10.0.0.2:1"]

[[group]]
name = "b"
members = ["10.0.0.3:1"]
"#,
        )
        .unwrap();
        let c = file.resolve_with(&Options::default()).unwrap();
        let s = &c.settings;
        assert_eq!(s.iface, "eth1");
        assert_eq!(
            (s.tunables.policy, s.tunables.threshold),
            (Policy::Absolute, 7)
        );
        assert_eq!(
            (s.tunables.max_pending, s.tunables.max_pending_client),
            (5, 3)
        );
        assert_eq!(s.tunables.on_overload, OnOverload::Drop);
        assert_eq!(s.protocol(), Protocol::Custom);
        assert_eq!((s.descriptor.id_offset, s.descriptor.id_len), (4, 2));
        assert_eq!(&s.descriptor.prefix[..3], b"GET");
        assert!(s.descriptor.expects_no_reply(
            |i| b"\0\0\0\0\0\0N!".get(i).copied(),
            |_| None,
            |x| x
        ));
        assert_eq!(s.timeout, Duration::from_millis(250));
        assert_eq!(s.grace, Duration::from_millis(400));
        assert_eq!((s.mark, s.inflight_max), (0x10, 1024));
        assert_eq!(s.ingress, IngressMode::Tc);
        assert_eq!(c.interval, Duration::from_millis(100));
        assert_eq!((c.duration, c.quiet), (Some(2.5), true));
        assert_eq!(s.groups.len(), 2);
        assert_eq!(c.group_names, vec![None, Some("b".to_string())]);
    }

    #[test]
    fn flags_override_the_file_field_by_field() {
        let file = parse(BASE).unwrap();
        let flags = Options {
            tunables: TunablesPatch {
                threshold: Some(9),
                ..Default::default()
            },
            timeout: Some(300),
            ..Options::default()
        };
        let c = file.resolve_with(&flags).unwrap();
        assert_eq!(c.settings.tunables.threshold, 9);
        assert_eq!(c.settings.iface, "eth0", "from the file");
        assert_eq!(
            c.settings.grace,
            Duration::from_millis(300),
            "grace follows timeout"
        );
        assert_eq!(c.group_names, vec![Some("users".to_string())]);
        // --group replaces the file's groups as a whole.
        let flags = Options {
            groups: Some(vec![GroupSpec {
                name: None,
                members: vec!["10.0.0.9:1".into()],
            }]),
            ..Options::default()
        };
        let c = file.resolve_with(&flags).unwrap();
        assert_eq!(c.settings.groups, vec![vec!["10.0.0.9:1".parse().unwrap()]]);
        assert_eq!(c.group_names, vec![None]);
    }

    #[test]
    fn pin_and_metrics_address_come_from_the_file_or_the_flags() {
        let file = parse(&with(
            "pin = \"/sys/fs/bpf/sel\"\nmetrics-addr = \"127.0.0.1:9641\"\n",
        ))
        .unwrap();
        let c = file.resolve_with(&Options::default()).unwrap();
        assert_eq!(c.pin, Some(PathBuf::from("/sys/fs/bpf/sel")));
        assert_eq!(c.metrics_addr, Some("127.0.0.1:9641".parse().unwrap()));
        let flags = Options {
            metrics_addr: Some("0.0.0.0:9000".parse().unwrap()),
            ..Options::default()
        };
        let c = file.resolve_with(&flags).unwrap();
        assert_eq!(c.metrics_addr, Some("0.0.0.0:9000".parse().unwrap()));
        assert_eq!(c.pin, Some(PathBuf::from("/sys/fs/bpf/sel")));
        let e = err(&with("metrics-addr = \"nowhere\"\n"));
        assert!(e.contains("metrics-addr"), "{e}");
    }

    #[test]
    fn netns_comes_from_the_file_or_the_flag() {
        let file = parse(&with("netns = \"/run/netns/pod1\"\n")).unwrap();
        let c = file.resolve_with(&Options::default()).unwrap();
        assert_eq!(c.netns, Some(PathBuf::from("/run/netns/pod1")));
        let flags = Options {
            netns: Some(PathBuf::from("/proc/42/ns/net")),
            ..Options::default()
        };
        let c = file.resolve_with(&flags).unwrap();
        assert_eq!(c.netns, Some(PathBuf::from("/proc/42/ns/net")));
        assert_eq!(
            parse(BASE)
                .unwrap()
                .resolve_with(&Options::default())
                .unwrap()
                .netns,
            None
        );
    }

    #[test]
    fn resolv_conf_implies_hedging_unless_hedge_after_is_given() {
        let path = std::env::temp_dir().join(format!("selector-resolv-h-{}", std::process::id()));
        std::fs::write(&path, "nameserver 10.0.0.53\nnameserver 10.0.1.53\n").unwrap();
        let flags = |hedge_after: Option<HedgeAfter>| Options {
            iface: Some("eth0".into()),
            resolv_conf: Some(path.clone()),
            tunables: TunablesPatch {
                hedge_after,
                ..Default::default()
            },
            ..Options::default()
        };
        let mut implied = flags(None).resolve().unwrap();
        assert_eq!(implied.settings.tunables.hedging.after, HedgeAfter::Auto);
        assert!(implied.hedging_implied);
        // An agent that cannot send copies turns off only what was implied.
        let warning = implied.without_implied_hedging().expect("a warning");
        assert!(warning.contains("CAP_NET_RAW"), "{warning}");
        assert_eq!(implied.settings.tunables.hedging.after, HedgeAfter::Off);
        for given in [HedgeAfter::Off, HedgeAfter::Auto] {
            let mut c = flags(Some(given)).resolve().unwrap();
            assert_eq!(c.settings.tunables.hedging.after, given);
            assert!(c.without_implied_hedging().is_none());
            assert_eq!(c.settings.tunables.hedging.after, given);
        }
        // The file's key counts as given too.
        let file = parse(&with("hedge-after = \"off\"\n")).unwrap();
        let c = file
            .resolve_with(&Options {
                groups: Some(vec![]),
                ..flags(None)
            })
            .unwrap();
        assert_eq!(c.settings.tunables.hedging.after, HedgeAfter::Off);
        assert!(!c.hedging_implied);
        // No resolv.conf group: hedging stays off by default.
        let plain = parse(BASE)
            .unwrap()
            .resolve_with(&Options::default())
            .unwrap();
        assert_eq!(plain.settings.tunables.hedging.after, HedgeAfter::Off);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn resolv_conf_adds_the_nameservers_as_a_dns_group() {
        let path = std::env::temp_dir().join(format!("selector-resolv-{}", std::process::id()));
        std::fs::write(&path, "nameserver 10.0.0.53\nnameserver 10.0.1.53\n").unwrap();
        let flags = Options {
            resolv_conf: Some(path.clone()),
            groups: Some(vec![]),
            ..Options::default()
        };
        let c = parse(BASE)
            .unwrap()
            .resolve_with(&Options {
                iface: Some("eth0".into()),
                ..flags.clone()
            })
            .unwrap();
        assert_eq!(
            c.settings.groups,
            vec![vec![
                "10.0.0.53:53".parse().unwrap(),
                "10.0.1.53:53".parse().unwrap()
            ]]
        );
        assert_eq!(c.group_names, vec![Some("resolv.conf".to_string())]);
        assert_eq!(c.settings.protocol(), Protocol::Dns);
        let memcached = Options {
            proto: Some(Protocol::Memcached),
            ..flags.clone()
        };
        let e = format!(
            "{:#}",
            parse(BASE).unwrap().resolve_with(&memcached).unwrap_err()
        );
        assert!(e.contains("resolv-conf") && e.contains("dns"), "{e}");
        // systemd-resolved's stub alone is refused, naming its upstream file.
        std::fs::write(&path, "nameserver 127.0.0.53\noptions edns0 trust-ad\n").unwrap();
        let stub = Options {
            iface: Some("eth0".into()),
            ..flags
        };
        let e = format!(
            "{:#}",
            parse(BASE).unwrap().resolve_with(&stub).unwrap_err()
        );
        assert!(
            e.contains("resolv-conf") && e.contains("systemd-resolved's local stub (127.0.0.53)"),
            "{e}"
        );
        assert!(e.contains("/run/systemd/resolve/resolv.conf"), "{e}");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn proto_from_the_flags_carries_its_descriptor_options() {
        let file = parse(&with(
            "proto = \"custom\"\nreq-id-offset = 4\nreq-id-len = 4\n",
        ))
        .unwrap();
        let from_file = file.resolve_with(&Options::default()).unwrap();
        assert_eq!(from_file.settings.protocol(), Protocol::Custom);
        let dns = Options {
            proto: Some(Protocol::Dns),
            ..Options::default()
        };
        let c = file.resolve_with(&dns).unwrap();
        assert_eq!(c.settings.descriptor, Descriptor::dns());
        // One option alone is laid over the file's descriptor.
        let len = Options {
            req_id_len: Some(2),
            ..Options::default()
        };
        let c = file.resolve_with(&len).unwrap();
        assert_eq!(
            (
                c.settings.descriptor.id_offset,
                c.settings.descriptor.id_len
            ),
            (4, 2)
        );
    }

    #[test]
    fn syntax_type_and_unknown_key_errors_name_line_and_key() {
        let e = err("iface = \"eth0\"\nthreshold = \"two\"\n");
        assert!(e.starts_with("sel.toml:2:13: threshold:"), "{e}");
        assert!(e.contains("invalid type"), "{e}");
        let e = err("iface = \"eth0\"\n\ncolour = \"blue\"\n");
        assert!(e.starts_with("sel.toml:3:1: colour: unknown field"), "{e}");
        let e = err("iface = \"eth0\"\npolicy = \"fastest\"\n");
        assert!(
            e.starts_with(
                "sel.toml:2:10: policy: unknown variant `fastest`, expected one of `threshold`"
            ),
            "{e}"
        );
        let e = err(&format!(
            "{BASE}\n[[group]]\nmembers = [\"10.0.0.3:1\"]\ncolour = 1\n"
        ));
        assert!(
            e.starts_with("sel.toml:10:1: group 2 colour: unknown field"),
            "{e}"
        );
        // A top-level key after a [[group]] header belongs to that group.
        let e = err(&format!("{BASE}mark = 16\n"));
        assert!(
            e.starts_with("sel.toml:7:1: group 1 mark: unknown field"),
            "{e}"
        );
        let e = err(&format!("{BASE}\n[[group]]\nname = \"x\"\n"));
        assert_eq!(e, "sel.toml:8:1: group 2: missing field `members`");
        let e = err("iface = \"eth0\"\nthreshold = = 2\n");
        assert!(e.starts_with("sel.toml:2:"), "{e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }

    #[test]
    fn bad_values_name_the_line_and_key_they_came_from() {
        let e = err(&BASE.replace("threshold = 2", "threshold = 0"));
        assert_eq!(e, "sel.toml:2: threshold: must be at least 1");
        let e = err(&with("mark = 3\n"));
        assert_eq!(
            e,
            "sel.toml:3: mark: must have exactly one bit set, got 0x00000003"
        );
        let e = err(&BASE.replace("10.0.0.2:11211", "10.0.0.1:11211"));
        assert_eq!(
            e,
            "sel.toml:6: group 1 members: backend 10.0.0.1:11211 appears twice in group 1"
        );
        let e = err(&BASE.replace("10.0.0.2:11211", "10.0.0.2"));
        assert!(
            e.starts_with("sel.toml:6: group 1 members: '10.0.0.2' is not an IPv4 address:port, an [IPv6 address]:port or a host:port"),
            "{e}"
        );
        let e = err(&format!(
            "{BASE}\n[[group]]\nname = \"users\"\nmembers = [\"10.0.0.3:1\"]\n"
        ));
        assert!(
            e.starts_with("sel.toml:8: group 2: group name 'users'"),
            "{e}"
        );
        let e = err(&with("proto = \"custom\"\n"));
        assert!(
            e.starts_with("sel.toml:3: proto: --proto custom needs"),
            "{e}"
        );
        let e = err(&with("\ninterval = 0\n"));
        assert_eq!(e, "sel.toml:4: interval: must be greater than 0");
        // A value the flags gave is the flags' error, as without a file.
        let file = parse(BASE).unwrap();
        let flags = Options {
            tunables: TunablesPatch {
                threshold: Some(0),
                ..Default::default()
            },
            ..Options::default()
        };
        let e = file.resolve_with(&flags).unwrap_err().to_string();
        assert_eq!(e, "--threshold must be at least 1");
    }

    #[test]
    fn members_may_be_host_names() {
        assert_eq!(
            resolve_member("localhost:11211"),
            Ok("127.0.0.1:11211".parse().unwrap())
        );
        assert_eq!(
            resolve_member("10.0.0.1:1"),
            Ok("10.0.0.1:1".parse().unwrap())
        );
        assert_eq!(
            resolve_member("[fd77::1]:11211"),
            Ok("[fd77::1]:11211".parse().unwrap())
        );
        for bad in ["localhost", "localhost:port", ":11211", "fd77::1:11211"] {
            let e = resolve_member(bad).unwrap_err();
            assert!(e.contains(&format!("'{bad}'")), "{e}");
        }
    }

    #[test]
    fn a_name_is_its_one_ipv4_address_or_else_its_one_ipv6_address() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let v4 = a("10.0.0.1:11211");
        let v6 = a("[fd77::1]:11211");
        assert_eq!(member_address("r:11211", [v4]), Ok(v4));
        assert_eq!(member_address("r:11211", [v6]), Ok(v6), "IPv6 only");
        assert_eq!(member_address("r:11211", [v6, v4]), Ok(v4), "dual stack");
        // The resolver may list an address once per socket type.
        assert_eq!(member_address("r:11211", [v6, v6]), Ok(v6));
        let two6 = member_address("r:11211", [v6, a("[fd77::2]:11211")]).unwrap_err();
        assert!(
            two6.contains("resolves to 2 IPv6 addresses (fd77::1, fd77::2)"),
            "{two6}"
        );
        let two4 = member_address("r:11211", [v6, v4, a("10.0.0.2:11211")]).unwrap_err();
        assert!(
            two4.contains("resolves to 2 IPv4 addresses (10.0.0.1, 10.0.0.2)"),
            "{two4}"
        );
        let none = member_address("r:11211", []).unwrap_err();
        assert!(
            none.contains("'r:11211' has no IPv4 or IPv6 address"),
            "{none}"
        );
    }

    #[test]
    fn without_a_file_the_flags_alone_are_resolved() {
        let flags = Options {
            iface: Some("eth0".into()),
            groups: Some(vec![GroupSpec {
                name: None,
                members: vec!["10.0.0.1:1".into()],
            }]),
            ..Options::default()
        };
        let c = flags.resolve().unwrap();
        assert_eq!(
            c.settings.tunables.threshold,
            RunDefaults::default().tunables.threshold
        );
        assert_eq!(c.interval, RunDefaults::default().interval);
        assert!(!c.quiet);
        let e = Options::default().resolve().unwrap_err().to_string();
        assert_eq!(e, "--iface is required");
    }
}
