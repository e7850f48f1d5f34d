-- The claim reads only the live partitions that may hold a job: `jobs_long`, and each slot
-- of the ring whose file is not empty. A slot is empty from its truncation until a job is
-- inserted into it, and an insert extends the file before it commits, so no committed job
-- is passed over; a job committed between the look and the claim's own snapshot is left to
-- the next claim, as one committed just after the claim would be. The partitions passed
-- over are pruned when the claim's (generic) plan starts: it neither scans their claim
-- indexes nor merges them, nor looks the jobs it locked up in them (a job it locked cannot
-- move meanwhile: the ring moves only jobs it can lock).
--
-- The slots are the four of 0028, named here: a migration that changes the ring changes this.

CREATE OR REPLACE FUNCTION airlock_jobs_claim(owner text, queues text[], paused text[], lim bigint, lease_seconds float8,
                                              from_priority smallint, from_run_at timestamptz)
RETURNS SETOF jobs LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET enable_sort = off SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    s0 smallint;
    s1 smallint;
    s2 smallint;
    s3 smallint;
BEGIN
    -- NULL for an empty slot: `slot IN (…, NULL)` matches no row of it.
    SELECT CASE WHEN pg_relation_size('jobs_ring_0') > 0 THEN 0 END,
           CASE WHEN pg_relation_size('jobs_ring_1') > 0 THEN 1 END,
           CASE WHEN pg_relation_size('jobs_ring_2') > 0 THEN 2 END,
           CASE WHEN pg_relation_size('jobs_ring_3') > 0 THEN 3 END
    INTO s0, s1, s2, s3;
    RETURN QUERY
    UPDATE jobs_live j
    SET state = 'running', attempt = j.attempt + 1, lease_owner = owner,
        lease_expires_at = now() + make_interval(secs => lease_seconds), heartbeat_at = now(),
        attempted_at = now(), effect_started_at = NULL
    FROM unnest(ARRAY(
        SELECT l.id FROM jobs_live l
        WHERE l.state = 'available' AND l.run_at <= now()
          AND (queues IS NULL OR l.queue = ANY (queues)) AND l.queue <> ALL (paused)
          AND (l.priority, l.run_at) >= (coalesce(from_priority, -32768), coalesce(from_run_at, '-infinity'))
          AND (from_priority IS NULL OR l.xmax = '0')
          AND l.slot IN (-1, s0, s1, s2, s3)
        ORDER BY l.priority, l.run_at, l.id
        LIMIT lim
        FOR UPDATE SKIP LOCKED)) AS picked(id)
    WHERE j.id = picked.id AND j.slot IN (-1, s0, s1, s2, s3)
    RETURNING j.*;
END $$;
