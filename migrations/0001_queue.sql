-- The job queue: one table for every kind of background work, plus the fleet of workers
-- and the principals (bearer tokens) every service authenticates.

-- Where a job is in its life. `parked` waits for a human; it is not terminal.
CREATE TYPE job_state AS ENUM ('available', 'running', 'completed', 'failed', 'parked', 'cancelled');

-- What repeating a job's effect would do to the outside world.
CREATE TYPE effect_class AS ENUM ('pure', 'idempotent', 'non_repeatable');

CREATE TABLE jobs (
    id                uuid PRIMARY KEY,
    kind              text NOT NULL CHECK (kind <> '' AND length(kind) <= 100),
    queue             text NOT NULL CHECK (queue <> '' AND length(queue) <= 100),
    payload           jsonb NOT NULL DEFAULT '{}'::jsonb,
    state             job_state NOT NULL DEFAULT 'available',
    -- lower runs first
    priority          smallint NOT NULL DEFAULT 100,
    run_at            timestamptz NOT NULL DEFAULT now(),
    -- the lease epoch: bumped by every claim, and every write of a holder is fenced on it
    attempt           integer NOT NULL DEFAULT 0,
    max_attempts      integer NOT NULL DEFAULT 10,
    effect_class      effect_class NOT NULL DEFAULT 'pure',
    -- set by the holder, inside the transaction that commits "the effect may now happen";
    -- cleared by the next claim or retry. The rescuer parks a non_repeatable job with it set.
    effect_started_at timestamptz,
    lease_owner       text,
    lease_expires_at  timestamptz,
    heartbeat_at      timestamptz,
    attempted_at      timestamptz,
    last_error        text,
    unique_key        text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz,
    -- a claim can never push the epoch past the allowed number of attempts
    CONSTRAINT jobs_attempts CHECK (attempt >= 0 AND max_attempts >= 1 AND attempt <= max_attempts),
    -- a running job always has a holder and a lease; no other state has one
    CONSTRAINT jobs_running_has_lease CHECK (
        (state = 'running') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    -- terminal states, and only they, carry the time they ended
    CONSTRAINT jobs_terminal_has_finished_at CHECK (
        (state IN ('completed', 'failed', 'cancelled')) = (finished_at IS NOT NULL)),
    -- an effect can only be in flight under a lease (running) or awaiting a human (parked)
    CONSTRAINT jobs_effect_only_when_held CHECK (
        effect_started_at IS NULL OR state IN ('running', 'parked'))
);

-- The claim path: only available rows are indexed, so completed rows piling up cost nothing.
CREATE INDEX jobs_claim_idx ON jobs (priority, run_at, id) WHERE state = 'available';
-- The rescuer's scan for expired leases.
CREATE INDEX jobs_lease_idx ON jobs (lease_expires_at) WHERE state = 'running';
-- Retention deletes finished rows oldest first.
CREATE INDEX jobs_finished_idx ON jobs (finished_at) WHERE state IN ('completed', 'cancelled', 'failed');
-- A unique key is unique among live jobs; once finished, the key may be used again.
CREATE UNIQUE INDEX jobs_unique_live_idx ON jobs (unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('available', 'running', 'parked');
CREATE INDEX jobs_kind_state_idx ON jobs (kind, state);

-- Exponential backoff with ±20% jitter, from 1 s after the first attempt, capped at one hour.
-- One definition, used by both failing holders and the rescuer.
CREATE FUNCTION airlock_backoff(attempt integer) RETURNS interval
LANGUAGE sql VOLATILE AS $$
    SELECT make_interval(secs => least(3600.0, power(2.0, greatest(attempt, 1) - 1))
                                 * (0.8 + random() * 0.4))
$$;

-- Queues that workers must not claim from (the send switch pauses the send queue).
CREATE TABLE queue_pauses (
    queue     text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    reason    text NOT NULL
);

-- One row per worker process; `heartbeat_at` shows it is alive.
CREATE TABLE workers (
    id           text PRIMARY KEY,
    host         text NOT NULL,
    pid          integer NOT NULL,
    version      text NOT NULL,
    queues       text[],
    concurrency  integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    in_flight    integer NOT NULL DEFAULT 0,
    stopped_at   timestamptz
);

CREATE TYPE principal_role AS ENUM ('agent', 'reviewer', 'operator', 'admin');

-- Bearer-token holders. The token itself is never stored: only its sha256.
CREATE TABLE principals (
    id           uuid PRIMARY KEY,
    name         text NOT NULL UNIQUE CHECK (name <> '' AND length(name) <= 200),
    role         principal_role NOT NULL,
    agent_id     text,
    token_sha256 bytea NOT NULL UNIQUE CHECK (length(token_sha256) = 32),
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz,
    -- an agent principal is bound to exactly one agent; no other role is
    CONSTRAINT principals_agent_binding CHECK ((role = 'agent') = (agent_id IS NOT NULL))
);
