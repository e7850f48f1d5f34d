-- Durable runs wait for humans and fail: two more run states. (An enum value added in a
-- transaction cannot be used in that transaction, so the schema that uses them follows in
-- the next migration.)
ALTER TYPE run_state ADD VALUE IF NOT EXISTS 'waiting' AFTER 'active';
ALTER TYPE run_state ADD VALUE IF NOT EXISTS 'failed' AFTER 'completed';
