#!/usr/bin/env bash
# The docs site from mkdocs.yml, built with Zensical into site/, strictly: a broken link or
# anchor, or a generated block that fails, fails the build. Installs what it needs first
# (scripts/setup.sh docs; a no-op when the test setup already ran). Safe to run twice.
#
#   scripts/docs.sh           -> build site/
#   scripts/docs.sh --serve   -> build, then serve it on http://localhost:8000 (--serve ADDR:PORT)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

serve=""
case "${1:-}" in
    "") ;;
    --serve) serve=${2:-localhost:8000} ;;
    *) echo "usage: scripts/docs.sh [--serve [ADDR:PORT]]" >&2; exit 2 ;;
esac

# The test setup's extra (dev) includes the docs tools; without it, install just those.
# The stamps are setup.sh's: the extra and a checksum of what pins it.
sum=$(cat pyproject.toml constraints/pins.txt | cksum | cut -d' ' -f1)
if [ ! -f ".venv/.ampscope-dev-$sum" ]; then
    bash scripts/setup.sh docs
fi
if [ ! -x .venv/bin/zensical ]; then
    echo "ampscope docs: Zensical is not installed (it needs Python 3.11 or newer)" >&2
    exit 1
fi

# scripts/docs_generated.py renders the generated pages; the checkout first, so the pages
# describe this tree's code.
export PYTHONPATH="$root/scripts:$root${PYTHONPATH:+:$PYTHONPATH}"
echo "==> building the docs into site/"
start=$(date +%s%N)
.venv/bin/zensical build --strict --clean
echo "==> docs built in $(( ($(date +%s%N) - start) / 1000000 )) ms"
if [ -n "$serve" ]; then
    echo "==> serving site/ on http://$serve (Ctrl-C stops)"
    exec .venv/bin/zensical serve --dev-addr "$serve"
fi
