//! Standard output when its reader may have gone (`selector run | head`,
//! `selector man | head`): a write that fails is an error to handle, not
//! the panic of `print!`.

use std::{
    io::{self, Write as _},
    sync::atomic::{AtomicBool, Ordering},
};

/// Writes `text` to stdout and flushes it.
pub fn write(text: &str) -> io::Result<()> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
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

/// Whether `e` is, or was caused by, a write to a pipe nobody reads.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_pipe_is_known_through_its_context() {
        let e = anyhow::Error::new(io::Error::from(io::ErrorKind::BrokenPipe))
            .context("writing the man page");
        assert!(is_broken_pipe(&e));
        let other = anyhow::Error::new(io::Error::from(io::ErrorKind::PermissionDenied));
        assert!(!is_broken_pipe(&other.context("x")));
    }
}
