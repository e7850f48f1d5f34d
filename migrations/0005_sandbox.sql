-- Sandboxed tasks: an agent asks for a command to run in a sandbox tier; a `sandbox.select`
-- job (or a human) decides the tier and logs the decision; a `sandbox.run` job runs it and
-- writes the outcome onto the decision that chose the tier.
--
-- Tiers and per-agent permissions live in configuration (`sandbox.*`), not here: what a
-- decision used is snapshotted into the decision row (`tier_spec`), so a later change of
-- configuration never rewrites history.

-- Where a task is. Terminal: succeeded, failed, timed_out, denied.
CREATE TYPE sandbox_task_state AS ENUM (
    'selecting', 'awaiting_choice', 'queued', 'running', 'succeeded', 'failed', 'timed_out', 'denied');

-- Who decides the tier: the agent, central rules, a human, or the agent within bounds.
CREATE TYPE sandbox_mode AS ENUM ('agent', 'platform', 'human', 'hybrid');

-- What a decision said: a tier, "a human must choose", or no.
CREATE TYPE sandbox_verdict AS ENUM ('chosen', 'escalated', 'denied');

CREATE TABLE sandbox_tasks (
    id             uuid PRIMARY KEY,
    agent          text NOT NULL CHECK (agent <> ''),
    -- the token that asked (an agent principal)
    principal_id   uuid NOT NULL REFERENCES principals (id),
    -- argv; the first element is the program
    command        text[] NOT NULL CHECK (cardinality(command) BETWEEN 1 AND 256 AND command[1] <> ''),
    -- literal variables of the spec; secrets are names only, resolved on the worker
    env            jsonb NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(env) = 'object'),
    secrets        text[] NOT NULL DEFAULT '{}',
    -- agents whose durable context is mounted read-only into the sandbox
    context        text[] NOT NULL DEFAULT '{}',
    kind           text CHECK (kind <> '' AND length(kind) <= 100),
    size           text CHECK (size IN ('small', 'medium', 'large')),
    -- what "similar tasks" means for the platform's history rule: the kind, else the program
    similarity     text NOT NULL CHECK (similarity <> ''),
    mode           sandbox_mode NOT NULL,
    requested_tier text,
    reason         text CHECK (length(reason) <= 2000),
    -- a sandboxed task is rerun after a lost worker, so it must be safe to repeat
    effect         effect_class NOT NULL DEFAULT 'pure' CHECK (effect IN ('pure', 'idempotent')),
    state          sandbox_task_state NOT NULL DEFAULT 'selecting',
    -- the tier of the decision that chose one
    tier           text,
    -- how many times a run started (more than one only after a lost worker)
    run_count      integer NOT NULL DEFAULT 0 CHECK (run_count >= 0),
    -- the head of each output stream, and why a run could not start or was given up
    stdout         text,
    stderr         text,
    error          text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz,
    -- terminal states, and only they, carry the time they ended
    CONSTRAINT sandbox_tasks_terminal_has_finished_at CHECK (
        (state IN ('succeeded', 'failed', 'timed_out', 'denied')) = (finished_at IS NOT NULL)),
    -- a task has a tier exactly when a decision chose one: from `queued` on, except for a
    -- denial or a selection that never finished (`failed` with no tier)
    CONSTRAINT sandbox_tasks_tier_when_chosen CHECK (
        CASE
            WHEN state IN ('selecting', 'awaiting_choice', 'denied') THEN tier IS NULL
            WHEN state IN ('queued', 'running', 'succeeded', 'timed_out') THEN tier IS NOT NULL
            ELSE true
        END),
    -- a task that ran or finished running has started at least once
    CONSTRAINT sandbox_tasks_ran CHECK (state NOT IN ('running', 'succeeded', 'timed_out') OR run_count >= 1)
);
CREATE INDEX sandbox_tasks_state_idx ON sandbox_tasks (state, created_at, id);
CREATE INDEX sandbox_tasks_agent_idx ON sandbox_tasks (agent, similarity, created_at);

-- Every decision about a task's tier, by whoever made it, with the outcome of the run it
-- led to. Append-only except for the outcome, which is written once (trigger below).
CREATE TABLE sandbox_decisions (
    id             uuid PRIMARY KEY,
    task_id        uuid NOT NULL REFERENCES sandbox_tasks (id),
    mode           sandbox_mode NOT NULL,
    verdict        sandbox_verdict NOT NULL,
    requested_tier text,
    chosen_tier    text,
    -- the chosen tier's limits and price at decision time
    tier_spec      jsonb,
    -- `agent:<id>`, `platform` or `human:<principal name>`
    chooser        text NOT NULL CHECK (chooser <> ''),
    reason         text NOT NULL CHECK (reason <> '' AND length(reason) <= 4000),
    decided_at     timestamptz NOT NULL DEFAULT now(),
    -- the outcome of the run, written once
    exit_code      integer,
    signal         integer,
    duration_ms    bigint CHECK (duration_ms >= 0),
    peak_rss_kib   bigint CHECK (peak_rss_kib >= 0),
    output_bytes   bigint CHECK (output_bytes >= 0),
    timed_out      boolean,
    killed_for     text CHECK (killed_for IN ('timeout', 'memory', 'cpu', 'disk')),
    -- which limits the provider could actually enforce for this run
    limits         text[],
    outcome_at     timestamptz,
    -- a chosen decision names its tier and snapshots it; the others name none
    CONSTRAINT sandbox_decisions_chosen_has_tier CHECK (
        (verdict = 'chosen') = (chosen_tier IS NOT NULL) AND (chosen_tier IS NULL) = (tier_spec IS NULL)),
    -- only a chosen decision leads to a run, so only it has an outcome
    CONSTRAINT sandbox_decisions_outcome_when_chosen CHECK (outcome_at IS NULL OR verdict = 'chosen'),
    -- an outcome is whole or absent
    CONSTRAINT sandbox_decisions_outcome_whole CHECK (
        (outcome_at IS NULL) = (duration_ms IS NULL) AND (outcome_at IS NULL) = (peak_rss_kib IS NULL)
        AND (outcome_at IS NULL) = (output_bytes IS NULL) AND (outcome_at IS NULL) = (timed_out IS NULL)
        AND (outcome_at IS NULL) = (limits IS NULL)),
    -- `timed_out` and a kill for the timeout say the same thing
    CONSTRAINT sandbox_decisions_timeout_agrees CHECK (timed_out = (killed_for IS NOT DISTINCT FROM 'timeout'))
);
CREATE INDEX sandbox_decisions_task_idx ON sandbox_decisions (task_id, decided_at);
CREATE INDEX sandbox_decisions_outcome_idx ON sandbox_decisions (outcome_at) WHERE outcome_at IS NOT NULL;
-- A task is settled once: at most one decision chooses a tier or denies it.
CREATE UNIQUE INDEX sandbox_decisions_final_idx ON sandbox_decisions (task_id) WHERE verdict IN ('chosen', 'denied');

-- Decisions are history: nothing but the first write of the outcome may change them.
CREATE FUNCTION sandbox_decisions_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'sandbox_decisions is append-only';
    END IF;
    IF OLD.outcome_at IS NOT NULL
       OR (OLD.id, OLD.task_id, OLD.mode, OLD.verdict, OLD.requested_tier, OLD.chosen_tier, OLD.tier_spec,
           OLD.chooser, OLD.reason, OLD.decided_at)
          IS DISTINCT FROM
          (NEW.id, NEW.task_id, NEW.mode, NEW.verdict, NEW.requested_tier, NEW.chosen_tier, NEW.tier_spec,
           NEW.chooser, NEW.reason, NEW.decided_at) THEN
        RAISE EXCEPTION 'a sandbox decision is immutable; only its outcome is written, once';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER sandbox_decisions_immutable BEFORE UPDATE OR DELETE ON sandbox_decisions
    FOR EACH ROW EXECUTE FUNCTION sandbox_decisions_guard();

-- One row per start of a run: which job epoch ran it on which worker, and how it ended.
-- A row left open by a lost worker is closed as `lost` by the next start or the rescuer.
CREATE TABLE sandbox_runs (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id     uuid NOT NULL REFERENCES sandbox_tasks (id),
    decision_id uuid NOT NULL REFERENCES sandbox_decisions (id),
    job_id      uuid NOT NULL,
    job_attempt integer NOT NULL,
    worker      text NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    ended_at    timestamptz,
    result      text CHECK (result IN ('finished', 'lost')),
    -- one start per lease epoch of a job
    CONSTRAINT sandbox_runs_epoch_key UNIQUE (job_id, job_attempt),
    -- a result and its time come together
    CONSTRAINT sandbox_runs_result_time CHECK ((result IS NULL) = (ended_at IS NULL))
);
CREATE INDEX sandbox_runs_task_idx ON sandbox_runs (task_id, started_at);
