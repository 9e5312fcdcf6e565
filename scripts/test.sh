#!/usr/bin/env bash
# Quickstart (2): set up and run the test suite (extra arguments go to pytest; the default
# leaves out tests marked slow: add `-m slow` for those, `-m ""` for everything).
#   --fast      the unit tests only (marker `fast`: no subprocess, no spawned rank), 1-3
#               minutes on 2 cores; no DeepSpeed op build (docs/testing.md)
#   VENV=path   run with that virtual environment as it is, instead of setting up .venv
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
    fast=1
    shift
fi
if [ -n "${VENV:-}" ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        echo "VENV=$VENV: no $VENV/bin/python (unset VENV to set up .venv)" >&2
        exit 2
    fi
else
    bash scripts/setup.sh
    VENV=.venv
fi
if [ "$fast" = 1 ]; then
    # A second -m replaces the `not slow` of pyproject's addopts.
    exec "$VENV/bin/python" -m pytest -q --durations=10 -m "fast and not slow" "$@"
fi
# DeepSpeed JIT-builds a small CPU op with gcc the first time (~50 s): once, into
# .torch_extensions, instead of in every test that starts an engine.
"$VENV/bin/python" -m parallel.zero --build-ops >/dev/null
exec "$VENV/bin/python" -m pytest -q --durations=15 "$@"
