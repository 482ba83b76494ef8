//! The `selector` command line: its clap types, and the control commands
//! (`status`, `set`, `drain`, `undrain`, `reload`) that talk to a running agent.
//! `run` is in [`run`] (the loop) and [`run_args`] (its flags); `detach`
//! in [`detach`]; `check` in [`check`].

mod check;
mod detach;
mod find_agent;
mod generate;
pub mod logging;
mod run;
mod run_args;

use std::net::SocketAddr;

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand};

pub use check::CheckArgs;
pub use detach::DetachArgs;
pub use generate::{CompletionsArgs, ManArgs};
pub use run::run;
pub use run_args::RunArgs;

use crate::api::{self, Reply, Request, Routed};
use crate::config::tunables::TunablesPatch;

#[derive(Debug, Parser)]
#[command(
    name = "selector",
    version = crate::api::build_info::LONG_VERSION,
    about = "Kernel-space replica selector: steers reads away from a stalled replica",
    long_about = "Kernel-space replica selector.\n\n\
        eBPF programs on the client's interface count the requests pending at each \
        backend. A read whose primary has THRESHOLD more pending requests than the \
        least-loaded replica of its group is sent to that replica instead (the \
        BookKeeper rule), and its response is rewritten to come from the primary, \
        so the application needs no change."
)]
pub struct Cli {
    /// How the agent's log lines are written: `text` (`selector: ...`) or
    /// `json` (one object per line with time, level and message). Levels
    /// from RUST_LOG.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value_t,
        env = "SELECTOR_LOG_FORMAT"
    )]
    pub log_format: logging::LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Attach to an interface and steer until interrupted (or --duration).
    Run(Box<RunArgs>),
    /// Change the run-time settings of the agent running on an interface
    /// (flags left out keep their values; defaults shown are `run`'s).
    Set(SetArgs),
    /// Stop choosing a backend (its pending requests still complete).
    Drain(BackendArgs),
    /// Let a drained backend be chosen again.
    Undrain(BackendArgs),
    /// Print the running agent's settings, totals and pending counts.
    Status(StatusArgs),
    /// Remove what `run --pin` left attached and pinned (or, without
    /// --pin, any selector links on the interface).
    Detach(DetachArgs),
    /// Make the running agent re-read its --config file and apply it.
    Reload(ReloadArgs),
    /// Check a config file and flags as `run` would (syntax, keys, values,
    /// groups, host names, the interface and its addresses), print one line
    /// saying what it would run with (the reply path here, whether it pins)
    /// and, on stderr, warnings and what was not checked; nothing is loaded
    /// or attached, and no privileges are needed. An error names the file,
    /// the line and the key.
    Check(Box<CheckArgs>),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(CompletionsArgs),
    /// Print the man page of selector, or of a subcommand, in roff
    /// (`selector man | man -l -`).
    Man(ManArgs),
}

/// `--netns` of the commands that talk to an agent.
#[derive(Debug, Default, Args)]
pub struct NetnsArg {
    /// The network namespace the agent was attached in (`selector run
    /// --netns PATH`): its control socket is there. Needs CAP_SYS_ADMIN.
    #[arg(long, value_name = "PATH")]
    pub netns: Option<std::path::PathBuf>,
}

/// Which running agent a control command talks to.
#[derive(Debug, Default, Args)]
pub struct AgentArgs {
    /// Interface the agent runs on (in this network namespace); may be
    /// left out when exactly one agent runs in it.
    #[arg(long, conflicts_with = "attachment")]
    pub iface: Option<String>,
    /// The attachment of an agent of several (`selector run --attachment`)
    /// to talk to, by its label: IFACE, or IFACE@NETNS for one in another
    /// namespace (as in its metrics and `selector status`). Without it and
    /// without --iface, such an agent in this namespace is talked to:
    /// `status` shows every attachment, the other commands need it.
    #[arg(long, value_name = "LABEL")]
    pub attachment: Option<String>,
    #[command(flatten)]
    pub netns: NetnsArg,
}

#[derive(Debug, Args)]
pub struct ReloadArgs {
    #[command(flatten)]
    pub agent: AgentArgs,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub agent: AgentArgs,
    /// Print the status as one JSON document (schema: docs/reference/status.md).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct SetArgs {
    #[command(flatten)]
    pub agent: AgentArgs,
    #[command(flatten)]
    pub tunables: TunablesPatch,
}

#[derive(Debug, Args)]
pub struct BackendArgs {
    #[command(flatten)]
    pub agent: AgentArgs,
    /// The backend, as given to --group.
    pub backend: SocketAddr,
}

/// Runs a control command against the agent on its interface and prints
/// the reply.
pub fn control(command: Command) -> Result<()> {
    let (agent, request, json) = match command {
        Command::Run(_) => bail!("not a control command"),
        Command::Check(a) => return check::check(&a),
        // Written whole, then to stdout: a reader gone is told apart.
        Command::Completions(a) => {
            let mut text = Vec::new();
            generate::completions(&a, &mut text)?;
            return Ok(crate::host::stdout::write(text)?);
        }
        Command::Man(a) => {
            let mut text = Vec::new();
            generate::man(&a, &mut text)?;
            return Ok(crate::host::stdout::write(text)?);
        }
        Command::Detach(a) => return detach::detach(a),
        Command::Status(a) => (a.agent, Request::Status, a.json),
        Command::Reload(a) => (a.agent, Request::Reload, false),
        Command::Set(a) => {
            if a.tunables.is_empty() {
                bail!(
                    "set needs at least one of {}",
                    TunablesPatch::flags().join(", ")
                );
            }
            (a.agent, Request::Set(a.tunables), false)
        }
        Command::Drain(a) => (
            a.agent,
            Request::Drain {
                backend: a.backend,
                drained: true,
            },
            false,
        ),
        Command::Undrain(a) => (
            a.agent,
            Request::Drain {
                backend: a.backend,
                drained: false,
            },
            false,
        ),
    };
    // The agent's socket is in the namespace it attached in.
    crate::host::netns::enter_if_given(agent.netns.netns.as_deref())?;
    // Naming no attachment, it is a plain request on the wire.
    let (endpoint, attachment) = find_agent::endpoint(agent.iface, agent.attachment)?;
    let reply = api::send(
        &endpoint,
        &Routed {
            attachment,
            request,
        },
    )?;
    let out = match reply {
        Reply::Status(status) if json => format!("{}\n", serde_json::to_string(&status)?),
        Reply::Status(status) => status.render(),
        Reply::Attachments {
            attachments,
            unavailable,
        } if json => {
            let mut all = serde_json::json!({ "attachments": attachments });
            if !unavailable.is_empty() {
                all["unavailable"] = serde_json::to_value(&unavailable)?;
            }
            format!("{}\n", serde_json::to_string(&all)?)
        }
        Reply::Attachments {
            attachments,
            unavailable,
        } => {
            let blocks: Vec<String> = attachments
                .iter()
                .map(|a| format!("attachment {}:\n{}", a.attachment, a.status.render()))
                .chain(
                    unavailable
                        .iter()
                        .map(|u| format!("attachment {}: no status: {}\n", u.attachment, u.reason)),
                )
                .collect();
            blocks.join("\n")
        }
        Reply::Done { message } => format!("{message}\n"),
        Reply::Error { message } => bail!("{message}"),
    };
    crate::host::stdout::write(out)?;
    Ok(())
}
