# Finds a PostgreSQL server that answers, or starts a throwaway one.
# Source this file, then call `airlock_postgres`; it exports DATABASE_URL and, when it
# started a cluster, AIRLOCK_PG_STARTED_DIR (stop it with `airlock_postgres_stop`).
# `airlock_postgres_throwaway` always starts a cluster of its own (for runs that restart
# or break the server: never the shared one), and `airlock_postgres_restart_cmd` prints
# the command that restarts it. A throwaway cluster skips fsync for speed, unless
# AIRLOCK_PG_DURABLE=1 (stock durability, for measurements).

_pg_answers() {
  # $1: URL. True when a server accepts a query there.
  command -v psql >/dev/null 2>&1 || return 1
  PGCONNECT_TIMEOUT=3 psql "$1" -Atqc 'select 1' >/dev/null 2>&1
}

_pg_bin() {
  local d
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then echo "$d"; return 0; fi
  done
  return 1
}

_pg_install() {
  echo "postgres: installing the Debian PostgreSQL packages" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends postgresql postgresql-client >&2
}

_pg_free_port() {
  local p
  for p in $(seq 55432 55532); do
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return 0; fi
  done
  return 1
}

airlock_postgres() {
  if [ -n "${DATABASE_URL:-}" ] && _pg_answers "$DATABASE_URL"; then
    echo "postgres: using DATABASE_URL" >&2
    return 0
  fi
  local local_url="postgres://postgres@127.0.0.1:5432/postgres"
  if _pg_answers "$local_url"; then
    echo "postgres: using the server on 127.0.0.1:5432" >&2
    export DATABASE_URL="$local_url"
    return 0
  fi
  airlock_postgres_throwaway
}

airlock_postgres_throwaway() {
  local bin
  bin=$(_pg_bin) || { _pg_install && bin=$(_pg_bin); } || { echo "postgres: no initdb found" >&2; return 1; }
  command -v psql >/dev/null 2>&1 || _pg_install
  local dir port run_as=()
  dir=$(mktemp -d /tmp/airlock-pg.XXXXXX)
  port=$(_pg_free_port) || { echo "postgres: no free port" >&2; return 1; }
  mkdir -p "$dir/data" "$dir/sock"
  if [ "$(id -u)" = 0 ]; then
    # initdb refuses to run as root.
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    chown -R postgres "$dir"
    chmod 755 "$dir"
    run_as=(runuser -u postgres --)
  fi
  "${run_as[@]}" "$bin/initdb" -D "$dir/data" -A trust -U postgres --no-sync -E UTF8 >"$dir/initdb.log" 2>&1 \
    || { cat "$dir/initdb.log" >&2; return 1; }
  local speed="-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
  [ "${AIRLOCK_PG_DURABLE:-0}" = 1 ] && speed=""
  "${run_as[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-p $port -k $dir/sock -c listen_addresses=127.0.0.1 $speed -c max_connections=300" \
    start >&2 || { cat "$dir/server.log" >&2; return 1; }
  export AIRLOCK_PG_STARTED_DIR="$dir" AIRLOCK_PG_BIN="$bin"
  export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
  echo "postgres: started a throwaway cluster on port $port ($dir)" >&2
}

airlock_postgres_restart_cmd() {
  # The shell command that restarts the cluster `airlock_postgres_throwaway` started,
  # closing every connection at once (`-m fast`) and waiting until it answers again.
  [ -n "${AIRLOCK_PG_STARTED_DIR:-}" ] || { echo "postgres: no throwaway cluster to restart" >&2; return 1; }
  local run_as=""
  [ "$(id -u)" = 0 ] && run_as="runuser -u postgres -- "
  echo "${run_as}$AIRLOCK_PG_BIN/pg_ctl -D $AIRLOCK_PG_STARTED_DIR/data -l $AIRLOCK_PG_STARTED_DIR/server.log -m fast -w -t 60 restart"
}

airlock_postgres_stop() {
  [ -n "${AIRLOCK_PG_STARTED_DIR:-}" ] || return 0
  local run_as=()
  [ "$(id -u)" = 0 ] && run_as=(runuser -u postgres --)
  "${run_as[@]}" "$AIRLOCK_PG_BIN/pg_ctl" -D "$AIRLOCK_PG_STARTED_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
  rm -rf "$AIRLOCK_PG_STARTED_DIR"
  unset AIRLOCK_PG_STARTED_DIR
}
