//! systemd's notification protocol (sd_notify(3)), for `Type=notify`
//! units: each notification is one datagram of `KEY=VALUE` lines sent to
//! the Unix socket named by `$NOTIFY_SOCKET` (an abstract name when it
//! starts with `@`, else a path). Without `$NOTIFY_SOCKET` (not started by
//! systemd) nothing is sent.
//!
//! The agent sends `READY=1` once attached, `STATUS=` with a one-line
//! summary, `RELOADING=1` and then `READY=1` around a reload,
//! `STOPPING=1` when it stops steering, and `WATCHDOG=1` from its loop
//! every half `$WATCHDOG_USEC` when systemd asks for it (`WatchdogSec=`,
//! for this process: `$WATCHDOG_PID` unset or ours).

use std::{
    io,
    os::{
        linux::net::SocketAddrExt as _,
        unix::net::{SocketAddr, UnixDatagram},
    },
    time::Duration,
};

/// Where notifications go, if anywhere.
#[derive(Debug, Default)]
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// The notifier systemd's environment describes (`NOTIFY_SOCKET`,
    /// `WATCHDOG_USEC`, `WATCHDOG_PID`). A socket that cannot be named or
    /// made is logged and ignored: the agent runs the same without it.
    pub fn from_env() -> Self {
        let var = |name| std::env::var(name).ok();
        let Some(socket) = var("NOTIFY_SOCKET") else {
            return Self::default();
        };
        let watchdog = watchdog_interval(
            var("WATCHDOG_USEC").as_deref(),
            var("WATCHDOG_PID").as_deref(),
            std::process::id(),
        );
        match Self::to(&socket, watchdog) {
            Ok(notifier) => notifier,
            Err(e) => {
                log::warn!("NOTIFY_SOCKET={socket}: cannot notify systemd: {e}");
                Self::default()
            }
        }
    }

    /// A notifier sending to `socket` (`@name` or a path), with systemd's
    /// watchdog interval if it asked for one.
    pub fn to(socket: &str, watchdog: Option<Duration>) -> io::Result<Self> {
        let address = match socket.strip_prefix('@') {
            Some(name) => SocketAddr::from_abstract_name(name)?,
            None if socket.starts_with('/') => SocketAddr::from_pathname(socket)?,
            None => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "neither an absolute path nor an @abstract name",
                ));
            }
        };
        // Never blocks the loop that notifies: a receiver that does not
        // read (its queue holds a few datagrams) loses a notification
        // instead of stopping the agent.
        let socket = UnixDatagram::unbound()?;
        socket.set_nonblocking(true)?;
        Ok(Self {
            target: Some((socket, address)),
            watchdog,
        })
    }

    /// Whether systemd listens (a `Type=notify` unit).
    pub fn enabled(&self) -> bool {
        self.target.is_some()
    }

    /// How often to send `WATCHDOG=1`: half systemd's interval, as
    /// sd_watchdog_enabled(3) advises; `None` without a watchdog.
    pub fn watchdog_period(&self) -> Option<Duration> {
        self.watchdog.filter(|_| self.enabled()).map(|w| w / 2)
    }

    /// Sends one notification (`KEY=VALUE` lines). A failure is logged:
    /// systemd then acts on its own timeouts.
    pub fn notify(&self, state: &str) {
        let Some((socket, address)) = &self.target else {
            return;
        };
        match socket.send_to_addr(state.as_bytes(), address) {
            Ok(_) => {}
            // Its queue is full: a ping is lost (the next may pass), any
            // other notification is said lost.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && state == "WATCHDOG=1" => {
                log::debug!("notifying systemd: its queue is full, one watchdog ping lost");
            }
            Err(e) => {
                let first = state.lines().next().unwrap_or("");
                log::warn!("notifying systemd ({first}): {e}");
            }
        }
    }

    /// `READY=1` with a status line.
    pub fn ready(&self, status: &str) {
        self.notify(&format!("READY=1\nSTATUS={}", one_line(status)));
    }

    /// `STATUS=` alone: what `systemctl status` shows.
    pub fn status(&self, status: &str) {
        self.notify(&format!("STATUS={}", one_line(status)));
    }

    /// `RELOADING=1`, with the monotonic time systemd wants beside it.
    pub fn reloading(&self) {
        self.notify(&format!(
            "RELOADING=1\nMONOTONIC_USEC={}\nSTATUS=reloading the configuration",
            crate::host::sys::monotonic_ns() / 1000
        ));
    }

    /// `STOPPING=1` with a status line.
    pub fn stopping(&self, status: &str) {
        self.notify(&format!("STOPPING=1\nSTATUS={}", one_line(status)));
    }

    pub fn watchdog(&self) {
        self.notify("WATCHDOG=1");
    }
}

/// A `STATUS=` value is one line.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// systemd's watchdog interval from `WATCHDOG_USEC` and `WATCHDOG_PID`
/// (sd_watchdog_enabled(3)): set, positive, and for this process (no
/// `WATCHDOG_PID`, or ours).
pub fn watchdog_interval(usec: Option<&str>, pid: Option<&str>, own_pid: u32) -> Option<Duration> {
    let usec: u64 = usec?.trim().parse().ok().filter(|u| *u > 0)?;
    match pid.map(|p| p.trim().parse::<u32>()) {
        None => {}
        Some(Ok(pid)) if pid == own_pid => {}
        Some(_) => return None,
    }
    Some(Duration::from_micros(usec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_is_ours_only_when_its_pid_is() {
        let ten_s = Some(Duration::from_secs(10));
        assert_eq!(watchdog_interval(Some("10000000"), None, 42), ten_s);
        assert_eq!(watchdog_interval(Some("10000000"), Some("42"), 42), ten_s);
        assert_eq!(watchdog_interval(Some("10000000"), Some("43"), 42), None);
        assert_eq!(watchdog_interval(Some("10000000"), Some("x"), 42), None);
        assert_eq!(watchdog_interval(Some("0"), None, 42), None);
        assert_eq!(watchdog_interval(Some("soon"), None, 42), None);
        assert_eq!(watchdog_interval(None, Some("42"), 42), None);
    }

    #[test]
    fn a_receiver_that_does_not_read_never_blocks_the_notifier() {
        let name = format!("selector-notify-full-{}", std::process::id());
        let listener =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let notifier = Notifier::to(&format!("@{name}"), None).unwrap();
        // Far more than the receiver's queue holds, none read.
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for _ in 0..1000 {
                notifier.watchdog();
            }
            done.send(()).unwrap();
        });
        finished
            .recv_timeout(Duration::from_secs(5))
            .expect("the notifier blocked on a full queue");
        assert_eq!(received(&listener), "WATCHDOG=1");
    }

    fn received(socket: &UnixDatagram) -> String {
        let mut buf = [0u8; 512];
        let n = socket.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn notifications_reach_a_path_socket_and_an_abstract_one() {
        let dir = std::env::temp_dir().join(format!("selector-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify");
        let _ = std::fs::remove_file(&path);
        let listener = UnixDatagram::bind(&path).unwrap();
        let notifier = Notifier::to(path.to_str().unwrap(), Some(Duration::from_secs(4))).unwrap();
        assert_eq!(notifier.watchdog_period(), Some(Duration::from_secs(2)));
        notifier.ready("attached to eth0,\n3 backends");
        assert_eq!(
            received(&listener),
            "READY=1\nSTATUS=attached to eth0, 3 backends"
        );
        notifier.watchdog();
        assert_eq!(received(&listener), "WATCHDOG=1");
        notifier.status("not steering:\tgone");
        assert_eq!(received(&listener), "STATUS=not steering: gone");
        notifier.stopping("stopping");
        assert_eq!(received(&listener), "STOPPING=1\nSTATUS=stopping");
        notifier.reloading();
        let reloading = received(&listener);
        assert!(
            reloading.starts_with("RELOADING=1\nMONOTONIC_USEC="),
            "{reloading}"
        );
        std::fs::remove_dir_all(&dir).unwrap();

        let name = format!("selector-notify-test-{}", std::process::id());
        let listener =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let notifier = Notifier::to(&format!("@{name}"), None).unwrap();
        assert_eq!(notifier.watchdog_period(), None);
        notifier.ready("ok");
        assert_eq!(received(&listener), "READY=1\nSTATUS=ok");
    }

    #[test]
    fn without_a_socket_nothing_is_sent_and_a_bad_one_is_refused() {
        let silent = Notifier::default();
        assert!(!silent.enabled());
        silent.ready("nobody listens");
        assert!(Notifier::to("relative/path", None).is_err());
    }
}
