//! The running agent: one owner loop ([`run`]) holds the [`crate::datapath::Selector`]
//! and serves the control socket, reloads, the metrics endpoint and systemd;
//! an agent of several attachments ([`attachments`]) runs one such loop per
//! attachment, with one control endpoint for all ([`control_router`]).

pub mod attachments;
pub mod control_router;
pub mod control_server;
pub mod endpoint;
pub mod health;
pub mod limits;
pub mod metrics;
pub mod reload;
pub mod render;
pub mod run;
pub mod sd_notify;
