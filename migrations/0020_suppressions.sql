-- Recipients nothing may be sent to, and what the submission rate limits count.

CREATE TYPE suppression_kind AS ENUM ('address', 'domain');

-- An address or a domain nothing may be sent to. Lifting one keeps the row (who lifted it,
-- when): the history of what was suppressed stays readable beside the audit log.
CREATE TABLE suppressions (
    id         uuid PRIMARY KEY,
    kind       suppression_kind NOT NULL,
    -- an address lowercased, or a domain lowercased without a leading `@`
    value      text NOT NULL CHECK (value <> '' AND value = lower(value) AND length(value) <= 320),
    reason     text NOT NULL CHECK (reason <> ''),
    created_by text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    lifted_at  timestamptz,
    lifted_by  text,
    -- an address has an `@`, a domain has none
    CONSTRAINT suppressions_value_by_kind CHECK ((kind = 'address') = (position('@' in value) > 0)),
    -- lifted is said by both columns or by neither
    CONSTRAINT suppressions_lifted CHECK ((lifted_at IS NULL) = (lifted_by IS NULL))
);
-- One live suppression per address or domain.
CREATE UNIQUE INDEX suppressions_live_key ON suppressions (kind, value) WHERE lifted_at IS NULL;

-- Each email delivery's recipients as submitted, lowercased: what the per-recipient daily
-- limit counts, by index rather than by reading every artifact of the day.
CREATE TABLE delivery_recipients (
    delivery_id uuid NOT NULL REFERENCES deliveries (id),
    address     text NOT NULL CHECK (address <> '' AND address = lower(address)),
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (delivery_id, address)
);
CREATE INDEX delivery_recipients_address_idx ON delivery_recipients (address, created_at);
