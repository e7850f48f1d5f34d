-- An agent's move between nodes is a relocation: the word "migration" is left to the
-- schema's own migrations. Tables, their history, the phase type and the names of their
-- constraints and indexes are renamed; no row changes.
ALTER TABLE migrations RENAME TO relocations;
ALTER TABLE migration_events RENAME TO relocation_events;
ALTER TABLE relocation_events RENAME COLUMN migration_id TO relocation_id;
ALTER TYPE migration_phase RENAME TO relocation_phase;
ALTER TABLE relocations RENAME CONSTRAINT migrations_epoch_newer TO relocations_epoch_newer;
ALTER TABLE relocations RENAME CONSTRAINT migrations_distinct_nodes TO relocations_distinct_nodes;
ALTER TABLE relocations RENAME CONSTRAINT migrations_finished TO relocations_finished;
ALTER TABLE relocations RENAME CONSTRAINT migrations_manifest_before_transfer TO relocations_manifest_before_transfer;
ALTER INDEX migrations_one_live_idx RENAME TO relocations_one_live_idx;
ALTER INDEX migrations_agent_idx RENAME TO relocations_agent_idx;
ALTER INDEX migration_events_migration_idx RENAME TO relocation_events_relocation_idx;
ALTER TRIGGER migration_events_append_only ON relocation_events RENAME TO relocation_events_append_only;
