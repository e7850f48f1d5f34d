-- The application role the services connect as: it owns nothing, and the migrations grant
-- it read and write on every table but UPDATE, DELETE and TRUNCATE on the append-only logs
-- (migrations/0021_application_role.sql). The owner (the role that migrates) keeps the
-- schema. Run as a role that may create roles; safe to run again. The password is a psql
-- variable: psql -v app_password=... -f roles.sql
\if :{?app_password}
\else
\set app_password airlock_app
\endif
SELECT format('CREATE ROLE airlock_app LOGIN PASSWORD %L', :'app_password')
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'airlock_app') \gexec
