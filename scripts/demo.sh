#!/usr/bin/env bash
# One command from a fresh machine to a running demo: installs ampscope into .venv
# and runs `ampscope demo` (arguments are passed through, see `ampscope demo --help`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh demo
exec .venv/bin/ampscope demo "$@"
