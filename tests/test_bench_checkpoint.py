"""benchmarks/bench_checkpoint.py runs, and each rank writes and reads back its own share."""

import json
import subprocess
import sys

from tests.conftest import ROOT, cli_env


def test_benchmark_saves_and_loads_each_ranks_share():
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_checkpoint.py"), "--ranks", "2",
           "--tensors", "5", "--rows", "64", "--cols", "48", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]  # 1 if a rank read back other values
    ranks = json.loads(done.stdout)["ranks"]["2"]
    share = 5 * 64 * 48 * 4 // 2  # bytes: a ZeRO-like half of the state per rank
    for rank in ranks:
        assert rank["load_equal"] and rank["share_mib"] * 2**20 == share
        assert share <= rank["bytes"] < share + 64 * 1024  # its tensors plus DCP's framing
        assert rank["async_first_blocked_s"] > 0 and rank["async_next_total_s"] > 0
