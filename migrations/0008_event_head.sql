-- The hash of a delivery's latest event, kept on its row. A transition then needs no read
-- of the event log to chain its event: the row it updates (guarded on state and version)
-- carries the head, and the update and the event insert go in one statement. It also
-- anchors the chain: an event log cut short no longer ends at the row's head.
-- `version` counts the delivery's events (every transition bumps it and appends one), so
-- the head is the event whose seq is the row's version.
ALTER TABLE deliveries ADD COLUMN event_hash text;

UPDATE deliveries d SET event_hash = e.hash
FROM delivery_events e
WHERE e.delivery_id = d.id AND e.seq = d.version;

ALTER TABLE deliveries ALTER COLUMN event_hash SET NOT NULL;
