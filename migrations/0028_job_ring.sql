-- `jobs` is partitioned, so that the versions claims and completions leave behind are
-- reclaimed by TRUNCATE, which no long transaction can hold up, instead of by vacuum, which
-- a transaction pinning the xmin horizon stops for as long as it stays open.
--
--   jobs            LIST (state)
--   ├── jobs_done   completed, failed, cancelled: appended when a job finishes, pruned by
--   │               retention; never written by a claim, and never read by one
--   └── jobs_live   available, running, parked: LIST (slot)
--       ├── jobs_ring_0 … jobs_ring_3   the ring: new jobs go to the current slot
--       │                               (`job_ring`); workers make the next one current
--       │                               every `worker.ring_slot_seconds` and truncate a slot
--       │                               once none of its jobs is live any more
--       └── jobs_long   (slot -1) the live jobs that outlived their slot: parked, waiting in
--                       a paused queue, running for long. Moved here so they never keep a
--                       slot from being truncated; vacuumed as a table
--
-- A job that finishes is deleted from its live partition and inserted into `jobs_done` in
-- the same statement (never an UPDATE of its state across partitions: a concurrent locker of
-- a row that moved partitions gets an error, where one of a deleted row passes it over, as
-- it passed over a row whose state changed). Everything else a job goes through (claim,
-- heartbeat, retry, park) updates it where it is.
--
-- Whoever reads `jobs` reads every job, as before. The id is the primary key of each
-- partition; a key across partitions would have to include the partition keys, so ids stay
-- unique because they are UUIDs made once per job and a move is one statement. A unique key
-- is unique among live jobs, which now lie in several partitions: `airlock_job_key_free`
-- checks it under a lock of the key (see there).

-- The ring's state: one row, the slot new jobs go to and since when it has been current.
CREATE TABLE job_ring (
    -- one row only
    one     boolean PRIMARY KEY DEFAULT true CONSTRAINT job_ring_one CHECK (one),
    -- a slot of the ring (a partition `jobs_ring_<current>` of `jobs_live`)
    current smallint NOT NULL CONSTRAINT job_ring_current CHECK (current >= 0),
    since   timestamptz NOT NULL DEFAULT now()
);
INSERT INTO job_ring (current) VALUES (0);

-- The slot a job inserted now goes to: the ring's current one, as the inserting statement
-- sees it. A statement that read it just before a switch inserts into the slot before, which
-- is harmless: that slot is truncated only once none of its jobs is live.
CREATE FUNCTION airlock_job_slot() RETURNS smallint LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT current FROM job_ring
$$;

-- The table as it was becomes the finished jobs' partition: no row of it is copied.
ALTER TABLE jobs RENAME TO jobs_done;
ALTER INDEX jobs_pkey RENAME TO jobs_done_pkey;
ALTER INDEX jobs_finished_idx RENAME TO jobs_done_finished_idx;
ALTER TABLE jobs_done ADD COLUMN slot smallint NOT NULL DEFAULT 0;

CREATE TABLE jobs (LIKE jobs_done INCLUDING DEFAULTS INCLUDING CONSTRAINTS) PARTITION BY LIST (state);
ALTER TABLE jobs ALTER COLUMN slot SET DEFAULT airlock_job_slot();
CREATE TABLE jobs_live PARTITION OF jobs FOR VALUES IN ('available', 'running', 'parked') PARTITION BY LIST (slot);

-- The ring's partitions are never vacuumed nor analyzed: TRUNCATE reclaims them whole, and
-- leaves them without statistics, so that the planner sizes one by its pages at planning
-- time (at least ten) and always reaches a job by an index. Statistics taken while a slot
-- was nearly empty would make a kept plan scan it whole once it has filled.
DO $$
BEGIN
    FOR s IN 0..3 LOOP
        EXECUTE format('CREATE TABLE jobs_ring_%s PARTITION OF jobs_live FOR VALUES IN (%s)
                        WITH (autovacuum_enabled = false, toast.autovacuum_enabled = false)', s, s);
    END LOOP;
END $$;
-- Vacuumed as `jobs` was (0006): a fixed number of changed rows, no throttling.
CREATE TABLE jobs_long PARTITION OF jobs_live FOR VALUES IN (-1) WITH (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 5000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);

-- Live jobs move to the ring's first slot.
INSERT INTO jobs_live SELECT * FROM jobs_done WHERE state IN ('available', 'running', 'parked');
DELETE FROM jobs_done WHERE state IN ('available', 'running', 'parked');
DROP INDEX jobs_claim_idx, jobs_lease_idx, jobs_unique_live_idx;

-- Each live partition: its primary key, and the indexes of the claim (only available jobs,
-- in claim order), of the rescuer (leases) and of unique keys, named after the partition.
-- The partitioned indexes over them make every live partition have them.
DO $$
DECLARE
    leaf text;
BEGIN
    FOREACH leaf IN ARRAY ARRAY['jobs_ring_0', 'jobs_ring_1', 'jobs_ring_2', 'jobs_ring_3', 'jobs_long'] LOOP
        EXECUTE format('ALTER TABLE %I ADD PRIMARY KEY (id)', leaf);
        EXECUTE format('CREATE INDEX %I ON %I (priority, run_at, id) WHERE state = ''available''', leaf || '_claim_idx', leaf);
        EXECUTE format('CREATE INDEX %I ON %I (lease_expires_at) WHERE lease_owner IS NOT NULL', leaf || '_lease_idx', leaf);
        EXECUTE format('CREATE INDEX %I ON %I (unique_key) WHERE unique_key IS NOT NULL', leaf || '_key_idx', leaf);
    END LOOP;
END $$;
CREATE INDEX jobs_claim_idx ON jobs_live (priority, run_at, id) WHERE state = 'available';
CREATE INDEX jobs_lease_idx ON jobs_live (lease_expires_at) WHERE lease_owner IS NOT NULL;
CREATE INDEX jobs_key_idx ON jobs_live (unique_key) WHERE unique_key IS NOT NULL;

-- What remains are finished jobs: the constraint says so, and lets the partition attach
-- without another scan.
ALTER TABLE jobs_done ADD CONSTRAINT jobs_done_finished CHECK (state IN ('completed', 'failed', 'cancelled'));
ALTER TABLE jobs ATTACH PARTITION jobs_done FOR VALUES IN ('completed', 'failed', 'cancelled');

-- Whether no live job holds `key`; the caller may then make one that does, until it commits.
-- It first takes a lock of the key for the caller's transaction, so that two transactions
-- making a job of the same key take turns: the second waits for the first to end, and
-- (being VOLATILE, its query takes a snapshot of its own, after the wait) sees the first's
-- job. A unique index cannot say it any more: live jobs lie in several partitions, and a
-- job keeps its key while it moves between them. Every statement that makes a job live
-- asks it (enqueueing, retrying a failed job), for each row; nothing else writes `unique_key`.
CREATE FUNCTION airlock_job_key_free(key text) RETURNS boolean LANGUAGE plpgsql VOLATILE COST 1000 AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1246710377, hashtext(key));
    RETURN NOT EXISTS (SELECT 1 FROM jobs_live WHERE unique_key = key);
END $$;

-- The ring's slots and their partitions, in slot order.
CREATE FUNCTION airlock_job_ring() RETURNS TABLE (slot smallint, leaf regclass) LANGUAGE sql STABLE AS $$
    SELECT m[1]::smallint, c.oid::regclass
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid,
         LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid), '^FOR VALUES IN \(''(\d+)''\)$') m
    WHERE i.inhparent = 'jobs_live'::regclass AND m IS NOT NULL
    ORDER BY 1
$$;

-- Each slot of the ring as it is now: current or not, its size on disk, and whether it is
-- fit to be made current (nothing on disk and no statistics: truncated, and nothing since).
-- `live` says whether a job of it is live; it reads the slot (up to its first live row).
CREATE FUNCTION airlock_job_ring_state()
RETURNS TABLE (slot smallint, current boolean, since timestamptz, bytes bigint, fit boolean, live boolean)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    r record;
    cur job_ring;
BEGIN
    SELECT * INTO cur FROM job_ring;
    FOR r IN SELECT g.slot, g.leaf, c.reltuples FROM airlock_job_ring() g JOIN pg_class c ON c.oid = g.leaf LOOP
        slot := r.slot;
        current := r.slot = cur.current;
        since := CASE WHEN current THEN cur.since END;
        bytes := pg_total_relation_size(r.leaf);
        fit := pg_relation_size(r.leaf) = 0 AND r.reltuples < 0;
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', r.leaf) INTO live;
        RETURN NEXT;
    END LOOP;
END $$;

-- Makes the next slot of the ring that is fit current, if the current one has been so for
-- at least `slot_seconds` or has statistics (`due`): returns the slot made current, or NULL (not due, or none
-- fit: every other slot still holds live jobs, or has not been truncated yet); no row while
-- another caller is at it. The slot after the current one in ring order is taken first, so a
-- slot whose jobs are still live is passed over until it empties.
CREATE FUNCTION airlock_job_ring_switch(slot_seconds integer) RETURNS TABLE (switched smallint, due boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    cur job_ring;
BEGIN
    IF slot_seconds < 1 THEN
        RAISE EXCEPTION 'slot_seconds must be positive' USING ERRCODE = '22023';
    END IF;
    IF NOT pg_try_advisory_xact_lock(4706955316487293701) THEN
        RETURN;
    END IF;
    SELECT * INTO cur FROM job_ring FOR UPDATE;
    -- Also due once someone analyzed the current slot (an ANALYZE of the whole database):
    -- statistics taken while it was nearly empty would have kept plans scan it whole as it
    -- fills. The next slot takes over, and this one, truncated once it drains, loses them.
    due := cur.since <= now() - make_interval(secs => slot_seconds)
        OR (SELECT c.reltuples >= 0 FROM airlock_job_ring() g JOIN pg_class c ON c.oid = g.leaf
            WHERE g.slot = cur.current);
    IF due THEN
        SELECT g.slot INTO switched FROM airlock_job_ring() g JOIN pg_class c ON c.oid = g.leaf
        WHERE g.slot <> cur.current AND pg_relation_size(g.leaf) = 0 AND c.reltuples < 0
        ORDER BY g.slot < cur.current, g.slot LIMIT 1;
        IF switched IS NOT NULL THEN
            UPDATE job_ring SET current = switched, since = now();
        END IF;
    END IF;
    RETURN NEXT;
END $$;

-- Moves `batch` jobs of slot `s` of the ring that nobody holds (available or parked; one
-- another statement has locked is passed over) to `jobs_long`, and returns how many moved.
-- For a slot that is no longer current (for the current one, nothing moves): its jobs that
-- outlived it. Running jobs are moved
-- only by `airlock_job_ring_recycle`, under the slot's lock, so that no holder's write can
-- find its job gone in the middle of a move.
CREATE FUNCTION airlock_job_ring_evacuate(s smallint, batch integer) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    leaf regclass;
    n bigint;
BEGIN
    SELECT g.leaf INTO leaf FROM airlock_job_ring() g WHERE g.slot = s;
    IF leaf IS NULL OR batch < 1 THEN
        RAISE EXCEPTION 'no slot % of the ring, or a batch under 1', s USING ERRCODE = '22023';
    END IF;
    IF (SELECT current FROM job_ring) = s THEN
        -- made current meanwhile (by another worker, once it had emptied): nothing to move
        RETURN 0;
    END IF;
    EXECUTE format(
        'WITH gone AS (DELETE FROM %1$s j WHERE j.ctid = ANY (ARRAY(
             SELECT ctid FROM %1$s WHERE state IN (''available'', ''parked'') LIMIT $1 FOR UPDATE SKIP LOCKED))
         RETURNING j.*)
         INSERT INTO jobs_long SELECT id, kind, queue, payload, state, priority, run_at, attempt, max_attempts,
             effect_class, effect_started_at, lease_owner, lease_expires_at, heartbeat_at, attempted_at,
             last_error, unique_key, created_at, finished_at, -1 FROM gone', leaf) USING batch;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- Truncates one slot of the ring that is not current and holds no live job, the oldest first
-- (in ring order after the current one), or, with `evacuate`, that slot after moving every
-- job still live in it to `jobs_long`, running ones included. Either way under the slot's
-- ACCESS EXCLUSIVE lock, which waits at most `lock_timeout_ms` (call it in a transaction of
-- its own: the timeout holds for the rest of it): a statement that reads or writes the slot
-- waits for the truncation, then sees the jobs where they were moved; none can be halfway.
-- Returns the slot, whether it was truncated (false: its lock was busy, or a job arrived
-- meanwhile; try again later) and how many jobs were moved; no row when no slot needs it or
-- another caller is at it. A slot fit to be made current, or current, is left alone.
CREATE FUNCTION airlock_job_ring_recycle(lock_timeout_ms integer, evacuate smallint DEFAULT NULL)
RETURNS TABLE (slot smallint, truncated boolean, moved bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    cur smallint;
    r record;
    live boolean;
BEGIN
    IF lock_timeout_ms < 1 THEN
        RAISE EXCEPTION 'lock_timeout_ms must be positive' USING ERRCODE = '22023';
    END IF;
    IF NOT pg_try_advisory_xact_lock(4706955316487293701) THEN
        RETURN;
    END IF;
    SELECT j.current INTO cur FROM job_ring j;
    FOR r IN SELECT g.slot, g.leaf FROM airlock_job_ring() g JOIN pg_class c ON c.oid = g.leaf
             WHERE g.slot <> cur AND (evacuate IS NULL OR g.slot = evacuate)
               AND (pg_relation_size(g.leaf) > 0 OR c.reltuples >= 0)
             ORDER BY g.slot < cur, g.slot LOOP
        IF evacuate IS NULL THEN
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', r.leaf) INTO live;
            CONTINUE WHEN live;
        END IF;
        slot := r.slot;
        moved := 0;
        BEGIN
            PERFORM set_config('lock_timeout', lock_timeout_ms || 'ms', true);
            EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', r.leaf);
        EXCEPTION WHEN lock_not_available THEN
            truncated := false;
            RETURN NEXT;
            RETURN;
        END;
        IF evacuate IS NULL THEN
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', r.leaf) INTO live;
        ELSE
            EXECUTE format(
                'WITH gone AS (DELETE FROM %s RETURNING *)
                 INSERT INTO jobs_long SELECT id, kind, queue, payload, state, priority, run_at, attempt,
                     max_attempts, effect_class, effect_started_at, lease_owner, lease_expires_at, heartbeat_at,
                     attempted_at, last_error, unique_key, created_at, finished_at, -1 FROM gone', r.leaf);
            GET DIAGNOSTICS moved = ROW_COUNT;
            live := false;
        END IF;
        IF NOT live THEN
            EXECUTE format('TRUNCATE %s', r.leaf);
        END IF;
        truncated := NOT live;
        RETURN NEXT;
        RETURN;
    END LOOP;
END $$;

REVOKE ALL ON FUNCTION airlock_job_ring_switch(integer), airlock_job_ring_evacuate(smallint, integer),
    airlock_job_ring_recycle(integer, smallint) FROM PUBLIC;

-- As in 0025: a table never analyzed is analyzed once it holds work, but for the ring's
-- slots, which are kept without statistics (see above), and the partitioned tables, whose
-- ANALYZE would analyze every partition, the ring's included.
CREATE OR REPLACE FUNCTION airlock_first_analyze(min_changes bigint) RETURNS SETOF regclass
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    t regclass;
BEGIN
    IF NOT pg_try_advisory_xact_lock(x'4149524c4f434b04'::bigint) THEN
        RETURN;
    END IF;
    FOR t IN
        SELECT s.relid::regclass FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
        WHERE s.schemaname = current_schema() AND s.last_analyze IS NULL AND s.last_autoanalyze IS NULL
          AND s.n_mod_since_analyze >= greatest(min_changes, 1) AND c.relkind = 'r'
          AND s.relid NOT IN (SELECT leaf FROM airlock_job_ring())
        ORDER BY s.n_mod_since_analyze DESC
    LOOP
        EXECUTE format('ANALYZE (SKIP_LOCKED) %s', t);
        RETURN NEXT t;
    END LOOP;
END $$;

SELECT airlock_grant_application('airlock_app');
