//! The flags of `selector run` and their translation into [`Options`],
//! laid over the config file's (see [`crate::config::file`]).

use std::{fmt, net::SocketAddr, path::PathBuf};

use anyhow::{Context as _, Result};
use clap::Args;

use crate::{
    agent::attachments::Attachment,
    config::file::{ConfigFile, GroupSpec, Options, RunConfig},
    config::settings::{IngressMode, Protocol, Settings, parse_group, parse_u32},
    config::tunables::TunablesPatch,
    datapath::pinning::DEFAULT_PIN_DIR,
};

/// One replica group: members in preference order.
#[derive(Clone, Debug)]
pub struct GroupArg(pub Vec<SocketAddr>);

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
    /// A TOML file with any of these settings (keys are the flag names);
    /// a flag given here wins over its key. `selector reload` or SIGHUP
    /// re-reads it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// One attachment of several served by this agent: a config file as
    /// for --config (its own iface, netns, groups and settings). Repeat for
    /// each; flags given here apply to all of them. One --metrics-addr
    /// serves them all (each sample labelled `attachment`, IFACE or
    /// IFACE@NETNS); each has its own control socket (`selector status
    /// --iface IFACE [--netns PATH]`) and is reloaded from its file on
    /// SIGHUP. No live tables (the lines of several would interleave).
    #[arg(
        long = "attachment",
        value_name = "FILE",
        conflicts_with_all = ["config", "iface", "groups", "netns", "resolv_conf", "pin"]
    )]
    pub attachments: Vec<PathBuf>,
    /// Network interface the application's traffic leaves by (needs an
    /// address of each family the groups use).
    #[arg(long)]
    pub iface: Option<String>,
    /// A replica group, e.g. 10.0.0.1:11211,10.0.0.2:11211,10.0.0.3:11211
    /// or [fd00::1]:11211,[fd00::2]:11211 (one address family per group).
    /// Repeat for more groups. Requests addressed to a member may go to
    /// any member of its group. Replaces the config file's groups.
    #[arg(long = "group", value_parser = group_arg)]
    pub groups: Vec<GroupArg>,
    #[command(flatten)]
    pub tunables: TunablesPatch,
    /// The protocol the groups speak: where a request's id is and which
    /// requests are reads (memcached: `get`/`gets` over UDP with its frame
    /// header; dns: every query; custom: the --req-id-* and --read-prefix*
    /// flags below) [default: memcached]
    #[arg(long, value_enum)]
    pub proto: Option<Protocol>,
    /// Custom protocol: byte offset of the request id in the UDP payload.
    #[arg(long)]
    pub req_id_offset: Option<u16>,
    /// Custom protocol: request id length in bytes (1-8).
    #[arg(long)]
    pub req_id_len: Option<u8>,
    /// Custom protocol: reads start with these bytes (default: every request is a read).
    #[arg(long)]
    pub read_prefix: Option<String>,
    /// Custom protocol: offset of the read prefix in the UDP payload [default: 0].
    #[arg(long)]
    pub read_prefix_offset: Option<u16>,
    /// Custom protocol: requests holding these bytes (1-8) at
    /// --no-reply-offset expect no reply; they are passed, never tracked.
    #[arg(long)]
    pub no_reply_marker: Option<String>,
    /// Custom protocol: offset of the no-reply marker in the UDP payload [default: 0].
    #[arg(long)]
    pub no_reply_offset: Option<u16>,
    /// Custom protocol: replies holding these bytes (1-8) at
    /// --error-offset are errors, failures of the replica (DNS: FORMERR,
    /// SERVFAIL, NOTIMP, REFUSED; memcached: SERVER_ERROR).
    #[arg(long)]
    pub error_marker: Option<String>,
    /// Custom protocol: offset of the error marker in the UDP payload [default: 0].
    #[arg(long)]
    pub error_offset: Option<u16>,
    /// Outlier ejection: a member with this many failures in a row (reads
    /// expired, error replies) is ejected: no read is moved to it, reads
    /// addressed to it go to the best other member. 0: off [default: 5].
    #[arg(long, value_name = "N")]
    pub eject_after: Option<u32>,
    /// Milliseconds of a first ejection, doubled for each ejection in a row
    /// (less up to a quarter at random); then one read probes the member:
    /// a good reply restores it, a failure ejects it again [default: 5000].
    #[arg(long, value_name = "MS")]
    pub eject_base: Option<u64>,
    /// Milliseconds of the longest ejection [default: 300000].
    #[arg(long, value_name = "MS")]
    pub eject_max: Option<u64>,
    /// The most of a group's members (not drained) ejected at once, in
    /// percent: at least one, never the last. A group with more members
    /// failing ejects none and is steered by counts alone [default: 50].
    #[arg(long, value_name = "PERCENT")]
    pub max_ejected: Option<u32>,
    /// Milliseconds after which an unanswered request is expired (1 to 3600000)
    /// [default: 1000].
    #[arg(long, value_name = "MS")]
    pub timeout: Option<u64>,
    /// Milliseconds after a request completed or expired during which a late
    /// reply to a redirected read is still rewritten (1 to 3600000;
    /// default: --timeout).
    #[arg(long, value_name = "MS")]
    pub grace: Option<u64>,
    /// Milliseconds the agent's heartbeat (written by every sweep) may age
    /// before the kernel programs take the agent for gone: then they move
    /// no read (lost reads' counts would make a member look loaded for
    /// good), until an agent adopts them again. 0: never; otherwise 1 to
    /// 3600000 [default: 4 sweep periods, within 1000 to 5000].
    #[arg(long, value_name = "MS")]
    pub heartbeat_bound: Option<u64>,
    /// The skb mark bit set on the selector's own re-sent requests between
    /// their redirect and their second egress pass, where it is cleared.
    /// Exactly one bit, decimal or 0x hex; pick one no fwmark rule matches
    /// [default: 0x01000000].
    #[arg(long, value_name = "BIT", value_parser = mark_arg)]
    pub mark: Option<Mark>,
    /// Capacity of the in-flight table; requests beyond it pass untracked
    /// [default: 65536].
    #[arg(long)]
    pub inflight_max: Option<u32>,
    /// Milliseconds between table prints (the sweep runs at least this often)
    /// [default: 1000].
    #[arg(long, value_name = "MS")]
    pub interval: Option<u64>,
    /// Where replies are processed [default: auto].
    #[arg(long, value_enum)]
    pub ingress: Option<IngressMode>,
    /// Stop after this many seconds, fractions allowed, at most 315360000
    /// (ten years) (default: run until SIGINT/SIGTERM).
    #[arg(long, value_name = "SECS")]
    pub duration: Option<f64>,
    /// Print only the final summary, not the live table.
    #[arg(long)]
    pub quiet: bool,
    /// Pin maps and links under DIR/IFACE on a bpf filesystem (DIR
    /// defaults to /sys/fs/bpf/selector). The programs keep steering after
    /// the agent exits (SIGTERM, SIGINT, SIGKILL alike); an agent started
    /// with the same DIR adopts them, counts carrying on; `selector detach`
    /// removes them.
    #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = DEFAULT_PIN_DIR)]
    pub pin: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics, and the
    /// probes /healthz (the agent's loop turns) and /readyz (attached,
    /// swept recently, configuration applied): 200, or 503 saying why.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_addr: Option<SocketAddr>,
    /// Add a group of the nameservers in PATH (default /etc/resolv.conf)
    /// of the first one's family, in file order, port 53: the stub
    /// resolver's, whose primary is the first. Implies --proto dns and,
    /// unless --hedge-after is given, --hedge-after auto (an agent without
    /// CAP_NET_RAW at start then runs without hedges, and says so); re-read
    /// on reload.
    /// A file naming only systemd-resolved's stub (127.0.0.53) is refused:
    /// use /run/systemd/resolve/resolv.conf, resolved's upstream list.
    #[arg(long, value_name = "PATH", num_args = 0..=1, default_missing_value = "/etc/resolv.conf")]
    pub resolv_conf: Option<PathBuf>,
    /// Attach to --iface in this network namespace: a pod's, as
    /// /proc/PID/ns/net of a process in it or /run/netns/NAME, from an
    /// agent started in the host's. The agent enters it at start (needs
    /// CAP_SYS_ADMIN): interface, routes, neighbours and its control socket
    /// are the namespace's (reach them with `selector status --netns
    /// PATH`); only --metrics-addr listens where the agent was started.
    /// Not with --pin.
    #[arg(long, value_name = "PATH")]
    pub netns: Option<PathBuf>,
}

impl RunArgs {
    /// The flags given, as options to lay over the config file.
    pub fn options(&self) -> Options {
        Options {
            iface: self.iface.clone(),
            groups: (!self.groups.is_empty()).then(|| {
                self.groups
                    .iter()
                    .map(|g| GroupSpec {
                        name: None,
                        members: g.0.iter().map(|a| a.to_string()).collect(),
                    })
                    .collect()
            }),
            tunables: self.tunables.clone(),
            proto: self.proto,
            req_id_offset: self.req_id_offset,
            req_id_len: self.req_id_len,
            read_prefix: self.read_prefix.clone(),
            read_prefix_offset: self.read_prefix_offset,
            no_reply_marker: self.no_reply_marker.clone(),
            no_reply_offset: self.no_reply_offset,
            timeout: self.timeout,
            grace: self.grace,
            heartbeat_bound: self.heartbeat_bound,
            mark: self.mark.map(|m| m.0),
            inflight_max: self.inflight_max,
            interval: self.interval,
            ingress: self.ingress,
            duration: self.duration,
            quiet: self.quiet.then_some(true),
            pin: self.pin.clone(),
            metrics_addr: self.metrics_addr,
            resolv_conf: self.resolv_conf.clone(),
            netns: self.netns.clone(),
            eject_after: self.eject_after,
            eject_base: self.eject_base,
            eject_max: self.eject_max,
            max_ejected: self.max_ejected,
            error_marker: self.error_marker.clone(),
            error_offset: self.error_offset,
        }
    }

    /// The flags over the config file (if any), checked; nothing on the
    /// host is looked at yet but the resolver.
    pub fn run_config(&self) -> Result<RunConfig> {
        let flags = self.options();
        match &self.config {
            Some(path) => ConfigFile::read(path)?.resolve_with(&flags),
            None => flags.resolve(),
        }
    }

    /// The flags laid over each `--attachment` file, at start and on each
    /// reload: all but `--metrics-addr`, which is the agent's.
    pub fn attachment_options(&self) -> Options {
        Options {
            metrics_addr: None,
            ..self.options()
        }
    }

    /// Each `--attachment` file under [`Self::attachment_options`], checked.
    pub fn attachments(&self) -> Result<Vec<Attachment>> {
        let flags = self.attachment_options();
        self.attachments
            .iter()
            .map(|file| {
                let mut config = ConfigFile::read(file)?
                    .resolve_with(&flags)
                    .with_context(|| format!("--attachment {}", file.display()))?;
                config.tables = false;
                Ok(Attachment {
                    config,
                    file: file.clone(),
                })
            })
            .collect()
    }

    /// The settings of [`Self::run_config`].
    pub fn settings(&self) -> Result<Settings> {
        Ok(self.run_config()?.settings)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use anyhow::bail;
    use clap::Parser as _;

    use super::*;
    use crate::{
        cli::{Cli, Command},
        config::hedge::HedgeAfter,
        config::settings::{MAX_TIMEOUT_MS, OnOverload},
    };
    use selector_common::{Policy, TieBreak};

    use crate::config::defaults::RunDefaults;

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
        assert_eq!(s.tunables.policy, d.tunables.policy);
        assert_eq!(s.tunables.threshold, d.tunables.threshold);
        assert_eq!(s.descriptor, d.descriptor);
        assert_eq!(s.ingress, d.ingress);
        assert_eq!((s.timeout, s.grace), (d.timeout, d.grace));
        assert_eq!(s.inflight_max, d.inflight_max);
        assert_eq!(
            (s.tunables.max_pending, s.tunables.max_pending_client),
            (0, 0)
        );
        assert_eq!(s.tunables.on_overload, d.tunables.on_overload);
        assert_eq!(s.mark, d.mark);
        assert_eq!(s.groups.len(), 2);
    }

    #[test]
    fn duration_is_refused_beyond_what_a_timer_holds() {
        for bad in ["1e20", "315360000.5", "NaN", "inf", "0", "-1"] {
            let err = parse_err(&[&format!("--duration={bad}")]);
            assert!(
                err.starts_with("--duration must be a positive"),
                "{bad}: {err}"
            );
        }
        for good in ["0.001", "2.5", "315360000"] {
            assert!(parse(&[&format!("--duration={good}")]).is_ok(), "{good}");
        }
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
        assert!(d.expects_no_reply(|i| b"\0\0\0\x01N!".get(i).copied(), |_| None, |x| x));
        assert!(!d.expects_no_reply(|i| b"\0\0\0\x01R?".get(i).copied(), |_| None, |x| x));
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
        assert_eq!(
            (s.tunables.max_pending, s.tunables.max_pending_client),
            (50, 8)
        );
        assert_eq!(s.tunables.on_overload, OnOverload::Reject);
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
    fn heartbeat_bound_defaults_to_a_few_sweep_periods_and_is_bounded() {
        let ms = Duration::from_millis;
        // --interval and --timeout 1000: a sweep every 250 ms, four of them.
        assert_eq!(parse(&[]).unwrap().heartbeat_bound, ms(1000));
        assert_eq!(
            parse(&["--timeout", "4000"]).unwrap().heartbeat_bound,
            ms(4000)
        );
        assert_eq!(
            parse(&["--timeout", "200", "--interval", "100"])
                .unwrap()
                .heartbeat_bound,
            ms(1000),
            "at least 1 s"
        );
        assert_eq!(
            parse(&["--interval", "10000", "--timeout", "60000"])
                .unwrap()
                .heartbeat_bound,
            ms(5000),
            "at most 5 s"
        );
        assert_eq!(
            parse(&["--heartbeat-bound", "300"])
                .unwrap()
                .heartbeat_bound,
            ms(300)
        );
        assert_eq!(
            parse(&["--heartbeat-bound", "0"]).unwrap().heartbeat_bound,
            Duration::ZERO,
            "off"
        );
        let over = (MAX_TIMEOUT_MS + 1).to_string();
        assert!(
            parse_err(&["--heartbeat-bound", &over])
                .contains("--heartbeat-bound must be at most 3600000 ms")
        );
        assert!(parse(&["--heartbeat-bound=-1"]).is_err());
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
                .tunables
                .policy,
            Policy::Observe
        );
    }

    #[test]
    fn latency_policy_and_tie_break_flags_are_taken_and_checked() {
        let d = parse(&[]).unwrap();
        assert_eq!(
            (d.tunables.budget, d.tunables.tie_break),
            (Duration::from_millis(1), TieBreak::Random)
        );
        assert_eq!(
            parse(&["--tie-break", "first"]).unwrap().tunables.tie_break,
            TieBreak::First
        );
        let s = parse(&[
            "--policy",
            "latency",
            "--budget",
            "0.5",
            "--tie-break",
            "random",
        ])
        .unwrap();
        assert_eq!(s.tunables.policy, Policy::Latency);
        assert_eq!(s.tunables.budget, Duration::from_micros(500));
        assert_eq!(s.tunables.tie_break, TieBreak::Random);
        assert!(parse_err(&["--budget", "0"]).contains("--budget"));
        assert!(parse_err(&["--budget=-1"]).contains("--budget"));
        assert!(parse(&["--tie-break", "last"]).is_err());
    }

    #[test]
    fn hedge_flags_are_taken_and_checked() {
        let s = parse(&["--hedge-after", "2", "--hedge-budget", "10"]).unwrap();
        assert_eq!(
            s.tunables.hedging.after,
            HedgeAfter::Fixed(Duration::from_millis(2))
        );
        assert_eq!(s.tunables.hedging.budget_percent, 10);
        assert_eq!(
            parse(&["--hedge-after", "auto"])
                .unwrap()
                .tunables
                .hedging
                .after,
            HedgeAfter::Auto
        );
        let d = parse(&[]).unwrap().tunables.hedging;
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

    /// Each flag's `[default: ...]` in `run --help` and `set --help`,
    /// from the help text itself.
    fn defaults_in_help(subcommand: &str) -> std::collections::BTreeMap<String, String> {
        use clap::CommandFactory as _;
        let mut cmd = Cli::command().term_width(10_000);
        let help = cmd
            .find_subcommand_mut(subcommand)
            .unwrap()
            .render_long_help()
            .to_string();
        let mut out = std::collections::BTreeMap::new();
        let mut flag = None;
        for line in help.lines() {
            let line = line.trim();
            if let Some(name) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("--"))
                .filter(|_| line.starts_with('-'))
            {
                flag = Some(name.trim_end_matches(',').to_string());
            }
            if let (Some(f), Some(at)) = (&flag, line.find("[default: ")) {
                let rest = &line[at + "[default: ".len()..];
                out.insert(f.clone(), rest[..rest.find(']').unwrap()].to_string());
            }
        }
        out
    }

    /// The defaults `--help` shows are the ones in force: every flag with
    /// a default says it, and says the value `RunDefaults` holds.
    #[test]
    fn help_shows_the_defaults_in_force() {
        let shown: std::collections::BTreeMap<String, String> = RunDefaults::default()
            .shown()
            .into_iter()
            .map(|(flag, value)| (flag.to_string(), value))
            .collect();
        assert_eq!(defaults_in_help("run"), shown);
        let set = defaults_in_help("set");
        assert!(!set.is_empty());
        for (flag, value) in &set {
            assert_eq!(Some(value), shown.get(flag), "set --{flag}");
        }
    }
}
