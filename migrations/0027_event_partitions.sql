-- `delivery_events` is partitioned by its delivery's id. Delivery ids are UUID v7, ordered
-- by creation time, so each partition holds the events of the deliveries created in one
-- period, and a delivery's whole chain lies in one partition: a chain never spans a
-- boundary, (delivery_id, seq) stays unique (the key includes the partition key), and every
-- read of one delivery's events is pruned to one partition.
--
-- Workers keep partitions ahead of time (`airlock_delivery_events_partitions`; there is no
-- default partition: an id no partition covers is refused, never misfiled), and, with a
-- retention set, move the partitions of finished periods out of the hot log into
-- `delivery_events_archive` (`airlock_archive_*`): a partition moves only when every
-- delivery of its period is in a terminal state, which no transition leaves, so its chains
-- are complete and stay so. The archive is the same shape, append-only as well, and read
-- with the hot log wherever a delivery's events are read; each archived partition gets a
-- seal (`delivery_event_archives`) recording that every chain in it ends at its delivery's
-- head (`deliveries.event_hash`, which stays on the hot row) and holds as many events as
-- the delivery's version counts. An operator may export and drop an archived partition
-- (`ALTER TABLE delivery_events_archive DETACH PARTITION …`); airlock never drops one.

-- The smallest UUID v7 of a moment (its millisecond, the rest zero), and the moment of one.
CREATE FUNCTION airlock_uuid_floor(at timestamptz) RETURNS uuid LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (lpad(to_hex(floor(extract(epoch FROM at) * 1000)::bigint), 12, '0') || '00000000000000000000')::uuid
$$;
CREATE FUNCTION airlock_uuid_time(id uuid) RETURNS timestamptz LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT to_timestamp((('x' || substr(replace(id::text, '-', ''), 1, 12))::bit(48)::bigint) / 1000.0)
$$;

-- The partitions of a range-partitioned table and their bounds (NULL: MINVALUE / MAXVALUE).
CREATE FUNCTION airlock_partitions(parent regclass)
RETURNS TABLE (part regclass, lo uuid, hi uuid) LANGUAGE sql STABLE AS $$
    SELECT c.oid::regclass, (m[1])::uuid, (m[2])::uuid
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid,
         LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid),
                              'FROM \((?:''([0-9a-f-]+)''|MINVALUE)\) TO \((?:''([0-9a-f-]+)''|MAXVALUE)\)') m
    WHERE i.inhparent = parent
$$;

-- The hot log becomes a partitioned table; what it held becomes its first partition, which
-- covers every id before the migration (and any later one already present).
ALTER TABLE delivery_events RENAME TO delivery_events_p0;
ALTER TABLE delivery_events_p0 RENAME CONSTRAINT delivery_events_seq_key TO delivery_events_p0_seq_key;
DROP TRIGGER delivery_events_append_only ON delivery_events_p0;
ALTER TRIGGER delivery_events_no_truncate ON delivery_events_p0 RENAME TO delivery_events_p0_no_truncate;

CREATE TABLE delivery_events (
    delivery_id uuid NOT NULL,
    seq         integer NOT NULL CONSTRAINT delivery_events_seq_check CHECK (seq >= 1),
    from_state  delivery_state,
    to_state    delivery_state NOT NULL,
    actor       text NOT NULL,
    reason      text,
    data        jsonb NOT NULL DEFAULT '{}'::jsonb,
    at          timestamptz NOT NULL DEFAULT now(),
    prev_hash   text,
    hash        text NOT NULL,
    CONSTRAINT delivery_events_seq_key UNIQUE (delivery_id, seq),
    CONSTRAINT delivery_events_chain CHECK ((seq = 1) = (prev_hash IS NULL) AND (seq = 1) = (from_state IS NULL))
) PARTITION BY RANGE (delivery_id);
CREATE TRIGGER delivery_events_append_only BEFORE UPDATE OR DELETE ON delivery_events
    FOR EACH ROW EXECUTE FUNCTION airlock_append_only();
CREATE TRIGGER delivery_events_no_truncate BEFORE TRUNCATE ON delivery_events
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only();

-- The archive: the same shape, append-only as well.
CREATE TABLE delivery_events_archive (LIKE delivery_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
    CONSTRAINT delivery_events_archive_seq_key UNIQUE (delivery_id, seq)) PARTITION BY RANGE (delivery_id);
CREATE TRIGGER delivery_events_archive_append_only BEFORE UPDATE OR DELETE ON delivery_events_archive
    FOR EACH ROW EXECUTE FUNCTION airlock_append_only();
CREATE TRIGGER delivery_events_archive_no_truncate BEFORE TRUNCATE ON delivery_events_archive
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only();

-- One row per archived partition: what its chains were found to be once archived.
CREATE TABLE delivery_event_archives (
    partition   text PRIMARY KEY,
    lo          uuid,
    hi          uuid NOT NULL,
    deliveries  bigint NOT NULL CHECK (deliveries >= 0),
    -- the partition's rows
    events      bigint NOT NULL CHECK (events >= 0),
    -- deliveries of the period whose chain in the archive does not end at their head, or
    -- does not hold as many events as their version counts: 0 for a sound archive
    broken      bigint NOT NULL CHECK (broken >= 0),
    -- events of the partition that belong to no delivery of the period: 0 as well
    strays      bigint NOT NULL CHECK (strays >= 0),
    archived_at timestamptz NOT NULL DEFAULT now()
);
CREATE TRIGGER delivery_event_archives_append_only BEFORE UPDATE OR DELETE ON delivery_event_archives
    FOR EACH ROW EXECUTE FUNCTION airlock_append_only();
CREATE TRIGGER delivery_event_archives_no_truncate BEFORE TRUNCATE ON delivery_event_archives
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only();

-- Gives a new partition of `delivery_events` what the hot log's first one has: its replica
-- identity and a TRUNCATE refusal of its own (row triggers come from the parent).
CREATE FUNCTION airlock_partition_dress(part regclass) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    idx regclass;
BEGIN
    SELECT i.indexrelid::regclass INTO idx FROM pg_index i WHERE i.indrelid = part AND i.indisunique;
    EXECUTE format('ALTER TABLE %s REPLICA IDENTITY USING INDEX %s', part, idx);
    EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON %s FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only()',
                   part::text || '_no_truncate', part);
END $$;

-- Keeps `delivery_events` partitioned ahead: from the end of the partition covering now (or
-- of the last one before it) to `ahead` periods past now, every gap gets partitions of
-- `period_seconds`. A partition that holds nothing, ends more than a period from now and
-- is longer than the period (the layout of a longer period) is cut again first, under a lock
-- of the log that waits at most `lock_timeout_ms`. New partitions are created apart and
-- attached, which does not stop writers. Returns the partitions created; nothing while
-- another caller is at it.
CREATE FUNCTION airlock_delivery_events_partitions(period_seconds bigint, ahead integer, lock_timeout_ms integer)
RETURNS SETOF text LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    period interval := make_interval(secs => period_seconds);
    horizon uuid := airlock_uuid_floor(now() + make_interval(secs => period_seconds * ahead));
    t uuid;
    covered uuid;
    nxt uuid;
    upto uuid;
    name text;
    p record;
    empty boolean;
BEGIN
    IF period_seconds < 1 OR ahead < 1 OR lock_timeout_ms < 1 THEN
        RAISE EXCEPTION 'period_seconds, ahead and lock_timeout_ms must be positive' USING ERRCODE = '22023';
    END IF;
    IF NOT pg_try_advisory_xact_lock(4706955316487293700) THEN
        RETURN;
    END IF;
    FOR p IN SELECT * FROM airlock_partitions('delivery_events') WHERE lo IS NOT NULL AND hi IS NOT NULL
             AND airlock_uuid_time(hi) > now() + period AND airlock_uuid_time(hi) - airlock_uuid_time(lo) > period LOOP
        EXECUTE format('SELECT NOT EXISTS (SELECT 1 FROM %s)', p.part) INTO empty;
        CONTINUE WHEN NOT empty;
        BEGIN
            PERFORM set_config('lock_timeout', lock_timeout_ms || 'ms', true);
            LOCK TABLE delivery_events IN ACCESS EXCLUSIVE MODE;
        EXCEPTION WHEN lock_not_available THEN
            -- busy: the layout is cut again at a later pass; the gaps are filled below all the same
            EXIT;
        END;
        EXECUTE format('SELECT NOT EXISTS (SELECT 1 FROM %s)', p.part) INTO empty;
        IF empty THEN
            EXECUTE format('DROP TABLE %s', p.part);
        END IF;
    END LOOP;
    SELECT hi INTO t FROM airlock_partitions('delivery_events') WHERE hi <= airlock_uuid_floor(now()) ORDER BY hi DESC LIMIT 1;
    t := coalesce(t, airlock_uuid_floor(now()));
    WHILE t < horizon LOOP
        SELECT hi INTO covered FROM airlock_partitions('delivery_events')
        WHERE (lo IS NULL OR lo <= t) AND (hi IS NULL OR t < hi);
        IF FOUND THEN
            EXIT WHEN covered IS NULL;
            t := covered;
            CONTINUE;
        END IF;
        SELECT lo INTO nxt FROM airlock_partitions('delivery_events') WHERE lo > t ORDER BY lo LIMIT 1;
        upto := airlock_uuid_floor(airlock_uuid_time(t) + period);
        IF nxt IS NOT NULL AND nxt < upto THEN
            upto := nxt;
        END IF;
        name := 'delivery_events_p' || to_char(airlock_uuid_time(t) AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS"_"MS');
        EXECUTE format('CREATE TABLE %I (LIKE delivery_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', name);
        EXECUTE format('ALTER TABLE delivery_events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', name, t, upto);
        PERFORM airlock_partition_dress(name::regclass);
        RETURN NEXT name;
        t := upto;
    END LOOP;
END $$;

-- Whether a delivery of the ids [lo, hi) still moves (is not in a terminal state, which no
-- transition leaves): it keeps the period's partition in the hot log. Few deliveries are
-- not terminal, and `deliveries_state_idx` finds them, so this is cheap even under a lock.
-- A submission of the period still in flight is seen once it commits: its one statement
-- holds the log's lock that a move waits for, and the move asks again under that lock.
CREATE FUNCTION airlock_period_open(lo uuid, hi uuid) RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM deliveries
                   WHERE state = ANY ('{persisted,scored,in_review,awaiting_approval,approved,sending,parked}')
                     AND (lo IS NULL OR id >= lo) AND id < hi)
$$;

-- Archiving, step 1 of 3: the oldest partition of the hot log whose period ended at least
-- `older_than_seconds` ago and whose deliveries are all finished, given a CHECK constraint of
-- its range (added NOT VALID, a moment's lock of that partition only) so that step 2 can
-- validate it without stopping anyone and step 3 attach it to the archive without a scan.
-- NULL when there is none, or when the oldest such partition still has a delivery moving
-- (the archive stays contiguous: it waits for that one).
CREATE FUNCTION airlock_archive_prepare(older_than_seconds bigint, lock_timeout_ms integer)
RETURNS text LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    p record;
BEGIN
    IF older_than_seconds < 0 OR lock_timeout_ms < 1 THEN
        RAISE EXCEPTION 'older_than_seconds must not be negative, lock_timeout_ms must be positive' USING ERRCODE = '22023';
    END IF;
    SELECT * INTO p FROM airlock_partitions('delivery_events')
    WHERE hi IS NOT NULL AND hi <= airlock_uuid_floor(now() - make_interval(secs => older_than_seconds))
    ORDER BY lo NULLS FIRST LIMIT 1;
    IF NOT FOUND OR airlock_period_open(p.lo, p.hi) THEN
        RETURN NULL;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = p.part AND conname = p.part::text || '_range') THEN
        PERFORM set_config('lock_timeout', lock_timeout_ms || 'ms', true);
        EXECUTE format('ALTER TABLE %s ADD CONSTRAINT %I CHECK (%s delivery_id < %L) NOT VALID', p.part,
                       p.part::text || '_range', CASE WHEN p.lo IS NULL THEN '' ELSE format('delivery_id >= %L AND', p.lo) END,
                       p.hi);
    END IF;
    RETURN p.part::text;
END $$;

-- Step 2: validates the range constraint (a scan that blocks no reader or writer).
CREATE FUNCTION airlock_archive_validate(part text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM airlock_partitions('delivery_events') p WHERE p.part::text = airlock_archive_validate.part) THEN
        RAISE EXCEPTION '% is not a partition of delivery_events', part USING ERRCODE = '22023';
    END IF;
    EXECUTE format('ALTER TABLE %I VALIDATE CONSTRAINT %I', part, part || '_range');
END $$;

-- Nobody but the owner may write an archived partition, even by its own name: whatever
-- another role was granted on it as a partition of the hot log is taken back but reading.
CREATE FUNCTION airlock_archive_close(part regclass) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    grantee name;
BEGIN
    FOR grantee IN SELECT DISTINCT r.rolname FROM pg_class c, aclexplode(c.relacl) a JOIN pg_roles r ON r.oid = a.grantee
                   WHERE c.oid = part AND a.grantee <> c.relowner AND a.privilege_type <> 'SELECT' LOOP
        EXECUTE format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON %s FROM %I', part, grantee);
    END LOOP;
END $$;

-- Step 3: moves the partition to the archive: under a lock of the hot log that waits at most
-- `lock_timeout_ms` (false when it could not be had: try again later), checks once more
-- that its period is closed, detaches it and attaches it to the archive (no scan: the
-- validated constraint proves its range). The seal follows in a transaction of its own
-- (`airlock_archive_seal`), so that its read holds no lock of the hot log.
CREATE FUNCTION airlock_archive_move(part text, lock_timeout_ms integer) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    p record;
BEGIN
    SELECT * INTO p FROM airlock_partitions('delivery_events') x WHERE x.part::text = airlock_archive_move.part;
    IF NOT FOUND OR p.hi IS NULL THEN
        RAISE EXCEPTION '% is not a closed partition of delivery_events', part USING ERRCODE = '22023';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = p.part AND conname = part || '_range' AND convalidated) THEN
        RAISE EXCEPTION '% has no validated range constraint (airlock_archive_validate)', part USING ERRCODE = '22023';
    END IF;
    BEGIN
        PERFORM set_config('lock_timeout', lock_timeout_ms || 'ms', true);
        LOCK TABLE delivery_events IN ACCESS EXCLUSIVE MODE;
    EXCEPTION WHEN lock_not_available THEN
        RETURN false;
    END;
    IF airlock_period_open(p.lo, p.hi) THEN
        RAISE EXCEPTION 'a delivery of % is not finished', part USING ERRCODE = '55000';
    END IF;
    EXECUTE format('ALTER TABLE delivery_events DETACH PARTITION %s', p.part);
    EXECUTE format('ALTER TABLE delivery_events_archive ATTACH PARTITION %s FOR VALUES FROM (%s) TO (%L)', p.part,
                   coalesce(quote_literal(p.lo), 'MINVALUE'), p.hi);
    PERFORM airlock_archive_close(p.part);
    RETURN true;
END $$;

-- Step 4: the seal of an archived partition, once (a second call returns the first's row).
CREATE FUNCTION airlock_archive_seal(part text) RETURNS SETOF delivery_event_archives
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    p record;
    n_deliveries bigint;
    n_events bigint;
    n_broken bigint;
    n_rows bigint;
BEGIN
    SELECT * INTO p FROM airlock_partitions('delivery_events_archive') x WHERE x.part::text = airlock_archive_seal.part;
    IF NOT FOUND THEN
        RAISE EXCEPTION '% is not a partition of delivery_events_archive', part USING ERRCODE = '22023';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM delivery_event_archives a WHERE a.partition = part) THEN
        EXECUTE format(
            'SELECT count(*), coalesce(sum(h.n), 0), count(*) FILTER (WHERE h.hash IS DISTINCT FROM d.event_hash OR h.n <> d.version)
             FROM deliveries d
             LEFT JOIN LATERAL (SELECT count(*) AS n, max(e.hash) FILTER (WHERE e.seq = d.version) AS hash
                                FROM %s e WHERE e.delivery_id = d.id) h ON true
             WHERE ($1::uuid IS NULL OR d.id >= $1) AND d.id < $2', p.part)
        INTO n_deliveries, n_events, n_broken USING p.lo, p.hi;
        EXECUTE format('SELECT count(*) FROM %s', p.part) INTO STRICT n_rows;
        INSERT INTO delivery_event_archives (partition, lo, hi, deliveries, events, broken, strays)
        VALUES (part, p.lo, p.hi, n_deliveries, n_rows, n_broken, n_rows - n_events)
        ON CONFLICT (partition) DO NOTHING;
    END IF;
    RETURN QUERY SELECT * FROM delivery_event_archives a WHERE a.partition = part;
END $$;

-- The first partition covers everything there is; the next periods are made ahead with the
-- default period (a week) and runway (four); workers keep it so with the configured ones.
DO $$
DECLARE
    top uuid;
BEGIN
    SELECT airlock_uuid_floor(greatest(now(), (SELECT airlock_uuid_time(delivery_id) + interval '1 millisecond'
                                               FROM delivery_events_p0 ORDER BY delivery_id DESC LIMIT 1)))
    INTO top;
    EXECUTE format('ALTER TABLE delivery_events ATTACH PARTITION delivery_events_p0 FOR VALUES FROM (MINVALUE) TO (%L)', top);
END $$;
SELECT airlock_delivery_events_partitions(604800, 4, 5000);

REVOKE ALL ON FUNCTION airlock_delivery_events_partitions(bigint, integer, integer),
    airlock_archive_prepare(bigint, integer), airlock_archive_validate(text), airlock_archive_move(text, integer),
    airlock_archive_seal(text) FROM PUBLIC;

-- As in 0025, with one rule in place of its list: the application role may call every
-- SECURITY DEFINER function of the schema (each does one bounded piece of the owner's work,
-- and PUBLIC may call none of them).
CREATE OR REPLACE FUNCTION airlock_grant_application(app_role name) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    log regclass;
    fn regprocedure;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = app_role) OR app_role = current_user
       OR NOT pg_has_role(current_user, (SELECT relowner FROM pg_class WHERE oid = 'audit_log'::regclass), 'USAGE') THEN
        RETURN;
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), app_role);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %I TO %I', current_schema(), app_role);
    EXECUTE format('REVOKE TRUNCATE, REFERENCES, TRIGGER ON ALL TABLES IN SCHEMA %I FROM %I', current_schema(), app_role);
    EXECUTE format('GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA %I TO %I', current_schema(), app_role);
    FOR log IN SELECT * FROM airlock_append_only_tables() LOOP
        EXECUTE format('REVOKE UPDATE, DELETE, TRUNCATE ON %s FROM %I', log, app_role);
    END LOOP;
    IF to_regclass('_sqlx_migrations') IS NOT NULL THEN
        EXECUTE format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON _sqlx_migrations FROM %I', app_role);
    END IF;
    -- The archive and its seals are written by the owner's functions alone.
    EXECUTE format('REVOKE INSERT ON delivery_events_archive, delivery_event_archives FROM %I', app_role);
    PERFORM airlock_archive_close(a.part) FROM airlock_partitions('delivery_events_archive') a;
    FOR fn IN SELECT p.oid::regprocedure FROM pg_proc p
              WHERE p.pronamespace = current_schema()::regnamespace AND p.prosecdef LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', fn, app_role);
    END LOOP;
END $$;

SELECT airlock_grant_application('airlock_app');
