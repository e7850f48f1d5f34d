-- The pipeline's logs carry only what they are read by. Every delivery writes six or seven
-- `delivery_events`, a `run_steps` row and its recipients; each row paid for a surrogate
-- key nothing reads (a sequence draw and a B-tree entry) and for a foreign-key check (a
-- lookup and a row lock on the parent, in a trigger) that its one writer makes true by
-- construction:
-- - an event is inserted only by the statement that inserts or moves its delivery's row
--   (`INSERT … SELECT … FROM delivery` / `… JOIN moved`), guarded on state and version;
-- - a step only by the statement that spends a step of its run's row (`… FROM spent`);
-- - recipients only by the statement that inserts their delivery;
-- and neither deliveries nor runs are ever deleted. What the keys identified stays unique
-- and indexed: (delivery_id, seq) and (run_id, seq), now also the rows' replica identity.
-- A row without its parent is reported by the tests' invariant checks, and an event's
-- chain is verified against its delivery's row (`deliveries.event_hash`) as before.

ALTER TABLE delivery_events DROP COLUMN id;
ALTER TABLE delivery_events DROP CONSTRAINT delivery_events_delivery_id_fkey;
ALTER TABLE delivery_events REPLICA IDENTITY USING INDEX delivery_events_seq_key;

ALTER TABLE run_steps DROP COLUMN id;
ALTER TABLE run_steps DROP CONSTRAINT run_steps_run_id_fkey;
ALTER TABLE run_steps REPLICA IDENTITY USING INDEX run_steps_run_seq_key;

ALTER TABLE delivery_recipients DROP CONSTRAINT delivery_recipients_delivery_id_fkey;
