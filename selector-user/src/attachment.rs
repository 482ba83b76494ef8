//! Whether the agent's programs are still attached to its interface, for
//! `/readyz`: the egress program in the interface's TCX egress chain, and
//! the reply path's program in its TCX ingress chain or as its XDP
//! program. Links of a deleted (or deleted and re-created) interface are
//! gone with it, and then nothing steers, though the agent runs on.

use anyhow::{Context as _, Result};
use aya::programs::{SchedClassifier, TcAttachType};
use selector_common::programs;

use crate::{IngressMode, Selector, interface, neighbours::Netlink};

/// What of the selector is not attached to its interface (empty: all is).
pub fn missing(selector: &Selector) -> Result<Vec<String>> {
    let iface = &selector.settings.iface;
    let Ok(ifindex) = interface::index(iface) else {
        return Ok(vec![format!("interface {iface} is gone")]);
    };
    let id = |name: &str| -> Result<u32> {
        let program = selector
            .ebpf()
            .program(name)
            .with_context(|| format!("program {name} missing from the object"))?;
        Ok(program.info()?.id())
    };
    let in_tcx = |attach: TcAttachType, id: u32| -> Result<bool> {
        let (_, attached) = SchedClassifier::query_tcx(iface, attach)
            .with_context(|| format!("querying the TCX programs of {iface}"))?;
        Ok(attached.iter().any(|p| p.id() == id))
    };
    let mut missing = Vec::new();
    if !in_tcx(TcAttachType::Egress, id(programs::EGRESS)?)? {
        missing.push(format!(
            "the request path (TC egress) is not attached to {iface}"
        ));
    }
    let reply_path = match selector.settings.ingress {
        IngressMode::Xdp => {
            Netlink::open()?.xdp_program(ifindex)? == Some(id(programs::INGRESS_XDP)?)
        }
        _ => in_tcx(TcAttachType::Ingress, id(programs::INGRESS_TC)?)?,
    };
    if !reply_path {
        missing.push(format!(
            "the reply path ({} ingress) is not attached to {iface}",
            selector.settings.ingress.name()
        ));
    }
    Ok(missing)
}
