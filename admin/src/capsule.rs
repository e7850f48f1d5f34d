//! Capsules and migration for operators: the `airlock-admin capsule` commands (`verify`
//! offline, `export` and `import` against the store and Postgres) and the admin routes
//! `GET /admin/v1/agents/{id}`, `POST /admin/v1/agents/{id}/migrations` and
//! `GET /admin/v1/migrations/{id}`.
//!
//! Every operator action (migration request, import) is audited in its own transaction.

use std::path::{Path as FsPath, PathBuf};

use airlock_capsule::archive::{self, Archive, DirArchive, StoreBlobs};
use airlock_capsule::files::{BlobSource, CapsuleFiles, TarLimits, now_rfc3339};
use airlock_capsule::manifest::Signer;
use airlock_capsule::relocation::{self, Relocation};
use airlock_capsule::verify::{VerifyOptions, verify_path};
use airlock_capsule::{AgentId, NodeId, agents};
use airlock_core::config::Config;
use airlock_core::principals::Role;
use airlock_http::{ApiError, Auth, JsonBody, parse_id};
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use clap::Subcommand;
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::server::AppState;

/// Attempts a migration job may spend on crashes and failures (waiting spends none).
const MIGRATE_MAX_ATTEMPTS: i32 = 100;

#[derive(Subcommand)]
pub enum CapsuleCommand {
    /// Verify a capsule folder or `.tar` offline: prints `ok`, or one line per problem and
    /// exits 1. Needs no configuration and no database.
    Verify {
        path: PathBuf,
        /// Accept the signature only from this ed25519 public key (hex); repeatable.
        #[arg(long = "key")]
        keys: Vec<String>,
        /// Report an unsigned capsule as a problem.
        #[arg(long)]
        require_signature: bool,
    },
    /// Write an agent's capsule (its latest checkpoint in the store) to a folder or a tar.
    Export {
        agent_id: String,
        #[arg(long)]
        out: PathBuf,
        /// Write one tar file instead of a folder.
        #[arg(long)]
        tar: bool,
        /// Sign the manifest with the ed25519 key in the variable `capsules.signing_key_env` names.
        #[arg(long)]
        sign: bool,
    },
    /// Verify a capsule, then store it as a new agent or a newer epoch of a stored one. It
    /// must be signed by a key of `capsules.trusted_keys`; a newer epoch of a stored agent
    /// always must.
    Import {
        path: PathBuf,
        /// Import a new agent whose capsule has no trusted signature (audited as such).
        #[arg(long)]
        allow_unsigned: bool,
    },
}

/// Runs a capsule command. `verify` touches neither configuration nor database.
pub async fn run(command: CapsuleCommand) -> anyhow::Result<()> {
    match command {
        CapsuleCommand::Verify { path, keys, require_signature } => {
            verify(&path, &VerifyOptions { trusted_keys: keys, require_signature, ..VerifyOptions::default() })
        }
        CapsuleCommand::Export { agent_id, out, tar, sign } => {
            let cfg = Config::load()?;
            let pool = airlock_core::db::connect(&cfg.database).await?;
            airlock_core::db::migrate(&pool).await?;
            let signer = if sign { Some(Signer::from_env(&cfg.capsules.signing_key_env)?) } else { None };
            let store = DirArchive::new(&cfg.capsules.store_dir);
            let m =
                export(&pool, &store, &AgentId::parse(&agent_id)?, &out, tar, signer.as_ref(), &cli_actor()).await?;
            println!(
                "exported {} epoch {} (holder {}) to {}",
                m.agent_id,
                m.epoch,
                display_holder(&m.holder),
                out.display()
            );
            Ok(())
        }
        CapsuleCommand::Import { path, allow_unsigned } => {
            let cfg = Config::load()?;
            let pool = airlock_core::db::connect(&cfg.database).await?;
            airlock_core::db::migrate(&pool).await?;
            let store = DirArchive::new(&cfg.capsules.store_dir);
            let trust = Trust { trusted_keys: &cfg.capsules.trusted_keys, allow_unsigned };
            let limits = TarLimits::from_config(&cfg.capsules);
            let a = import_within(&pool, &store, &path, &cli_actor(), &trust, &limits).await?;
            println!("imported {} at epoch {}", a.id, a.epoch);
            Ok(())
        }
    }
}

fn display_holder(h: &str) -> &str {
    if h.is_empty() { "none" } else { h }
}

fn cli_actor() -> String {
    format!("cli:{}", std::env::var("USER").ok().filter(|u| !u.is_empty()).unwrap_or_else(|| "unknown".into()))
}

/// Prints `ok`, or each problem on its own line and fails.
pub fn verify(path: &FsPath, opts: &VerifyOptions) -> anyhow::Result<()> {
    let report = verify_path(path, opts).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if report.is_ok() {
        println!("ok");
        return Ok(());
    }
    for p in &report.problems {
        println!("{p}");
    }
    anyhow::bail!("{} does not verify ({} problems)", path.display(), report.problems.len())
}

/// Writes the agent's latest checkpoint from the store as a capsule folder or tar, audited
/// (a capsule carries the agent's memory and journal out of airlock): the entry is committed
/// once the capsule is written, and nothing is written when the audit cannot be.
pub async fn export(
    pool: &PgPool,
    store: &dyn Archive,
    agent: &AgentId,
    out: &FsPath,
    tar: bool,
    signer: Option<&Signer>,
    actor: &str,
) -> anyhow::Result<airlock_capsule::Manifest> {
    let row = agents::get(pool, agent).await?.ok_or_else(|| anyhow::anyhow!("no agent {agent}"))?;
    let mut cap =
        store.get_checkpoint(agent)?.ok_or_else(|| anyhow::anyhow!("the store holds no checkpoint of {agent}"))?;
    if cap.manifest.epoch > row.max_epoch {
        anyhow::bail!(
            "the store's checkpoint of {agent} has epoch {} beyond any Postgres handed out",
            cap.manifest.epoch
        );
    }
    cap.manifest.exported_at = now_rfc3339();
    let mut tx = pool.begin().await?;
    airlock_core::audit::record_as(
        &mut tx,
        actor,
        "admin",
        airlock_core::audit::Action {
            action: "capsule.export",
            target_kind: "agent",
            target_id: agent.to_string(),
            reason: None,
            data: json!({"epoch": cap.manifest.epoch, "tar": tar, "signed_by": signer.map(Signer::key_id),
                         "out": out.display().to_string()}),
        },
    )
    .await?;
    let blobs = StoreBlobs(store);
    if tar {
        cap.write_tar(out, &blobs, signer)?;
    } else {
        cap.write_dir(out, &blobs, signer)?;
    }
    tx.commit().await?;
    Ok(cap.manifest)
}

/// Whose signatures an import trusts.
#[derive(Debug, Clone, Copy)]
pub struct Trust<'a> {
    /// `capsules.trusted_keys`: ed25519 public keys, hex.
    pub trusted_keys: &'a [String],
    /// `--allow-unsigned`: a new agent may be imported without a trusted signature.
    pub allow_unsigned: bool,
}

/// Verifies a capsule folder or tar and stores it: blobs and checkpoint into the store,
/// the agent into Postgres (new, or a newer epoch of a stored agent), audited.
///
/// The capsule must be signed by a key of `trust.trusted_keys`. Without such a signature
/// (unsigned, or signed by another key) only a new agent is imported, and only with
/// `trust.allow_unsigned`, which the audit entry records; a capsule naming a stored agent
/// is refused, so nobody replaces an agent with a capsule they made up.
pub async fn import(
    pool: &PgPool,
    store: &dyn Archive,
    path: &FsPath,
    actor: &str,
    trust: &Trust<'_>,
) -> anyhow::Result<agents::Agent> {
    import_within(pool, store, path, actor, trust, &TarLimits::default()).await
}

/// [`import`] of a tar within `limits` (`capsules.max_tar_*`).
pub async fn import_within(
    pool: &PgPool,
    store: &dyn Archive,
    path: &FsPath,
    actor: &str,
    trust: &Trust<'_>,
    limits: &TarLimits,
) -> anyhow::Result<agents::Agent> {
    let report = verify_path(path, &VerifyOptions { tar_limits: *limits, ..VerifyOptions::default() })?;
    if !report.is_ok() {
        let lines: Vec<String> = report.problems.iter().map(ToString::to_string).collect();
        anyhow::bail!("{} does not verify:\n{}", path.display(), lines.join("\n"));
    }
    // Signed, and by whom it claims: now whether that key is one the operator trusts.
    let trusted = report.signed
        && !trust.trusted_keys.is_empty()
        && verify_path(
            path,
            &VerifyOptions { trusted_keys: trust.trusted_keys.to_vec(), require_signature: true, tar_limits: *limits },
        )?
        .is_ok();
    let (cap, blobs): (CapsuleFiles, Box<dyn BlobSource>) = if std::fs::metadata(path)?.is_dir() {
        let (c, b) = CapsuleFiles::read_dir(path)?;
        (c, Box::new(b))
    } else {
        let (c, b) = CapsuleFiles::read_tar_within(path, limits)?;
        (c, Box::new(b))
    };
    cap.check()?;
    let sha = cap.manifest_sha256();
    let mut tx = pool.begin().await?;
    if !trusted {
        let what = if report.signed { "signed by a key not in" } else { "not signed by a key of" };
        if agents::get(&mut *tx, cap.agent_id()).await?.is_some() {
            anyhow::bail!(
                "{}: agent {} exists; a capsule that replaces it must be signed by a key of capsules.trusted_keys \
                 (this one is {what} capsules.trusted_keys)",
                path.display(),
                cap.agent_id()
            );
        }
        if !trust.allow_unsigned {
            anyhow::bail!(
                "{}: the capsule is {what} capsules.trusted_keys; import it as a new agent with --allow-unsigned \
                 (audited), or sign it with a trusted key",
                path.display()
            );
        }
    }
    let signed_by = if trusted { report.signed_by.as_deref() } else { None };
    let row = agents::record_import(&mut *tx, cap.agent_id(), cap.manifest.epoch, &sha, signed_by).await?;
    airlock_core::audit::record_as(
        &mut tx,
        actor,
        "admin",
        airlock_core::audit::Action {
            action: "capsule.import",
            target_kind: "agent",
            target_id: cap.agent_id().to_string(),
            reason: (!trusted).then_some("imported without a trusted signature (--allow-unsigned)"),
            data: json!({"epoch": cap.manifest.epoch, "manifest_sha256": sha, "trusted_signature": trusted,
                         "signed_by": signed_by, "allow_unsigned": !trusted}),
        },
    )
    .await?;
    archive::put_capsule(store, &cap, blobs.as_ref())?;
    tx.commit().await?;
    Ok(row)
}

/// The capsule routes, merged into the admin router.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(get_agent)).routes(routes!(create_migration)).routes(routes!(get_migration))
}

fn agent_view(a: &agents::Agent) -> Value {
    json!({"id": a.id, "holder": a.holder, "epoch": a.epoch, "state": a.state.as_str(),
           "max_epoch": a.max_epoch, "updated_at": a.updated_at})
}

/// Where an agent runs: its holder node, epoch and state (`stored`, `active`, `migrating`).
#[utoipa::path(get, path = "/admin/v1/agents/{id}", params(("id" = String, Path, description = "agent id")),
    responses((status = 200, description = "`{id, holder, epoch, state}`"), (status = 404)))]
pub async fn get_agent(
    State(pool): State<PgPool>,
    auth: Auth,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    auth.require(Role::Operator)?;
    let id = AgentId::parse(&id).map_err(|e| ApiError::validation(e.to_string()))?;
    let a = agents::get(&pool, &id).await?.ok_or_else(|| ApiError::not_found("agent"))?;
    Ok(Json(agent_view(&a)))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrationBody {
    /// The node to move the agent to (one of `nodes.<id>`).
    target_node: String,
    reason: Option<String>,
}

/// Enqueues a `capsule.migrate` job that moves the agent to `target_node`.
#[utoipa::path(post, path = "/admin/v1/agents/{id}/migrations", params(("id" = String, Path, description = "agent id")),
    request_body = MigrationBody,
    responses((status = 202, description = "`{id, phase}`"), (status = 400, description = "unknown node"), (status = 404),
        (status = 409, description = "already on that node, or already migrating")))]
pub async fn create_migration(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<MigrationBody>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let who = auth.require(Role::Operator)?;
    let agent = AgentId::parse(&id).map_err(|e| ApiError::validation(e.to_string()))?;
    let target = NodeId::parse(&body.target_node).map_err(|e| ApiError::validation(format!("target_node: {e}")))?;
    if !state.config.nodes.contains_key(target.as_str()) {
        return Err(ApiError::validation(format!("target_node: `{target}` is not a configured node (nodes.<id>.url)")));
    }
    let mut tx = state.pool.begin().await?;
    let m = relocation::create(&mut tx, &agent, &target, &who.name, MIGRATE_MAX_ATTEMPTS).await?;
    airlock_core::audit::record(
        &mut tx,
        who,
        airlock_core::audit::Action {
            action: "agent.migrate",
            target_kind: "agent",
            target_id: agent.to_string(),
            reason: body.reason.as_deref(),
            data: json!({"migration_id": m.id, "source_node": m.source_node, "target_node": m.target_node,
                         "from_epoch": m.from_epoch, "epoch": m.epoch}),
        },
    )
    .await?;
    tx.commit().await?;
    Ok((StatusCode::ACCEPTED, Json(json!({"id": m.id, "phase": m.phase, "agent_id": m.agent_id, "epoch": m.epoch}))))
}

/// The public view of a migration with its history.
pub async fn migration_view(pool: &PgPool, m: &Relocation) -> Result<Value, sqlx::Error> {
    let history = relocation::history(pool, m.id).await?;
    Ok(json!({
        "id": m.id, "agent_id": m.agent_id, "source_node": m.source_node, "target_node": m.target_node,
        "from_epoch": m.from_epoch, "epoch": m.epoch, "phase": m.phase, "outcome": m.outcome(),
        "reason": m.reason, "manifest_sha256": m.manifest_sha256,
        "blobs": {"total": m.blobs_total, "sent": m.blobs_sent, "skipped": m.blobs_skipped, "bytes_sent": m.bytes_sent},
        "requested_by": m.requested_by, "job_id": m.job_id,
        "created_at": m.created_at, "updated_at": m.updated_at, "finished_at": m.finished_at,
        "history": history,
    }))
}

/// A migration: its phase, the history of phases with times, and its outcome.
#[utoipa::path(get, path = "/admin/v1/migrations/{id}", params(("id" = String, Path, description = "migration id")),
    responses((status = 200, description = "phase, history, outcome"), (status = 404)))]
pub async fn get_migration(
    State(pool): State<PgPool>,
    auth: Auth,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    auth.require(Role::Operator)?;
    let m = relocation::get(&pool, parse_id(&id)?).await?.ok_or_else(|| ApiError::not_found("migration"))?;
    Ok(Json(migration_view(&pool, &m).await?))
}
