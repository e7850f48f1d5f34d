//! The `airlock-admin` command line: the service, and the operator's actions for scripts
//! and runbooks (the send switch, queue pauses, jobs, tokens), each audited.

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
    /// Check a service's health endpoint: exit 0 when it answers 2xx (container health checks).
    Probe {
        /// e.g. http://127.0.0.1:7071/healthz
        url: String,
    },
    /// Operate on jobs (audited).
    Jobs {
        #[command(subcommand)]
        command: JobsCommand,
    },
    /// The global send switch (audited, as the route).
    Switch {
        #[command(subcommand)]
        command: SwitchCommand,
    },
    /// Named queues: pause or resume claims from one (audited), list them with their depth.
    Queues {
        #[command(subcommand)]
        command: QueuesCommand,
    },
    /// The audit log.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// Capsules: `verify` (offline), `export`, `import`.
    Capsule {
        #[command(subcommand)]
        command: crate::capsule::CapsuleCommand,
    },
    /// Sandboxed tasks.
    Sandbox {
        #[command(subcommand)]
        command: crate::sandbox::SandboxCommand,
    },
    /// Re-ask another model every recorded decision of a run, with no tool call and no
    /// effect; print per step `same` or `diverged` with both actions.
    ReplayEval {
        /// The run whose replay log is the fixture.
        #[arg(long)]
        run: String,
        /// The other model's server: `http://127.0.0.1:<port>` or `http://[::1]:<port>`.
        #[arg(long)]
        endpoint: String,
        /// The model id to ask.
        #[arg(long)]
        model: String,
        /// One JSON document instead of lines.
        #[arg(long)]
        json: bool,
        /// How long one completion may take.
        #[arg(long, default_value_t = 120)]
        timeout_seconds: u64,
    },
}

#[derive(Subcommand)]
pub enum JobsCommand {
    /// Make a parked or failed job available again now.
    Retry {
        /// The job's id.
        id: String,
        /// Why (recorded in the audit log).
        #[arg(long)]
        reason: String,
    },
    /// Cancel a job that is available or parked.
    Cancel {
        /// The job's id.
        id: String,
        /// Why (recorded in the audit log).
        #[arg(long)]
        reason: String,
    },
}

#[derive(Subcommand)]
pub enum SwitchCommand {
    /// Allow sending: approved deliveries go out.
    On {
        /// Why (recorded in the audit log).
        #[arg(long)]
        reason: String,
    },
    /// Stop sending: approved deliveries wait; nothing is lost.
    Off {
        /// Why (recorded in the audit log).
        #[arg(long)]
        reason: String,
    },
    /// Print whether sending is on, who set it, when and why.
    Status {
        /// One JSON object instead of a line.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum QueuesCommand {
    /// Stop workers claiming from a queue (running jobs go on).
    Pause {
        /// The queue's name.
        name: String,
        /// Why (recorded in the audit log).
        #[arg(long)]
        reason: String,
    },
    /// Let workers claim from a paused queue again.
    Resume {
        /// The queue's name.
        name: String,
        /// Why (recorded in the audit log).
        #[arg(long)]
        reason: String,
    },
    /// airlock's queues and any other with unfinished jobs or a pause: depth by state, paused
    /// since when and why.
    List {
        /// One JSON document instead of lines.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum AuditCommand {
    /// Recompute the hash chain; prints `ok`, or what is broken and exits 1. With
    /// `--head`, the chain must also still reach the head exported earlier, so removing the
    /// newest entries is seen.
    Verify {
        /// A head written by `audit export-head`, kept outside the database.
        #[arg(long)]
        head: Option<std::path::PathBuf>,
    },
    /// Print the newest entry of the chain (id, hash, count) as JSON, to keep outside the
    /// database for `audit verify --head`.
    ExportHead {
        /// Write it to this file instead of stdout.
        #[arg(long)]
        out: Option<std::path::PathBuf>,
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
        /// Refuse the token once this long has passed: a number and a unit, `s`, `m`, `h`,
        /// `d` or `w` (`90d`, `12h`); at most ten years. Without it the token lasts until revoked.
        #[arg(long, value_parser = parse_duration)]
        expires_in: Option<std::time::Duration>,
    },
    /// List principals (names, roles, agents, creation, expiry, last use, revocation; never tokens).
    List,
    /// Revoke a principal's token at once.
    Revoke {
        /// The principal's name.
        name: String,
        /// Why (recorded in the audit log).
        #[arg(long, default_value = "revoked from the command line")]
        reason: String,
    },
}

/// GETs a health URL; succeeds on a 2xx answer within five seconds.
async fn probe(url: &str) -> anyhow::Result<()> {
    let client = reqwest::Client::builder().timeout(std::time::Duration::from_secs(5)).no_proxy().build()?;
    let status = client.get(url).send().await?.status();
    anyhow::ensure!(status.is_success(), "{url} answered {status}");
    Ok(())
}

/// Who acts from the command line: the operating-system user, as the audit log shows it.
fn cli_actor() -> String {
    format!("cli:{}", std::env::var("USER").ok().filter(|u| !u.is_empty()).unwrap_or_else(|| "unknown".into()))
}

/// `90d`, `12h`, `30m`, `3600s`, `2w`: a whole number and one unit.
fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).ok_or_else(|| format!("`{s}` has no unit (s, m, h, d or w)"))?;
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().map_err(|_| format!("`{s}` does not start with a whole number"))?;
    let unit_seconds = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        other => return Err(format!("`{other}` is not a unit: s, m, h, d or w")),
    };
    n.checked_mul(unit_seconds)
        .filter(|&secs| secs > 0)
        .map(std::time::Duration::from_secs)
        .ok_or_else(|| format!("`{s}` must be more than 0 s and fit in a duration"))
}

async fn audit_cli(
    pool: &sqlx::PgPool,
    action: &str,
    target: &str,
    reason: Option<&str>,
    data: serde_json::Value,
) -> anyhow::Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let mut tx = pool.begin().await?;
    airlock_core::audit::record_as(
        &mut tx,
        &cli_actor(),
        "admin",
        airlock_core::audit::Action { action, target_kind: "principal", target_id: target.to_string(), reason, data },
    )
    .await?;
    Ok(tx)
}

/// Runs a parsed command.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    // Capsule commands load what they need themselves; `capsule verify` needs nothing.
    let cli = match cli.command {
        Command::Capsule { command } => return crate::capsule::run(command).await,
        Command::Probe { url } => return probe(&url).await,
        command => Cli { command },
    };
    let cfg = Config::load()?;
    let pool = airlock_core::db::connect(&cfg.database).await?;
    airlock_core::db::migrate(&pool).await?;
    match cli.command {
        // Handled above, before any configuration or database access.
        Command::Capsule { command } => crate::capsule::run(command).await,
        Command::Probe { url } => probe(&url).await,
        Command::Migrate => {
            // Again even when nothing was pending: a role created after the last migration
            // gets its rights here.
            airlock_core::db::grant_application(&pool).await?;
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::Token { command: TokenCommand::Create { role, name, agent, expires_in } } => {
            let role = Role::parse(&role)
                .ok_or_else(|| anyhow::anyhow!("--role must be one of agent, reviewer, operator, admin"))?;
            let mut tx = audit_cli(
                &pool,
                "token.create",
                &name,
                None,
                serde_json::json!({"role": role.as_str(), "agent": agent,
                                   "expires_in_seconds": expires_in.map(|d| d.as_secs())}),
            )
            .await?;
            let (p, token) = principals::create_expiring(&mut *tx, &name, role, agent.as_deref(), expires_in).await?;
            tx.commit().await?;
            tracing::info!(principal.id = %p.id, principal.name = %p.name, role = role.as_str(), "principal created");
            println!("{}", token.expose());
            Ok(())
        }
        Command::Token { command: TokenCommand::List } => {
            let time = |t: Option<chrono::DateTime<chrono::Utc>>| {
                t.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)).unwrap_or_else(|| "-".into())
            };
            println!(
                "{:<32} {:<9} {:<24} {:<20} {:<20} {:<20} revoked",
                "name", "role", "agent", "created", "expires", "last_used"
            );
            for p in principals::list(&pool).await? {
                println!(
                    "{:<32} {:<9} {:<24} {:<20} {:<20} {:<20} {}",
                    p.name,
                    p.role.as_str(),
                    p.agent_id.as_deref().unwrap_or("-"),
                    time(Some(p.created_at)),
                    time(p.expires_at),
                    time(p.last_used_at),
                    time(p.revoked_at)
                );
            }
            Ok(())
        }
        Command::Token { command: TokenCommand::Revoke { name, reason } } => {
            let mut tx = audit_cli(&pool, "token.revoke", &name, Some(&reason), serde_json::json!({})).await?;
            if !principals::revoke(&mut *tx, &name, &cli_actor()).await? {
                anyhow::bail!("no live principal named `{name}`");
            }
            tx.commit().await?;
            println!("revoked {name}");
            Ok(())
        }
        Command::Jobs { command } => {
            let (action, id, reason) = match &command {
                JobsCommand::Retry { id, reason } => ("job.retry", id, reason),
                JobsCommand::Cancel { id, reason } => ("job.cancel", id, reason),
            };
            let job_id: airlock_core::ids::JobId = id.parse().map_err(|_| anyhow::anyhow!("`{id}` is not a job id"))?;
            if reason.trim().is_empty() {
                anyhow::bail!("--reason must not be empty");
            }
            let mut tx = pool.begin().await?;
            let job = airlock_queue::get(&mut *tx, job_id).await?;
            airlock_core::audit::record_as(
                &mut tx,
                &cli_actor(),
                "admin",
                airlock_core::audit::Action {
                    action,
                    target_kind: "job",
                    target_id: id.clone(),
                    reason: Some(reason),
                    data: serde_json::json!({"kind": job.kind, "state_before": job.state}),
                },
            )
            .await?;
            match command {
                JobsCommand::Retry { .. } => airlock_queue::retry_now(&mut *tx, job_id).await?,
                JobsCommand::Cancel { .. } => airlock_queue::cancel(&mut *tx, job_id, reason).await?,
            }
            tx.commit().await?;
            println!("{action} {id}");
            Ok(())
        }
        Command::Audit { command: AuditCommand::Verify { head } } => {
            let head = match head {
                None => None,
                Some(path) => {
                    let text = std::fs::read_to_string(&path)
                        .map_err(|e| anyhow::anyhow!("--head {}: {e}", path.display()))?;
                    Some(
                        serde_json::from_str::<airlock_core::audit::Head>(&text)
                            .map_err(|e| anyhow::anyhow!("--head {}: not an exported head: {e}", path.display()))?,
                    )
                }
            };
            match airlock_core::audit::verify_against(&pool, head.as_ref()).await? {
                Ok(()) => {
                    println!("ok");
                    Ok(())
                }
                Err(broken) => {
                    println!("broken: {broken}");
                    std::process::exit(1);
                }
            }
        }
        Command::Audit { command: AuditCommand::ExportHead { out } } => {
            let head = airlock_core::audit::head(&pool)
                .await?
                .ok_or_else(|| anyhow::anyhow!("the audit log is empty: nothing to export"))?;
            let text = serde_json::to_string(&head)?;
            match out {
                Some(path) => std::fs::write(&path, format!("{text}\n"))?,
                None => println!("{text}"),
            }
            Ok(())
        }
        Command::Sandbox { command } => crate::sandbox::run_cli(&pool, &cfg, command).await,
        Command::Switch { command } => {
            let s = match command {
                SwitchCommand::On { reason } => {
                    airlock_delivery::pipeline::set_send_enabled_as(&pool, &cli_actor(), "admin", true, Some(&reason))
                        .await?
                }
                SwitchCommand::Off { reason } => {
                    airlock_delivery::pipeline::set_send_enabled_as(&pool, &cli_actor(), "admin", false, Some(&reason))
                        .await?
                }
                SwitchCommand::Status { json: true } => {
                    println!("{}", serde_json::to_string(&airlock_delivery::store::send_switch(&pool).await?)?);
                    return Ok(());
                }
                SwitchCommand::Status { json: false } => airlock_delivery::store::send_switch(&pool).await?,
            };
            println!(
                "send switch {} (set by {} at {}: {})",
                if s.enabled { "on" } else { "off" },
                s.updated_by,
                s.updated_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                s.reason
            );
            Ok(())
        }
        Command::Queues { command } => {
            let (name, pause, reason) = match command {
                QueuesCommand::Pause { name, reason } => (name, true, reason),
                QueuesCommand::Resume { name, reason } => (name, false, reason),
                QueuesCommand::List { json } => {
                    let queues = crate::queues::list(&pool).await?;
                    if json {
                        println!("{}", serde_json::to_string(&queues)?);
                        return Ok(());
                    }
                    println!(
                        "{:<24} {:<7} {:>9} {:>7} {:>6}  reason",
                        "queue", "state", "available", "running", "parked"
                    );
                    for q in queues {
                        let n = |s: &str| q.depth.get(s).copied().unwrap_or(0);
                        println!(
                            "{:<24} {:<7} {:>9} {:>7} {:>6}  {}",
                            q.name,
                            if q.paused { "paused" } else { "active" },
                            n("available"),
                            n("running"),
                            n("parked"),
                            q.reason.as_deref().unwrap_or("-")
                        );
                    }
                    return Ok(());
                }
            };
            let actor = cli_actor();
            let q = crate::queues::set_paused(&pool, crate::queues::Operator::Cli(&actor), &name, pause, Some(&reason))
                .await?;
            println!("queue {} {}", q.name, if q.paused { "paused" } else { "resumed" });
            Ok(())
        }
        Command::ReplayEval { run, endpoint, model, json, timeout_seconds } => {
            let run: airlock_core::ids::RunId =
                run.parse().map_err(|_| anyhow::anyhow!("--run: `{run}` is not a run id"))?;
            let timeout = std::time::Duration::from_secs(timeout_seconds.max(1));
            let compared = crate::replay::evaluate(&pool, run, &endpoint, &model, timeout).await?;
            crate::replay::print(run, &model, &compared, json);
            Ok(())
        }
        Command::Serve => {
            let listener = tokio::net::TcpListener::bind(cfg.admin.listen).await?;
            tracing::info!(listen = %listener.local_addr()?, "admin listening");
            let shutdown = airlock_core::shutdown::on_signals()?;
            let limits = airlock_http::ServeLimits::from(&cfg.http);
            let app = router(AppState { pool, config: std::sync::Arc::new(cfg) });
            airlock_http::serve(listener, app, limits, shutdown).await?;
            Ok(())
        }
    }
}
