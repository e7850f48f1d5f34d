-- The jobs' CHECK constraints move from `jobs` to its two partitions, each stated for the
-- states it holds. Postgres compiles a table's CHECK expressions again for every statement
-- that writes it (from their stored text), and the constraints on `jobs` reached every
-- partition with their `state IN (…)` arrays, whose constants are the costliest part to read
-- back: a claim and a completion compiled thirteen expressions between them, about a tenth
-- of the database's work per job. What each says is unchanged, given the partition bounds
-- (`jobs_live`: available, running, parked; `jobs_done`: completed, failed, cancelled):
--
--   jobs_attempts, jobs_kind_check, jobs_queue_check   unchanged, on both
--   jobs_running_has_lease         live: unchanged; done: never both lease columns set
--   jobs_terminal_has_finished_at  live: `jobs_live_unfinished`; done: `jobs_done_finished_at`
--   jobs_effect_only_when_held     live: not while available; done: never
--   jobs_done_finished             the partition bound says it
--
-- On `jobs_done`, which may hold millions of rows, they are added NOT VALID: every row there
-- was checked by the constraints they replace, and new rows are checked as before.

ALTER TABLE jobs
    DROP CONSTRAINT jobs_attempts,
    DROP CONSTRAINT jobs_running_has_lease,
    DROP CONSTRAINT jobs_terminal_has_finished_at,
    DROP CONSTRAINT jobs_effect_only_when_held,
    DROP CONSTRAINT jobs_kind_check,
    DROP CONSTRAINT jobs_queue_check;
ALTER TABLE jobs_done DROP CONSTRAINT jobs_done_finished;

ALTER TABLE jobs_live
    ADD CONSTRAINT jobs_attempts CHECK (attempt >= 0 AND max_attempts >= 1 AND attempt <= max_attempts),
    ADD CONSTRAINT jobs_kind_check CHECK (kind <> '' AND length(kind) <= 100),
    ADD CONSTRAINT jobs_queue_check CHECK (queue <> '' AND length(queue) <= 100),
    ADD CONSTRAINT jobs_running_has_lease CHECK ((state = 'running') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    ADD CONSTRAINT jobs_live_unfinished CHECK (finished_at IS NULL),
    ADD CONSTRAINT jobs_effect_only_when_held CHECK (effect_started_at IS NULL OR state <> 'available');

ALTER TABLE jobs_done
    ADD CONSTRAINT jobs_attempts CHECK (attempt >= 0 AND max_attempts >= 1 AND attempt <= max_attempts) NOT VALID,
    ADD CONSTRAINT jobs_kind_check CHECK (kind <> '' AND length(kind) <= 100) NOT VALID,
    ADD CONSTRAINT jobs_queue_check CHECK (queue <> '' AND length(queue) <= 100) NOT VALID,
    ADD CONSTRAINT jobs_running_has_lease CHECK (lease_owner IS NULL OR lease_expires_at IS NULL) NOT VALID,
    ADD CONSTRAINT jobs_done_finished_at CHECK (finished_at IS NOT NULL) NOT VALID,
    ADD CONSTRAINT jobs_effect_only_when_held CHECK (effect_started_at IS NULL) NOT VALID;
