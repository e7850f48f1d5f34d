//! The `airlock-admin` command line.

use airlock_core::config::Config;
use airlock_core::principals::{self, Role};
use clap::{Parser, Subcommand};

use crate::server::{AppState, router};

/// Reviewer/operator service and operator commands for airlock.
#[derive(Parser)]
#[command(name = "airlock-admin", version)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Serve the reviewer/operator HTTP API and web page.
    Serve,
    /// Apply the migrations and exit.
    Migrate,
    /// Manage principals (bearer tokens).
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
}

#[derive(Subcommand)]
pub enum TokenCommand {
    /// Create a principal and print its bearer token alone on stdout.
    Create {
        /// agent, reviewer, operator or admin
        #[arg(long)]
        role: String,
        /// A unique name for the principal.
        #[arg(long)]
        name: String,
        /// The agent id an agent principal is bound to.
        #[arg(long)]
        agent: Option<String>,
    },
}

/// Runs a parsed command.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let cfg = Config::load()?;
    let pool = airlock_core::db::connect(&cfg.database).await?;
    airlock_core::db::migrate(&pool).await?;
    match cli.command {
        Command::Migrate => {
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::Token { command: TokenCommand::Create { role, name, agent } } => {
            let role = Role::parse(&role)
                .ok_or_else(|| anyhow::anyhow!("--role must be one of agent, reviewer, operator, admin"))?;
            let (p, token) = principals::create(&pool, &name, role, agent.as_deref()).await?;
            tracing::info!(principal.id = %p.id, principal.name = %p.name, role = role.as_str(), "principal created");
            println!("{}", token.expose());
            Ok(())
        }
        Command::Serve => {
            let listener = tokio::net::TcpListener::bind(cfg.admin.listen).await?;
            tracing::info!(listen = %listener.local_addr()?, "admin listening");
            let shutdown = airlock_core::http::shutdown_on_signals()?;
            let app = router(AppState { pool, config: std::sync::Arc::new(cfg) });
            airlock_core::http::serve(listener, app, shutdown).await?;
            Ok(())
        }
    }
}
