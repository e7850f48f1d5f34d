-- Agent turns: airlock drives a local model through the airlock.action.v1 protocol inside
-- a durable run. The turn's decisions and tool results are steps of the run's replay log
-- and its tool calls are effects of the run; these tables hold the turn itself, what it
-- went through, and the authorizations a human grants or denies.

CREATE TYPE turn_state AS ENUM (
    'queued', 'running', 'authorization_required', 'completed', 'failed', 'cancelled',
    'model_unavailable', 'model_protocol_error', 'budget_exhausted');

CREATE TABLE agent_turns (
    id           uuid PRIMARY KEY,
    run_id       uuid NOT NULL REFERENCES runs (id),
    -- the run's step that asked for the turn: asking again returns the same turn
    step_id      text NOT NULL CHECK (step_id <> '' AND length(step_id) <= 200),
    agent        text NOT NULL,
    -- a configured model's name (`models.<name>`)
    model        text NOT NULL,
    instructions text NOT NULL,
    input        text NOT NULL,
    tools        text[] NOT NULL,
    -- max_rounds, max_tool_calls, max_context_bytes, max_result_bytes
    limits       jsonb NOT NULL,
    -- the final text becomes a delivery of the run: {"channel": "email", "email": {…}}
    deliver      jsonb,
    state        turn_state NOT NULL DEFAULT 'queued',
    rounds       integer NOT NULL DEFAULT 0 CHECK (rounds >= 0),
    tool_calls   integer NOT NULL DEFAULT 0 CHECK (tool_calls >= 0),
    final_text   text,
    delivery_id  uuid REFERENCES deliveries (id),
    error        jsonb,
    next_event   bigint NOT NULL DEFAULT 1,
    -- the run epoch of the worker driving the turn: a write of an older driver changes nothing
    epoch        bigint NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz,
    CONSTRAINT agent_turns_run_step_key UNIQUE (run_id, step_id),
    -- the terminal states, and only they, carry the time the turn ended
    CONSTRAINT agent_turns_terminal_has_finished_at CHECK (
        (state IN ('completed', 'failed', 'cancelled', 'model_unavailable', 'model_protocol_error', 'budget_exhausted'))
        = (finished_at IS NOT NULL)),
    -- a final text only for a completed turn; an error only for one that ended otherwise
    CONSTRAINT agent_turns_final_when_completed CHECK (final_text IS NULL OR state = 'completed'),
    CONSTRAINT agent_turns_error_when_ended CHECK (
        error IS NULL OR state IN ('failed', 'cancelled', 'model_unavailable', 'model_protocol_error', 'budget_exhausted'))
);
CREATE INDEX agent_turns_run_idx ON agent_turns (run_id, created_at);

-- What a turn went through, for `GET /v1/turns/{id}/events`: append-only.
CREATE TABLE turn_events (
    turn_id uuid NOT NULL REFERENCES agent_turns (id),
    seq     bigint NOT NULL,
    -- what the event stands for: a driver that runs a round again writes it once
    key     text NOT NULL CHECK (key <> '' AND length(key) <= 300),
    kind    text NOT NULL CHECK (kind <> '' AND length(kind) <= 64),
    data    jsonb NOT NULL DEFAULT '{}'::jsonb,
    at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (turn_id, seq),
    CONSTRAINT turn_events_once UNIQUE (turn_id, key)
);
CREATE TRIGGER turn_events_append_only BEFORE UPDATE OR DELETE ON turn_events
    FOR EACH ROW EXECUTE FUNCTION airlock_append_only();

CREATE TYPE authorization_state AS ENUM ('pending', 'granted', 'denied');

-- A non-repeatable tool call the model asked for, waiting for (or decided by) a human.
-- A grant is bound to the sha256 of the exact canonical arguments the human saw.
CREATE TABLE turn_authorizations (
    id               uuid PRIMARY KEY,
    turn_id          uuid NOT NULL REFERENCES agent_turns (id),
    run_id           uuid NOT NULL REFERENCES runs (id),
    -- the run's step of the call (its effect's step once granted)
    call_step        text NOT NULL,
    tool_id          text NOT NULL,
    arguments        jsonb NOT NULL,
    arguments_sha256 text NOT NULL CHECK (arguments_sha256 ~ '^[0-9a-f]{64}$'),
    state            authorization_state NOT NULL DEFAULT 'pending',
    decided_by       text,
    note             text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    decided_at       timestamptz,
    CONSTRAINT turn_authorizations_one_per_call UNIQUE (turn_id, call_step),
    -- a decision has its human, note and time; a pending one none of them
    CONSTRAINT turn_authorizations_decided CHECK (
        (state = 'pending') = (decided_by IS NULL AND decided_at IS NULL)
        AND (state = 'pending' OR note IS NOT NULL))
);
CREATE INDEX turn_authorizations_state_idx ON turn_authorizations (state, created_at);

-- The agent's journal as airlock writes it: each turn appends its messages, tool calls
-- and results as its own chain (machine `turn-<id>`) of journal lines, merged with the
-- capsule's journal wherever that journal is read. Append-only.
CREATE TABLE agent_journal (
    agent   text NOT NULL,
    machine text NOT NULL,
    seq     bigint NOT NULL CHECK (seq >= 1),
    line    text NOT NULL,
    at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent, machine, seq)
);
CREATE TRIGGER agent_journal_append_only BEFORE UPDATE OR DELETE ON agent_journal
    FOR EACH ROW EXECUTE FUNCTION airlock_append_only();
