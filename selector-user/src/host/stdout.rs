//! Standard output when its reader may have gone (`selector run | head`,
//! `selector man | head`): a write that fails is an error to handle, not
//! the panic of `print!`.

use std::{
    io::{self, Write as _},
    sync::atomic::{AtomicBool, Ordering},
};

/// A write to stdout failed: its error, told apart from any other I/O
/// error (a control socket's broken pipe is not the reader of stdout gone).
#[derive(Debug)]
pub struct StdoutFailed(pub io::Error);

impl std::fmt::Display for StdoutFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "writing to stdout: {}", self.0)
    }
}

impl std::error::Error for StdoutFailed {}

/// Writes `text` to stdout and flushes it.
pub fn write(text: impl AsRef<[u8]>) -> Result<(), StdoutFailed> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_ref())
        .and_then(|()| out.flush())
        .map_err(StdoutFailed)
}

/// Set once a table could not be written: none is tried again.
static TABLES_STOPPED: AtomicBool = AtomicBool::new(false);

/// Prints the running agent's table or summary. When stdout cannot take
/// it (its reader gone), the printing ends, said once on stderr; the agent
/// goes on steering.
pub fn print_table(text: &str) {
    if TABLES_STOPPED.load(Ordering::Relaxed) {
        return;
    }
    if let Err(e) = write(text) {
        TABLES_STOPPED.store(true, Ordering::Relaxed);
        // Not through the log, which a running agent writes to stdout.
        let _ = writeln!(
            io::stderr(),
            "selector: stdout: {e}: no more tables are printed; the agent goes on"
        );
    }
}

/// Whether `e` is, or was caused by, a write to stdout when nobody reads
/// it any more.
pub fn is_stdout_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<StdoutFailed>()
            .is_some_and(|f| f.0.kind() == io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_stdouts_broken_pipe_counts_as_its_reader_gone() {
        let closed = |kind| anyhow::Error::new(StdoutFailed(io::Error::from(kind)));
        assert!(is_stdout_closed(
            &closed(io::ErrorKind::BrokenPipe).context("writing the man page")
        ));
        assert!(!is_stdout_closed(&closed(io::ErrorKind::PermissionDenied)));
        // The agent's socket closed under a request: an error to report.
        let socket = anyhow::Error::new(io::Error::from(io::ErrorKind::BrokenPipe));
        assert!(!is_stdout_closed(&socket.context("sending the request")));
    }
}
