//! The flags of `selector run` and their translation into [`Settings`].

use std::{fmt, net::SocketAddrV4, time::Duration};

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use selector_common::{DEFAULT_INFLIGHT_MAX, Descriptor, MARK_REDIRECTED};

use super::{OnOverloadArg, PolicyArg};
use crate::hedging::{DEFAULT_BUDGET_PERCENT, HedgeAfter, HedgeSettings};
use crate::settings::{
    DEFAULT_THRESHOLD, DEFAULT_TIMEOUT_MS, IngressMode, Settings, parse_group, parse_u32,
};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ProtoArg {
    /// memcached UDP: 16-bit request id in the frame header; reads are get/gets.
    Memcached,
    /// DNS: 16-bit message id; every query is a read.
    Dns,
    /// Set with --req-id-offset, --req-id-len and optionally --read-prefix.
    Custom,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum IngressArg {
    /// XDP on the interface.
    Xdp,
    /// TC ingress (for devices where XDP does not fit).
    Tc,
}

/// One replica group: members in preference order.
#[derive(Clone, Debug)]
pub struct GroupArg(pub Vec<SocketAddrV4>);

fn group_arg(s: &str) -> Result<GroupArg, String> {
    parse_group(s).map(GroupArg)
}

/// An skb mark value; shown in hex, as marks usually are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mark(pub u32);

impl fmt::Display for Mark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#010x}", self.0)
    }
}

fn mark_arg(s: &str) -> Result<Mark, String> {
    parse_u32(s).map(Mark)
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Network interface the application's traffic leaves by (needs an IPv4 address).
    #[arg(long)]
    pub iface: String,
    /// A replica group, e.g. 10.0.0.1:11211,10.0.0.2:11211,10.0.0.3:11211.
    /// Repeat for more groups. Requests addressed to a member may go to
    /// any member of its group.
    #[arg(long = "group", required = true, value_parser = group_arg)]
    pub groups: Vec<GroupArg>,
    #[arg(long, value_enum, default_value_t = PolicyArg::Threshold)]
    pub policy: PolicyArg,
    /// Pending requests: the margin (threshold policy) or the limit
    /// (absolute policy) at which reads leave the primary.
    #[arg(long, default_value_t = DEFAULT_THRESHOLD)]
    pub threshold: u32,
    /// Pending requests per backend at which it is no longer chosen; when
    /// the primary and every eligible replica are there, --on-overload
    /// applies (0: no bound).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_pending: u32,
    /// What a read gets when its backends are at --max-pending or its
    /// client socket at --max-pending-client.
    #[arg(long, value_enum, default_value_t = OnOverloadArg::Pass)]
    pub on_overload: OnOverloadArg,
    /// Pending requests per client socket at which its reads are
    /// overloaded (0: no bound).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_pending_client: u32,
    #[arg(long, value_enum, default_value_t = ProtoArg::Memcached)]
    pub proto: ProtoArg,
    /// Custom protocol: byte offset of the request id in the UDP payload.
    #[arg(long)]
    pub req_id_offset: Option<u16>,
    /// Custom protocol: request id length in bytes (1-8).
    #[arg(long)]
    pub req_id_len: Option<u8>,
    /// Custom protocol: reads start with these bytes (default: every request is a read).
    #[arg(long)]
    pub read_prefix: Option<String>,
    /// Custom protocol: offset of the read prefix in the UDP payload.
    #[arg(long, default_value_t = 0)]
    pub read_prefix_offset: u16,
    /// Custom protocol: requests holding these bytes (1-8) at
    /// --no-reply-offset expect no reply; they are passed, never tracked.
    #[arg(long)]
    pub no_reply_marker: Option<String>,
    /// Custom protocol: offset of the no-reply marker in the UDP payload.
    #[arg(long, default_value_t = 0)]
    pub no_reply_offset: u16,
    /// Milliseconds after which an unanswered request is expired (1 to 3600000).
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_TIMEOUT_MS)]
    pub timeout: u64,
    /// Milliseconds after a request completed or expired during which a late
    /// reply to a redirected read is still rewritten (1 to 3600000;
    /// default: --timeout).
    #[arg(long, value_name = "MS")]
    pub grace: Option<u64>,
    /// The skb mark bit set on the selector's own re-sent requests between
    /// their redirect and their second egress pass, where it is cleared.
    /// Exactly one bit, decimal or 0x hex; pick one no fwmark rule matches.
    #[arg(long, value_name = "BIT", value_parser = mark_arg, default_value_t = Mark(MARK_REDIRECTED))]
    pub mark: Mark,
    /// Hedged reads: a read still pending after MS milliseconds (decimals
    /// allowed; at most half of --timeout) gets one copy, sent to the least
    /// pending other replica of its group; the first reply reaches the
    /// application, the later one is dropped. `auto`: after the primary's
    /// recent p95 latency. `off`: never.
    #[arg(long, value_name = "MS|auto|off", default_value = "off")]
    pub hedge_after: HedgeAfter,
    /// Hedges at most this percentage of reads (1-100; plus a burst of 10).
    #[arg(long, value_name = "PERCENT", default_value_t = DEFAULT_BUDGET_PERCENT)]
    pub hedge_budget: u32,
    /// Capacity of the in-flight table; requests beyond it pass untracked.
    #[arg(long, default_value_t = DEFAULT_INFLIGHT_MAX)]
    pub inflight_max: u32,
    /// Milliseconds between table prints (the sweep runs at least this often).
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    pub interval: u64,
    #[arg(long, value_enum, default_value_t = IngressArg::Xdp)]
    pub ingress: IngressArg,
    /// Stop after this many seconds (default: run until SIGINT/SIGTERM).
    #[arg(long, value_name = "SECS")]
    pub duration: Option<f64>,
    /// Print only the final summary, not the live table.
    #[arg(long)]
    pub quiet: bool,
}

impl RunArgs {
    /// The flags as checked settings; nothing on the host is looked at yet.
    pub fn settings(&self) -> Result<Settings> {
        if self.interval == 0 {
            bail!("--interval must be greater than 0");
        }
        if self.duration.is_some_and(|d| !(d > 0.0 && d.is_finite())) {
            bail!("--duration must be a positive number of seconds");
        }
        let timeout = Duration::from_millis(self.timeout);
        let settings = Settings {
            iface: self.iface.clone(),
            groups: self.groups.iter().map(|g| g.0.clone()).collect(),
            policy: self.policy.into(),
            threshold: self.threshold,
            descriptor: self.descriptor()?,
            timeout,
            inflight_max: self.inflight_max,
            ingress: match self.ingress {
                IngressArg::Xdp => IngressMode::Xdp,
                IngressArg::Tc => IngressMode::Tc,
            },
            max_pending: self.max_pending,
            max_pending_client: self.max_pending_client,
            on_overload: self.on_overload.into(),
            mark: self.mark.0,
            grace: self.grace.map_or(timeout, Duration::from_millis),
            hedging: HedgeSettings {
                after: self.hedge_after,
                budget_percent: self.hedge_budget,
            },
        };
        settings.plan()?;
        Ok(settings)
    }

    fn descriptor(&self) -> Result<Descriptor> {
        let custom_flags = self.req_id_offset.is_some()
            || self.req_id_len.is_some()
            || self.read_prefix.is_some()
            || self.read_prefix_offset != 0
            || self.no_reply_marker.is_some()
            || self.no_reply_offset != 0;
        Ok(match self.proto {
            ProtoArg::Memcached | ProtoArg::Dns if custom_flags => {
                bail!(
                    "--req-id-offset, --req-id-len, --read-prefix[-offset] and --no-reply-* need --proto custom"
                )
            }
            ProtoArg::Memcached => Descriptor::memcached(),
            ProtoArg::Dns => Descriptor::dns(),
            ProtoArg::Custom => {
                let (Some(offset), Some(len)) = (self.req_id_offset, self.req_id_len) else {
                    bail!("--proto custom needs --req-id-offset and --req-id-len");
                };
                let prefix = self.read_prefix.as_deref().unwrap_or("");
                let descriptor =
                    Descriptor::custom(offset, len, self.read_prefix_offset, prefix.as_bytes());
                let descriptor = match &self.no_reply_marker {
                    Some(marker) => descriptor.and_then(|d| {
                        d.with_no_reply_prefix(self.no_reply_offset, marker.as_bytes())
                    }),
                    None if self.no_reply_offset != 0 => {
                        bail!("--no-reply-offset needs --no-reply-marker")
                    }
                    None => descriptor,
                };
                descriptor.map_err(|e| anyhow::anyhow!("bad protocol descriptor: {e}"))?
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;
    use selector_common::Policy;

    use super::*;
    use crate::{
        cli::{Cli, Command},
        settings::{MAX_TIMEOUT_MS, OnOverload},
    };

    fn parse(args: &[&str]) -> Result<Settings> {
        let mut argv = vec![
            "selector",
            "run",
            "--iface",
            "eth0",
            "--group",
            "10.0.0.1:1",
        ];
        argv.extend_from_slice(args);
        let cli = Cli::try_parse_from(argv).map_err(|e| anyhow::anyhow!("{e}"))?;
        let Command::Run(run) = cli.command else {
            bail!("not a run command");
        };
        run.settings()
    }

    fn parse_err(args: &[&str]) -> String {
        parse(args).unwrap_err().to_string()
    }

    #[test]
    fn defaults_are_those_of_settings_new() {
        let s = parse(&["--group", "10.0.0.2:1,10.0.0.3:1"]).unwrap();
        let d = Settings::new("eth0", vec![]);
        assert_eq!(s.policy, d.policy);
        assert_eq!(s.threshold, d.threshold);
        assert_eq!(s.descriptor, d.descriptor);
        assert_eq!(s.ingress, d.ingress);
        assert_eq!((s.timeout, s.grace), (d.timeout, d.grace));
        assert_eq!(s.inflight_max, d.inflight_max);
        assert_eq!((s.max_pending, s.max_pending_client), (0, 0));
        assert_eq!(s.on_overload, d.on_overload);
        assert_eq!(s.mark, d.mark);
        assert_eq!(s.groups.len(), 2);
    }

    #[test]
    fn custom_descriptor_needs_its_flags() {
        assert!(parse_err(&["--proto", "custom"]).contains("--req-id-offset"));
        let s = parse(&[
            "--proto",
            "custom",
            "--req-id-offset",
            "4",
            "--req-id-len",
            "4",
            "--read-prefix",
            "GET",
        ])
        .unwrap();
        assert_eq!((s.descriptor.id_offset, s.descriptor.id_len), (4, 4));
        assert_eq!(&s.descriptor.prefix[..3], b"GET");
        assert!(parse_err(&["--req-id-len", "4"]).contains("--proto custom"));
    }

    #[test]
    fn custom_descriptor_can_name_requests_that_expect_no_reply() {
        let custom = [
            "--proto",
            "custom",
            "--req-id-offset",
            "0",
            "--req-id-len",
            "4",
        ];
        let mut args = custom.to_vec();
        args.extend(["--no-reply-marker", "N!", "--no-reply-offset", "4"]);
        let d = parse(&args).unwrap().descriptor;
        assert!(d.expects_no_reply(|i| b"\0\0\0\x01N!".get(i).copied()));
        assert!(!d.expects_no_reply(|i| b"\0\0\0\x01R?".get(i).copied()));
        let mut too_long = custom.to_vec();
        too_long.extend(["--no-reply-marker", "123456789"]);
        assert!(parse_err(&too_long).contains("no-reply marker"));
        let mut offset_only = custom.to_vec();
        offset_only.extend(["--no-reply-offset", "4"]);
        assert!(parse_err(&offset_only).contains("--no-reply-marker"));
        assert!(parse_err(&["--no-reply-marker", "x"]).contains("--proto custom"));
    }

    #[test]
    fn overload_flags_are_taken_and_checked() {
        let s = parse(&[
            "--max-pending",
            "50",
            "--on-overload",
            "reject",
            "--max-pending-client",
            "8",
            "--proto",
            "dns",
        ])
        .unwrap();
        assert_eq!((s.max_pending, s.max_pending_client), (50, 8));
        assert_eq!(s.on_overload, OnOverload::Reject);
        let custom = [
            "--on-overload",
            "reject",
            "--proto",
            "custom",
            "--req-id-offset",
            "0",
            "--req-id-len",
            "4",
        ];
        assert!(parse_err(&custom).contains("--on-overload reject needs --proto memcached or dns"));
        assert!(parse(&["--on-overload", "throttle"]).is_err());
        assert!(parse(&["--max-pending", "-1"]).is_err());
    }

    #[test]
    fn mark_takes_one_bit_in_hex_or_decimal() {
        assert_eq!(parse(&["--mark", "0x00000010"]).unwrap().mark, 0x10);
        assert_eq!(parse(&["--mark", "256"]).unwrap().mark, 0x100);
        assert!(parse_err(&["--mark", "0x3"]).contains("exactly one bit"));
        assert!(parse_err(&["--mark", "0"]).contains("exactly one bit"));
        assert!(parse_err(&["--mark", "bit3"]).contains("0x hex"));
    }

    #[test]
    fn timeout_and_grace_are_bounded() {
        let max = MAX_TIMEOUT_MS.to_string();
        let over = (MAX_TIMEOUT_MS + 1).to_string();
        assert!(parse_err(&["--timeout", "0"]).contains("--timeout must be at least 1 ms"));
        assert!(parse_err(&["--timeout", &over]).contains("--timeout must be at most 3600000 ms"));
        assert!(parse_err(&["--timeout", &u64::MAX.to_string()]).contains("at most"));
        assert!(parse_err(&["--grace", "0"]).contains("--grace must be at least 1 ms"));
        assert!(parse_err(&["--grace", &over]).contains("--grace"));
        let s = parse(&["--timeout", &max, "--grace", "5"]).unwrap();
        assert_eq!(s.timeout, Duration::from_millis(MAX_TIMEOUT_MS));
        assert_eq!(s.grace, Duration::from_millis(5));
        // --grace follows --timeout unless given.
        let s = parse(&["--timeout", "250"]).unwrap();
        assert_eq!(s.grace, Duration::from_millis(250));
    }

    #[test]
    fn bad_values_are_rejected_before_anything_runs() {
        assert!(parse(&["--group", "10.0.0.2"]).is_err());
        assert!(parse_err(&["--group", "10.0.0.1:1"]).contains("group 1 and group 2"));
        assert!(parse(&["--interval", "0"]).is_err());
        assert!(parse(&["--policy", "fastest"]).is_err());
        assert!(parse(&["--threshold", "0"]).is_err());
        assert_eq!(
            parse(&["--threshold", "0", "--policy", "observe"])
                .unwrap()
                .policy,
            Policy::Observe
        );
    }

    #[test]
    fn hedge_flags_are_taken_and_checked() {
        let s = parse(&["--hedge-after", "2", "--hedge-budget", "10"]).unwrap();
        assert_eq!(s.hedging.after, HedgeAfter::Fixed(Duration::from_millis(2)));
        assert_eq!(s.hedging.budget_percent, 10);
        assert_eq!(
            parse(&["--hedge-after", "auto"]).unwrap().hedging.after,
            HedgeAfter::Auto
        );
        let d = parse(&[]).unwrap().hedging;
        assert_eq!((d.after, d.budget_percent), (HedgeAfter::Off, 5));
        assert!(parse(&["--hedge-after", "soon"]).is_err());
        assert!(parse_err(&["--hedge-after", "600"]).contains("half of --timeout"));
        assert!(parse_err(&["--hedge-budget", "0"]).contains("--hedge-budget"));
    }

    #[test]
    fn help_shows_the_mark_in_hex() {
        use clap::CommandFactory as _;
        let mut cmd = Cli::command();
        let run = cmd.find_subcommand_mut("run").unwrap();
        let help = run.render_long_help().to_string();
        assert!(help.contains("[default: 0x01000000]"), "{help}");
        assert!(help.contains("--on-overload"), "{help}");
    }
}
