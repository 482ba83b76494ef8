//! One agent serving several attachments (`selector run --attachment FILE
//! ...`): an interface in the agent's own network namespace or in another
//! (a pod's), each with its own groups, settings, counts, control socket
//! and reloads, as an agent of its own would have; one metrics and probe
//! endpoint for all, where every sample carries the label `attachment`,
//! and one control endpoint for all, where each request names its
//! attachment by the same label ([`crate::agent::control_router`]).
//!
//! Each attachment runs the agent's owner loop ([`crate::agent::run`]) on a
//! thread of its own, which enters the attachment's namespace first: a
//! network namespace is a thread's, so its interface, netlink sockets,
//! hedge sockets and control socket are that namespace's, as with
//! `--netns`. A signal stops them all; so does the end of any one (a
//! failure: an attachment that cannot attach fails the start).

use std::{net::SocketAddr, path::PathBuf, thread};

use anyhow::{Context as _, Result, anyhow, bail};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::watch,
    task::JoinSet,
};

use crate::{
    agent::{
        control_router::ControlRouter,
        endpoint::{MetricsServer, Sources},
        run::{Member, Role, Stops, run_as},
        sd_notify::Notifier,
    },
    config::file::{Options, RunConfig},
    host::preflight::{CAP_NET_RAW, drop_capability, has_capability},
};

thread_local! {
    /// The attachment this thread runs, for the log's lines.
    static CURRENT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// The attachment the calling thread runs, if it runs one of several: its
/// log lines say which.
pub fn current() -> Option<String> {
    CURRENT.with(|c| c.borrow().clone())
}

/// How often the agent looks whether every attachment is ready, to tell
/// systemd.
const READY_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// One attachment: its configuration and the file it was read from (what
/// a reload reads again).
pub struct Attachment {
    pub config: RunConfig,
    pub file: PathBuf,
}

/// The attachment's name: its interface, and the namespace it is in.
pub fn label(config: &RunConfig) -> String {
    match &config.netns {
        Some(ns) => format!("{}@{}", config.settings.iface, ns.display()),
        None => config.settings.iface.clone(),
    }
}

/// Checks what only matters with several: no two attachments name the
/// same interface in the same namespace, none asks for a metrics address
/// of its own (the agent has one, `--metrics-addr`), none pins (pins are
/// named by interface).
pub fn check(attachments: &[Attachment]) -> Result<()> {
    if attachments.len() < 2 {
        bail!("--attachment: give at least two (one attachment is `selector run --config FILE`)");
    }
    let mut seen = Vec::new();
    for a in attachments {
        let name = label(&a.config);
        let file = a.file.display();
        if seen.contains(&name) {
            bail!("--attachment {file}: {name} is attached by an earlier --attachment");
        }
        if a.config.metrics_addr.is_some() {
            bail!(
                "--attachment {file}: sets metrics-addr; the attachments share the agent's one endpoint (give --metrics-addr on the command line)"
            );
        }
        if a.config.pin.is_some() {
            bail!(
                "--attachment {file}: sets pin; not with several attachments (pins are named by interface)"
            );
        }
        seen.push(name);
    }
    Ok(())
}

/// Runs every attachment until a signal, the end of --duration, or the end
/// of any one (a failure, or its file's own duration), which stops the
/// others; the first failure is returned.
///
/// The agent takes SIGINT and SIGTERM for all, from before the first
/// attachment starts (a signal in between is not lost), and tells them
/// ([`Stops`]): stop steering, and how many signals came (one that comes
/// while an attachment waits for its redirected reads cuts the wait short;
/// another attachment's end does not).
pub async fn run(
    attachments: Vec<Attachment>,
    flags: Options,
    metrics_addr: Option<SocketAddr>,
) -> Result<()> {
    check(&attachments)?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let sources = Sources::of_attachments(attachments.iter().map(|a| label(&a.config)).collect());
    // Bound first: a second agent of several attachments in this
    // namespace is refused before anything is attached.
    let router = ControlRouter::bind()?;
    tokio::spawn(router.serve(sources.clone()));
    if let Some(addr) = metrics_addr {
        let server = MetricsServer::bind(addr).await?;
        log::info!(
            "metrics of {} attachments at http://{}/metrics (probes: /healthz, /readyz)",
            attachments.len(),
            server.local_addr()?
        );
        tokio::spawn(server.serve_sources(sources.clone()));
    }
    let (stop, told) = watch::channel(Stops::default());
    let stop_all = |stop: &watch::Sender<Stops>| {
        stop.send_if_modified(|asked| !std::mem::replace(&mut asked.all, true));
    };
    let signalled = |stop: &watch::Sender<Stops>| {
        stop.send_modify(|asked| {
            asked.all = true;
            asked.signals += 1;
        });
    };
    let mut running = JoinSet::new();
    let mut failure = None;
    for Attachment { config, file } in attachments {
        let name = label(&config);
        let member = Member {
            label: name.clone(),
            sources: sources.clone(),
            stop: told.clone(),
        };
        let flags = flags.clone();
        let (done, ended) = tokio::sync::oneshot::channel();
        let started = thread::Builder::new().name(name.clone()).spawn(move || {
            CURRENT.with(|c| *c.borrow_mut() = Some(member.label.clone()));
            let result = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("a runtime for the attachment")
                .and_then(|runtime| {
                    runtime.block_on(run_as(config, Some(file), flags, Role::Member(member)))
                });
            let _ = done.send(result);
        });
        if let Err(e) = started {
            // The ones started stop, and are waited for.
            failure = Some(anyhow!(e).context(format!("starting the thread of attachment {name}")));
            stop_all(&stop);
            break;
        }
        running.spawn(async move {
            let result = ended
                .await
                .unwrap_or_else(|_| Err(anyhow!("its thread ended without a word")));
            (name, result)
        });
    }
    // systemd (`Type=notify`) hears READY once every attachment is ready,
    // then the watchdog's pings while every attachment's loop turns.
    let notifier = Notifier::from_env();
    if notifier.enabled() {
        let (sources, count) = (sources.clone(), running.len());
        tokio::spawn(async move {
            while !sources.all_ready() {
                tokio::time::sleep(READY_POLL).await;
            }
            notifier.ready(&format!("steering {count} attachments"));
            let Some(period) = notifier.watchdog_period() else {
                return;
            };
            loop {
                tokio::time::sleep(period).await;
                if sources.all_live() {
                    notifier.watchdog();
                }
            }
        });
    }
    // The attachments' threads took CAP_NET_RAW with them (each opens its
    // hedge sockets, then gives it up); this thread, which serves the
    // endpoint, needs it no more.
    // A failure here ends nothing: the attachments are running.
    if let Err(e) = has_capability(CAP_NET_RAW).and_then(|has| match has {
        true => drop_capability(CAP_NET_RAW),
        false => Ok(()),
    }) {
        log::warn!("giving up CAP_NET_RAW on the agent's own thread: {e:#}");
    }
    loop {
        tokio::select! {
            _ = interrupt.recv() => signalled(&stop),
            _ = terminate.recv() => signalled(&stop),
            ended = running.join_next() => {
                let Some(ended) = ended else { break };
                // The waiting task cannot panic; said, not unwrapped.
                let (name, result) = match ended {
                    Ok(ended) => ended,
                    Err(e) => ("?".to_string(), Err(anyhow!("waiting for an attachment: {e}"))),
                };
                match result {
                    Err(e) => {
                        log::error!("attachment {name}: {e:#}");
                        failure.get_or_insert(e.context(format!("attachment {name}")));
                    }
                    Ok(()) if !stop.borrow().all => {
                        log::info!("attachment {name} ended: stopping the others");
                    }
                    Ok(()) => {}
                }
                stop_all(&stop);
            }
        }
    }
    failure.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::file::ConfigFile;

    fn attachment(text: &str) -> Attachment {
        let file = PathBuf::from("/etc/selector/a.toml");
        Attachment {
            config: ConfigFile::parse(Path::new("/etc/selector/a.toml"), text.into())
                .unwrap()
                .resolve_with(&Options::default())
                .unwrap(),
            file,
        }
    }

    const GROUP: &str = "[[group]]\nmembers = [\"10.0.0.1:11211\", \"10.0.0.2:11211\"]\n";

    #[test]
    fn attachments_are_named_by_interface_and_namespace_and_never_twice() {
        let host = attachment(&format!("iface = \"eth0\"\n{GROUP}"));
        let pod = attachment(&format!(
            "iface = \"eth0\"\nnetns = \"/run/netns/pod1\"\n{GROUP}"
        ));
        assert_eq!(label(&host.config), "eth0");
        assert_eq!(label(&pod.config), "eth0@/run/netns/pod1");
        check(&[host, pod]).unwrap();

        let twice = [
            attachment(&format!("iface = \"eth0\"\n{GROUP}")),
            attachment(&format!("iface = \"eth0\"\n{GROUP}")),
        ];
        let e = check(&twice).unwrap_err().to_string();
        assert!(
            e.contains("eth0 is attached by an earlier --attachment"),
            "{e}"
        );

        let one = [attachment(&format!("iface = \"eth0\"\n{GROUP}"))];
        assert!(
            check(&one)
                .unwrap_err()
                .to_string()
                .contains("at least two")
        );

        let own_endpoint = [
            attachment(&format!("iface = \"eth0\"\n{GROUP}")),
            attachment(&format!(
                "iface = \"eth1\"\nmetrics-addr = \"127.0.0.1:9641\"\n{GROUP}"
            )),
        ];
        let e = check(&own_endpoint).unwrap_err().to_string();
        assert!(e.contains("sets metrics-addr"), "{e}");

        let pinned = [
            attachment(&format!("iface = \"eth0\"\n{GROUP}")),
            attachment(&format!(
                "iface = \"eth1\"\npin = \"/sys/fs/bpf/x\"\n{GROUP}"
            )),
        ];
        assert!(check(&pinned).unwrap_err().to_string().contains("sets pin"));
    }
}
