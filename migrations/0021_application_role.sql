-- The append-only logs hold against the database too: no TRUNCATE (a statement trigger, as
-- the row triggers refuse UPDATE and DELETE), and an application role that may read and
-- insert them but never change or remove a row.

CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only();
CREATE TRIGGER delivery_events_no_truncate BEFORE TRUNCATE ON delivery_events
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only();
CREATE TRIGGER run_steps_no_truncate BEFORE TRUNCATE ON run_steps
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only();
CREATE TRIGGER run_effects_no_truncate BEFORE TRUNCATE ON run_effects
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only();
CREATE TRIGGER turn_events_no_truncate BEFORE TRUNCATE ON turn_events
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only();
CREATE TRIGGER agent_journal_no_truncate BEFORE TRUNCATE ON agent_journal
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only();
CREATE TRIGGER relocation_events_no_truncate BEFORE TRUNCATE ON relocation_events
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only();
CREATE TRIGGER grants_no_truncate BEFORE TRUNCATE ON grants
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_append_only();

-- The logs the application role may only read and append to: every table that refuses
-- UPDATE or DELETE by an `*_append_only` trigger. A new log gets such a trigger, and with it
-- this treatment, without another list to keep.
CREATE FUNCTION airlock_append_only_tables() RETURNS SETOF regclass LANGUAGE sql STABLE AS $$
    SELECT DISTINCT t.tgrelid::regclass FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
    WHERE c.relnamespace = current_schema()::regnamespace AND t.tgname LIKE '%\_append\_only' AND NOT t.tgisinternal
$$;

-- Grants the application role `app_role` what the services need on every table and
-- sequence of the schema: read and write, except UPDATE, DELETE and TRUNCATE on the
-- append-only logs, and nothing but reading on the migrations' own table (the owner
-- migrates). It owns nothing, so it cannot drop or disable a trigger either. Applied again
-- after every migration by whoever migrates (see `airlock_core::db::migrate`); a no-op
-- when the role does not exist, or the caller is not (a member of) the tables' owner.
CREATE FUNCTION airlock_grant_application(app_role name) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    log regclass;
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
END $$;

SELECT airlock_grant_application('airlock_app');
