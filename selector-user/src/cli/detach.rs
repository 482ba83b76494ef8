//! `selector detach`: removes what `selector run --pin` left attached and
//! pinned, or, without `--pin`, any selector links on the interface; then
//! the managed neighbour entries its agent left for the members.

use std::{net::IpAddr, path::PathBuf, time::Duration};

use anyhow::{Result, bail};
use clap::Args;

use crate::{
    datapath::pinning::{DEFAULT_PIN_DIR, PinDir},
    host::interface,
    host::neighbours,
};

#[derive(Debug, Args)]
pub struct DetachArgs {
    /// Interface the selector is attached to (in this network namespace).
    #[arg(long)]
    pub iface: String,
    /// The pin directory given to `selector run --pin` (default
    /// /sys/fs/bpf/selector): stop steering, wait for the redirected reads
    /// in flight, unpin the links (which detaches them) and remove every
    /// pin under DIR/IFACE. Without it: force-detach any selector links
    /// on the interface; pins elsewhere are left as they are.
    #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = DEFAULT_PIN_DIR)]
    pub pin: Option<PathBuf>,
    /// With --pin: milliseconds to wait for redirected reads in flight to be
    /// answered before the reply path goes (the agent's --timeout).
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    pub wait: u64,
    #[command(flatten)]
    pub netns: super::NetnsArg,
}

pub fn detach(args: DetachArgs) -> Result<()> {
    let iface = &args.iface;
    // The interface (and an agent's control socket) are the namespace's.
    crate::host::netns::enter_if_given(args.netns.netns.as_deref())?;
    if crate::api::socket::agent_running(&crate::api::socket::Endpoint::Interface(iface.clone()))? {
        bail!(
            "a selector agent is running on {iface}; stop it first (SIGTERM; with --pin it leaves the pins for this command)"
        );
    }
    // Read while the maps are there: the members whose neighbour entries
    // the agent marked managed and left (pinned: for the programs that
    // steered on; killed: it never got to delete them).
    let pins = args
        .pin
        .as_ref()
        .map(|dir| PinDir::at(dir, iface))
        .transpose()?;
    let members = crate::datapath::detach::member_addresses(iface, pins.as_ref());
    match &pins {
        Some(pins) => {
            let removed =
                crate::datapath::detach::detach_pinned(pins, Duration::from_millis(args.wait))?;
            if removed.waited_out > 0 {
                say(&format!(
                    "selector: {} redirected reads were still unanswered after {} ms\n",
                    removed.waited_out, args.wait
                ));
            }
            say(&format!(
                "selector: detached from {iface}: unpinned links [{}], {} maps, {} programs; removed {}\n",
                removed.links.join(", "),
                removed.maps,
                removed.programs,
                pins.root().display()
            ));
        }
        None => {
            let detached = crate::datapath::detach::detach_attached(iface)?;
            if !detached.is_empty() {
                say(&format!(
                    "selector: detached from {iface}: {} (pins, if any, remain until removed)\n",
                    detached.join(", ")
                ));
            }
            // An unpinned agent killed outright leaves only its entries.
            if release_neighbours(iface, &members).is_empty() && detached.is_empty() {
                bail!("nothing of the selector is attached to {iface}");
            }
            return Ok(());
        }
    }
    release_neighbours(iface, &members);
    Ok(())
}

/// After the detach (nothing steers any more): deletes the managed
/// neighbour entries the agent left, and says which. A failure is only
/// logged: the links are gone, which is what detach is for.
fn release_neighbours(iface: &str, members: &[IpAddr]) -> Vec<IpAddr> {
    // No interface: no entries on it either.
    let Ok(ifindex) = interface::index(iface) else {
        return Vec::new();
    };
    match neighbours::release_managed(ifindex, members) {
        Ok(released) => {
            if !released.is_empty() {
                say(&format!(
                    "selector: deleted the managed neighbour entries of {released:?} on {iface}\n"
                ));
            }
            released
        }
        Err(e) => {
            log::warn!("deleting the managed neighbour entries on {iface}: {e:#}");
            Vec::new()
        }
    }
}

/// Prints a line of what was done: the work is done whatever becomes of the
/// words (a reader gone only loses them).
fn say(text: &str) {
    let _ = crate::host::stdout::write(text);
}
