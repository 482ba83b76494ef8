//! The `selector` command line and its run loop.

use std::{net::SocketAddrV4, time::Duration};

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use selector_common::{DEFAULT_INFLIGHT_MAX, Descriptor, Policy};

use crate::{
    Selector,
    control::{self, Request},
    neighbours,
    settings::{IngressMode, Settings, parse_group},
    sys, telemetry,
};

#[derive(Debug, Parser)]
#[command(
    name = "selector",
    version,
    about = "Kernel-space replica selector: steers reads away from a stalled replica",
    long_about = "Kernel-space replica selector.\n\n\
        eBPF programs on the client's interface count the requests pending at each \
        backend. A read whose primary has THRESHOLD more pending requests than the \
        least-loaded replica of its group is sent to that replica instead (the \
        BookKeeper rule), and its response is rewritten to come from the primary, \
        so the application needs no change."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Attach to an interface and steer until interrupted (or --duration).
    Run(RunArgs),
    /// Change the policy or threshold of the agent running on an interface.
    Set(SetArgs),
    /// Stop choosing a backend (its pending requests still complete).
    Drain(BackendArgs),
    /// Let a drained backend be chosen again.
    Undrain(BackendArgs),
    /// Print the running agent's settings, totals and pending counts.
    Status(IfaceArgs),
}

#[derive(Debug, Args)]
pub struct IfaceArgs {
    /// Interface the agent runs on (in this network namespace).
    #[arg(long)]
    pub iface: String,
}

#[derive(Debug, Args)]
pub struct SetArgs {
    #[arg(long)]
    pub iface: String,
    #[arg(long, value_enum)]
    pub policy: Option<PolicyArg>,
    #[arg(long)]
    pub threshold: Option<u32>,
}

#[derive(Debug, Args)]
pub struct BackendArgs {
    #[arg(long)]
    pub iface: String,
    /// The backend, as given to --group.
    pub backend: SocketAddrV4,
}

impl From<PolicyArg> for Policy {
    fn from(p: PolicyArg) -> Self {
        match p {
            PolicyArg::Threshold => Policy::Threshold,
            PolicyArg::Absolute => Policy::Absolute,
            PolicyArg::Observe => Policy::Observe,
        }
    }
}

/// Runs a control command against the agent on its interface.
pub fn control(command: Command) -> Result<()> {
    let (iface, request) = match command {
        Command::Run(_) => bail!("not a control command"),
        Command::Status(a) => (a.iface, Request::Status),
        Command::Set(a) => {
            if a.policy.is_none() && a.threshold.is_none() {
                bail!("set needs --policy and/or --threshold");
            }
            (
                a.iface,
                Request::Set {
                    policy: a.policy.map(Policy::from),
                    threshold: a.threshold,
                },
            )
        }
        Command::Drain(a) => (
            a.iface,
            Request::Drain {
                backend: a.backend,
                drained: true,
            },
        ),
        Command::Undrain(a) => (
            a.iface,
            Request::Drain {
                backend: a.backend,
                drained: false,
            },
        ),
    };
    print!("{}", control::send(&iface, &request)?);
    Ok(())
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PolicyArg {
    /// Redirect when pending[primary] >= pending[least loaded] + threshold.
    Threshold,
    /// Redirect when pending[primary] >= threshold, to the least loaded.
    Absolute,
    /// Count and report, never redirect.
    Observe,
}

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

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Network interface the application's traffic leaves by.
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
    #[arg(long, default_value_t = 4)]
    pub threshold: u32,
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
    /// Milliseconds after which an unanswered request is expired.
    #[arg(long, default_value_t = 1000)]
    pub timeout: u64,
    /// Capacity of the in-flight table; requests beyond it pass untracked.
    #[arg(long, default_value_t = DEFAULT_INFLIGHT_MAX)]
    pub inflight_max: u32,
    /// Milliseconds between table prints (the sweep runs at least this often).
    #[arg(long, default_value_t = 1000)]
    pub interval: u64,
    #[arg(long, value_enum, default_value_t = IngressArg::Xdp)]
    pub ingress: IngressArg,
    /// Stop after this many seconds (default: run until SIGINT/SIGTERM).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Print only the final summary, not the live table.
    #[arg(long)]
    pub quiet: bool,
}

impl RunArgs {
    pub fn settings(&self) -> Result<Settings> {
        let custom_flags = self.req_id_offset.is_some()
            || self.req_id_len.is_some()
            || self.read_prefix.is_some()
            || self.read_prefix_offset != 0;
        let descriptor = match self.proto {
            ProtoArg::Memcached | ProtoArg::Dns if custom_flags => {
                bail!(
                    "--req-id-offset, --req-id-len and --read-prefix[-offset] need --proto custom"
                )
            }
            ProtoArg::Memcached => Descriptor::memcached(),
            ProtoArg::Dns => Descriptor::dns(),
            ProtoArg::Custom => {
                let (Some(offset), Some(len)) = (self.req_id_offset, self.req_id_len) else {
                    bail!("--proto custom needs --req-id-offset and --req-id-len");
                };
                let prefix = self.read_prefix.as_deref().unwrap_or("");
                Descriptor::custom(offset, len, self.read_prefix_offset, prefix.as_bytes())
                    .map_err(|e| anyhow::anyhow!("bad protocol descriptor: {e}"))?
            }
        };
        if self.interval == 0 {
            bail!("--interval must be greater than 0");
        }
        if self.duration.is_some_and(|d| !(d > 0.0 && d.is_finite())) {
            bail!("--duration must be a positive number of seconds");
        }
        let timeout = Duration::from_millis(self.timeout);
        let settings = Settings {
            policy: self.policy.into(),
            threshold: self.threshold,
            descriptor,
            timeout,
            grace: timeout,
            inflight_max: self.inflight_max,
            ingress: match self.ingress {
                IngressArg::Xdp => IngressMode::Xdp,
                IngressArg::Tc => IngressMode::Tc,
            },
            ..Settings::new(
                self.iface.clone(),
                self.groups.iter().map(|g| g.0.clone()).collect(),
            )
        };
        settings.plan()?;
        Ok(settings)
    }
}

/// A control request on its way to the main loop, with where to reply.
type ControlCall = (Request, tokio::sync::oneshot::Sender<Result<String>>);

/// Longest control request line accepted.
const MAX_REQUEST: u64 = 4096;

/// Reads one request from a control connection (in its own task, so a slow
/// or idle client never holds up the sweep), hands it to the main loop, and
/// writes the reply. Only root or the agent's own user may control it.
async fn serve_control(
    stream: tokio::net::UnixStream,
    calls: tokio::sync::mpsc::Sender<ControlCall>,
) {
    use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
    // SAFETY: geteuid has no preconditions.
    let own_uid = unsafe { libc::geteuid() };
    let allowed = stream
        .peer_cred()
        .is_ok_and(|c| c.uid() == 0 || c.uid() == own_uid);
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read.take(MAX_REQUEST));
    let read_line = reader.read_line(&mut line);
    let received = tokio::time::timeout(Duration::from_secs(1), read_line).await;
    let reply = if !allowed {
        Err(anyhow::anyhow!(
            "permission denied: only root or the agent's user may control it"
        ))
    } else if !matches!(received, Ok(Ok(n)) if n > 0) {
        Err(anyhow::anyhow!("no request received"))
    } else {
        match Request::decode(&line) {
            Ok(request) => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                match calls.send((request, tx)).await {
                    Ok(()) => rx
                        .await
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("agent stopping"))),
                    Err(_) => Err(anyhow::anyhow!("agent stopping")),
                }
            }
            Err(e) => Err(e),
        }
    };
    let text = match reply {
        Ok(text) => text,
        Err(e) => format!("error: {e:#}\n"),
    };
    let _ = write.write_all(text.as_bytes()).await;
    let _ = write.shutdown().await;
}

/// How often the neighbour entries of the backends are refreshed.
const NEIGHBOUR_REFRESH: Duration = Duration::from_secs(10);

/// Attaches, then sweeps and prints until a signal or the duration ends.
pub async fn run(args: RunArgs) -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};

    let settings = args.settings()?;
    // Handlers first: a signal during attach still ends in a clean detach.
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    // Claiming the control socket first also refuses a second agent on the
    // same interface before it attaches anything.
    let listener = std::os::unix::net::UnixListener::bind_addr(&control::address(&settings.iface)?)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => anyhow::anyhow!(
                "a selector is already running on {} in this network namespace",
                settings.iface
            ),
            _ => e.into(),
        })?;
    listener.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(listener)?;
    let mut selector = Selector::attach(&settings)?;
    let addrs: Vec<SocketAddrV4> = selector.backends.iter().map(|b| b.addr).collect();
    let unresolved = neighbours::warm_up(&addrs, Duration::from_millis(500));
    println!(
        "selector: attached to {} ({} ingress), {} backends in {} groups, policy {:?} threshold {}, timeout {} ms",
        settings.iface,
        match settings.ingress {
            IngressMode::Xdp => "XDP",
            IngressMode::Tc => "TC",
        },
        addrs.len(),
        settings.groups.len(),
        settings.policy,
        settings.threshold,
        args.timeout
    );
    if !unresolved.is_empty() {
        println!(
            "selector: no neighbour entry yet for {:?} (fine if routed; the first redirect to them waits for resolution)",
            unresolved
        );
    }

    let interval = Duration::from_millis(args.interval);
    // Sweep often enough that an expiry is at most a quarter timeout late.
    let sweep_every = interval
        .min(settings.timeout / 4)
        .max(Duration::from_millis(1));
    let mut sweep_tick = tokio::time::interval(sweep_every);
    let mut print_tick = tokio::time::interval(interval);
    let mut refresh_tick = tokio::time::interval(NEIGHBOUR_REFRESH);
    let deadline = args
        .duration
        .map(|d| tokio::time::Instant::now() + Duration::from_secs_f64(d));
    let until_deadline = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(until_deadline);
    print_tick.tick().await;
    refresh_tick.tick().await;
    let (calls_tx, mut calls_rx) = tokio::sync::mpsc::channel::<ControlCall>(8);
    let mut last = selector.snapshot()?;
    loop {
        tokio::select! {
            _ = sigint.recv() => break,
            _ = sigterm.recv() => break,
            _ = &mut until_deadline => break,
            _ = sweep_tick.tick() => {
                // A failed sweep is retried next tick; the data path goes on.
                if let Err(e) = selector.sweep(sys::monotonic_ns()) {
                    log::warn!("sweep failed: {e:#}");
                }
                selector.flush_kernel_logs();
            }
            _ = refresh_tick.tick() => neighbours::probe(&addrs),
            accepted = listener.accept() => {
                if let Ok((stream, _)) = accepted {
                    tokio::spawn(serve_control(stream, calls_tx.clone()));
                }
            }
            Some((request, reply)) = calls_rx.recv() => {
                let result = control::apply(&mut selector, &request);
                if let (Ok(text), false) = (&result, request == Request::Status) {
                    print!("selector: control: {text}");
                }
                let _ = reply.send(result);
            }
            _ = print_tick.tick() => {
                let now = match selector.snapshot() {
                    Ok(now) => now,
                    Err(e) => {
                        log::warn!("reading the maps failed: {e:#}");
                        continue;
                    }
                };
                if !args.quiet {
                    println!("{}", telemetry::render_table(&selector.backends, &last, &now));
                }
                last = now;
            }
        }
    }
    selector.sweep(sys::monotonic_ns())?;
    let end = selector.snapshot()?;
    println!("selector: detaching from {}; totals:", settings.iface);
    let totals = telemetry::totals(&selector.backends, &end);
    print!("{}", telemetry::render_summary(&totals));
    print!(
        "{}",
        telemetry::render_footer(
            end.inflight,
            &totals,
            &telemetry::passed_counts(&end.passed)
        )
    );
    drop(selector);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Settings> {
        let mut argv = vec!["selector", "run"];
        argv.extend_from_slice(args);
        let cli = Cli::try_parse_from(argv).map_err(|e| anyhow::anyhow!("{e}"))?;
        let Command::Run(run) = cli.command else {
            anyhow::bail!("not a run command");
        };
        run.settings()
    }

    fn parse_err(args: &[&str]) -> String {
        parse(args).unwrap_err().to_string()
    }

    #[test]
    fn defaults_are_memcached_threshold_xdp() {
        let s = parse(&["--iface", "eth0", "--group", "10.0.0.1:1,10.0.0.2:1"]).unwrap();
        assert_eq!(s.policy, Policy::Threshold);
        assert_eq!(s.descriptor, Descriptor::memcached());
        assert_eq!(s.ingress, IngressMode::Xdp);
        assert_eq!(s.groups[0].len(), 2);
    }

    #[test]
    fn custom_descriptor_needs_its_flags() {
        let base = ["--iface", "eth0", "--group", "10.0.0.1:1"];
        let mut a = base.to_vec();
        a.extend(["--proto", "custom"]);
        assert!(parse_err(&a).contains("--req-id-offset"));
        a.extend([
            "--req-id-offset",
            "4",
            "--req-id-len",
            "4",
            "--read-prefix",
            "GET",
        ]);
        let s = parse(&a).unwrap();
        assert_eq!((s.descriptor.id_offset, s.descriptor.id_len), (4, 4));
        assert_eq!(&s.descriptor.prefix[..3], b"GET");
        let mut b = base.to_vec();
        b.extend(["--req-id-len", "4"]);
        assert!(parse_err(&b).contains("--proto custom"));
    }

    #[test]
    fn bad_values_are_rejected_before_anything_runs() {
        assert!(parse(&["--iface", "eth0", "--group", "10.0.0.1"]).is_err());
        assert!(parse(&["--iface", "eth0"]).is_err());
        assert!(
            parse(&[
                "--iface",
                "eth0",
                "--group",
                "10.0.0.1:1",
                "--group",
                "10.0.0.1:1"
            ])
            .unwrap_err()
            .to_string()
            .contains("group 1 and group 2")
        );
        assert!(
            parse(&[
                "--iface",
                "eth0",
                "--group",
                "10.0.0.1:1",
                "--interval",
                "0"
            ])
            .is_err()
        );
        assert!(
            parse(&[
                "--iface",
                "eth0",
                "--group",
                "10.0.0.1:1",
                "--policy",
                "fastest"
            ])
            .is_err()
        );
    }
}
