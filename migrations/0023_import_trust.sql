-- How each agent's capsule was trusted when it was imported, checked again when the agent
-- is first placed on a node from the store: the key that signed it (which must still be in
-- `capsules.trusted_keys` then), or the operator's `--allow-unsigned` (audited at import).
-- Both NULL: imported before this was recorded; such an agent is not placed from the store
-- until it is imported again.
ALTER TABLE agents ADD COLUMN import_signed_by text CHECK (import_signed_by IS NULL OR import_signed_by ~ '^[0-9a-f]{64}$');
ALTER TABLE agents ADD COLUMN import_unsigned boolean;
