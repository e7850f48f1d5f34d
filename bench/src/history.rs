//! A month of history, written with set-based SQL: finished deliveries with every row the
//! pipeline writes for one (events hash-chained as the pipeline chains them, scores,
//! reviews, approvals, send attempts, receipts, recipients), a standing review queue, the
//! runs they belong to with their replay logs, and finished jobs. What the bench measures
//! on top of, and what the plan tests hold the hot paths' plans against.
//!
//! The rows are made, not replayed through the service: a million deliveries take minutes
//! this way, and days through the API. Their shapes are the service's: the chain of every
//! delivery verifies (`airlock_delivery::store::events::verify_chain`), its head is on its
//! row, and every finished delivery has its receipt.

use std::time::Instant;

use sqlx::{PgConnection, PgPool};

/// How much history to write.
#[derive(Debug, Clone, Copy)]
pub struct History {
    /// Finished deliveries (sent, and one in twenty rejected by a reviewer).
    pub deliveries: i64,
    /// Deliveries still waiting in review, the newest of the history.
    pub in_review: i64,
    /// Steps of the runs' replay logs, spread over one run per fifty deliveries.
    pub run_steps: i64,
    /// Finished jobs, all within the last day (the default retention keeps a day).
    pub jobs: i64,
}

impl History {
    /// The bench's default: a month of an installation sending some thirty thousand a day.
    pub const MONTH: History =
        History { deliveries: 1_000_000, in_review: 6_000, run_steps: 2_000_000, jobs: 1_000_000 };

    fn runs(&self) -> i64 {
        ((self.deliveries + self.in_review) / 50).max(1)
    }
}

/// The agent every history delivery belongs to is one of these sixteen.
pub const AGENTS: i64 = 16;

/// Writes `h` into the database of `pool` (migrated, and otherwise empty or not: ids are
/// derived from `tag`, so two loads with different tags do not collide), then vacuums and
/// analyzes it as a month of autovacuum would have. Returns the seconds each part took.
pub async fn load(pool: &PgPool, h: History, tag: &str) -> anyhow::Result<Vec<(&'static str, f64)>> {
    let mut conn = pool.acquire().await?;
    let c: &mut PgConnection = &mut conn;
    let mut took = Vec::new();
    // Rows made whole, in dependency order: the per-row reference checks would only
    // re-read what this statement has just written.
    sqlx::query("SET session_replication_role = replica").execute(&mut *c).await?;
    for f in FUNCTIONS {
        sqlx::query(*f).execute(&mut *c).await?;
    }
    let total = h.deliveries + h.in_review;
    let runs = h.runs();
    let steps_per_run = (h.run_steps / runs).max(1);
    let t = Instant::now();
    sqlx::query(
        r#"CREATE TEMP TABLE history (
               g bigint PRIMARY KEY, id uuid NOT NULL, run_id uuid NOT NULL, agent text NOT NULL,
               path text[] NOT NULL, at timestamptz NOT NULL, address text NOT NULL,
               body jsonb NOT NULL, sha text NOT NULL, head text)"#,
    )
    .execute(&mut *c)
    .await?;
    sqlx::query(
        r#"INSERT INTO history (g, id, run_id, agent, path, at, address, body, sha)
           SELECT g, pg_temp.vid($1 || ':delivery', g, now() - interval '1 hour' - interval '30 days' * ($2 - g)::float8 / $2),
                  pg_temp.hid($1 || ':run', g % $3),
                  'history-agent-' || (g % $3 % $5), p.path,
                  -- a month, oldest first, ending an hour ago; the review queue is the newest
                  now() - interval '1 hour' - interval '30 days' * ($2 - g)::float8 / $2,
                  'reader' || (g % 1000) || '@example.org', a.body,
                  encode(sha256(convert_to(a.body::text, 'UTF8')), 'hex')
           FROM generate_series(1, $2) g,
                LATERAL (SELECT CASE
                    WHEN g > $2 - $4 THEN ARRAY['persisted', 'scored', 'in_review']
                    WHEN g % 20 = 0 THEN ARRAY['persisted', 'scored', 'in_review', 'awaiting_approval', 'approved', 'sending', 'sent']
                    WHEN g % 20 = 10 THEN ARRAY['persisted', 'scored', 'in_review', 'rejected']
                    ELSE ARRAY['persisted', 'scored', 'awaiting_approval', 'approved', 'sending', 'sent'] END AS path) p,
                LATERAL (SELECT jsonb_build_object('channel', 'email', 'email', jsonb_build_object(
                    'from', 'agent@example.com', 'to', jsonb_build_array('reader' || (g % 1000) || '@example.org'),
                    'subject', 'Weekly report ' || g,
                    'text', 'The numbers for this week are in: orders up, returns down, nothing unusual to report.'))
                    AS body) a"#,
    )
    .bind(tag)
    .bind(total)
    .bind(runs)
    .bind(h.in_review)
    .bind(AGENTS)
    .execute(&mut *c)
    .await?;
    took.push(("plan", t.elapsed().as_secs_f64()));

    let t = Instant::now();
    sqlx::query(
        r#"INSERT INTO runs (id, agent, state, used_steps, used_tokens, used_cost_micros, epoch, holder,
                             next_seq, result, created_at, updated_at, finished_at)
           SELECT pg_temp.hid($1 || ':run', r), 'history-agent-' || (r % $4), 'completed', $3, 120 * $3, 30 * $3, 1,
                  'history-agent-' || (r % $4), $3 + 1, '{}',
                  now() - interval '1 hour' - interval '30 days' * ($2 - r)::float8 / $2,
                  now() - interval '1 hour' - interval '30 days' * ($2 - r)::float8 / $2 + interval '10 minutes',
                  now() - interval '1 hour' - interval '30 days' * ($2 - r)::float8 / $2 + interval '10 minutes'
           FROM generate_series(0, $2 - 1) r"#,
    )
    .bind(tag)
    .bind(runs)
    .bind(steps_per_run)
    .bind(AGENTS)
    .execute(&mut *c)
    .await?;
    sqlx::query(
        r#"INSERT INTO run_steps (run_id, seq, step_id, kind, data, usage_tokens, usage_cost_micros, epoch, recorded_at)
           SELECT pg_temp.hid($1 || ':run', r), s, 'step-' || s, 'model_output',
                  '{"text": "a recorded answer of a typical size, with a little JSON around it"}', 120, 30, 1,
                  now() - interval '1 hour' - interval '30 days' * ($3 - r)::float8 / $3 + interval '1 second' * s
           FROM generate_series(0, $3 - 1) r, generate_series(1, $2) s"#,
    )
    .bind(tag)
    .bind(steps_per_run)
    .bind(runs)
    .execute(&mut *c)
    .await?;
    took.push(("runs and their steps", t.elapsed().as_secs_f64()));

    let t = Instant::now();
    sqlx::query(
        "INSERT INTO artifacts (sha256, body, size_bytes, created_at)
         SELECT sha, body, octet_length(body::text), at FROM history ON CONFLICT DO NOTHING",
    )
    .execute(&mut *c)
    .await?;
    took.push(("artifacts", t.elapsed().as_secs_f64()));

    // The chains, one event of every delivery per statement, each hashed from the last.
    let t = Instant::now();
    for seq in 1..=7_i32 {
        sqlx::query(
            r#"WITH e AS (
                   SELECT g, id, $1::int AS seq, path[$1 - 1] AS from_state, path[$1] AS to_state,
                          pg_temp.actor(path, $1, agent) AS actor, pg_temp.reason(path, $1) AS reason,
                          pg_temp.data(path, $1) AS data, at + interval '200 milliseconds' * ($1 - 1) AS at, head
                   FROM history WHERE cardinality(path) >= $1),
               hashed AS (
                   SELECT e.*, pg_temp.event_hash(head, id, seq, from_state, to_state, actor, reason, data) AS hash
                   FROM e),
               written AS (
                   INSERT INTO delivery_events (delivery_id, seq, from_state, to_state, actor, reason, data, at,
                                                prev_hash, hash)
                   SELECT id, seq, from_state::delivery_state, to_state::delivery_state, actor, reason, data::jsonb,
                          at, head, hash
                   FROM hashed)
               UPDATE history SET head = hashed.hash FROM hashed WHERE history.g = hashed.g"#,
        )
        .bind(seq)
        .execute(&mut *c)
        .await?;
    }
    took.push(("delivery events", t.elapsed().as_secs_f64()));

    let t = Instant::now();
    sqlx::query(
        r#"INSERT INTO deliveries (id, run_id, step_id, agent, channel, state, version, idempotency_key,
                                   artifact_sha256, submitted_sha256, effect_class, event_hash, created_at, updated_at)
           SELECT id, run_id, 'history-' || g, agent, 'email', path[cardinality(path)]::delivery_state,
                  cardinality(path), 'dlv_' || airlock_effect_key(run_id, 'history-' || g), sha, sha, 'non_repeatable', head, at,
                  at + interval '200 milliseconds' * (cardinality(path) - 1)
           FROM history"#,
    )
    .execute(&mut *c)
    .await?;
    sqlx::query(
        "INSERT INTO delivery_recipients (delivery_id, address, created_at) SELECT id, address, at FROM history",
    )
    .execute(&mut *c)
    .await?;
    sqlx::query(
        r#"INSERT INTO scores (id, delivery_id, artifact_sha256, value, reasons, scorer, threshold, created_at)
           SELECT pg_temp.hid($1 || ':score', g), id, sha, pg_temp.score(path), '[]', 'rules', 0.7,
                  at + interval '200 milliseconds'
           FROM history"#,
    )
    .bind(tag)
    .execute(&mut *c)
    .await?;
    sqlx::query(
        r#"INSERT INTO reviews (id, delivery_id, action, reviewer, note, from_sha256, to_sha256, created_at)
           SELECT pg_temp.hid($1 || ':review', g), id, CASE WHEN 'rejected' = ANY (path) THEN 'reject' ELSE 'accept' END,
                  'reviewer:rita', 'read it through', sha, sha, at + interval '600 milliseconds'
           FROM history WHERE 'in_review' = ANY (path) AND cardinality(path) > 3"#,
    )
    .bind(tag)
    .execute(&mut *c)
    .await?;
    sqlx::query(
        r#"INSERT INTO approvals (id, delivery_id, artifact_sha256, approver, grant_id, note, created_at)
           SELECT pg_temp.hid($1 || ':approval', g), id, sha,
                  CASE WHEN 'in_review' = ANY (path) THEN 'reviewer:rita' END,
                  CASE WHEN 'in_review' = ANY (path) THEN NULL ELSE pg_temp.hid($1 || ':grant', 0) END,
                  CASE WHEN 'in_review' = ANY (path) THEN 'read it through' END,
                  at + interval '200 milliseconds' * (cardinality(path) - 3)
           FROM history WHERE 'sent' = ANY (path)"#,
    )
    .bind(tag)
    .execute(&mut *c)
    .await?;
    sqlx::query(
        r#"INSERT INTO send_attempts (id, delivery_id, job_id, lease_attempt, worker, artifact_sha256, started_at,
                                      outcome, finished_at)
           SELECT pg_temp.hid($1 || ':attempt', g), id, pg_temp.hid($1 || ':send-job', g), 1, 'history-worker', sha,
                  at + interval '200 milliseconds' * (cardinality(path) - 2), 'sent',
                  at + interval '200 milliseconds' * (cardinality(path) - 1)
           FROM history WHERE 'sent' = ANY (path)"#,
    )
    .bind(tag)
    .execute(&mut *c)
    .await?;
    sqlx::query(
        r#"INSERT INTO receipts (id, delivery_id, attempt_id, channel, message_id, provider_response, payload_sha256,
                                 sent_at, attempt, worker)
           SELECT pg_temp.hid($1 || ':receipt', g), id, pg_temp.hid($1 || ':attempt', g), 'email',
                  '<' || id || '@airlock>', '250 2.0.0 queued', sha,
                  at + interval '200 milliseconds' * (cardinality(path) - 1), 1, 'history-worker'
           FROM history WHERE 'sent' = ANY (path)"#,
    )
    .bind(tag)
    .execute(&mut *c)
    .await?;
    took.push(("deliveries and their rows", t.elapsed().as_secs_f64()));

    // The queue's finished work: the score and send jobs of the newest deliveries, all
    // within the day the default retention keeps.
    let t = Instant::now();
    sqlx::query(
        r#"INSERT INTO jobs (id, kind, queue, payload, state, priority, run_at, attempt, max_attempts, effect_class,
                             lease_owner, attempted_at, unique_key, created_at, finished_at)
           SELECT pg_temp.hid($1 || ':job', j), CASE WHEN j % 2 = 0 THEN 'delivery.score' ELSE 'delivery.send' END,
                  CASE WHEN j % 2 = 0 THEN 'default' ELSE 'send' END,
                  jsonb_build_object('delivery_id', h.id), 'completed',
                  CASE WHEN j % 2 = 0 THEN 50 ELSE 40 END, f, 1, 10,
                  (CASE WHEN j % 2 = 0 THEN 'pure' ELSE 'non_repeatable' END)::effect_class, NULL, f,
                  CASE WHEN j % 2 = 0 THEN 'score:' ELSE 'send:' END || h.id,
                  f, f + interval '50 milliseconds'
           FROM generate_series(1, $2) j JOIN history h ON h.g = $3 - j / 2,
                LATERAL (SELECT now() - interval '20 hours' * j::float8 / $2 AS f) t"#,
    )
    .bind(tag)
    .bind(h.jobs)
    .bind(h.deliveries)
    .execute(&mut *c)
    .await?;
    took.push(("finished jobs", t.elapsed().as_secs_f64()));

    sqlx::query("DROP TABLE history").execute(&mut *c).await?;
    sqlx::query("RESET session_replication_role").execute(&mut *c).await?;
    let t = Instant::now();
    for table in TABLES {
        sqlx::query(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {table}"))).execute(&mut *c).await?;
    }
    // Written out now, so that a checkpoint during a measurement does not bill it for the set-up.
    sqlx::query("CHECKPOINT").execute(&mut *c).await?;
    took.push(("vacuum, analyze, checkpoint", t.elapsed().as_secs_f64()));
    conn.close_on_drop();
    Ok(took)
}

/// The sequential scans each table the history fills, and each partition of one, has had
/// so far, as far as the statistics have been written out (a session writes its counts out
/// at the latest when it ends); see [`Scans::since`].
pub async fn seq_scans(pool: &PgPool) -> Result<Scans, sqlx::Error> {
    let rows = sqlx::query_as(
        r#"SELECT t.name AS "table", s.relname::text AS name, s.seq_scan AS seq_scans,
                pg_relation_size(s.relid) / current_setting('block_size')::bigint AS pages
         FROM unnest($1::text[]) t (name)
         JOIN pg_stat_user_tables s ON s.schemaname = current_schema() AND (s.relname = t.name
              OR s.relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = to_regclass(t.name)))
         ORDER BY t.name, s.relname"#,
    )
    .bind(TABLES)
    .fetch_all(pool)
    .await?;
    Ok(Scans(rows))
}

/// One relation of a [`Scans`] reading: a table the history fills or a partition of one.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Relation {
    pub table: String,
    pub name: String,
    pub seq_scans: i64,
    pub pages: i64,
}

/// One reading of [`seq_scans`].
#[derive(Debug, Clone)]
pub struct Scans(pub Vec<Relation>);

impl Scans {
    /// How many of [`TABLES`] the reading found (each must be there to be counted).
    pub fn tables(&self) -> usize {
        TABLES.iter().filter(|&&t| self.0.iter().any(|r| r.table == t)).count()
    }

    /// Per table the history fills (in [`TABLES`] order), the sequential scans since
    /// `before` of the table itself and of those of its partitions that held the history
    /// then: 10 pages (80 kB) or more at `before`. A partition made or filled since (the
    /// current period's) is not the history, and the planner reads one that small whole
    /// rather than through its index.
    pub fn since(&self, before: &Scans) -> Vec<(String, i64)> {
        let then = |r: &Relation| before.0.iter().find(|b| b.table == r.table && b.name == r.name);
        TABLES
            .iter()
            .map(|&table| {
                let n = self
                    .0
                    .iter()
                    .filter(|r| r.table == table)
                    .filter_map(|r| match then(r) {
                        b if r.name == table => Some(r.seq_scans - b.map_or(0, |b| b.seq_scans)),
                        Some(b) if b.pages >= 10 => Some(r.seq_scans - b.seq_scans),
                        _ => None,
                    })
                    .sum();
                (table.to_string(), n)
            })
            .collect()
    }
}

/// The tables the history fills.
pub const TABLES: &[&str] = &[
    "runs",
    "run_steps",
    "artifacts",
    "deliveries",
    "delivery_events",
    "delivery_recipients",
    "scores",
    "reviews",
    "approvals",
    "send_attempts",
    "receipts",
    "jobs",
];

/// The loader's own functions, in this connection's temporary schema.
const FUNCTIONS: &[&str] = &[
    // A stable id per tag and number.
    "CREATE FUNCTION pg_temp.hid(tag text, g bigint) RETURNS uuid LANGUAGE sql IMMUTABLE
     AS $$ SELECT md5(tag || ':' || g)::uuid $$",
    // A stable UUID v7 of a moment (deliveries' ids: the event log is partitioned by them).
    "CREATE FUNCTION pg_temp.vid(tag text, g bigint, at timestamptz) RETURNS uuid LANGUAGE sql IMMUTABLE
     AS $$ SELECT overlay(md5(tag || ':' || g) PLACING substr(replace(airlock_uuid_floor(at)::text, '-', ''), 1, 12)
                          FROM 1 FOR 12)::uuid $$",
    // Who took each step of a path.
    r#"CREATE FUNCTION pg_temp.actor(path text[], seq int, agent text) RETURNS text LANGUAGE sql IMMUTABLE AS $$
       SELECT CASE path[seq]
           WHEN 'persisted' THEN 'agent:' || agent
           WHEN 'approved' THEN CASE WHEN 'in_review' = ANY (path) THEN 'reviewer:rita' ELSE 'grant:history' END
           WHEN 'awaiting_approval' THEN CASE WHEN 'in_review' = ANY (path) THEN 'reviewer:rita' ELSE 'worker:history' END
           WHEN 'rejected' THEN 'reviewer:rita'
           ELSE 'worker:history' END $$"#,
    r#"CREATE FUNCTION pg_temp.reason(path text[], seq int) RETURNS text LANGUAGE sql IMMUTABLE AS $$
       SELECT CASE WHEN path[seq] IN ('awaiting_approval', 'approved', 'rejected') AND 'in_review' = ANY (path)
                   THEN 'read it through' END $$"#,
    r#"CREATE FUNCTION pg_temp.score(path text[]) RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
       SELECT CASE WHEN 'in_review' = ANY (path) THEN 0.41 ELSE 0.92 END $$"#,
    // An event's data as the service serialises it (keys sorted, no spaces): the text the
    // hash is taken of; the column holds the same value as jsonb.
    r#"CREATE FUNCTION pg_temp.data(path text[], seq int) RETURNS text LANGUAGE sql IMMUTABLE AS $$
       SELECT CASE path[seq]
           WHEN 'scored' THEN '{"reasons":[],"score":' || pg_temp.score(path) || '}'
           WHEN 'sent' THEN '{"attempt":1}'
           ELSE '{}' END $$"#,
    // `airlock_delivery::store::events::event_hash`, in SQL: the sha256 of the event's
    // content as compact JSON with its keys in order.
    r#"CREATE FUNCTION pg_temp.event_hash(prev text, delivery uuid, seq int, from_state text, to_state text,
                                         actor text, reason text, data text) RETURNS text LANGUAGE sql IMMUTABLE AS $$
       SELECT encode(sha256(convert_to(
           '{"actor":' || to_json(actor)::text || ',"data":' || data || ',"delivery":' || to_json(delivery::text)::text
           || ',"from":' || coalesce(to_json(from_state)::text, 'null') || ',"prev":' || coalesce(to_json(prev)::text, 'null')
           || ',"reason":' || coalesce(to_json(reason)::text, 'null') || ',"seq":' || seq || ',"to":' || to_json(to_state)::text
           || '}', 'UTF8')), 'hex') $$"#,
];
