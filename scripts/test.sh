#!/usr/bin/env bash
# Quickstart (2): set up and run the test suite (extra arguments go to pytest; the default
# leaves out tests marked slow: add `-m slow` for those, `-m ""` for everything).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# DeepSpeed JIT-builds a small CPU op with gcc the first time (~50 s): once, into
# .torch_extensions, instead of in every test that starts an engine.
.venv/bin/python -m parallel.zero --build-ops >/dev/null
exec .venv/bin/python -m pytest -q --durations=15 "$@"
