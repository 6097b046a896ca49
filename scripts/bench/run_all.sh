#!/usr/bin/env bash
# Runs the benchmark suite one benchmark after the other (they would skew each other in parallel)
# and prints every figure with the machine's description. PostgreSQL figures need the test server:
# FERRY_TEST_PG_URL is taken from the environment, or the server is started (and stopped after).
#   scripts/bench/run_all.sh            all: scheduler, cold start, disk moves, orchestration, drain, throughput,
#                                       server list
#   BENCH_HOSTS=1000,10000,100000 BENCH_RESIZES=50 scripts/bench/run_all.sh
#   BENCH_DRAIN_SERVERS=1000 BENCH_DRAIN_ARGS="--host-vcpus 64 --host-memory-mb 131072 --host-disk-gb 400" \
#     scripts/bench/run_all.sh      the 1,000-server drain (about 30 minutes here)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${VENV:-.venv}/bin/python
if [ -z "${FERRY_TEST_PG_URL:-}" ]; then
  if ! scripts/test-postgres.sh status; then trap 'scripts/test-postgres.sh stop' EXIT; fi
  FERRY_TEST_PG_URL=$(scripts/test-postgres.sh start)
  export FERRY_TEST_PG_URL
fi
"$py" scripts/bench/bench_scheduler.py --hosts "${BENCH_HOSTS:-1000,10000}" --runs "${BENCH_SCHEDULER_RUNS:-20}"
echo
"$py" scripts/bench/bench_cold_start.py
echo
"$py" scripts/bench/bench_disks.py ${BENCH_DISK_ARGS:-}
echo
"$py" scripts/bench/bench_orchestration.py --runs "${BENCH_RESIZES:-50}"
echo
"$py" scripts/bench/bench_orchestration.py --runs "${BENCH_RESIZES:-50}" --cross-cell
echo
"$py" scripts/bench/bench_drain.py --servers "${BENCH_DRAIN_SERVERS:-150}" --drain-hosts "${BENCH_DRAIN_HOSTS:-5}" --concurrency "${BENCH_DRAIN_CONCURRENCY:-20}" ${BENCH_DRAIN_ARGS:-}
echo
"$py" scripts/bench/bench_throughput.py --servers "${BENCH_THROUGHPUT_SERVERS:-200}"
echo
"$py" scripts/bench/bench_list.py --servers "${BENCH_LIST_SERVERS:-10000,100000}"
