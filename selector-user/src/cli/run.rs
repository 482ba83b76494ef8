//! `selector run`: its flags ([`super::RunArgs`]) into a configuration, then
//! the agent ([`crate::agent::run`]).

use anyhow::Result;

use super::RunArgs;

/// Runs the agent with `args` until a signal or `--duration`.
pub async fn run(args: RunArgs) -> Result<()> {
    let config = args.run_config()?;
    crate::agent::run::run(config, args.config.clone(), args.options()).await
}
