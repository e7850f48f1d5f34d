-- Capsules and live migration: which node holds each agent at which epoch, and the phases
-- of each migration, recorded after every step so that another worker can resume one.

-- Where an agent is, as the coordinator sees it.
CREATE TYPE agent_state AS ENUM ('stored', 'active', 'migrating');

CREATE TABLE agents (
    -- the one id of the agent: the capsule's agent_id, every node's, every request's
    id              text PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$'),
    -- the node that runs it; NULL while it is only in the capsule store
    holder          text CHECK (holder IS NULL OR holder ~ '^[a-z0-9][a-z0-9_-]{0,63}$'),
    -- the holder's fencing epoch
    epoch           bigint NOT NULL CHECK (epoch >= 0),
    -- the highest epoch ever handed out for this agent: every migration takes a fresh one
    max_epoch       bigint NOT NULL,
    state           agent_state NOT NULL DEFAULT 'stored',
    -- sha256 of the manifest of the checkpoint last put in the store through this table
    manifest_sha256 text CHECK (manifest_sha256 IS NULL OR manifest_sha256 ~ '^[0-9a-f]{64}$'),
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    -- an epoch is handed out once: the allocator never falls behind the holder's epoch
    CONSTRAINT agents_epoch_allocated CHECK (max_epoch >= epoch),
    -- an active agent has a holder; a stored one has none; a migrating one keeps its source
    CONSTRAINT agents_holder_by_state CHECK (
        (state = 'active' AND holder IS NOT NULL) OR (state = 'stored' AND holder IS NULL) OR state = 'migrating')
);

-- The steps of the migration protocol. `activating` is recorded *before* the activate call:
-- it marks the point of no return.
CREATE TYPE migration_phase AS ENUM (
    'created', 'frozen', 'proposed', 'transferred', 'prepared', 'activating',
    'activated', 'retired', 'completed', 'aborting', 'aborted');

CREATE TABLE migrations (
    id              uuid PRIMARY KEY,
    agent_id        text NOT NULL REFERENCES agents (id),
    -- NULL when the agent was only in the store (a first placement)
    source_node     text,
    target_node     text NOT NULL,
    -- the source's epoch, and the fresh epoch the target will hold
    from_epoch      bigint NOT NULL,
    epoch           bigint NOT NULL,
    phase           migration_phase NOT NULL DEFAULT 'created',
    -- the checkpoint being moved, fixed once the source is frozen
    manifest_sha256 text CHECK (manifest_sha256 IS NULL OR manifest_sha256 ~ '^[0-9a-f]{64}$'),
    blobs_total     integer NOT NULL DEFAULT 0 CHECK (blobs_total >= 0),
    blobs_sent      integer NOT NULL DEFAULT 0 CHECK (blobs_sent >= 0),
    -- blobs the target already had: not sent
    blobs_skipped   integer NOT NULL DEFAULT 0 CHECK (blobs_skipped >= 0),
    bytes_sent      bigint NOT NULL DEFAULT 0 CHECK (bytes_sent >= 0),
    -- why it aborted, or what it waits for
    reason          text,
    requested_by    text NOT NULL,
    job_id          uuid,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    -- the target always gets an epoch newer than the source's
    CONSTRAINT migrations_epoch_newer CHECK (epoch > from_epoch),
    CONSTRAINT migrations_distinct_nodes CHECK (source_node IS DISTINCT FROM target_node),
    -- a migration has an end time exactly when it is over
    CONSTRAINT migrations_finished CHECK ((phase IN ('completed', 'aborted')) = (finished_at IS NOT NULL)),
    -- nothing is sent before the checkpoint to send is fixed
    CONSTRAINT migrations_manifest_before_transfer CHECK (
        manifest_sha256 IS NOT NULL OR phase IN ('created', 'aborting', 'aborted'))
);
-- At most one unfinished migration per agent.
CREATE UNIQUE INDEX migrations_one_live_idx ON migrations (agent_id) WHERE phase NOT IN ('completed', 'aborted');
CREATE INDEX migrations_agent_idx ON migrations (agent_id, created_at);

-- Append-only history of every phase a migration went through.
CREATE TABLE migration_events (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    migration_id uuid NOT NULL REFERENCES migrations (id),
    phase        migration_phase NOT NULL,
    at           timestamptz NOT NULL DEFAULT now(),
    -- the worker that recorded it (NULL: the admin service)
    worker       text,
    detail       jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX migration_events_migration_idx ON migration_events (migration_id, id);
CREATE TRIGGER migration_events_append_only BEFORE UPDATE OR DELETE ON migration_events
    FOR EACH ROW EXECUTE FUNCTION airlock_append_only();
