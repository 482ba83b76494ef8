//! The one control endpoint of an agent of several attachments (`selector
//! run --attachment`): `selector status|set|drain|undrain|reload
//! --attachment LABEL` reach it, in the agent's own network namespace
//! ([`Endpoint::Attachments`]), and each request goes to the owner loop of
//! the attachment it names, as its own control socket's would; a status
//! naming none is every attachment's.

use std::time::Duration;

use anyhow::Result;
use tokio::task::JoinSet;

use crate::{
    agent::{
        control_server::{ControlListener, LocalCaller, answer_connection, error},
        endpoint::Sources,
    },
    api::{AttachmentStatus, Reply, Request, Routed, Unavailable, socket::Endpoint},
};

/// Longest an attachment's loop may take to answer (a client waits 5 s):
/// one that is slow or stuck costs its own requests, not the endpoint.
const ANSWER_WAIT: Duration = Duration::from_secs(4);

/// Where a request goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// To the attachment of this label.
    One(String),
    /// A status of every attachment.
    All,
}

/// Where `routed` goes among the attachments `expected` (labels, in the
/// order given) of which `started` are running; an error says why nowhere.
pub fn route(routed: &Routed, expected: &[String], started: &[String]) -> Result<Route, String> {
    match &routed.attachment {
        Some(label) if started.contains(label) => Ok(Route::One(label.clone())),
        Some(label) if expected.contains(label) => {
            Err(format!("attachment {label} has not started yet"))
        }
        Some(label) => Err(format!(
            "no attachment {label}: the agent's attachments are {}",
            expected.join(", ")
        )),
        None if routed.request == Request::Status => Ok(Route::All),
        None => Err(format!(
            "this agent serves several attachments: name one with --attachment ({})",
            expected.join(", ")
        )),
    }
}

/// The endpoint's listening socket.
pub struct ControlRouter {
    listener: ControlListener,
}

impl ControlRouter {
    /// Takes the endpoint's lock and binds its socket, in this thread's
    /// network namespace; a second agent of several attachments in it is
    /// refused.
    pub fn bind() -> Result<Self> {
        Ok(Self {
            listener: ControlListener::bind(&Endpoint::Attachments)?,
        })
    }

    /// Answers connections until the task is dropped, each in a task of
    /// its own, routing to the attachments of `sources` (added as they
    /// attach).
    pub async fn serve(self, sources: Sources) {
        loop {
            let (stream, permit) = self.listener.accept().await;
            let sources = sources.clone();
            tokio::spawn(async move {
                answer_connection(stream, |routed: Routed| answer(&sources, routed)).await;
                drop(permit);
            });
        }
    }
}

/// The reply to `routed`: its attachment's, or every attachment's status
/// (asked of all at once).
async fn answer(sources: &Sources, routed: Routed) -> Reply {
    let callers = sources.callers();
    let started: Vec<String> = callers.iter().map(|(label, _)| label.clone()).collect();
    match route(&routed, &sources.expected_labels(), &started) {
        Err(message) => error(&message),
        Ok(Route::One(label)) => match callers.into_iter().find(|(l, _)| *l == label) {
            Some((_, caller)) => within_wait(&label, &caller, routed.request).await,
            None => error(&format!("attachment {label} has not started yet")),
        },
        Ok(Route::All) => {
            let expected = sources.expected_labels();
            let mut asked = JoinSet::new();
            for (label, caller) in callers {
                asked.spawn(async move {
                    let reply = within_wait(&label, &caller, Request::Status).await;
                    (label, reply)
                });
            }
            let mut replies: Vec<(String, Option<Reply>)> =
                expected.into_iter().map(|label| (label, None)).collect();
            for (label, reply) in asked.join_all().await {
                if let Some(slot) = replies.iter_mut().find(|(l, _)| *l == label) {
                    slot.1 = Some(reply);
                }
            }
            every_status(replies)
        }
    }
}

/// A bare status's reply from each attachment's own (`None`: not started
/// yet), in the order given: the statuses there are, and why the others
/// gave none, so that a missing attachment is said, not left out.
fn every_status(replies: Vec<(String, Option<Reply>)>) -> Reply {
    let mut attachments = Vec::with_capacity(replies.len());
    let mut unavailable = Vec::new();
    for (attachment, reply) in replies {
        let reason = match reply {
            Some(Reply::Status(status)) => {
                attachments.push(AttachmentStatus {
                    attachment,
                    status: *status,
                });
                continue;
            }
            Some(Reply::Error { message }) => message,
            Some(other) => format!("unexpected reply to status: {other:?}"),
            None => "not started yet".to_string(),
        };
        unavailable.push(Unavailable { attachment, reason });
    }
    Reply::Attachments {
        attachments,
        unavailable,
    }
}

/// `caller`'s reply to `request`, or an error after [`ANSWER_WAIT`].
async fn within_wait(label: &str, caller: &LocalCaller, request: Request) -> Reply {
    tokio::time::timeout(ANSWER_WAIT, caller.call(request))
        .await
        .unwrap_or_else(|_| {
            error(&format!(
                "attachment {label} did not answer within {} s",
                ANSWER_WAIT.as_secs()
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to(attachment: Option<&str>, request: Request) -> Routed {
        Routed {
            attachment: attachment.map(String::from),
            request,
        }
    }

    #[test]
    fn requests_go_to_the_attachment_they_name_and_a_bare_status_to_all() {
        let expected = ["eth0".to_string(), "eth0@/run/netns/pod-a".to_string()];
        let started = &expected[..];
        assert_eq!(
            route(
                &to(Some("eth0@/run/netns/pod-a"), Request::Reload),
                &expected,
                started
            ),
            Ok(Route::One("eth0@/run/netns/pod-a".into()))
        );
        assert_eq!(
            route(&to(None, Request::Status), &expected, started),
            Ok(Route::All)
        );
        assert_eq!(
            route(&to(None, Request::Reload), &expected, started),
            Err("this agent serves several attachments: name one with --attachment (eth0, eth0@/run/netns/pod-a)".into())
        );
        assert_eq!(
            route(&to(Some("eth1"), Request::Status), &expected, started),
            Err(
                "no attachment eth1: the agent's attachments are eth0, eth0@/run/netns/pod-a"
                    .into()
            )
        );
        // Named before it attached: said so, not "no attachment".
        assert_eq!(
            route(
                &to(Some("eth0@/run/netns/pod-a"), Request::Status),
                &expected,
                &expected[..1]
            ),
            Err("attachment eth0@/run/netns/pod-a has not started yet".into())
        );
    }

    #[test]
    fn a_bare_status_says_which_attachments_gave_none_and_why() {
        let status = crate::agent::metrics::tests::status();
        let reply = every_status(vec![
            ("a".into(), Some(Reply::Status(Box::new(status.clone())))),
            ("b".into(), None),
            (
                "c".into(),
                Some(error("attachment c did not answer within 4 s")),
            ),
        ]);
        assert_eq!(
            reply,
            Reply::Attachments {
                attachments: vec![AttachmentStatus {
                    attachment: "a".into(),
                    status,
                }],
                unavailable: vec![
                    Unavailable {
                        attachment: "b".into(),
                        reason: "not started yet".into(),
                    },
                    Unavailable {
                        attachment: "c".into(),
                        reason: "attachment c did not answer within 4 s".into(),
                    },
                ],
            }
        );
    }

    /// Before any attachment has started, a bare status names them all,
    /// instead of an empty list.
    #[tokio::test]
    async fn a_bare_status_before_any_attachment_started_names_them() {
        let sources = Sources::of_attachments(vec!["a".into(), "b".into()]);
        let reply = answer(&sources, to(None, Request::Status)).await;
        let not_started = |label: &str| Unavailable {
            attachment: label.into(),
            reason: "not started yet".into(),
        };
        assert_eq!(
            reply,
            Reply::Attachments {
                attachments: Vec::new(),
                unavailable: vec![not_started("a"), not_started("b")],
            }
        );
    }
}
