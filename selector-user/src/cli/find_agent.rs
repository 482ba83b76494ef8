//! Which agent a control command (`status`, `set`, `drain`, `undrain`,
//! `reload`) talks to when `--iface` is left out: the only one running in
//! this network namespace. Each agent listens on the abstract Unix socket
//! `selector/IFACE` (see [`crate::api`]); the namespace's listening
//! sockets are in /proc/net/unix, abstract names written with a leading `@`.

use anyhow::{Context as _, Result, bail};

/// `__SO_ACCEPTCON` in /proc/net/unix's flags: a listening socket (a
/// connection accepted from it shows the same name).
const LISTENING: u32 = 0x0001_0000;

/// The name prefix of the agents' sockets, as /proc/net/unix shows it.
const PREFIX: &str = "@selector/";

/// `iface` if given, else the interface of the one agent in this network
/// namespace; none or several is an error saying what to do.
pub fn agent_iface(iface: Option<String>) -> Result<String> {
    match iface {
        Some(iface) => Ok(iface),
        None => {
            let table = std::fs::read_to_string("/proc/net/unix")
                .context("finding the running agents in /proc/net/unix (give --iface)")?;
            only_agent(listening_agents(&table))
        }
    }
}

/// The interfaces of the agents listening in a /proc/net/unix table,
/// sorted, each once.
pub fn listening_agents(table: &str) -> Vec<String> {
    let mut found: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            // Num RefCount Protocol Flags Type St Inode [Path]
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = u32::from_str_radix(fields.get(3)?, 16).ok()?;
            let iface = fields.get(7)?.strip_prefix(PREFIX)?;
            (flags & LISTENING != 0 && !iface.is_empty()).then(|| iface.to_string())
        })
        .collect();
    found.sort();
    found.dedup();
    found
}

/// The one agent's interface.
pub fn only_agent(found: Vec<String>) -> Result<String> {
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => bail!(
            "no selector agent is running in this network namespace (no socket @selector/IFACE \
             in /proc/net/unix): start one with `selector run`, or run this command in the \
             agent's namespace (`--netns PATH` as given to `selector run --netns`, or \
             `ip netns exec NS selector ...`)"
        ),
        several => bail!(
            "{} selector agents run in this network namespace (on {}): name one with --iface",
            several.len(),
            several.join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A /proc/net/unix with two agents (one with a client connected, whose
    /// accepted socket shows the name too), a client socket, systemd's
    /// and others' sockets.
    const TABLE: &str = "\
Num       RefCount Protocol Flags    Type St Inode Path
0000000000000000: 00000002 00000000 00010000 0001 01 21290 @selector/veth0
0000000000000000: 00000003 00000000 00000000 0001 03 21301 @selector/veth0
0000000000000000: 00000002 00000000 00010000 0001 01 21310 @selector/eth1
0000000000000000: 00000002 00000000 00000000 0002 01 21320 @selector/stale
0000000000000000: 00000002 00000000 00010000 0001 01 1873 /run/systemd/private
0000000000000000: 00000002 00000000 00010000 0001 01 1900 @/org/kernel/linux/storage
0000000000000000: 00000003 00000000 00000000 0001 03 21302
0000000000000000: 00000002 00000000 00010000 0001 01 1950 @selectors/veth9
";

    #[test]
    fn only_listening_agent_sockets_count() {
        assert_eq!(listening_agents(TABLE), vec!["eth1", "veth0"]);
        assert_eq!(
            listening_agents(TABLE.lines().next().unwrap()),
            Vec::<String>::new()
        );
    }

    #[test]
    fn one_agent_is_chosen_none_or_several_is_an_error() {
        assert_eq!(only_agent(vec!["veth0".into()]).unwrap(), "veth0");
        let none = only_agent(vec![]).unwrap_err().to_string();
        assert!(
            none.starts_with("no selector agent is running in this network namespace"),
            "{none}"
        );
        let several = only_agent(listening_agents(TABLE)).unwrap_err().to_string();
        assert_eq!(
            several,
            "2 selector agents run in this network namespace (on eth1, veth0): name one with --iface"
        );
        // A given --iface is used as it is, whatever runs.
        assert_eq!(agent_iface(Some("eth7".into())).unwrap(), "eth7");
    }
}
