//! A testbed of network namespaces with real servers, shared by the
//! integration tests, the demo (`cargo xtask run`) and the benchmark.
//!
//! Every namespace gets a name unique to the process and the testbed, and
//! is removed when its owner is dropped, also when a test fails.

pub mod agent;
pub mod bench;
pub mod bpffs;
pub mod dns;
pub mod faults;
pub mod foreign;
pub mod frames;
pub mod loaded;
pub mod memcached;
pub mod netns;
pub mod paged;
pub mod pods;
pub mod prometheus;
pub mod receive;
pub mod slowdowns;
pub mod topology;

pub use memcached::{
    ClientSocket, LoadReport, LoadSpec, MemcachedClient, Replica, preload, run_load, run_load_on,
};
pub use netns::{Namespace, sh};
pub use topology::Testbed;

/// Polls `condition` every 10 ms until it holds (true) or `within` has
/// passed (false): a test waits for what it needs, not for a guessed time.
pub fn wait_for(within: std::time::Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + within;
    loop {
        if condition() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
