-- The delivery pipeline: persist → score → review → approve → send → receipt.

CREATE TYPE delivery_state AS ENUM (
    'persisted', 'scored', 'in_review', 'awaiting_approval', 'approved',
    'sending', 'sent', 'failed', 'parked', 'rejected', 'cancelled');

CREATE TYPE channel AS ENUM ('email', 'webhook');

CREATE TYPE run_state AS ENUM ('active', 'budget_exhausted', 'completed', 'cancelled');

-- An agent's run: its inputs and its budget. 0 in a limit means unlimited.
CREATE TABLE runs (
    id               uuid PRIMARY KEY,
    agent            text NOT NULL CHECK (agent <> ''),
    inputs           jsonb NOT NULL DEFAULT '{}'::jsonb,
    state            run_state NOT NULL DEFAULT 'active',
    max_steps        bigint NOT NULL DEFAULT 0 CHECK (max_steps >= 0),
    max_tokens       bigint NOT NULL DEFAULT 0 CHECK (max_tokens >= 0),
    max_cost_micros  bigint NOT NULL DEFAULT 0 CHECK (max_cost_micros >= 0),
    used_steps       bigint NOT NULL DEFAULT 0,
    used_tokens      bigint NOT NULL DEFAULT 0,
    used_cost_micros bigint NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    -- spending never passes a finite limit
    CONSTRAINT runs_steps_within_budget CHECK (max_steps = 0 OR used_steps <= max_steps),
    CONSTRAINT runs_tokens_within_budget CHECK (max_tokens = 0 OR used_tokens <= max_tokens),
    CONSTRAINT runs_cost_within_budget CHECK (max_cost_micros = 0 OR used_cost_micros <= max_cost_micros)
);
CREATE INDEX runs_agent_idx ON runs (agent, created_at);

-- Artifacts, content-addressed: the key is the sha256 of the canonical JSON body.
CREATE TABLE artifacts (
    sha256     text PRIMARY KEY CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    body       jsonb NOT NULL,
    size_bytes integer NOT NULL CHECK (size_bytes >= 0),
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE deliveries (
    id               uuid PRIMARY KEY,
    run_id           uuid NOT NULL REFERENCES runs (id),
    step_id          text NOT NULL CHECK (step_id <> '' AND length(step_id) <= 200),
    agent            text NOT NULL,
    channel          channel NOT NULL,
    state            delivery_state NOT NULL DEFAULT 'persisted',
    -- bumped by every transition; lets readers detect change
    version          integer NOT NULL DEFAULT 1,
    idempotency_key  text NOT NULL UNIQUE,
    -- the artifact as it stands now (a reviewer's edit replaces it)
    artifact_sha256  text NOT NULL REFERENCES artifacts (sha256),
    -- the artifact the agent submitted: what a repeated submission is compared with
    submitted_sha256 text NOT NULL REFERENCES artifacts (sha256),
    effect_class     effect_class NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    -- one delivery per step of a run: the idempotency of submission
    CONSTRAINT deliveries_run_step_key UNIQUE (run_id, step_id),
    -- email cannot be repeated safely; a webhook carries its key and can
    CONSTRAINT deliveries_effect_by_channel CHECK (
        (channel = 'email' AND effect_class = 'non_repeatable') OR
        (channel = 'webhook' AND effect_class = 'idempotent'))
);
CREATE INDEX deliveries_state_idx ON deliveries (state, created_at, id);
CREATE INDEX deliveries_agent_idx ON deliveries (agent, created_at);

-- Append-only history of every transition, hash-chained per delivery.
CREATE TABLE delivery_events (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    delivery_id uuid NOT NULL REFERENCES deliveries (id),
    seq         integer NOT NULL CHECK (seq >= 1),
    from_state  delivery_state,
    to_state    delivery_state NOT NULL,
    actor       text NOT NULL,
    reason      text,
    data        jsonb NOT NULL DEFAULT '{}'::jsonb,
    at          timestamptz NOT NULL DEFAULT now(),
    -- sha256 of the previous event of the same delivery (NULL for the first)
    prev_hash   text,
    hash        text NOT NULL,
    CONSTRAINT delivery_events_seq_key UNIQUE (delivery_id, seq),
    -- only the first event has no predecessor, and only it has no from-state
    CONSTRAINT delivery_events_chain CHECK ((seq = 1) = (prev_hash IS NULL) AND (seq = 1) = (from_state IS NULL))
);

-- History tables refuse updates and deletes.
CREATE FUNCTION airlock_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME;
END $$;
CREATE TRIGGER delivery_events_append_only BEFORE UPDATE OR DELETE ON delivery_events
    FOR EACH ROW EXECUTE FUNCTION airlock_append_only();

CREATE TABLE scores (
    id              uuid PRIMARY KEY,
    delivery_id     uuid NOT NULL REFERENCES deliveries (id),
    artifact_sha256 text NOT NULL REFERENCES artifacts (sha256),
    value           double precision NOT NULL CHECK (value >= 0 AND value <= 1),
    reasons         jsonb NOT NULL DEFAULT '[]'::jsonb,
    scorer          text NOT NULL,
    threshold       double precision NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX scores_delivery_idx ON scores (delivery_id, created_at);

CREATE TABLE reviews (
    id          uuid PRIMARY KEY,
    delivery_id uuid NOT NULL REFERENCES deliveries (id),
    action      text NOT NULL CHECK (action IN ('accept', 'edit', 'reject')),
    reviewer    text NOT NULL,
    note        text,
    from_sha256 text NOT NULL REFERENCES artifacts (sha256),
    to_sha256   text NOT NULL REFERENCES artifacts (sha256),
    created_at  timestamptz NOT NULL DEFAULT now(),
    -- only an edit changes the artifact
    CONSTRAINT reviews_edit_changes CHECK ((action = 'edit') OR (from_sha256 = to_sha256))
);
CREATE INDEX reviews_delivery_idx ON reviews (delivery_id, created_at);

CREATE TABLE approvals (
    id              uuid PRIMARY KEY,
    delivery_id     uuid NOT NULL REFERENCES deliveries (id),
    -- the exact artifact the approver saw
    artifact_sha256 text NOT NULL REFERENCES artifacts (sha256),
    approver        text,
    grant_id        uuid,
    note            text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- approved by a human, or by a standing grant a human created: exactly one
    CONSTRAINT approvals_one_source CHECK ((approver IS NULL) <> (grant_id IS NULL))
);
CREATE INDEX approvals_delivery_idx ON approvals (delivery_id, created_at);

-- One row per attempt to perform a send; outcome NULL means "started, not yet known".
CREATE TABLE send_attempts (
    id              uuid PRIMARY KEY,
    delivery_id     uuid NOT NULL REFERENCES deliveries (id),
    job_id          uuid NOT NULL,
    lease_attempt   integer NOT NULL,
    worker          text NOT NULL,
    artifact_sha256 text NOT NULL REFERENCES artifacts (sha256),
    started_at      timestamptz NOT NULL DEFAULT now(),
    outcome         text CHECK (outcome IN ('sent', 'not_delivered', 'failed', 'ambiguous', 'lease_expired')),
    detail          text,
    finished_at     timestamptz,
    -- one attempt per lease epoch of a job
    CONSTRAINT send_attempts_epoch_key UNIQUE (job_id, lease_attempt),
    -- an outcome and its time come together
    CONSTRAINT send_attempts_outcome_time CHECK ((outcome IS NULL) = (finished_at IS NULL))
);
CREATE INDEX send_attempts_delivery_idx ON send_attempts (delivery_id, started_at);

-- Exactly one receipt per sent delivery.
CREATE TABLE receipts (
    id                uuid PRIMARY KEY,
    delivery_id       uuid NOT NULL UNIQUE REFERENCES deliveries (id),
    attempt_id        uuid REFERENCES send_attempts (id),
    channel           channel NOT NULL,
    message_id        text,
    provider_response text,
    payload_sha256    text NOT NULL,
    sent_at           timestamptz NOT NULL DEFAULT now(),
    attempt           integer NOT NULL,
    worker            text,
    attested_by       text,
    -- a receipt comes from a worker's attempt, or from a human who confirmed a parked send
    CONSTRAINT receipts_source CHECK ((attempt_id IS NOT NULL AND worker IS NOT NULL) OR attested_by IS NOT NULL)
);

-- Global settings: exactly one row.
CREATE TABLE settings (
    id           integer PRIMARY KEY CHECK (id = 1),
    send_enabled boolean NOT NULL DEFAULT false,
    updated_by   text NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    reason       text NOT NULL
);
INSERT INTO settings (id, send_enabled, updated_by, reason) VALUES (1, false, 'system', 'sending is off until an operator turns it on');
-- While the switch is off, the send queue is paused.
INSERT INTO queue_pauses (queue, reason) VALUES ('send', 'send switch off');

-- Every human and operator action, hash-chained.
CREATE TABLE audit_log (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    actor       text NOT NULL,
    role        text NOT NULL,
    action      text NOT NULL,
    target_kind text NOT NULL,
    target_id   text NOT NULL,
    reason      text,
    data        jsonb NOT NULL DEFAULT '{}'::jsonb,
    prev_hash   text,
    hash        text NOT NULL
);
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION airlock_append_only();
