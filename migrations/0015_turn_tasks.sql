-- A sandboxed task asked for by an agent turn's `sandbox.run` carries the idempotency key
-- of the call's step: the same call again (a driver that took over) is the same task.
ALTER TABLE sandbox_tasks ADD COLUMN idempotency_key text
    CHECK (idempotency_key IS NULL OR (idempotency_key <> '' AND length(idempotency_key) <= 200));
CREATE UNIQUE INDEX sandbox_tasks_idempotency_key ON sandbox_tasks (idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- The token that asked for a turn: the tasks the turn starts are its agent's, asked by it.
ALTER TABLE agent_turns ADD COLUMN principal_id uuid REFERENCES principals (id);
