-- The queue's hot statements as functions, for their plans (see below), and two earlier
-- functions made to keep theirs.

-- The slot a job inserted now goes to (PL/pgSQL keeps the query's plan; the queue's own
-- inserts read `job_ring` once per statement instead).
CREATE OR REPLACE FUNCTION airlock_job_slot() RETURNS smallint LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
BEGIN
    RETURN (SELECT current FROM job_ring);
END $$;

-- Whether a key is free is asked of each live partition's key index, whatever the planner
-- believes of the slots' sizes.
ALTER FUNCTION airlock_job_key_free(text) SET enable_seqscan = off;
ALTER FUNCTION airlock_job_key_free(text) SET plan_cache_mode = force_generic_plan;

-- The claim, and the writes over held jobs (each given the arrays of their ids and attempts,
-- the leases, fenced on them and locking the jobs in id order first, so that two of them over
-- the same jobs, a worker's heartbeat and its completions, cannot deadlock; each returns the
-- `(id, attempt)` of every job it changed, the others' leases being lost). They are functions
-- for one reason: their plans. The ring's slots have no statistics and are truncated in turn,
-- so a plan made while a slot was nearly empty, and kept while it fills, would find jobs with
-- a hash join over whole slots, or sort a slot's backlog; the settings below leave the
-- planner nothing but the indexes, whatever it believes of the slots' sizes. (Statements that
-- reach one job by its id need no such care: an index is cheaper than reading a slot of the
-- ten pages the planner believes at the least.) Callers read the rows they return: a
-- function runs whole when its result is first read.

-- Claims up to `lim` available jobs for `owner` in claim order (priority, run_at, id), bumping
-- each one's attempt (the lease epoch) and leasing it for `lease_seconds`; jobs of `queues`
-- (NULL: every queue), none of `paused`. With `from_priority` set, a bounded claim: it starts
-- at (`from_priority`, `from_run_at`) in claim order, and passes over every version that a
-- transaction has updated or locked since it was written (`xmax` set), which a claim would
-- otherwise follow to its newest version and lock until its own commit (see the queue's
-- `ClaimFrom`). Its plan walks the claim index of each live partition in claim order,
-- merged, and stops after `lim` rows; it then updates the jobs it locked by one primary-key
-- lookup each.
CREATE FUNCTION airlock_jobs_claim(owner text, queues text[], paused text[], lim bigint, lease_seconds float8,
                                   from_priority smallint, from_run_at timestamptz)
RETURNS SETOF jobs LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET enable_sort = off SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
BEGIN
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
        ORDER BY l.priority, l.run_at, l.id
        LIMIT lim
        FOR UPDATE SKIP LOCKED)) AS picked(id)
    WHERE j.id = picked.id
    RETURNING j.*;
END $$;

-- Extends the leases by `seconds`.
CREATE FUNCTION airlock_jobs_heartbeat(ids uuid[], attempts integer[], seconds float8)
RETURNS TABLE (id uuid, attempt integer) LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE jobs_live j SET lease_expires_at = now() + make_interval(secs => seconds), heartbeat_at = now()
    FROM (SELECT h.id FROM jobs_live h JOIN unnest(ids, attempts) AS t(id, attempt)
              ON h.id = t.id AND h.attempt = t.attempt
          WHERE h.state = 'running' ORDER BY h.id FOR UPDATE OF h) AS held
    WHERE j.id = held.id AND j.state = 'running'
    RETURNING j.id, j.attempt;
END $$;

-- Marks the effect of each held job as started, if its lease has not run out.
CREATE FUNCTION airlock_jobs_mark_effect_started(ids uuid[], attempts integer[])
RETURNS TABLE (id uuid, attempt integer) LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE jobs_live j SET effect_started_at = now()
    FROM (SELECT h.id FROM jobs_live h JOIN unnest(ids, attempts) AS t(id, attempt)
              ON h.id = t.id AND h.attempt = t.attempt
          WHERE h.state = 'running' ORDER BY h.id FOR UPDATE OF h) AS held
    WHERE j.id = held.id AND j.state = 'running' AND j.lease_expires_at > now()
    RETURNING j.id, j.attempt;
END $$;

-- Completes each held job: moves it to the finished jobs (`keep`), or deletes it
-- (`retention.delete_completed_jobs`). A job finishes by a DELETE from its live partition,
-- never an UPDATE across partitions: a row updated into another partition makes whoever
-- waited to lock it fail, where a deleted one is passed over, as a row whose state no longer
-- matched was.
CREATE FUNCTION airlock_jobs_complete(ids uuid[], attempts integer[], keep boolean)
RETURNS TABLE (id uuid, attempt integer) LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
BEGIN
    IF keep THEN
        RETURN QUERY
        WITH gone AS (
            DELETE FROM jobs_live j
            USING (SELECT h.id FROM jobs_live h JOIN unnest(ids, attempts) AS t(id, attempt)
                       ON h.id = t.id AND h.attempt = t.attempt
                   WHERE h.state = 'running' ORDER BY h.id FOR UPDATE OF h) AS held
            WHERE j.id = held.id AND j.state = 'running'
            RETURNING j.*)
        INSERT INTO jobs_done (id, kind, queue, payload, state, priority, run_at, attempt, max_attempts,
                               effect_class, effect_started_at, lease_owner, lease_expires_at, heartbeat_at,
                               attempted_at, last_error, unique_key, created_at, finished_at, slot)
        SELECT g.id, g.kind, g.queue, g.payload, 'completed', g.priority, g.run_at, g.attempt, g.max_attempts,
               g.effect_class, NULL, NULL, NULL, g.heartbeat_at, g.attempted_at, g.last_error, g.unique_key,
               g.created_at, now(), g.slot
        FROM gone g
        RETURNING jobs_done.id, jobs_done.attempt;
    ELSE
        RETURN QUERY
        DELETE FROM jobs_live j
        USING (SELECT h.id FROM jobs_live h JOIN unnest(ids, attempts) AS t(id, attempt)
                   ON h.id = t.id AND h.attempt = t.attempt
               WHERE h.state = 'running' ORDER BY h.id FOR UPDATE OF h) AS held
        WHERE j.id = held.id AND j.state = 'running'
        RETURNING j.id, j.attempt;
    END IF;
END $$;
