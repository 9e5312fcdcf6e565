#!/usr/bin/env bash
# The GPU check in one call: bash scripts/gpu_check.sh OUT_DIR [--cpu] [gpu_check.py options]
#
# On the borrowed GPU machine (bare Python with torch, no network) it first installs the
# wheels that scripts/gpu_wheels.sh downloaded into .whl/ (carried there with the working
# tree) into a scratch folder, without an index or dependencies, then runs
# benchmarks/gpu_check.py, which writes OUT_DIR/gpu_check.json after every section.
# A Python that has them already (CI, the dev box: .venv) uses its own site-packages.
# Everything printed also goes to OUT_DIR/gpu_check.log. docs/benchmarks.md#gpu-check.
set -euo pipefail
if [[ $# -lt 1 || $1 == -* ]]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR [--cpu] [gpu_check.py options]" >&2
    exit 2
fi
out=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee -a "$out/gpu_check.log") 2>&1

# Which Python: $PYTHON, else the repository's .venv, else python3 on the PATH.
if [[ -n ${PYTHON:-} ]]; then
    py=$PYTHON
elif [[ -x $root/.venv/bin/python ]]; then
    py=$root/.venv/bin/python
else
    py=$(command -v python3 || command -v python)
fi
echo "[gpu_check.sh] $(date -u +%FT%TZ) python $py ($("$py" -V 2>&1))"

shopt -s nullglob
wheels=("$root"/.whl/*.whl)
if "$py" -c 'import megatron.core, wids, webdataset' 2>/dev/null; then
    echo "[gpu_check.sh] $py has megatron-core, wids and webdataset: .whl/ not needed"
elif ((${#wheels[@]})); then
    site=${TMPDIR:-/tmp}/gpu-check-site
    rm -rf "$site"
    if "$py" -m pip --version >/dev/null 2>&1; then
        "$py" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" \
            "${wheels[@]}"
    else  # no pip: a wheel is a zip laid out for site-packages
        for wheel in "${wheels[@]}"; do "$py" -m zipfile -e "$wheel" "$site"; done
    fi
    echo "[gpu_check.sh] installed ${#wheels[@]} wheels into $site"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    # The test suite starts CLI subprocesses with PYTHONPATH set to the repository alone
    # (tests/conftest.py cli_env); a .pth file in the user site-packages, which Python adds
    # to every process that inherits PYTHONUSERBASE, puts the wheels on their path too.
    if [[ $("$py" -c 'import site; print(site.ENABLE_USER_SITE)') == True ]]; then
        export PYTHONUSERBASE=${TMPDIR:-/tmp}/gpu-check-userbase
        user_site=$("$py" -c 'import site; print(site.getusersitepackages())')
        mkdir -p "$user_site"
        echo "$site" >"$user_site/gpu-check-wheels.pth"
    else
        echo "[gpu_check.sh] warning: user site-packages are off (a venv?): test subprocesses" \
            "that reset PYTHONPATH will not see the wheels"
    fi
else
    echo "[gpu_check.sh] warning: $py lacks megatron-core, wids or webdataset and there is" \
        "no .whl/*.whl: run scripts/gpu_wheels.sh first and carry .whl"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

cd "$root"
status=0
"$py" benchmarks/gpu_check.py --out "$out" "$@" || status=$?
echo "[gpu_check.sh] $(date -u +%FT%TZ) exit $status; files in $out:"
ls -l "$out"
exit "$status"
