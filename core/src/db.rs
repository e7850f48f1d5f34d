//! Connecting to Postgres and applying the one schema.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgPool};

use crate::config::DatabaseConfig;

/// The migrations under `migrations/`, embedded once here for every binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Opens a pool. A connection idle for `database.check_after_idle_ms` is checked before
/// use, so a restarted Postgres is survived by the next query rather than by a restart of
/// the process; one in steady use is not (the check is a round trip: per statement, it
/// was a third of a worker's traffic). Statements are prepared once per connection, and
/// Postgres decides per statement whether to plan each execution with its values or keep a
/// generic plan.
pub async fn connect(cfg: &DatabaseConfig) -> Result<PgPool, sqlx::Error> {
    let options: sqlx::postgres::PgConnectOptions = cfg.url.expose().parse()?;
    let idle = Duration::from_millis(cfg.check_after_idle_ms);
    PgPoolOptions::new()
        .max_connections(cfg.max_connections)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(cfg.acquire_timeout_seconds))
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= idle {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
        .connect_with(options)
        .await
}

/// The planner settings of the queue's connections (see [`queue_plans`]).
const QUEUE_PLAN_SETTINGS: &str = "SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off; \
     SET enable_bitmapscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off; SET enable_sort = off";

/// Gives `conn` the planner settings of the queue's connections (see [`queue_plans`]), for
/// the session: what plans a worker's claims and completions get.
pub async fn set_queue_plans(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(QUEUE_PLAN_SETTINGS).execute(conn).await.map(drop)
}

/// A pool of at most `max_connections` to the same database as `pool`, with its settings,
/// for the queue's hottest statements, claims and completions, which the worker keeps
/// prepared:
/// - one generic plan per prepared statement (`plan_cache_mode = force_generic_plan`): their
///   right plan does not depend on their values (a test checks their generic plans), and
///   left to choose, Postgres re-plans them at every execution, because a plan made for the
///   actual values looks cheaper than the generic one; that planning was about a fifth of
///   its CPU under load;
/// - no plan but by index (no sequential or bitmap scan, hash or merge join, or sort): the ring's slots have no statistics and are truncated in turn,
///   and a plan made while they were nearly empty, kept while one fills, would read a
///   backlog whole at every claim.
///
/// sqlx looks a type of the schema up in the catalog the first time a connection meets it,
/// by a query those settings make take a third of a second: each connection first looks up
/// `types` (the schema's types the statements read or write), then takes the settings.
/// Connections open when first needed.
pub fn queue_plans(pool: &PgPool, max_connections: u32, types: &'static [&'static str]) -> PgPool {
    let looked_up = format!("SELECT {}", types.iter().map(|t| format!("NULL::{t}")).collect::<Vec<_>>().join(", "));
    pool.options()
        .clone()
        .max_connections(max_connections)
        .min_connections(0)
        .after_connect(move |conn, _| {
            let looked_up = looked_up.clone();
            Box::pin(async move {
                if !types.is_empty() {
                    sqlx::query(sqlx::AssertSqlSafe(looked_up)).fetch_one(&mut *conn).await?;
                }
                set_queue_plans(conn).await
            })
        })
        .connect_lazy_with((*pool.connect_options()).clone())
}

/// The role the services connect as in a deployment that separates it from the owner of
/// the schema: it reads and writes every table but may only insert into the append-only logs
/// (see `migrations/0021_application_role.sql`). `scripts/dev` and compose create it.
pub const APP_ROLE: &str = "airlock_app";

/// Applies every pending migration, then (when the caller owns the schema) grants
/// [`APP_ROLE`] its rights on every table, the new ones included; safe to run concurrently
/// from several processes (sqlx takes an advisory lock). When nothing is pending the
/// migrator is not run at all, so a service connected as the application role, which may
/// not change the schema, starts against a database its owner has migrated.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    if !pending(pool).await? {
        return Ok(());
    }
    MIGRATOR.run(pool).await?;
    grant_application(pool).await?;
    Ok(())
}

/// Grants [`APP_ROLE`] its rights on every table as they are now (see [`migrate`]); a no-op
/// unless the caller owns the schema and the role exists. Serialised by an advisory lock:
/// two GRANTs on one table at once can fail.
pub async fn grant_application(pool: &PgPool) -> Result<(), sqlx::Error> {
    const GRANT_LOCK: i64 = 0x4149_524c_4f43_4b03;
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(GRANT_LOCK).execute(&mut *tx).await?;
    sqlx::query("SELECT airlock_grant_application($1)").bind(APP_ROLE).execute(&mut *tx).await?;
    tx.commit().await
}

/// Analyzes each table of the schema that was never analyzed and has had at least
/// `min_changes` rows written since (`migrations/0025_first_statistics.sql`, which the
/// application role may call); returns the tables it analyzed. Empty while another caller
/// is at it.
pub async fn first_analyze(pool: &PgPool, min_changes: i64) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT t::text FROM airlock_first_analyze($1) t").bind(min_changes).fetch_all(pool).await
}

/// Whether autovacuum will leave `table`'s dead rows where they are: the server runs with
/// `autovacuum = off` (or without `track_counts`, which it needs), or the table's storage
/// parameters turn it off (`autovacuum_enabled = false`). The queue's ring is reclaimed by
/// truncation, but its long-lived jobs (`jobs_long`) are not: never vacuumed, it keeps every
/// version their claims and completions leave, and claims slow as they step over them; the
/// worker says so when it starts.
pub async fn autovacuum_off(pool: &PgPool, table: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT NOT current_setting('autovacuum')::bool OR NOT current_setting('track_counts')::bool
                OR EXISTS (SELECT 1 FROM pg_class c, pg_options_to_table(c.reloptions) o
                           WHERE c.oid = to_regclass($1) AND o.option_name = 'autovacuum_enabled'
                             AND NOT o.option_value::bool)",
    )
    .bind(table)
    .fetch_one(pool)
    .await
}

/// Whether an embedded migration is not applied yet (any, not only the newest: versions
/// may be applied out of order when a lower one arrives later).
async fn pending(pool: &PgPool) -> Result<bool, sqlx::Error> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL").fetch_one(pool).await?;
    if !exists {
        return Ok(true);
    }
    let applied: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success").fetch_all(pool).await?;
    Ok(MIGRATOR.iter().any(|m| !applied.contains(&m.version)))
}

/// Whether the database answers and every embedded migration is applied.
pub async fn ready(pool: &PgPool) -> bool {
    matches!(pending(pool).await, Ok(false))
}
