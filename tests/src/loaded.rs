//! Loaded selectors for the packet-fixture tests, reused: a test's selector
//! goes back to a pool when the test ends, and the next test with the same
//! in-flight table size gets it recycled (every map emptied and filled
//! afresh, `Selector::recycle`) instead of loading the programs again. In
//! the kernel matrix's emulated guests a load (the verifier) took 10 to
//! 30 s, most of a fixture suite's time.
//!
//! `SELECTOR_FRESH_LOADS=1` loads anew for every test, to check that no
//! outcome depends on reuse.

use std::{
    ops::{Deref, DerefMut},
    sync::Mutex,
};

use selector_common::inflight::slots_for;
use selector_user::{Selector, Settings};

static POOL: Mutex<Vec<Selector>> = Mutex::new(Vec::new());

/// A selector loaded for one test; given back to the pool when dropped,
/// unless the test failed or the selector cannot be recycled (attached,
/// pinned, a map taken out).
pub struct Loaded(Option<Selector>);

/// A selector for `settings`, loaded (not attached) as `Selector::load`
/// would, its programs reused from an earlier test's when one is pooled.
fn fresh_loads() -> bool {
    std::env::var_os("SELECTOR_FRESH_LOADS").is_some_and(|v| v == "1")
}

pub fn load(settings: &Settings) -> anyhow::Result<Loaded> {
    let pooled = if fresh_loads() {
        None
    } else {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let slots = slots_for(settings.inflight_max);
        pool.iter()
            .position(|s| slots_for(s.settings.inflight_max) == slots)
            .map(|i| pool.swap_remove(i))
    };
    let selector = match pooled {
        Some(s) => s.recycle(settings)?,
        None => Selector::load(settings)?,
    };
    Ok(Loaded(Some(selector)))
}

impl Loaded {
    /// The selector itself, never pooled again.
    pub fn into_inner(mut self) -> Selector {
        self.0.take().expect("present until dropped")
    }
}

impl Deref for Loaded {
    type Target = Selector;
    fn deref(&self) -> &Selector {
        self.0.as_ref().expect("present until dropped")
    }
}

impl DerefMut for Loaded {
    fn deref_mut(&mut self) -> &mut Selector {
        self.0.as_mut().expect("present until dropped")
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let Some(selector) = self.0.take() else {
            return;
        };
        if !std::thread::panicking() && !fresh_loads() && selector.recyclable() {
            POOL.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(selector);
        }
    }
}
