"""The statistics of a study report: configurations over seeds, best-of learning rate, paired
differences. Pure functions of the runs' tags and final losses.

- A *configuration* is a run's grid values without its seed: architecture, depth, width,
  tokens D, learning rate, warm-up and, for a dependent stage, the parent's architecture.
  Its seeds give a mean and a spread (sample standard deviation) of the final validation
  loss; perplexity is exp(loss) per run, then averaged.
- *Best of learning rate*: configurations that differ only in learning rate (and warm-up)
  form a tuning group; its best member has the lowest mean final validation loss. Only best
  members are compared across architectures, so each architecture gets its own best lr.
- *Paired differences*: a run of architecture X and a run of the baseline are paired when
  they share the rest of the configuration (at each one's best lr), the seed and the data
  order (`train.seed`, `data.path`, `train.batch_size`, `model.seq_len`: the loader's order
  depends on nothing else). The difference loss_X - loss_baseline per pair has a mean, a
  standard deviation and a 95% Student-t interval (2+ pairs).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from slurm.report_data import StudyRun
from slurm.sweep_axes import si_format

CONFIG_KEYS = ("architecture", "n_layers", "d_model", "D", "lr", "warmup", "from")
TUNED_KEYS = ("lr", "warmup")
DATA_ORDER_PARAMS = ("train.seed", "data.path", "train.batch_size", "model.seq_len")


def config_of(run: StudyRun) -> tuple[tuple[str, str], ...]:
    """The run's configuration: (key, value) pairs of CONFIG_KEYS that it has."""
    values = {"architecture": run.architecture, "n_layers": run.grid("n_layers"),
              "d_model": run.grid("d_model"), "D": run.tags.get("D"), "lr": run.grid("lr"),
              "warmup": run.grid("warmup"), "from": run.tags.get("parent_architecture")}
    return tuple((k, values[k]) for k in CONFIG_KEYS if values[k] is not None)


def label(config: tuple[tuple[str, str], ...], skip: tuple[str, ...] = ()) -> str:
    """A readable name: `denseformer-1x1 L4 W64 D5.12k lr=0.003`."""
    parts = []
    for key, value in config:
        if key in skip:
            continue
        if key == "architecture":
            parts.append(value)
        elif key == "n_layers":
            parts.append(f"L{value}")
        elif key == "d_model":
            parts.append(f"W{value}")
        elif key == "D":
            parts.append(f"D{si_format(float(value))}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


@dataclass
class SeedStats:
    """The finished runs of one configuration, over seeds."""

    config: tuple[tuple[str, str], ...]
    runs: list[StudyRun]
    mean: float
    std: float  # sample standard deviation; nan with one seed
    ppl_mean: float
    seeds: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.runs)


def seed_stats(runs: list[StudyRun]) -> list[SeedStats]:
    """One SeedStats per configuration of the runs with a final validation loss."""
    groups: dict[tuple, list[StudyRun]] = {}
    for run in runs:
        if run.loss is not None:
            groups.setdefault(config_of(run), []).append(run)
    stats = []
    for config, members in groups.items():
        losses = [r.loss for r in members]
        stats.append(SeedStats(
            config=config, runs=members, mean=statistics.fmean(losses),
            std=statistics.stdev(losses) if len(losses) > 1 else math.nan,
            ppl_mean=statistics.fmean(math.exp(x) for x in losses),
            seeds=sorted(r.grid("seed") or "?" for r in members)))
    return sorted(stats, key=lambda s: [v for _, v in s.config])


def untuned(config: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in config if k not in TUNED_KEYS)


@dataclass
class Tuning:
    """A group of configurations that differ only in lr / warm-up, and its best member."""

    group: tuple[tuple[str, str], ...]
    members: list[SeedStats]
    best: SeedStats


def best_of(stats: list[SeedStats]) -> list[Tuning]:
    """Per tuning group, the configuration with the lowest mean final validation loss."""
    groups: dict[tuple, list[SeedStats]] = {}
    for s in stats:
        groups.setdefault(untuned(s.config), []).append(s)
    return [Tuning(group, members, min(members, key=lambda s: s.mean))
            for group, members in groups.items()]


def _order_key(run: StudyRun) -> tuple[str, ...]:
    return tuple(run.params.get(k, "") for k in DATA_ORDER_PARAMS)


@dataclass
class Paired:
    """loss(architecture) - loss(baseline) over runs that share seed and data order."""

    architecture: str
    context: tuple[tuple[str, str], ...]  # the shared configuration, architecture left out
    pairs: list[tuple[str, str, float]]  # (run, baseline run, difference)
    mean: float
    std: float
    low: float  # 95% Student-t interval of the mean difference (nan with one pair)
    high: float

    @property
    def wins(self) -> int:
        """Pairs in which the architecture's loss is lower."""
        return sum(d < 0 for _, _, d in self.pairs)


def paired_differences(tunings: list[Tuning], baseline: str) -> list[Paired]:
    """For each best configuration of another architecture, its paired differences against
    the baseline's best configuration in the same context."""
    # deferred: pulls in scipy (slow to start, or optional)
    from scipy import stats

    def context(config):
        return tuple((k, v) for k, v in untuned(config) if k != "architecture")

    base = {context(t.group): t.best for t in tunings
            if dict(t.group).get("architecture") == baseline}
    results = []
    for tuning in tunings:
        arch = dict(tuning.group).get("architecture")
        where = context(tuning.group)
        if arch == baseline or where not in base:
            continue
        reference = {_order_key(r): r for r in base[where].runs}
        pairs = [(r.name, reference[_order_key(r)].name,
                  r.loss - reference[_order_key(r)].loss)
                 for r in tuning.best.runs if _order_key(r) in reference]
        if not pairs:
            continue
        diffs = [d for _, _, d in pairs]
        mean = statistics.fmean(diffs)
        std = statistics.stdev(diffs) if len(diffs) > 1 else math.nan
        low = high = math.nan
        if len(diffs) > 1:
            half = stats.t.ppf(0.975, len(diffs) - 1) * std / math.sqrt(len(diffs))
            low, high = mean - half, mean + half
        results.append(Paired(arch, where, pairs, mean, std, low, high))
    return results
