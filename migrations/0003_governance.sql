-- Governance: standing grants, revocable principals.

-- A standing, scoped, expiring, count-limited approval that a human created.
CREATE TABLE grants (
    id                uuid PRIMARY KEY,
    created_by        text NOT NULL,
    reason            text NOT NULL CHECK (reason <> ''),
    channel           channel NOT NULL,
    -- the agents it covers (never empty: a grant names whom it trusts)
    agent_ids         text[] NOT NULL CHECK (cardinality(agent_ids) >= 1),
    -- email: every recipient's domain must be in this list
    recipient_domains text[] NOT NULL DEFAULT '{}',
    -- webhook: the call's origin must be in this list
    webhook_origins   text[] NOT NULL DEFAULT '{}',
    min_score         double precision NOT NULL CHECK (min_score >= 0 AND min_score <= 1),
    expires_at        timestamptz NOT NULL,
    max_uses          integer NOT NULL CHECK (max_uses >= 1),
    uses              integer NOT NULL DEFAULT 0,
    created_at        timestamptz NOT NULL DEFAULT now(),
    revoked_at        timestamptz,
    revoked_by        text,
    -- a grant can never be used more than it allows
    CONSTRAINT grants_uses_bounded CHECK (uses >= 0 AND uses <= max_uses),
    -- an email grant names domains, a webhook grant names origins
    CONSTRAINT grants_scope_by_channel CHECK (
        (channel = 'email' AND cardinality(recipient_domains) >= 1 AND cardinality(webhook_origins) = 0) OR
        (channel = 'webhook' AND cardinality(webhook_origins) >= 1 AND cardinality(recipient_domains) = 0)),
    CONSTRAINT grants_revocation CHECK ((revoked_at IS NULL) = (revoked_by IS NULL))
);
CREATE INDEX grants_live_idx ON grants (channel, expires_at) WHERE revoked_at IS NULL;

-- A grant's scope never widens after creation: only its use count and revocation change.
CREATE FUNCTION airlock_grants_scope_frozen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.channel IS DISTINCT FROM OLD.channel OR NEW.agent_ids IS DISTINCT FROM OLD.agent_ids
       OR NEW.recipient_domains IS DISTINCT FROM OLD.recipient_domains
       OR NEW.webhook_origins IS DISTINCT FROM OLD.webhook_origins
       OR NEW.min_score IS DISTINCT FROM OLD.min_score OR NEW.expires_at IS DISTINCT FROM OLD.expires_at
       OR NEW.max_uses IS DISTINCT FROM OLD.max_uses OR NEW.created_by IS DISTINCT FROM OLD.created_by
       OR NEW.reason IS DISTINCT FROM OLD.reason THEN
        RAISE EXCEPTION 'a grant''s scope cannot change after creation';
    END IF;
    IF OLD.revoked_at IS NOT NULL AND NEW.revoked_at IS DISTINCT FROM OLD.revoked_at THEN
        RAISE EXCEPTION 'a revoked grant stays revoked';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER grants_scope_frozen BEFORE UPDATE ON grants
    FOR EACH ROW EXECUTE FUNCTION airlock_grants_scope_frozen();
CREATE TRIGGER grants_no_delete BEFORE DELETE ON grants
    FOR EACH ROW EXECUTE FUNCTION airlock_append_only();

ALTER TABLE approvals ADD CONSTRAINT approvals_grant_fk FOREIGN KEY (grant_id) REFERENCES grants (id);

ALTER TABLE principals ADD COLUMN revoked_by text;
