-- Cheaper upkeep of the hot queue table.

-- Every claim and completion changes `state`, so an index on it is written by every
-- transition; the operator counts it served are rare and read the table instead.
DROP INDEX jobs_kind_state_idx;

-- The queue table churns: vacuum and analyze it after a fixed number of changed rows
-- rather than a fraction of a table that keeps finished jobs (the default 20 % lets
-- millions of dead tuples pile up), and without cost-based throttling.
ALTER TABLE jobs SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 5000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);
