//! `selector run`: its flags ([`super::RunArgs`]) into a configuration, then
//! the agent ([`crate::agent::run`]), or with `--attachment` the agent of
//! several ([`crate::agent::attachments`]).

use anyhow::Result;

use super::{RunArgs, logging::LogFormat};

/// Runs the agent with `args` until a signal or `--duration`. With the
/// log in JSON, standard output carries JSON lines only: no tables.
pub async fn run(args: RunArgs, log_format: LogFormat) -> Result<()> {
    if !args.attachments.is_empty() {
        let attachments = args.attachments()?;
        let flags = args.attachment_options();
        return crate::agent::attachments::run(attachments, flags, args.metrics_addr).await;
    }
    let mut config = args.run_config()?;
    config.tables = log_format == LogFormat::Text;
    crate::agent::run::run(config, args.config.clone(), args.options()).await
}
