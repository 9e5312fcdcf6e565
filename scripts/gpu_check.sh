#!/usr/bin/env bash
# The GPU check in one call: bash scripts/gpu_check.sh OUT_DIR [--cpu] [gpu_check.py options]
#
# On the borrowed GPU machine (bare Python with torch, no network) it first installs the
# wheels that scripts/gpu_wheels.sh downloaded into .whl/ (carried there with the working
# tree; $GPU_CHECK_WHEELS names another folder) into a scratch folder, without an index or
# dependencies, and makes them importable by every process of the check (a scratch venv, see
# below), then runs benchmarks/gpu_check.py, which writes OUT_DIR/gpu_check.json after every
# section. A Python that has the packages (CI, the dev box: .venv) runs as it is.
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
# Without importing them (torch takes seconds): does $py have the packages of the wheels?
has_packages() {
    "$py" -c 'import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ("megatron", "wids", "webdataset")))'
}
wheel_dir=${GPU_CHECK_WHEELS:-$root/.whl}
wheels=("$wheel_dir"/*.whl)
# The wheels are for the GPU machine's Python (3.12): used where $py lacks the packages, or
# where GPU_CHECK_WHEELS names them.
if [[ -z ${GPU_CHECK_WHEELS:-} ]] && has_packages; then
    echo "[gpu_check.sh] $py has megatron-core, wids and webdataset: no wheels needed"
elif ((${#wheels[@]})); then
    scratch=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-env.XXXXXX")
    trap 'rm -rf "$scratch"' EXIT
    site=$scratch/wheels
    if "$py" -m pip --version >/dev/null 2>&1; then
        "$py" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" \
            "${wheels[@]}"
    else  # no pip: a wheel is a zip laid out for site-packages
        for wheel in "${wheels[@]}"; do "$py" -m zipfile -e "$wheel" "$site"; done
    fi
    echo "[gpu_check.sh] installed ${#wheels[@]} wheels from $wheel_dir into $site"
    # Every process of the check must see them, the test suite's CLI subprocesses too, which
    # reset PYTHONPATH (tests/conftest.py cli_env) and run sys.executable. So the check runs
    # on a fresh venv's Python whose site-packages holds a .pth that adds the wheels, then
    # the site directories of $py (a venv Python has user site-packages off, so a .pth in the
    # user site would not load). The wheels come first: the carried versions win.
    if "$py" -m venv --without-pip "$scratch/venv"; then
        venv_site=$("$scratch/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
        "$py" - "$site" >"$venv_site/_gpu_check_carried.pth" <<'PY'
import site, sys
dirs = [sys.argv[1], *site.getsitepackages()]
if site.ENABLE_USER_SITE:
    dirs.append(site.getusersitepackages())
for d in dirs:
    print(f"import site; site.addsitedir({d!r})")
PY
        py=$scratch/venv/bin/python
        export GPU_CHECK_VIA=venv
    else  # PYTHONPATH alone reaches every process but those that reset it
        echo "[gpu_check.sh] warning: $py -m venv failed: the wheels go on PYTHONPATH, which" \
            "test subprocesses that reset it will not see"
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" GPU_CHECK_VIA=PYTHONPATH
    fi
    export GPU_CHECK_SITE=$site
    echo "[gpu_check.sh] running on $py (via $GPU_CHECK_VIA)"
else
    echo "[gpu_check.sh] warning: $py lacks megatron-core, wids or webdataset and there is" \
        "no $wheel_dir/*.whl: run scripts/gpu_wheels.sh first and carry .whl"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

cd "$root"
status=0
"$py" benchmarks/gpu_check.py --out "$out" "$@" || status=$?
echo "[gpu_check.sh] $(date -u +%FT%TZ) exit $status; files in $out:"
ls -l "$out"
exit "$status"
