#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, then lint, types, the
# strict docs build, tests and the quick benchmark smoke run. Safe to run twice.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh test
. .venv/bin/activate

echo "==> ruff"
ruff check ampscope tests bench dashboards
ruff format --check ampscope tests bench dashboards
echo "==> mypy"
mypy
echo "==> docs (strict build into site/)"
# Zensical needs Python 3.11; elsewhere the docs build (and tests/docs) skip, except in CI.
if [ -x .venv/bin/zensical ] || [ "${CI:-}" = true ]; then
    bash scripts/docs.sh
else
    echo "skipping the docs build: Zensical is not installed (it needs Python 3.11 or newer)" >&2
fi
echo "==> pytest"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
    echo "pytest collected no tests: treating as a failure" >&2
    exit 1
fi
exit $rc
