-- Tokens with an optional expiry (`token create --expires-in`), refused from that moment,
-- and the time each was last used (`token list`), written at most once a minute.
ALTER TABLE principals ADD COLUMN expires_at timestamptz;
ALTER TABLE principals ADD COLUMN last_used_at timestamptz;
ALTER TABLE principals ADD CONSTRAINT principals_expiry_after_creation CHECK (expires_at IS NULL OR expires_at > created_at);
