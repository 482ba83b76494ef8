//! The `NEXT_HOPS` map: for each backend whose next hop is on the
//! selector's interface and resolved, the Ethernet addresses to write into
//! a redirected request so that it continues without a second pass through
//! egress. Refreshed from the kernel's neighbour table (one netlink dump per
//! call; routes when they changed, or once a second), which the agent does
//! when the kernel announces a change (`crate::host::route_events`), so a
//! neighbour that changes its address, or stops being resolved, is
//! followed at once; an unknown next hop is written as zero and its
//! requests take `bpf_redirect_neigh`.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow};
use aya::maps::Array;
use selector_common::{NextHopMac, names};

use crate::{
    api::RoutedElsewhere,
    datapath::Selector,
    host::neighbours::{Netlink, NextHop},
};

/// How often routes are looked up again (neighbours: every refresh).
const ROUTE_REFRESH: Duration = Duration::from_secs(1);

/// What the agent last wrote to `NEXT_HOPS`, and the routes it came from.
pub struct NextHops {
    netlink: Netlink,
    ifindex: u32,
    iface_mac: [u8; 6],
    /// Backend id -> its next hop (None: no route on this interface).
    routes: Vec<(u32, Option<NextHop>)>,
    routes_at: Option<Instant>,
    published: HashMap<u32, NextHopMac>,
}

impl NextHops {
    /// For the selector's interface (in the calling thread's namespace).
    pub fn new(iface: &str) -> Result<Self> {
        let ifindex = crate::host::interface::index(iface)?;
        let mut netlink = Netlink::open()?;
        let iface_mac = netlink
            .link_address(ifindex)?
            .ok_or_else(|| anyhow!("{iface} has no Ethernet address"))?;
        Ok(Self {
            netlink,
            ifindex,
            iface_mac,
            routes: Vec::new(),
            routes_at: None,
            published: HashMap::new(),
        })
    }

    /// Re-reads the neighbour table (and the routes, once a second or when
    /// the backends changed) and writes the entries that changed. Returns
    /// how many backends have a known next hop.
    pub fn refresh(&mut self, selector: &mut Selector) -> Result<usize> {
        let ids: Vec<u32> = selector.backends.iter().map(|b| b.index).collect();
        let stale = self
            .routes_at
            .is_none_or(|at| at.elapsed() >= ROUTE_REFRESH)
            || self
                .routes
                .iter()
                .map(|(id, _)| *id)
                .ne(ids.iter().copied());
        if stale {
            // One lookup per address: members of many groups often share
            // a host (512 backends on one address in the scale benchmark).
            let mut by_addr = HashMap::new();
            let mut elsewhere = Vec::new();
            self.routes = selector
                .backends
                .iter()
                .map(|b| {
                    let hop = *by_addr
                        .entry(b.addr.ip())
                        .or_insert_with(|| self.netlink.next_hop(b.addr.ip()).ok());
                    // A member routed by another interface: the programs
                    // never see requests to it (nor its replies).
                    if let Some(h) = hop.filter(|h| h.ifindex != self.ifindex) {
                        elsewhere.push(RoutedElsewhere {
                            backend: b.addr,
                            iface: crate::host::interface::name(h.ifindex)
                                .unwrap_or_else(|| format!("ifindex {}", h.ifindex)),
                        });
                    }
                    (b.index, hop.filter(|h| h.ifindex == self.ifindex))
                })
                .collect();
            self.routes_at = Some(Instant::now());
            selector.routed_elsewhere = elsewhere;
        }
        let neighbours: HashMap<_, _> = self
            .netlink
            .neighbours_on(self.ifindex)?
            .into_iter()
            .collect();
        let mut wanted: HashMap<u32, NextHopMac> = HashMap::new();
        for (id, hop) in &self.routes {
            let known = hop.and_then(|h| {
                let n = neighbours.get(&h.via).filter(|n| n.is_resolved())?;
                let dst: [u8; 6] = n.lladdr.as_deref()?.try_into().ok()?;
                Some(NextHopMac {
                    dst,
                    src: self.iface_mac,
                    ifindex: self.ifindex,
                })
            });
            wanted.insert(*id, known.unwrap_or_default());
        }
        let mut map: Array<_, NextHopMac> = Array::try_from(selector.map_mut(names::NEXT_HOPS)?)?;
        for (id, entry) in writes(&self.published, &wanted) {
            map.set(id, entry, 0)
                .with_context(|| format!("writing the next hop of backend {id}"))?;
        }
        self.published = wanted;
        Ok(self.published.values().filter(|e| e.ifindex != 0).count())
    }

    /// The routes changed (the kernel said so): the next refresh looks
    /// them up again.
    pub fn routes_changed(&mut self) {
        self.routes_at = None;
    }

    /// Forgets every next hop, so that redirects take `bpf_redirect_neigh`
    /// (for pinned programs left running without an agent to follow
    /// neighbour changes).
    pub fn forget_all(&mut self, selector: &mut Selector) -> Result<()> {
        // Every backend's too, not only what this agent wrote: adopted
        // pins hold the previous agent's entries until a refresh succeeds.
        let mut ids: Vec<u32> = selector.backends.iter().map(|b| b.index).collect();
        ids.extend(self.published.keys());
        ids.sort_unstable();
        ids.dedup();
        let mut map: Array<_, NextHopMac> = Array::try_from(selector.map_mut(names::NEXT_HOPS)?)?;
        for id in ids {
            map.set(id, NextHopMac::default(), 0)?;
        }
        self.published.clear();
        Ok(())
    }
}

/// The entries to write to go from `published` (what the map holds, as
/// far as this agent wrote it) to `wanted` (every backend's, unknown ones
/// zero): those that changed or were never written, and zero for a
/// backend gone since (a reload removed it) that had one. An entry that
/// stays unknown is not written again (it was, on every refresh, for every
/// member whose neighbour is unresolved).
fn writes(
    published: &HashMap<u32, NextHopMac>,
    wanted: &HashMap<u32, NextHopMac>,
) -> Vec<(u32, NextHopMac)> {
    let changed = wanted
        .iter()
        .filter(|(id, entry)| published.get(id) != Some(entry))
        .map(|(id, entry)| (*id, *entry));
    let gone = published
        .iter()
        .filter(|(id, entry)| !wanted.contains_key(id) && entry.ifindex != 0)
        .map(|(id, _)| (*id, NextHopMac::default()));
    let mut all: Vec<_> = changed.chain(gone).collect();
    all.sort_by_key(|(id, _)| *id);
    all
}

#[cfg(feature = "testing")]
/// For callers without an agent loop (tests, benchmarks): marks the
/// backends' next hops managed, waits up to `wait` for them to resolve, and
/// publishes their addresses once. Returns the backends still unresolved.
pub fn publish_once(selector: &mut Selector, wait: Duration) -> Vec<std::net::SocketAddr> {
    let addrs: Vec<_> = selector.backends.iter().map(|b| b.addr).collect();
    let unresolved = crate::host::neighbours::warm_up(&addrs, wait);
    if let Err(e) = NextHops::new(&selector.settings.iface).and_then(|mut n| n.refresh(selector)) {
        log::warn!("publishing the next hops: {e:#}");
    }
    unresolved
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hop(last: u8) -> NextHopMac {
        NextHopMac {
            dst: [2, 0, 0, 0, 0, last],
            src: [2, 0, 0, 0, 0, 1],
            ifindex: 7,
        }
    }

    #[test]
    fn only_changed_entries_are_written_and_unknown_ones_once() {
        let unknown = NextHopMac::default();
        let first: HashMap<u32, NextHopMac> = [(0, hop(10)), (1, unknown)].into();
        // Nothing written yet: both, the unknown one as zero.
        assert_eq!(
            writes(&HashMap::new(), &first),
            [(0, hop(10)), (1, unknown)]
        );
        // The same again: nothing (an unresolved member is not rewritten).
        assert_eq!(writes(&first, &first), []);
        // Resolved now, and the other's address changed.
        let second: HashMap<u32, NextHopMac> = [(0, hop(11)), (1, hop(12))].into();
        assert_eq!(writes(&first, &second), [(0, hop(11)), (1, hop(12))]);
        // Backend 1 removed by a reload: its entry goes back to zero, once.
        let third: HashMap<u32, NextHopMac> = [(0, hop(11))].into();
        assert_eq!(writes(&second, &third), [(1, unknown)]);
        assert_eq!(writes(&third, &third), []);
    }
}
