//! Which agent a control command (`status`, `set`, `drain`, `undrain`,
//! `reload`) talks to when `--iface` is left out: the only one running in
//! this network namespace, found by the locks the agents hold beside their
//! sockets (see [`crate::api::socket`]).

use anyhow::{Result, bail};

/// `iface` if given, else the interface of the one agent in this network
/// namespace; none or several is an error saying what to do.
pub fn agent_iface(iface: Option<String>) -> Result<String> {
    match iface {
        Some(iface) => Ok(iface),
        None => only_agent(crate::api::socket::running_agents()?),
    }
}

/// The one agent's interface.
pub fn only_agent(found: Vec<String>) -> Result<String> {
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => bail!(
            "no selector agent is running in this network namespace (none holds a lock in \
             /run/selector/net-INODE): start one with `selector run`, or run this command in \
             the agent's namespace (`--netns PATH` as given to `selector run --netns`, or \
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

    #[test]
    fn one_agent_is_chosen_none_or_several_is_an_error() {
        assert_eq!(only_agent(vec!["veth0".into()]).unwrap(), "veth0");
        let none = only_agent(vec![]).unwrap_err().to_string();
        assert!(
            none.starts_with("no selector agent is running in this network namespace"),
            "{none}"
        );
        let several = only_agent(vec!["eth1".into(), "veth0".into()])
            .unwrap_err()
            .to_string();
        assert_eq!(
            several,
            "2 selector agents run in this network namespace (on eth1, veth0): name one with --iface"
        );
        // A given --iface is used as it is, whatever runs.
        assert_eq!(agent_iface(Some("eth7".into())).unwrap(), "eth7");
    }
}
