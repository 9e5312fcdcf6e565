#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv. Idempotent: re-runs only
# pip when pyproject.toml changed since the last successful set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.setup-stamp"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "setting up $VENV (about 2 minutes the first time)..." >&2
"$VENV/bin/python" -m pip install --quiet --upgrade pip 2>&1 | { grep -v "is ignored: it is neither" || true; }
# The CPU wheel of torch lies on disk here; on a GPU cluster install your CUDA build of torch
# first and this line is a no-op (any torch >= 2.6 satisfies pyproject.toml).
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}" 2>&1 | { grep -v "is ignored: it is neither" || true; }
fi
# DS_BUILD_OPS=0: DeepSpeed builds its ops lazily (JIT) instead of at install time.
# eval: lm-evaluation-harness, which python -m pretrain lm-eval and its tests need.
DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install --quiet -e ".[dev,eval,hf,triton]" 2>&1 | { grep -v "is ignored: it is neither" || true; }
echo "$want" > "$stamp"
