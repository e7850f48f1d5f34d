-- A bounded claim starts at the last job its worker claimed, not a second of `run_at` before
-- it. The ring's slots are never vacuumed: every job claimed from a slot leaves an entry at
-- the front of the slot's claim index until the slot is truncated, whatever the xmin horizon,
-- and a claim from the front steps over all of them (a slot's whole backlog by the time it is
-- drained). Started a second before the last job's `run_at`, a bounded claim still stepped
-- over every job enqueued in that second: all of a backlog enqueued at once.
--
-- The second is what lets a job enqueued by a transaction that began before the last job's
-- was (its `run_at` is that transaction's start) and committed after it be claimed at once.
-- Any job committed from now on by a transaction no longer than a second has `run_at` at or
-- after a second ago; so the claim starts at the last job claimed, by its whole key
-- (`from_priority`, `from_run_at`, `from_id`), or at a second ago if that is earlier. What
-- sorts before (a more urgent job, one released, a longer transaction's) is the unbounded
-- claim's, as before.
--
-- The function gains an argument: the old one is dropped (a worker of an earlier release
-- fails its claims, and backs off, until it is replaced; no job is lost).

DROP FUNCTION airlock_jobs_claim(text, text[], text[], bigint, float8, smallint, timestamptz);

CREATE FUNCTION airlock_jobs_claim(owner text, queues text[], paused text[], lim bigint, lease_seconds float8,
                                   from_priority smallint, from_run_at timestamptz, from_id uuid)
RETURNS SETOF jobs LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET enable_sort = off SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    s0 smallint;
    s1 smallint;
    s2 smallint;
    s3 smallint;
    -- Where a bounded claim starts in claim order (with `from_priority`).
    start_at timestamptz;
    start_id uuid;
BEGIN
    -- NULL for an empty slot: `slot IN (…, NULL)` matches no row of it (see 0030).
    SELECT CASE WHEN pg_relation_size('jobs_ring_0') > 0 THEN 0 END,
           CASE WHEN pg_relation_size('jobs_ring_1') > 0 THEN 1 END,
           CASE WHEN pg_relation_size('jobs_ring_2') > 0 THEN 2 END,
           CASE WHEN pg_relation_size('jobs_ring_3') > 0 THEN 3 END
    INTO s0, s1, s2, s3;
    start_at := least(coalesce(from_run_at, '-infinity'), now() - interval '1 second');
    start_id := CASE WHEN start_at = from_run_at THEN from_id END;
    RETURN QUERY
    UPDATE jobs_live j
    SET state = 'running', attempt = j.attempt + 1, lease_owner = owner,
        lease_expires_at = now() + make_interval(secs => lease_seconds), heartbeat_at = now(),
        attempted_at = now(), effect_started_at = NULL
    FROM unnest(ARRAY(
        SELECT l.id FROM jobs_live l
        WHERE l.state = 'available' AND l.run_at <= now()
          AND (queues IS NULL OR l.queue = ANY (queues)) AND l.queue <> ALL (paused)
          AND (l.priority, l.run_at, l.id)
              >= (coalesce(from_priority, -32768), start_at, coalesce(start_id, '00000000-0000-0000-0000-000000000000'))
          AND (from_priority IS NULL OR l.xmax = '0')
          AND l.slot IN (-1, s0, s1, s2, s3)
        ORDER BY l.priority, l.run_at, l.id
        LIMIT lim
        FOR UPDATE SKIP LOCKED)) AS picked(id)
    WHERE j.id = picked.id AND j.slot IN (-1, s0, s1, s2, s3)
    RETURNING j.*;
END $$;
