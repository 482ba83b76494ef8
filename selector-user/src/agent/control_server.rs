//! The agent's side of the control socket: accepting connections, reading
//! one request each, and applying it to the running selector. The
//! listening and the reading serve the endpoint of an agent of several
//! attachments too ([`crate::agent::control_router`]).

use std::{future::Future, time::Duration};

use std::os::unix::fs::PermissionsExt as _;

use anyhow::{Context as _, Result, anyhow};
use serde::de::DeserializeOwned;
use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader},
    net::{UnixListener, UnixStream},
    sync::{OwnedSemaphorePermit, mpsc, oneshot},
};

use crate::{
    agent::limits::{ACCEPT_BACKOFF, ConnectionLimit, WRITE_WAIT},
    agent::reload::Reloader,
    api::{
        MAX_REQUEST_BYTES, Reply, Request, Routed, Status,
        socket::{Endpoint, RunningLock},
    },
    config::tunables::TunablesPatch,
    datapath::Selector,
    telemetry::{self, TailHistory},
};

/// How long a client has to send its request.
const REQUEST_WAIT: Duration = Duration::from_secs(1);

/// A control socket bound under its endpoint's lock, admitting at most
/// [`ConnectionLimit`]'s connections at once.
pub struct ControlListener {
    listener: UnixListener,
    /// Held while the agent runs; removes the socket file when dropped.
    _running: RunningLock,
    limit: ConnectionLimit,
}

impl ControlListener {
    /// Takes the endpoint's lock (refused while another agent holds it) and
    /// binds its socket, for root and the agent's user only.
    pub fn bind(endpoint: &Endpoint) -> Result<Self> {
        let running = RunningLock::take(endpoint)?;
        let listener = std::os::unix::net::UnixListener::bind(running.socket())
            .with_context(|| format!("binding {}", running.socket().display()))?;
        std::fs::set_permissions(running.socket(), std::fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener: UnixListener::from_std(listener)?,
            _running: running,
            limit: ConnectionLimit::default(),
        })
    }

    /// The next connection there is room for, with its place (cancel-safe:
    /// use it in `select!`). One beyond the limit is closed at once.
    pub async fn accept(&self) -> (UnixStream, OwnedSemaphorePermit) {
        loop {
            match self.listener.accept().await {
                Ok((stream, _)) => {
                    if let Some(permit) = self.limit.admit() {
                        return (stream, permit);
                    }
                }
                // Out of descriptors, say: wait instead of spinning.
                Err(e) => {
                    log::warn!("control socket: accept failed: {e}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    }
}

/// A request on its way to the main loop, with where to send the reply.
pub struct ControlCall {
    request: Request,
    reply: oneshot::Sender<Reply>,
}

/// The listening control socket. Connections are read in tasks of their
/// own, so a slow or idle client never holds up the sweep; their requests
/// come back to the main loop, the only owner of the selector.
pub struct ControlServer {
    listener: ControlListener,
    calls_tx: mpsc::Sender<ControlCall>,
    calls_rx: mpsc::Receiver<ControlCall>,
}

impl ControlServer {
    /// Takes the interface's lock and binds its socket. Done before
    /// attaching, this is also what refuses a second agent on the same
    /// interface.
    pub fn bind(iface: &str) -> Result<Self> {
        let listener = ControlListener::bind(&Endpoint::Interface(iface.into()))?;
        let (calls_tx, calls_rx) = mpsc::channel(8);
        Ok(Self {
            listener,
            calls_tx,
            calls_rx,
        })
    }

    /// The next request for the main loop (cancel-safe: use it in `select!`).
    pub async fn next_call(&mut self) -> ControlCall {
        loop {
            tokio::select! {
                (stream, permit) = self.listener.accept() => {
                    let caller = self.local_caller();
                    tokio::spawn(async move {
                        answer_connection(stream, |routed: Routed| async move {
                            // Meant for the agent's endpoint of several:
                            // not applied to whichever attachment this is.
                            match routed.attachment {
                                Some(label) => error(&format!(
                                    "this is the control socket of one attachment: it takes no --attachment ({label})"
                                )),
                                None => caller.call(routed.request).await,
                            }
                        })
                        .await;
                        drop(permit);
                    });
                },
                Some(call) = self.calls_rx.recv() => return call,
            }
        }
    }

    /// A way for the agent's own tasks (the metrics endpoint) to make
    /// requests; they are answered in turn with the socket's.
    pub fn local_caller(&self) -> LocalCaller {
        LocalCaller(self.calls_tx.clone())
    }
}

/// Makes control requests from inside the agent.
#[derive(Clone, Debug)]
pub struct LocalCaller(mpsc::Sender<ControlCall>);

impl LocalCaller {
    /// The status, as `selector status --json` shows it.
    pub async fn status(&self) -> Result<Status> {
        match self.call(Request::Status).await {
            Reply::Status(status) => Ok(*status),
            Reply::Error { message } => Err(anyhow!(message)),
            other => Err(anyhow!("unexpected reply to status: {other:?}")),
        }
    }

    /// Passes `request` to the owner loop and waits for its reply.
    pub async fn call(&self, request: Request) -> Reply {
        let (reply, answered) = oneshot::channel();
        match self.0.send(ControlCall { request, reply }).await {
            Ok(()) => answered
                .await
                .unwrap_or_else(|_| error("the agent is stopping")),
            Err(_) => error("the agent is stopping"),
        }
    }
}

impl ControlCall {
    /// Whether this call asks for a reload.
    pub fn is_reload(&self) -> bool {
        self.request == Request::Reload
    }

    /// Applies the request and sends the reply; true if it was a reload
    /// that applied. While the agent is stopping, only `status` is served:
    /// a change could start steering again.
    pub fn answer(
        self,
        selector: &mut Selector,
        reloader: &mut Reloader,
        tails: &TailHistory,
        stopping: bool,
    ) -> bool {
        let result = match &self.request {
            Request::Status => {
                status(selector, reloader, tails).map(|s| Reply::Status(Box::new(s)))
            }
            _ if stopping => Err(anyhow!("the agent is stopping; it takes no changes")),
            Request::Set(change) => set(selector, change),
            Request::Drain { backend, drained } => drain(selector, reloader, *backend, *drained),
            Request::Reload => reloader
                .reload(selector)
                .map(|message| Reply::Done { message })
                .map_err(|e| anyhow!("reload refused, running configuration kept: {e:#}")),
        };
        let reloaded = matches!((&self.request, &result), (Request::Reload, Ok(_)));
        let reply = result.unwrap_or_else(|e| Reply::Error {
            message: format!("{e:#}"),
        });
        if let Reply::Done { message } = &reply {
            log::info!("control: {message}");
        }
        let _ = self.reply.send(reply);
        reloaded
    }
}

fn status(selector: &Selector, reloader: &Reloader, tails: &TailHistory) -> Result<Status> {
    let now = selector.snapshot()?;
    Ok(Status {
        iface: selector.settings.iface.clone(),
        settings: selector.settings_in_force(),
        in_flight: now.inflight,
        last_interval: tails.last_interval(),
        drained: selector.drained()?,
        groups_over_cap: selector.groups_over_cap(),
        passed: telemetry::passed_counts(&now.passed),
        headers_pulled: now.headers_pulled,
        backends: telemetry::totals(&selector.backends, &now, tails),
        hedges: crate::telemetry::hedges::total(&now.hedges),
        tc_attach: selector.tc_attach.map_or("", |t| t.name()).into(),
        config_reload_success: Some(reloader.record.success()),
        config_reload_timestamp_seconds: Some(reloader.record.timestamp_seconds()),
        build: crate::api::build_info::BuildInfo::current(),
        heartbeat: selector.heartbeat_state(),
        netns: selector.netns.clone(),
        routed_elsewhere: selector.routed_elsewhere.clone(),
    })
}

fn set(selector: &mut Selector, change: &TunablesPatch) -> Result<Reply> {
    let wanted = change.applied_to(&selector.settings)?;
    let previous = std::mem::replace(&mut selector.settings, wanted);
    if let Err(e) = selector.write_config() {
        // Nothing changed in the kernel: keep what is in force.
        selector.settings = previous;
        return Err(e);
    }
    Ok(Reply::Done {
        message: selector.settings_in_force().tunables.describe(),
    })
}

fn drain(
    selector: &mut Selector,
    reloader: &Reloader,
    backend: std::net::SocketAddr,
    drained: bool,
) -> Result<Reply> {
    let id = selector
        .backend_index(backend)
        .filter(|_| !reloader.table.is_retiring(backend))
        .ok_or_else(|| anyhow!("{backend} is not a configured backend"))?;
    selector.set_drained(id, drained)?;
    Ok(Reply::Done {
        message: format!("{backend} {}", if drained { "drained" } else { "active" }),
    })
}

/// Reads one request line (a `R`) from a connection, has `answer` reply
/// to it and writes the reply line. Only root or the agent's own user may
/// control it.
pub async fn answer_connection<R, F, Fut>(stream: UnixStream, answer: F)
where
    R: DeserializeOwned,
    F: FnOnce(R) -> Fut,
    Fut: Future<Output = Reply>,
{
    // SAFETY: geteuid has no preconditions.
    let own_uid = unsafe { libc::geteuid() };
    let allowed = stream
        .peer_cred()
        .is_ok_and(|c| c.uid() == 0 || c.uid() == own_uid);
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read.take(MAX_REQUEST_BYTES));
    let received = tokio::time::timeout(REQUEST_WAIT, reader.read_line(&mut line)).await;
    let reply = if !allowed {
        error("permission denied: only root or the agent's user may control it")
    } else if !matches!(received, Ok(Ok(n)) if n > 0) {
        error("no request received")
    } else {
        match serde_json::from_str(line.trim_end()) {
            Ok(request) => answer(request).await,
            Err(e) => error(&format!("bad request: {e}")),
        }
    };
    if let Ok(mut text) = serde_json::to_string(&reply) {
        text.push('\n');
        let _ = tokio::time::timeout(WRITE_WAIT, async {
            write.write_all(text.as_bytes()).await?;
            write.shutdown().await
        })
        .await;
    }
}

/// An error reply.
pub fn error(message: &str) -> Reply {
    Reply::Error {
        message: message.into(),
    }
}
