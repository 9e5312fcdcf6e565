"""Scaling-law fits (numpy + scipy), independent of where the numbers come from.

- Loss against compute, per architecture: L(C) = A * C^(-alpha), a straight line in log-log
  space fitted by least squares (scipy.stats.linregress); standard errors from the
  regression (needs 3 or more points).
- Loss against parameters and tokens (Hoffmann et al. 2022, approach 3):
  L(N, D) = E + A / N^a + B / D^b, fitted to log L with a Huber loss from a grid of starting
  points (scipy.optimize.least_squares); standard errors from the Jacobian at the optimum.
  Only when the grid allows: 3+ distinct N, 3+ distinct D, more points than parameters.
- Compute multiplier of an architecture X over a baseline T at budget C: the compute the
  baseline needs to reach X's loss at C, divided by C:
      m(C) = C_T(L_X(C)) / C,   with C_T(L) = (A_T / L)^(1 / alpha_T).
  m > 1: X reaches a loss that would cost the baseline m times more compute. Its interval
  comes from sampling both fits' parameters from their covariances.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass
class ComputeFit:
    """L(C) = A * C^(-alpha); log_a = ln A. Errors are standard errors (nan if unknown)."""

    log_a: float
    alpha: float
    log_a_err: float
    alpha_err: float
    cov_log_a_alpha: float
    points: int
    rmse_log: float  # root-mean-square residual of ln L

    @property
    def a(self) -> float:
        return float(np.exp(self.log_a))

    def loss(self, compute):
        """L at `compute` (scalar or array)."""
        return np.exp(self.log_a - self.alpha * np.log(compute))

    def compute_for(self, loss):
        """The compute at which this law reaches `loss`."""
        return np.exp((self.log_a - np.log(loss)) / self.alpha)

    def samples(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """(count, 2) draws of (ln A, alpha) from the fit's normal approximation."""
        mean = np.array([self.log_a, self.alpha])
        if not np.isfinite([self.log_a_err, self.alpha_err]).all():
            return np.tile(mean, (count, 1))
        cov = np.array([[self.log_a_err**2, self.cov_log_a_alpha],
                        [self.cov_log_a_alpha, self.alpha_err**2]])
        return rng.multivariate_normal(mean, cov, size=count)


def fit_compute_law(compute, loss) -> ComputeFit:
    """Fit L = A * C^(-alpha) to points (C, L); needs 2+ distinct compute values."""
    # deferred: pulls in scipy (slow to start, or optional)
    from scipy import stats

    x, y = np.log(np.asarray(compute, float)), np.log(np.asarray(loss, float))
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError(f"need at least 2 distinct compute values, got {len(set(x))}")
    reg = stats.linregress(x, y)
    residual = y - (reg.intercept + reg.slope * x)
    if len(x) >= 3:
        slope_err, intercept_err = reg.stderr, reg.intercept_stderr
        # OLS: cov(intercept, slope) = -mean(x) var(slope); alpha = -slope flips the sign.
        cov = float(np.mean(x)) * slope_err**2
    else:
        slope_err = intercept_err = cov = float("nan")
    return ComputeFit(log_a=float(reg.intercept), alpha=float(-reg.slope),
                      log_a_err=float(intercept_err), alpha_err=float(slope_err),
                      cov_log_a_alpha=cov, points=len(x),
                      rmse_log=float(np.sqrt(np.mean(residual**2))))


@dataclass
class ParamsTokensFit:
    """L(N, D) = E + A / N^a + B / D^b with standard errors (nan if unknown)."""

    E: float
    A: float
    B: float
    a: float
    b: float
    errors: dict[str, float]
    points: int
    rmse_log: float

    def loss(self, n, d):
        """L at N = n parameters and D = d tokens."""
        return self.E + self.A / np.power(n, self.a) + self.B / np.power(d, self.b)


def distinct_count(values, rel: float = 1e-3) -> int:
    """How many values differ from each other by more than `rel` (relative)."""
    values = np.sort(np.asarray(values, float))
    return int(1 + np.sum(np.diff(values) > rel * values[1:]))


def can_fit_params_tokens(n_params, tokens) -> bool:
    """True when the grid has 3+ distinct N, 3+ distinct D and 6+ points."""
    return len(n_params) >= 6 and distinct_count(n_params) >= 3 and distinct_count(tokens) >= 3


def _starting_point(n, d, y) -> list[float]:
    """For fixed exponents the law is linear in (E, A, B): scan a grid of (a, b), solve each
    for non-negative (E, A, B) weighted by 1/L (relative errors), keep the best."""
    # deferred: pulls in scipy (slow to start, or optional)
    from scipy.optimize import nnls

    best = (np.inf, None)
    for a, b in itertools.product(np.arange(0.05, 1.0, 0.025), repeat=2):
        design = np.stack([np.ones_like(n), n**-a, d**-b], axis=1) / y[:, None]
        coef, norm = nnls(design, np.ones_like(y))
        if norm < best[0] and (coef > 0).all():
            best = (norm, [*np.log(coef), a, b])
    if best[1] is None:
        return [0.0, 5.0, 5.0, 0.3, 0.3]
    return [float(v) for v in best[1]]


def fit_params_tokens(n_params, tokens, loss, huber_delta: float = 1e-3) -> ParamsTokensFit:
    """Fit L(N, D) = E + A/N^a + B/D^b (Hoffmann et al.'s approach 3)."""
    # deferred: pulls in scipy (slow to start, or optional)
    from scipy.optimize import least_squares
    from scipy.special import logsumexp

    n, d, y = (np.asarray(v, float) for v in (n_params, tokens, loss))
    if not can_fit_params_tokens(n, d):
        raise ValueError("L(N, D) needs 3+ distinct N, 3+ distinct D and 6+ runs")
    log_n, log_d, log_y = np.log(n), np.log(d), np.log(y)

    def residual(theta):  # theta = (ln E, ln A, ln B, a, b)
        e, la, lb, a, b = theta
        terms = np.stack([np.full_like(log_n, e), la - a * log_n, lb - b * log_d])
        return logsumexp(terms, axis=0) - log_y

    best = least_squares(residual, _starting_point(n, d, y), loss="huber", f_scale=huber_delta,
                         bounds=([-10, -10, -10, 0, 0], [10, 30, 30, 3, 3]))
    theta = best.x
    res = residual(theta)
    dof = len(y) - len(theta)
    jac = best.jac
    try:
        cov = np.linalg.inv(jac.T @ jac) * float(res @ res) / dof
        sd = np.sqrt(np.diag(cov))
    except np.linalg.LinAlgError:
        sd = np.full(len(theta), np.nan)
    e, la, lb, a, b = theta
    errors = {"E": float(np.exp(e) * sd[0]), "A": float(np.exp(la) * sd[1]),
              "B": float(np.exp(lb) * sd[2]), "a": float(sd[3]), "b": float(sd[4])}
    return ParamsTokensFit(E=float(np.exp(e)), A=float(np.exp(la)), B=float(np.exp(lb)),
                           a=float(a), b=float(b), errors=errors, points=len(y),
                           rmse_log=float(np.sqrt(np.mean(res**2))))


@dataclass
class Multiplier:
    compute: float
    value: float
    low: float  # 16th percentile (nan without uncertainties)
    high: float  # 84th percentile


def compute_multiplier(candidate: ComputeFit, baseline: ComputeFit, budgets,
                       samples: int = 4000, seed: int = 0) -> list[Multiplier]:
    """Compute multiplier of `candidate` over `baseline` at each budget, with a 68% interval."""
    rng = np.random.default_rng(seed)
    draws_x, draws_t = candidate.samples(samples, rng), baseline.samples(samples, rng)
    uncertain = np.isfinite([candidate.alpha_err, baseline.alpha_err]).any()
    out = []
    for c in budgets:
        value = float(baseline.compute_for(candidate.loss(c)) / c)
        low = high = float("nan")
        if uncertain:
            log_loss = draws_x[:, 0] - draws_x[:, 1] * np.log(c)
            with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
                m = np.exp((draws_t[:, 0] - log_loss) / draws_t[:, 1] - np.log(c))
            m = m[np.isfinite(m) & (draws_t[:, 1] > 0)]
            if len(m):
                low, high = (float(q) for q in np.percentile(m, [16, 84]))
        out.append(Multiplier(compute=float(c), value=value, low=low, high=high))
    return out
