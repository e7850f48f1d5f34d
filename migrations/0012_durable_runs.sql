-- Durable runs: a holder epoch that fences every write, a replay log of every
-- non-deterministic input, and a ledger of every external effect with its attempts.

ALTER TABLE runs
    -- the holder's fencing epoch: creating a run holds it at 1, every claim takes epoch + 1
    ADD COLUMN epoch bigint NOT NULL DEFAULT 1 CHECK (epoch >= 1),
    -- the principal that holds the run at that epoch
    ADD COLUMN holder text,
    -- the seq the next step of the replay log gets
    ADD COLUMN next_seq bigint NOT NULL DEFAULT 1 CHECK (next_seq >= 1),
    -- what the run waits for while `waiting` (e.g. `effect:<step_id>`)
    ADD COLUMN waiting_on text,
    ADD COLUMN result jsonb,
    ADD COLUMN error jsonb,
    ADD COLUMN finished_at timestamptz;

-- Runs that ended before their end was recorded (a spent budget) end when they were last updated.
UPDATE runs SET finished_at = updated_at WHERE state IN ('budget_exhausted', 'completed', 'cancelled');
UPDATE runs SET holder = agent WHERE holder IS NULL;
ALTER TABLE runs ALTER COLUMN holder SET NOT NULL;

ALTER TABLE runs
    -- terminal states, and only they, carry the time the run ended
    ADD CONSTRAINT runs_terminal_has_finished_at CHECK (
        (state IN ('completed', 'failed', 'cancelled', 'budget_exhausted')) = (finished_at IS NOT NULL)),
    -- a waiting run says what it waits for; no other run does
    ADD CONSTRAINT runs_waiting_says_on_what CHECK ((state = 'waiting') = (waiting_on IS NOT NULL)),
    -- a result only for a completed run; an error (or why it was cancelled) only for a
    -- failed or cancelled one
    ADD CONSTRAINT runs_result_when_completed CHECK (result IS NULL OR state = 'completed'),
    ADD CONSTRAINT runs_error_when_ended CHECK (error IS NULL OR state IN ('failed', 'cancelled'));
CREATE INDEX runs_state_idx ON runs (state, created_at, id);

-- What a step of the replay log records. `effect` and `delivery` are the ledger's entries
-- in the log: an effect begun, a delivery submitted.
CREATE TYPE run_step_kind AS ENUM (
    'model_output', 'tool_result', 'clock', 'random', 'input', 'note', 'effect', 'delivery');

-- The replay log: append-only, one row per step, numbered per run.
CREATE TABLE run_steps (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id            uuid NOT NULL REFERENCES runs (id),
    seq               bigint NOT NULL CHECK (seq >= 1),
    step_id           text NOT NULL CHECK (step_id <> '' AND length(step_id) <= 200),
    kind              run_step_kind NOT NULL,
    data              jsonb NOT NULL DEFAULT '{}'::jsonb,
    usage_tokens      bigint NOT NULL DEFAULT 0 CHECK (usage_tokens >= 0),
    usage_cost_micros bigint NOT NULL DEFAULT 0 CHECK (usage_cost_micros >= 0),
    -- the holder epoch that recorded it
    epoch             bigint NOT NULL CHECK (epoch >= 1),
    recorded_at       timestamptz NOT NULL DEFAULT now(),
    -- a step is recorded once: recording it again returns it
    CONSTRAINT run_steps_run_step_key UNIQUE (run_id, step_id),
    CONSTRAINT run_steps_run_seq_key UNIQUE (run_id, seq)
);
CREATE TRIGGER run_steps_append_only BEFORE UPDATE OR DELETE ON run_steps
    FOR EACH ROW EXECUTE FUNCTION airlock_append_only();

-- What happened to an effect: an attempt started, its outcome, or a human's authorisation
-- of one more attempt after an attempt whose outcome nobody knows.
CREATE TYPE run_effect_event AS ENUM ('started', 'succeeded', 'failed', 'retry_authorised');

-- The effects ledger: append-only; an effect's state is its latest event.
CREATE TABLE run_effects (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id          uuid NOT NULL REFERENCES runs (id),
    step_id         text NOT NULL,
    attempt         integer NOT NULL CHECK (attempt >= 1),
    event           run_effect_event NOT NULL,
    -- a run's effects are external writes: never `pure`
    effect_class    effect_class NOT NULL CHECK (effect_class <> 'pure'),
    target          text NOT NULL DEFAULT '' CHECK (length(target) <= 2000),
    description     text NOT NULL DEFAULT '' CHECK (length(description) <= 2000),
    idempotency_key text NOT NULL,
    result          jsonb,
    epoch           bigint NOT NULL CHECK (epoch >= 1),
    -- who recorded it: the holder, or the human who settled an unknown outcome
    actor           text NOT NULL,
    -- the human's decision and note, when a human settled it
    resolution      text CHECK (resolution IS NULL OR resolution IN ('confirmed_done', 'retry', 'abandon')),
    note            text,
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    -- the effect's step is in the replay log
    CONSTRAINT run_effects_step_fk FOREIGN KEY (run_id, step_id) REFERENCES run_steps (run_id, step_id),
    -- one start and at most one end per attempt
    CONSTRAINT run_effects_event_once UNIQUE (run_id, step_id, attempt, event),
    -- a human's settlement carries a note
    CONSTRAINT run_effects_resolution_noted CHECK (resolution IS NULL OR note IS NOT NULL)
);
CREATE INDEX run_effects_step_idx ON run_effects (run_id, step_id, id);
CREATE TRIGGER run_effects_append_only BEFORE UPDATE OR DELETE ON run_effects
    FOR EACH ROW EXECUTE FUNCTION airlock_append_only();
-- An attempt ends once: succeeded or failed, never both.
CREATE UNIQUE INDEX run_effects_one_end_idx ON run_effects (run_id, step_id, attempt)
    WHERE event IN ('succeeded', 'failed');
