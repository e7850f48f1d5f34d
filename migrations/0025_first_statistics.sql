-- A new installation's tables have no planner statistics until autovacuum first analyzes
-- them, a naptime or more after work arrives (about 80 s was seen on `jobs` with a standing
-- backlog), and until then every statement a worker keeps prepared is planned blind: the
-- queue drained at 0.6 of a warm database's rate until that first analysis. Workers call
-- this on a short tick instead (see `worker.first_analyze_rows`).
--
-- It analyzes each table of the schema that was never analyzed (neither by hand nor by
-- autovacuum) and has had at least `min_changes` rows inserted, updated or deleted since,
-- and returns those tables. One caller at a time does the work (the others return at once);
-- a table another ANALYZE holds is skipped, and tried again at the next call. It runs as the
-- tables' owner, so that the application role, which owns nothing, may call it; it does
-- nothing else, and only that role (and the owner) may execute it.
CREATE FUNCTION airlock_first_analyze(min_changes bigint) RETURNS SETOF regclass
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    t regclass;
BEGIN
    IF NOT pg_try_advisory_xact_lock(x'4149524c4f434b04'::bigint) THEN
        RETURN;
    END IF;
    FOR t IN
        SELECT s.relid::regclass FROM pg_stat_user_tables s
        WHERE s.schemaname = current_schema() AND s.last_analyze IS NULL AND s.last_autoanalyze IS NULL
          AND s.n_mod_since_analyze >= greatest(min_changes, 1)
        ORDER BY s.n_mod_since_analyze DESC
    LOOP
        EXECUTE format('ANALYZE (SKIP_LOCKED) %s', t);
        RETURN NEXT t;
    END LOOP;
END $$;

REVOKE ALL ON FUNCTION airlock_first_analyze(bigint) FROM PUBLIC;

-- As in 0021, and the application role may also call the function above.
CREATE OR REPLACE FUNCTION airlock_grant_application(app_role name) RETURNS void LANGUAGE plpgsql AS $$
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
    EXECUTE format('GRANT EXECUTE ON FUNCTION airlock_first_analyze(bigint) TO %I', app_role);
END $$;

SELECT airlock_grant_application('airlock_app');
