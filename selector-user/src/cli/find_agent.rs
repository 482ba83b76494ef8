//! Which agent a control command (`status`, `set`, `drain`, `undrain`,
//! `reload`) talks to: the one on `--iface`; the endpoint of the agent of
//! several attachments with `--attachment`, or when it is the only agent
//! running in this network namespace and neither is given; else the only
//! agent running in it. Running agents are found by the locks they hold beside their
//! sockets (see [`crate::api::socket`]).

use anyhow::{Result, bail};

use crate::api::{
    Reply, Request, Routed,
    socket::{Endpoint, agent_running, running_agents},
};

/// The endpoint to talk to, and the attachment to name there.
pub fn endpoint(
    iface: Option<String>,
    attachment: Option<String>,
) -> Result<(Endpoint, Option<String>)> {
    Ok(match (iface, attachment) {
        (Some(iface), _) => (Endpoint::Interface(iface), None),
        (None, Some(label)) => (Endpoint::Attachments, Some(label)),
        (None, None) if agent_running(&Endpoint::Attachments)? => {
            beside_attachments(&attachments_started()?, running_agents()?)?
        }
        (None, None) => (Endpoint::Interface(only_agent(running_agents()?)?), None),
    })
}

/// The labels of the attachments the agent of several in this namespace
/// has started.
fn attachments_started() -> Result<Vec<String>> {
    let asked = Routed {
        attachment: None,
        request: Request::Status,
    };
    match crate::api::send(&Endpoint::Attachments, &asked)? {
        Reply::Attachments { attachments, .. } => {
            Ok(attachments.into_iter().map(|a| a.attachment).collect())
        }
        Reply::Error { message } => bail!("the agent of several attachments: {message}"),
        other => bail!("the agent of several attachments: unexpected reply {other:?}"),
    }
}

/// With an agent of several attachments (`labels`) in this namespace: it,
/// unless an agent of its own runs here too (an interface of `running`
/// that is not one of its attachments here, labelled by the bare name).
pub fn beside_attachments(
    labels: &[String],
    running: Vec<String>,
) -> Result<(Endpoint, Option<String>)> {
    let others: Vec<String> = running
        .into_iter()
        .filter(|iface| !labels.contains(iface))
        .collect();
    if others.is_empty() {
        return Ok((Endpoint::Attachments, None));
    }
    bail!(
        "an agent of several attachments ({}) and agents on {} run in this network namespace: \
         name one with --attachment LABEL or --iface IFACE",
        labels.join(", "),
        others.join(", ")
    )
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
        // A given --iface or --attachment is used as it is, whatever runs.
        assert_eq!(
            endpoint(Some("eth7".into()), None).unwrap(),
            (Endpoint::Interface("eth7".into()), None)
        );
        assert_eq!(
            endpoint(None, Some("eth0@/run/netns/a".into())).unwrap(),
            (Endpoint::Attachments, Some("eth0@/run/netns/a".into()))
        );
    }

    #[test]
    fn an_agent_of_several_is_chosen_unless_another_runs_beside_it() {
        let labels = ["eth0".to_string(), "eth0@/run/netns/a".to_string()];
        // Its own attachment's lock here is its own.
        assert_eq!(
            beside_attachments(&labels, vec!["eth0".into()]).unwrap(),
            (Endpoint::Attachments, None)
        );
        assert_eq!(
            beside_attachments(&labels, vec![]).unwrap(),
            (Endpoint::Attachments, None)
        );
        let e = beside_attachments(&labels, vec!["eth0".into(), "eth1".into()])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "an agent of several attachments (eth0, eth0@/run/netns/a) and agents on eth1 run in \
             this network namespace: name one with --attachment LABEL or --iface IFACE"
        );
    }
}
