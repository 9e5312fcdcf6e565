#!/usr/bin/env bash
# Download, here, the wheels the GPU check needs on the borrowed GPU machine (CPython 3.12,
# x86-64 manylinux, no network there): megatron-core, wids, webdataset and their small
# dependencies that machine lacks, plus pytest-timeout for the suite's timeouts. Not MLflow
# or DeepSpeed (the check runs with tracking and ZeRO off). Into .whl/ (git-ignored), which
# the device `run` call carries; scripts/gpu_check.sh installs them there. With
# OFFICIAL=<a checkout of epfml/DenseFormer> it also copies the official code (its
# denseformer/ package and LICENSE) to .whl/DenseFormer, for `gpu_check.sh --official`.
# Usage: [OFFICIAL=PATH] bash scripts/gpu_wheels.sh        (docs/benchmarks.md#gpu-check)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$root/.whl
limit_mib=64  # what a device call carries, with the working tree
py=${PYTHON:-$root/.venv/bin/python}
[[ -x $py ]] || py=$(command -v python3)

# Pinned to what .venv runs (pyproject.toml), so the GPU runs the same libraries.
packages=(megatron-core==0.16.1 wids==0.1.11 webdataset==1.0.2 braceexpand==0.1.7
    pytest-timeout==2.4.0)

if [[ -n ${OFFICIAL:-} && ! -f ${OFFICIAL:-}/denseformer/__init__.py ]]; then
    echo "error: OFFICIAL=$OFFICIAL holds no denseformer/__init__.py" >&2
    exit 2
fi

rm -rf "$dest.new"
mkdir -p "$dest.new"
# --no-deps: the machine has torch, numpy, pyyaml, packaging and pytest already; the list
# above is every other requirement of these packages.
"$py" -m pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest.new" "${packages[@]}"
if [[ -n ${OFFICIAL:-} ]]; then
    mkdir -p "$dest.new/DenseFormer"
    cp -r "$OFFICIAL/denseformer" "$dest.new/DenseFormer/"
    cp "$OFFICIAL/LICENSE" "$dest.new/DenseFormer/" 2>/dev/null || true
    echo "copied the official code from $OFFICIAL to $dest/DenseFormer"
fi
rm -rf "$dest"
mv "$dest.new" "$dest"

total=$(cat "$dest"/*.whl | wc -c)
ls -l "$dest"
echo "total $(( (total + 1048575) / 1048576 )) MiB in $(ls "$dest"/*.whl | wc -l) wheels ($total bytes)"
if (( total > limit_mib * 1048576 )); then
    echo "error: the wheels exceed ${limit_mib} MiB, more than a device call carries" >&2
    exit 1
fi
