//! What the open-loop loads' receivers share (memcached's in
//! [`crate::memcached`], the benchmarks' in `bench::open_loop`): which
//! receive errors only mean "nothing yet", and when to stop waiting.

use std::{
    io::{Error, ErrorKind},
    sync::Mutex,
    time::{Duration, Instant},
};

/// A read timeout, or an ICMP error an earlier datagram drew (a replica
/// down): the receiver goes on.
pub fn nothing_yet(e: &Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::ConnectionRefused
    )
}

/// Whether a receiver is done: the sender finished (`send_end`) and every
/// read in `table` was answered, or `drain` has passed since.
pub fn done<T>(
    send_end: &Mutex<Option<Instant>>,
    table: &Mutex<Vec<Option<T>>>,
    drain: Duration,
) -> bool {
    let Some(end) = *send_end.lock().unwrap() else {
        return false;
    };
    end.elapsed() >= drain || table.lock().unwrap().iter().all(Option::is_none)
}
