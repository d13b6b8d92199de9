#!/usr/bin/env bash
# Prepare this checkout: a virtual environment in .venv with ampscope installed
# (editable) and, for the test suite, Debian's prometheus/promtool/pushgateway.
# Safe to run again: every step checks before it acts.
#
#   scripts/setup.sh demo   -> ampscope + the exporter's dependencies
#   scripts/setup.sh docs   -> the above + the docs site's tools (Zensical, mkdocstrings)
#   scripts/setup.sh test   -> all of the above + test and lint tools + Prometheus binaries
set -euo pipefail

mode=${1:-test}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

python=${PYTHON:-python3}
if ! command -v "$python" >/dev/null; then
    echo "ampscope setup: $python not found; install Python 3.10 or newer" >&2
    exit 1
fi

if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv"
    "$python" -m venv .venv
fi

case "$mode" in
    demo) extra=service ;;
    docs) extra=docs ;;
    test) extra=dev ;;
    *) echo "ampscope setup: unknown mode '$mode' (demo, docs or test)" >&2; exit 2 ;;
esac
# The constraints pin torch to the CPU build; an unpinned torch pulls GBs of CUDA wheels.
stamp=.venv/.ampscope-$extra-$(cat pyproject.toml constraints/pins.txt | cksum | cut -d' ' -f1)
if [ ! -f "$stamp" ]; then
    echo "==> installing ampscope[$extra] into .venv"
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -c constraints/pins.txt -e ".[$extra]"
    touch "$stamp"
fi

if [ "$mode" = test ]; then
    need=()
    command -v promtool >/dev/null || need+=(prometheus)
    command -v prometheus-pushgateway >/dev/null || need+=(prometheus-pushgateway)
    # The web view's tests drive Debian's chromium through its chromedriver (Selenium).
    command -v chromium >/dev/null || need+=(chromium)
    command -v chromedriver >/dev/null || need+=(chromium-driver)
    # The rules are also evaluated by VictoriaMetrics' vmalert (tests/deploy/test_e2e_two_nodes.py).
    command -v vmalert >/dev/null || need+=(victoria-metrics)
    # Node runs the Prometheus Operator's schema validators (tests/deploy/test_kubernetes.py).
    command -v node >/dev/null || need+=(nodejs)
    command -v npm >/dev/null || need+=(npm)
    # The TLS tests make their CA, server and client certificates with it (tests/exporter/credentials.py).
    command -v openssl >/dev/null || need+=(openssl)
    if [ ${#need[@]} -gt 0 ]; then
        sudo=""
        [ "$(id -u)" -eq 0 ] || sudo=sudo
        if command -v apt-get >/dev/null && { [ -z "$sudo" ] || command -v sudo >/dev/null; }; then
            echo "==> installing Debian packages: ${need[*]}"
            $sudo apt-get update -qq
            DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
        elif [ "${CI:-}" = true ]; then
            echo "ampscope setup: cannot install ${need[*]} (no apt-get/sudo) and CI needs them" >&2
            exit 1
        else
            echo "ampscope setup: ${need[*]} not installed; the tests that need them will skip" >&2
        fi
    fi
fi

if [ "$mode" = test ] && command -v npm >/dev/null; then
    validators=tests/deploy/k8s-validate
    lock_stamp=$validators/node_modules/.ampscope-$(cksum <"$validators/package-lock.json" | cut -d' ' -f1)
    if [ ! -f "$lock_stamp" ]; then
        echo "==> installing the Kubernetes schema validators (npm ci in $validators)"
        npm ci --prefix "$validators" --no-audit --no-fund --loglevel=error >/dev/null
        touch "$lock_stamp"
    fi
fi
