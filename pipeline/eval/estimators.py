"""Unbiased pass@k and pass^k from n samples per task, and confidence intervals over tasks (docs/evaluation.md).

A task sampled n times with c successes gives, for any k <= n:

- pass@k = 1 - C(n-c, k) / C(n, k): the probability that at least one of k samples drawn without replacement from
  the n succeeds. Averaged over every k-subset of the n samples it is exactly the share of subsets with a success,
  so it is an unbiased estimate of the policy's pass@k on that task (Chen et al. 2021, "Evaluating Large Language
  Models Trained on Code").
- pass^k = C(c, k) / C(n, k): the share of k-subsets in which *every* sample succeeds, the unbiased estimate of the
  probability that k independent tries all succeed (tau-bench's consistency metric).

Both are computed as products, never as factorials, so n in the thousands stays exact to float precision.

Tasks are the unit of sampling: a score is the mean over tasks of the per-task estimate, and its confidence
interval comes from the spread of those per-task values (the central limit theorem over tasks, as in Miller 2024,
"Adding Error Bars to Evals"). Fewer than two tasks give no interval: it is reported as missing, never as zero
width. Two policies scored on the same tasks are compared per task (a paired difference), which removes the
task-difficulty variance both share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

Z95 = 1.959963984540054  # two-sided 95 % quantile of the standard normal


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task with ``c`` successes out of ``n`` samples."""
    _check(n, c, k)
    if n - c < k:
        return 1.0  # every k-subset holds a success
    # C(n-c, k) / C(n, k) = prod_{i=0}^{k-1} (n-c-i) / (n-i)
    miss = 1.0
    for i in range(k):
        miss *= (n - c - i) / (n - i)
    return 1.0 - miss


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k (all k samples succeed) for one task with ``c`` successes out of ``n`` samples."""
    _check(n, c, k)
    if c < k:
        return 0.0
    # C(c, k) / C(n, k) = prod_{i=0}^{k-1} (c-i) / (n-i)
    hit = 1.0
    for i in range(k):
        hit *= (c - i) / (n - i)
    return hit


def _check(n: int, c: int, k: int) -> None:
    if not 0 <= c <= n:
        raise ValueError(f"successes c={c} must be between 0 and the n={n} samples")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} needs 1 <= k <= n={n} samples per task: raise [eval].samples or drop this k")


class Estimate(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A mean over ``n`` units (tasks, (task, harness) pairs, rollouts or calls) with its 95 % interval;
    ``low``/``high`` are None under two units (there is no spread to measure), ``mean`` is None with none."""

    mean: float | None
    low: float | None = None
    high: float | None = None
    se: float | None = None
    n: int = 0

    def text(self, digits: int = 3) -> str:
        if self.mean is None:
            return "n/a (n=0)"
        if self.low is None or self.high is None:
            return f"{self.mean:.{digits}f} (n=1, no CI)"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def wilson(p: float, n: int) -> tuple[float, float]:
    """Wilson's 95 % score interval for a proportion ``p`` of ``n`` units."""
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return centre - half, centre + half


def mean_ci(values: Sequence[float], *, lo: float | None = 0.0, hi: float | None = 1.0) -> Estimate:
    """Mean of per-task values with a normal 95 % interval from their standard error, clipped to [lo, hi]
    (pass rates cannot leave [0, 1]; pass None for an unbounded quantity such as a paired difference).

    For a rate in [0, 1] the interval also covers Wilson's score interval of the mean over the same number of
    units: when every task scored 0 (or 1) the spread is 0, and the normal interval alone would claim certainty
    (0 of 4 tasks reads [0, 0.49], not [0, 0])."""
    t = len(values)
    if t == 0:
        return Estimate(mean=None)
    m = math.fsum(values) / t
    if t < 2:
        return Estimate(mean=m, n=t)
    var = math.fsum((v - m) ** 2 for v in values) / (t - 1)
    se = math.sqrt(var / t)
    low, high = m - Z95 * se, m + Z95 * se
    if lo == 0.0 and hi == 1.0 and 0.0 <= m <= 1.0:
        w_low, w_high = wilson(m, t)
        low, high = min(low, w_low), max(high, w_high)
    if lo is not None:
        low = max(lo, low)
    if hi is not None:
        high = min(hi, high)
    return Estimate(mean=m, low=low, high=high, se=se, n=t)


def paired_difference(a: dict[str, float], b: dict[str, float], *, rates: bool = True) -> Estimate:
    """``a - b`` over the tasks both scored, with the interval of the per-task differences.

    When every task's difference is the same (often: both policies scored 0 everywhere) their spread is 0 and the
    normal interval would claim certainty; for rates the interval is then Newcombe's hybrid score interval for a
    difference of two proportions over the same number of tasks (which ignores the pairing: conservative)."""
    common = sorted(a.keys() & b.keys())
    est = mean_ci([a[t] - b[t] for t in common], lo=None, hi=None)
    if not rates or est.se is None or est.se > 0 or est.mean is None:
        return est
    n = len(common)
    pa, pb = (min(1.0, max(0.0, sum(x[t] for t in common) / n)) for x in (a, b))
    (la, ua), (lb, ub) = wilson(pa, n), wilson(pb, n)
    d = pa - pb
    return Estimate(mean=est.mean, low=d - math.hypot(pa - la, ub - pb), high=d + math.hypot(ua - pa, pb - lb),
                    se=est.se, n=n)
