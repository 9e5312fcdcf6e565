"""The matched-budget section of a study report, for a sweep with `match_flops:`
(slurm/sweep_flops.py), whose runs carry the tag `arms`.

Two arms: *params*, one shape and one token budget D for every architecture, so that the
parameter counts differ only by the connections' own parameters; *flops*, D set per
architecture so that D x f (f = flops_per_token(), the connection's cost included) is the
baseline's training FLOPs. Per arm, one row per configuration (its seeds pooled):
architecture, N (non-embedding parameters) and N - N_baseline, f, D, the training FLOPs
f D (tag C_model) and their ratio to the baseline's, the final validation loss (mean and
sample standard deviation over seeds) and its difference from the baseline's mean in the
same arm, and the step time (median over seeds of each run's median step,
slurm/report_cost.py). The baseline of a row is the baseline architecture's configuration
in the same arm with the same shape, lr and warm-up (and, in the params arm, the same D).
"""

from __future__ import annotations

import math
import statistics

from slurm.report_cost import step_seconds
from slurm.report_html import column, paragraph, section, table
from slurm.report_stats import SeedStats, label
from slurm.sweep_flops import ARMS_TAG

ARMS = ("params", "flops")
ARM_TITLES = {"params": "matched parameters (one shape, one D)",
              "flops": "matched FLOPs (D x FLOPs/token = the baseline's)"}


def _arms(stats: SeedStats) -> set[str]:
    return set(stats.runs[0].tags.get(ARMS_TAG, "").split(",")) - {""}


def _context(stats: SeedStats, arm: str) -> tuple:
    return tuple((k, v) for k, v in stats.config
                 if k != "architecture" and not (arm == "flops" and k == "D"))


def _tag(stats: SeedStats, key: str) -> float | None:
    values = [float(r.tags[key]) for r in stats.runs if key in r.tags]
    return statistics.fmean(values) if values else None


def arm_rows(stats: list[SeedStats], baseline: str) -> list[dict]:
    """One dict per (arm, configuration) of the configurations tagged with arms, baseline
    first in each arm; the numbers of the section (report.json keeps them)."""
    rows = []
    for arm in ARMS:
        members = [s for s in stats if arm in _arms(s)]
        bases = {_context(s, arm): s for s in members
                 if dict(s.config)["architecture"] == baseline}
        members.sort(key=lambda s: (dict(s.config)["architecture"] != baseline,
                                    _context(s, arm), dict(s.config)["architecture"]))
        for s in members:
            base = bases.get(_context(s, arm))
            n, flops, tokens = _tag(s, "N"), _tag(s, "C_model"), _tag(s, "D")
            steps = [t for t in (step_seconds(r) for r in s.runs) if t is not None]
            row = {"arm": arm, "config": label(s.config), "architecture":
                   dict(s.config)["architecture"], "seeds": s.n, "n_params": n,
                   "flops_per_token": flops / tokens if flops and tokens else None,
                   "tokens": tokens, "flops": flops, "val_loss": s.mean, "val_loss_std": s.std,
                   "step_seconds": statistics.median(steps) if steps else None,
                   "n_params_over_baseline": None, "flops_ratio": None, "minus_baseline": None}
            if base is not None:
                n_base, flops_base = _tag(base, "N"), _tag(base, "C_model")
                if n is not None and n_base is not None:
                    row["n_params_over_baseline"] = n - n_base
                if flops and flops_base:
                    row["flops_ratio"] = flops / flops_base
                row["minus_baseline"] = s.mean - base.mean
            rows.append(row)
    return rows


def arms_section(stats: list[SeedStats], baseline: str) -> tuple[str, list[dict]]:
    """The section (empty without tagged runs) and its rows."""
    rows = arm_rows(stats, baseline)
    if not rows:
        return "", []
    columns = [column([r[k] for r in rows], digits) for k, digits in (
        ("flops_per_token", 4), ("tokens", 4), ("flops", 4), ("step_seconds", 3))]

    def fixed(value: float | None, spec: str) -> str:
        return "—" if value is None else f"{value:{spec}}"

    cells = []
    for i, r in enumerate(rows):
        spread = (f" ± {r['val_loss_std']:.4f}" if math.isfinite(r["val_loss_std"])
                  else " (1 seed)")
        extra = r["n_params_over_baseline"]
        cells.append((ARM_TITLES[r["arm"]], r["config"], r["seeds"],
                      fixed(r["n_params"], ".0f"), fixed(extra, "+.0f"), columns[0][i],
                      columns[1][i], columns[2][i], fixed(r["flops_ratio"], ".4f"),
                      f"{r['val_loss']:.4f}{spread}", fixed(r["minus_baseline"], "+.4f"),
                      columns[3][i]))
    return section(
        "Matched parameters and matched FLOPs",
        paragraph(f"Each architecture in two arms (match_flops: in the sweep): at matched "
                  f"parameters every architecture trains the same shape on the same tokens, "
                  f"so N differs only by the connections' own parameters; at matched FLOPs "
                  f"its tokens are set so that tokens x FLOPs/token (flops_per_token(), "
                  f"attention, LM head and the connection included) is {baseline}'s, to the "
                  f"nearest whole step. Validation loss: mean ± sample standard deviation "
                  f"over seeds; minus {baseline}: the difference of the means in the same "
                  f"arm (negative: better). Step time: the median over seeds of each run's "
                  f"median step."),
        table(["arm", "configuration", "seeds", "N", f"N - {baseline}", "FLOPs/token",
               "tokens", "FLOPs", f"FLOPs / {baseline}", "val loss", f"minus {baseline}",
               "step s"], cells, numeric=range(2, 12))), rows
