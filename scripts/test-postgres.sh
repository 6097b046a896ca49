#!/usr/bin/env bash
# Starts (or stops) a throwaway PostgreSQL server on loopback for the test suite.
#   scripts/test-postgres.sh start    -> prints the server's base URL (postgresql+psycopg2://…/)
#   scripts/test-postgres.sh stop
#   scripts/test-postgres.sh status   -> exit status 0 when the server is running
#   scripts/test-postgres.sh remove   -> stops the server and deletes its data directory
# Data lives under $FERRY_PG_DIR (default .ferry/test-postgres); the server listens on
# 127.0.0.1 only, on $FERRY_PG_PORT or else the first free port from 55432 up, so several
# checkouts on one machine each get their own server. PostgreSQL refuses to run as root, so the
# server runs as the 'postgres' system user when started by root; if that user cannot reach the
# checkout (a home directory closed to others), the data goes under /tmp instead.
# Only start needs PostgreSQL installed: without it, stop and remove have no server to stop
# (remove still deletes the data) and status answers 1.
set -euo pipefail
cmd=${1:-start}
pg_dir=${FERRY_PG_DIR:+$(realpath -m "$FERRY_PG_DIR")}
cd "$(dirname "$0")/.."
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)

# Runs a command as the server's owner; from / so that a checkout closed to that user is no cwd.
as_owner() {
  if [ "$(id -u)" = 0 ]; then (cd / && runuser -u postgres -- "$@"); else "$@"; fi
}

data_dir() {
  if [ -n "$pg_dir" ]; then echo "$pg_dir"; return; fi
  mkdir -p .ferry
  if [ "$(id -u)" = 0 ] && ! as_owner test -x "$PWD/.ferry" 2>/dev/null; then
    echo "/tmp/ferry-test-postgres-$(printf '%s' "$PWD" | sha256sum | cut -c1-12)"
  else
    echo "$PWD/.ferry/test-postgres"
  fi
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_port() {
  local p
  for p in $(seq 55432 55531); do
    port_in_use "$p" || { echo "$p"; return; }
  done
  echo "no free port in 55432-55531 for the test PostgreSQL server" >&2
  return 1
}

running() { [ -n "$bindir" ] && as_owner "$bindir/pg_ctl" -D "$dir" status >/dev/null 2>&1; }

stop_server() {
  if [ -s "$dir/PG_VERSION" ] && running; then
    as_owner "$bindir/pg_ctl" -D "$dir" -m fast -w stop >/dev/null
  fi
}

dir=$(data_dir)
case "$cmd" in
  start)
    [ -n "$bindir" ] || { echo "PostgreSQL server binaries not found (apt-get install postgresql)" >&2; exit 1; }
    if [ ! -s "$dir/PG_VERSION" ]; then
      mkdir -p "$dir"
      if [ "$(id -u)" = 0 ]; then chown postgres: "$dir"; fi
      as_owner "$bindir/initdb" -D "$dir" -U ferry --auth=trust -E UTF8 >/dev/null
    fi
    if ! running; then
      port=${FERRY_PG_PORT:-$(free_port)}
      as_owner "$bindir/pg_ctl" -D "$dir" -w -t 60 -l "$dir/server.log" \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c max_connections=200 -c fsync=off" start >/dev/null
      # Nobody uses a server that was not running: drop the databases an interrupted run left behind.
      as_owner "$bindir/psql" -h "$dir" -p "$port" -U ferry -d postgres -Atc \
        "SELECT datname FROM pg_database WHERE datname LIKE 'ferry\\_%'" |
        while read -r leftover; do
          as_owner "$bindir/dropdb" -h "$dir" -p "$port" -U ferry --if-exists "$leftover"
        done
    fi
    # The fourth line of postmaster.pid is the port the running server listens on.
    port=$(sed -n 4p "$dir/postmaster.pid")
    echo "postgresql+psycopg2://ferry@127.0.0.1:$port/"
    ;;
  stop)
    stop_server
    ;;
  remove)
    stop_server
    # A server whose binaries were uninstalled while it ran cannot be stopped here: keep its data.
    pid=$(head -n 1 "$dir/postmaster.pid" 2>/dev/null || true)
    if [ -z "$bindir" ] && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      echo "the test PostgreSQL server in $dir still runs; stop it first" >&2
      exit 1
    fi
    # Only a directory this script made: a data directory, or one an interrupted start left empty.
    if [ -s "$dir/PG_VERSION" ]; then
      rm -rf "$dir"
    elif [ -d "$dir" ]; then
      rmdir "$dir" 2>/dev/null || true
    fi
    ;;
  status)
    [ -s "$dir/PG_VERSION" ] && running
    ;;
  *) echo "usage: $0 start|stop|status|remove" >&2; exit 2 ;;
esac
