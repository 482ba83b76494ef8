//! Tests only: a loaded selector made as fresh as a new load, without
//! loading its programs again. A load runs the verifier over some 400,000
//! instructions: a fraction of a second here, 10 to 30 s in the kernel
//! matrix's emulated guests, where the packet-fixture suites, one load per
//! test, spent most of their time in it.

use anyhow::{Result, bail};
use aya::maps::Map;
use selector_common::{hedge, inflight::slots_for, names};

use crate::{
    config::settings::Settings,
    datapath::{Selector, batch, loader::unattached_reply_path},
    host::sys,
};

impl Selector {
    /// Whether [`Self::recycle`] can make it fresh: loaded, never attached
    /// nor pinned, every map of the object still in it (a hedge thread
    /// takes the event ring).
    pub fn recyclable(&self) -> bool {
        self.pins.is_none()
            && self.tc_attach.is_none()
            && self.netns.is_none()
            && names::ALL
                .iter()
                .chain(hedge::names::ALL.iter())
                .all(|name| self.ebpf.map(name).is_some())
    }

    /// This selector's programs, every map emptied (arrays zeroed, hash
    /// maps and the event ring emptied) and filled for `settings` as
    /// [`Self::load`] fills them, the agent's own state new. `settings`
    /// must size the in-flight table as this selector's were.
    pub fn recycle(self, settings: &Settings) -> Result<Self> {
        if !self.recyclable() {
            bail!("only a loaded, unattached selector with all its maps can be recycled");
        }
        if slots_for(settings.inflight_max) != slots_for(self.settings.inflight_max) {
            bail!("the in-flight table's size is fixed at load");
        }
        let backends = settings.plan()?;
        let reply_path = unattached_reply_path(settings);
        let Self {
            mut ebpf,
            mut logger,
            ..
        } = self;
        // The kernel's log ring is the logger's, not the object's: its
        // records go out under the test that made them.
        if let Some(l) = logger.as_mut() {
            l.flush();
        }
        for (name, map) in ebpf.maps_mut() {
            clear(name, map)?;
        }
        let mut fresh = Self::assemble(ebpf, logger, settings, backends, reply_path, None, false)?;
        fresh.fill()?;
        Ok(fresh)
    }
}

/// Empties one map of the object, or refuses a kind it cannot restore.
fn clear(name: &str, map: &mut Map) -> Result<()> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    match map {
        // The compiler's read-only data is frozen and never written.
        Map::Array(_) if name.starts_with(".rodata") => {}
        // Initialised data would need its initial bytes back.
        Map::Array(_) if name.starts_with(".data") => {
            bail!("{name}: initialised data cannot be restored")
        }
        Map::Array(_) | Map::PerCpuArray(_) => batch::zero(map)?,
        Map::HashMap(data) | Map::LruHashMap(data) => {
            let key_size = data.info()?.key_size() as usize;
            sys::delete_all(data.fd().as_fd().as_raw_fd(), key_size)?;
        }
        Map::RingBuf(_) => {
            let mut ring = aya::maps::RingBuf::try_from(map)?;
            while ring.next().is_some() {}
        }
        _ => bail!("{name}: a kind of map recycling does not know"),
    }
    Ok(())
}

/// Every array and hash map of `selector`'s object, by name: an array's
/// values in order, a hash map's entries sorted, as raw bytes (the config's
/// heartbeat, a clock reading, zeroed). Two selectors loaded and filled
/// alike dump alike.
pub fn dump_maps(selector: &Selector) -> Result<Vec<(String, Vec<u8>)>> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let mut out = Vec::new();
    for (name, map) in selector.ebpf.maps() {
        let (data, per_cpu) = match map {
            Map::Array(d) | Map::HashMap(d) | Map::LruHashMap(d) => (d, false),
            Map::PerCpuArray(d) => (d, true),
            _ => continue,
        };
        let info = data.info()?;
        let key = info.key_size() as usize;
        let value = batch::element_bytes(info.value_size(), per_cpu)?;
        let fd = data.fd().as_fd().as_raw_fd();
        let mut entries = Vec::new();
        let mut cursor = None;
        loop {
            let want = 256u32;
            let mut keys = vec![0u8; key * want as usize];
            let mut values = vec![0u8; value * want as usize];
            // SAFETY: room for `want` keys and values of the map's sizes.
            let (filled, next, done) = unsafe {
                sys::lookup_batch(fd, cursor, keys.as_mut_ptr(), values.as_mut_ptr(), want)
            }?;
            for i in 0..filled {
                entries.push([&keys[i * key..][..key], &values[i * value..][..value]].concat());
            }
            if done || filled == 0 {
                break;
            }
            cursor = Some(next);
        }
        if !matches!(map, Map::Array(_) | Map::PerCpuArray(_)) {
            entries.sort();
        }
        let mut bytes = entries.concat();
        if name == names::CONFIG {
            let at = 4 + std::mem::offset_of!(selector_common::Config, heartbeat_ns);
            bytes[at..at + 8].fill(0);
        }
        out.push((name.to_string(), bytes));
    }
    out.sort();
    Ok(out)
}
