"""The editable install that scripts/setup.sh makes: built without a setuptools warning (pip
shows each as a BuildBackendWarning block in the demo's output)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from tests.conftest import ROOT

PACKAGES = ("pretrain", "parallel", "data_pipeline", "slurm")

# The build backend's hook as pip runs it: every warning it emits is recorded.
BUILD = """
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from setuptools import build_meta
    build_meta.build_editable(sys.argv[1])
print(json.dumps([f"{w.category.__name__}: {w.message}" for w in caught]))
"""


def test_editable_build_emits_no_warning(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    for package in PACKAGES:  # the layout, without the code
        (project / package).mkdir()
        (project / package / "__init__.py").write_text("")
    done = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path / "wheel")], cwd=project,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    assert wheel.name.startswith("denseformer_pretrain-")
