-- A run stopped for having more processes and threads than its tier's `max_processes`
-- records `killed_for = 'processes'`.
ALTER TABLE sandbox_decisions DROP CONSTRAINT sandbox_decisions_killed_for_check;
ALTER TABLE sandbox_decisions ADD CONSTRAINT sandbox_decisions_killed_for_check
    CHECK (killed_for IN ('timeout', 'memory', 'cpu', 'disk', 'processes'));
