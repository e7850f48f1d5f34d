-- The claim becomes a plain statement that workers keep prepared (`queue/src/claim.rs`),
-- instead of a call of `airlock_jobs_claim`: the function's call, the rows its RETURN QUERY
-- gathers and the settings it saves and restores cost more than the claim's own work.
--
-- The function read which slots of the ring hold rows (`0030_claim_pruned`) at every claim,
-- and skipped the others when its plan started; a statement can only skip partitions when
-- its plan starts by its parameters, not by what a volatile function returns. So the worker
-- passes the slots its last claim found holding rows, and every claim says which hold rows
-- now: this function, which the claim statement calls once. A claim that was given fewer
-- than those may have passed jobs over, and its worker claims again at once (never idles on
-- it) with the slots it learned.
--
-- `airlock_jobs_claim` stays, for workers of the previous release until they are replaced.

-- The slots of the ring whose file is not empty, in slot order. An insert extends the file
-- before it commits: a job that a snapshot taken before this call sees lies in one of them.
CREATE FUNCTION airlock_job_ring_used() RETURNS smallint[] LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT array_remove(ARRAY[CASE WHEN pg_relation_size('jobs_ring_0') > 0 THEN 0 END,
                              CASE WHEN pg_relation_size('jobs_ring_1') > 0 THEN 1 END,
                              CASE WHEN pg_relation_size('jobs_ring_2') > 0 THEN 2 END,
                              CASE WHEN pg_relation_size('jobs_ring_3') > 0 THEN 3 END]::smallint[], NULL)
$$;
