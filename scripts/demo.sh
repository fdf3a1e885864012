#!/usr/bin/env bash
# The demo on a fresh machine: installs uv if needed, then the locked runtime + envoy + demo
# dependencies (no dev tools), and runs `extproc demo` with any arguments given here.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/uv.sh
exec $UV run --locked --no-dev --extra demo extproc demo "$@"
