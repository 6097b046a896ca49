#!/usr/bin/env bash
# Starts (or stops) a throwaway PostgreSQL server on loopback for the test suite.
#   scripts/test-postgres.sh start   -> prints the server's base URL (postgresql://…/)
#   scripts/test-postgres.sh stop
# Data lives under $FERRY_PG_DIR (default .ferry/test-postgres); the server listens on
# 127.0.0.1:$FERRY_PG_PORT (default 55432) only. PostgreSQL refuses to run as root, so the
# server runs as the 'postgres' system user when started by root.
set -euo pipefail
cmd=${1:-start}
port=${FERRY_PG_PORT:-55432}
dir=$(realpath -m "${FERRY_PG_DIR:-.ferry/test-postgres}")
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
[ -n "$bindir" ] || { echo "PostgreSQL server binaries not found (apt-get install postgresql)" >&2; exit 1; }

as_owner() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

case "$cmd" in
  start)
    if [ ! -s "$dir/PG_VERSION" ]; then
      mkdir -p "$dir"
      [ "$(id -u)" = 0 ] && chown postgres: "$dir"
      as_owner "$bindir/initdb" -D "$dir" -U ferry --auth=trust -E UTF8 >/dev/null
    fi
    if ! as_owner "$bindir/pg_ctl" -D "$dir" status >/dev/null 2>&1; then
      as_owner "$bindir/pg_ctl" -D "$dir" -w -t 60 -l "$dir/server.log" \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c max_connections=200 -c fsync=off" start >/dev/null
    fi
    echo "postgresql+psycopg2://ferry@127.0.0.1:$port/"
    ;;
  stop)
    if [ -s "$dir/PG_VERSION" ]; then
      as_owner "$bindir/pg_ctl" -D "$dir" -m fast stop >/dev/null 2>&1 || true
    fi
    ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
