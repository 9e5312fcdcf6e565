#!/usr/bin/env bash
# Quickstart (1): set up, build the demo data, pretrain a tiny DenseFormer on CPU, evaluate.
# Extra arguments are passed to `pretrain train` (e.g. --set train.steps=50).
# Re-running continues the same run (train.resume=auto) and reuses the data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
DATA=data/demo
RUN=${RUN_DIR:-runs/demo}
if [ ! -f "$DATA/index.json" ]; then
    $PY -m data_pipeline demo-corpus --out data/demo-corpus.jsonl
    $PY -m data_pipeline prepare --input data/demo-corpus.jsonl --out "$DATA" \
        --vocab-size 4096 --seq-len 128
fi
$PY -m pretrain train --config configs/tiny.yaml --set data.path="$DATA" \
    --set run.dir="$RUN" --set train.resume=auto "$@"
$PY -m pretrain eval --run "$RUN"
cat <<MSG

Run directory:  $RUN  (config.yaml, metrics.jsonl, loss_curve.png, checkpoints/)
MLflow store:   sqlite:///$(realpath "$RUN")/mlflow.db
Browse it with: .venv/bin/mlflow ui --backend-store-uri sqlite:///$(realpath "$RUN")/mlflow.db
MSG
