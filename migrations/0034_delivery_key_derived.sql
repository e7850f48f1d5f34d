-- A delivery's idempotency key is derived from its run and step (`runs/src/key.rs`:
-- `'dlv_'` and the first 32 hex characters of sha256 of `"airlock/v1\0" + run id + "\0" +
-- step id`), and `(run_id, step_id)` is unique: the key's own unique index added only the
-- detection of a 128-bit collision, at the price of one more insert into a randomly keyed
-- index with every submission. On a large history that index's leaf pages are each first
-- touched since the last checkpoint by one submission, which then writes the whole page to
-- the WAL (about 40 % of a submission's WAL on 500,000 deliveries).
--
-- The index is replaced by a CHECK that the key is the derivation of its row: a key is
-- then unique because its run and step are, and no row can carry a key computed any other
-- way. Changing the derivation (its `airlock/v1` context) means changing this function.

-- The 32 hex characters of the derivation, as `airlock_runs::key::digest` computes them.
CREATE FUNCTION airlock_effect_key(run_id uuid, step_id text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT left(encode(sha256(convert_to('airlock/v1', 'UTF8') || '\x00'::bytea
                              || convert_to(run_id::text, 'UTF8') || '\x00'::bytea
                              || convert_to(step_id, 'UTF8')), 'hex'), 32)
$$;

ALTER TABLE deliveries ADD CONSTRAINT deliveries_idempotency_key_derived
    CHECK (idempotency_key = 'dlv_' || airlock_effect_key(run_id, step_id)) NOT VALID;
ALTER TABLE deliveries VALIDATE CONSTRAINT deliveries_idempotency_key_derived;
ALTER TABLE deliveries DROP CONSTRAINT deliveries_idempotency_key_key;
