"""The white-box harness space: 3^5 configurations, an orthogonal training design, held-out configurations,
the training-set variants of the paper's ablations and the rules that give each task its K configurations
(Harness Scaling; the design is described in docs/rollout.md, "The white-box harness and the harness space").

A configuration picks a realization 0, 1 or 2 for each of the five components S (system prompt), T (tool
interface), O (observation), C (context management), W (workflow) of the white-box harness; its name is
``S0T1O2C1W0`` and the adapter name the scheduler puts into ``RolloutRequest.harness`` is
``whitebox:S0T1O2C1W0``. The components, their levels, :class:`HarnessConfig` and the tool names per
configuration are defined once, by the harness itself (``harness_images.whitebox.agent.components``, standard
library only); this module re-exports them and builds the experiment design over them.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np

from harness_images.whitebox.agent.components import (
    CANONICAL_TOOLS,
    COMPONENTS,
    LEVELS,
    REALIZATIONS,
    HarnessConfig,
    offered_tools,
    tool_name_for,
)

__all__ = [
    "ASSIGNMENTS",
    "CANONICAL_TOOLS",
    "COMPONENTS",
    "LEVELS",
    "PUBLISHED_HELD_OUT",
    "PUBLISHED_TRAINING",
    "RANDOM_SIZE",
    "REALIZATIONS",
    "SPACES",
    "AssignmentRule",
    "HarnessConfig",
    "Space",
    "all_configs",
    "assign",
    "design",
    "held_out_configs",
    "locality_assignment",
    "offered_tools",
    "orthogonal_array",
    "tool_name_for",
    "training_configs",
]


def all_configs() -> list[HarnessConfig]:
    """All 3^5 = 243 configurations, in name order."""
    return [HarnessConfig(*lv) for lv in itertools.product(range(LEVELS), repeat=len(COMPONENTS))]


# ------------------------------------------------------------------------------------------ orthogonal arrays
def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def _nonsquare(p: int) -> int:
    squares = {(x * x) % p for x in range(1, p)}
    return next(v for v in range(2, p) if v not in squares)


def _rao_hamming(p: int) -> np.ndarray:
    """OA(p^2, p+1, p, 2): rows (x, y) in GF(p)^2, columns x and y + kx for k in GF(p)."""
    x, y = (a.ravel() for a in np.meshgrid(np.arange(p), np.arange(p), indexing="ij"))
    return np.stack([x] + [(y + k * x) % p for k in range(p)], axis=1)


def _addelman_kempthorne(p: int) -> np.ndarray:
    """OA(2p^2, 2p+1, p, 2) for an odd prime p (Addelman & Kempthorne 1961).

    Rows are (h, x, y) with a half h in {0, 1} and x, y in GF(p). Let v be a non-square of GF(p) and
    c_0 = 1, c_1 = v. The columns are

        x;     A_k = y + k x + f_h(k);     B_k = y + b_h(k) x + c_h x^2 + e_h(k)      (k in GF(p))

    with b_0(k) = k, b_1(k) = v k, f_0 = e_0 = 0, f_1(k) = k^2 (1 - 1/v) / 4, e_1(k) = -k^2 (1 - v) / 4.
    Why every pair of columns is balanced over the 2p^2 rows: y runs over all of GF(p) in each (h, x), so a
    pair (P, Q) is balanced iff, for every d, the number of (h, x) with Q - P = d is 2. For x against any
    column, and for A_k against A_k' or B_k against B_k', Q - P is a non-constant linear function of x in
    each half, which hits every d once per half. For A_k against B_k', Q - P = c_h x^2 + beta x + gamma is
    quadratic: its number of roots of Q - P = d is 1 + chi(D_h + 4 c_h d), chi the quadratic character and
    D_h = beta^2 - 4 c_h gamma. The choices of b_1, f_1, e_1 make D_1 / v = D_0 for every (k, k'), so
    D_1 + 4 v d = v (D_0 + 4 d) and chi(v) = -1 makes the two halves' chi terms cancel: 2 roots for every d.
    The first p+1 columns of half 0 are the Rao-Hamming array, so both constructions agree where they overlap.
    """
    if p % 2 == 0:
        raise ValueError("the Addelman-Kempthorne construction needs an odd prime number of levels")
    v = _nonsquare(p)
    inv4, inv_v = pow(4, -1, p), pow(v, -1, p)
    rows = []
    for h, x, y in itertools.product(range(2), range(p), range(p)):
        c = 1 if h == 0 else v
        row = [x]
        for k in range(p):
            f = 0 if h == 0 else k * k * (1 - inv_v) * inv4
            row.append(y + k * x + f)
        for k in range(p):
            b = k if h == 0 else v * k
            e = 0 if h == 0 else -k * k * (1 - v) * inv4
            row.append(y + b * x + c * x * x + e)
        rows.append(row)
    return np.array(rows, dtype=np.int64) % p


def orthogonal_array(levels: int, factors: int) -> np.ndarray:
    """A strength-2 orthogonal array with ``factors`` columns at a prime number of ``levels``, as an int
    array of shape (runs, factors): every pair of columns shows every pair of levels equally often.

    ``factors <= levels + 1``: the Rao-Hamming array, ``levels^2`` runs (the most a p^2-run array can carry).
    ``factors <= 2 levels + 1`` (odd ``levels``): the Addelman-Kempthorne array, ``2 levels^2`` runs; for
    5 factors at 3 levels that is the 18-run design (the three-level part of the classic L18). Both are built
    from finite-field arithmetic, and the first columns are taken.
    """
    if not _is_prime(levels):
        raise ValueError(f"levels={levels}: the constructions need a prime number of levels")
    if factors < 1:
        raise ValueError(f"factors={factors}: need at least one factor")
    if factors <= levels + 1:
        return _rao_hamming(levels)[:, :factors]
    if levels % 2 == 1 and factors <= 2 * levels + 1:
        return _addelman_kempthorne(levels)[:, :factors]
    raise ValueError(
        f"factors={factors} at levels={levels}: at most {levels + 1} "
        f"({2 * levels + 1} for odd levels) factors are supported"
    )


def training_configs() -> list[HarnessConfig]:
    """The 18 training configurations: the strength-2 array with columns S, T, O, C, W in that order."""
    return [HarnessConfig.from_levels(row) for row in orthogonal_array(LEVELS, len(COMPONENTS))]


# The sets the Harness Scaling paper trained and evaluated on (its Table 6 and Table 8), so its in-space vs
# held-out comparison can be reproduced. The training set is a strength-2 orthogonal design like the generated one,
# but a different one: the generated array contains S0T2O1C1W2, one of the published held-out configurations.
PUBLISHED_TRAINING = (
    "S0T0O0C0W0", "S0T1O1C1W1", "S0T2O2C2W2", "S1T0O0C1W1", "S1T1O1C2W2", "S1T2O2C0W0",
    "S2T0O1C0W2", "S2T1O2C1W0", "S2T2O0C2W1", "S0T0O2C2W1", "S0T1O0C0W2", "S0T2O1C1W0",
    "S1T0O1C2W0", "S1T1O2C0W1", "S1T2O0C1W2", "S2T0O2C1W2", "S2T1O0C2W0", "S2T2O1C0W1",
)
PUBLISHED_HELD_OUT = (
    "S0T2O1C1W2", "S2T1O1C2W0", "S0T1O0C2W2", "S2T2O0C0W1", "S0T1O2C0W1", "S1T0O0C2W1",
    "S0T0O0C1W2", "S0T0O1C0W1", "S0T2O2C2W0", "S1T0O1C1W0", "S1T0O2C2W2", "S1T1O0C0W0",
    "S1T2O1C0W2", "S1T2O2C1W1", "S2T0O2C0W0", "S2T1O1C1W2", "S2T1O2C2W1", "S2T2O0C1W0",
)


Space = Literal["published", "generated", "random18", "all"]
SPACES: tuple[str, ...] = get_args(Space)
RANDOM_SIZE = 18  # the "random18" space: as many configurations as the published training set


def design(space: str = "published", seed: int = 0) -> tuple[list[HarnessConfig], list[HarnessConfig]]:
    """(training, held-out) configurations of a space:

    - ``"published"`` (the default): the paper's Tables 6 and 8;
    - ``"generated"``: :func:`training_configs` and a disjoint translate of it (:func:`held_out_configs`, by ``seed``);
    - ``"random18"``: the paper's Random-18 ablation, 18 configurations drawn uniformly with ``seed`` from the 225
      outside the published held-out set, which stays its held-out set (drawn from all 243, some would be trained
      on and the held-out column would no longer measure configurations never seen);
    - ``"all"``: all 243, in name order. Its held-out set is still the published one, so that column stays comparable
      across variants, but it is trained on: there it measures nothing held out.
    """
    if space not in SPACES:
        raise ValueError(f"harness space {space!r}: expected one of {', '.join(map(repr, SPACES))}")
    published_held = [HarnessConfig.parse(n) for n in PUBLISHED_HELD_OUT]
    if space == "published":
        return [HarnessConfig.parse(n) for n in PUBLISHED_TRAINING], published_held
    if space == "generated":
        train = training_configs()
        return train, held_out_configs(train, seed)
    if space == "random18":
        held = set(published_held)
        pool = [c for c in all_configs() if c not in held]
        return random.Random(seed).sample(pool, RANDOM_SIZE), published_held
    return all_configs(), published_held


def held_out_configs(training: Sequence[HarnessConfig], seed: int = 0) -> list[HarnessConfig]:
    """Evaluation configurations outside ``training``: a translate ``training + t`` (mod 3, per component)
    by a shift t chosen with ``seed`` among those that make it disjoint from the training set.

    A translate of an orthogonal array is an orthogonal array, so every realization of every component
    appears equally often (and every pair of realizations too), and its distances mirror the training set's.
    """
    train = np.array([c.levels for c in training], dtype=np.int64)
    for col, comp in enumerate(COMPONENTS):
        counts = np.bincount(train[:, col], minlength=LEVELS)
        if len(set(counts.tolist())) != 1:
            raise ValueError(
                f"training levels of component {comp} are unbalanced ({counts.tolist()}); "
                "held-out translates keep the training marginals, so pass a balanced design"
            )
    members = {c.levels for c in training}
    shifts = []
    for shift in itertools.product(range(LEVELS), repeat=len(COMPONENTS)):
        if any(shift) and not any(
            tuple(((train[i] + shift) % LEVELS).tolist()) in members for i in range(len(train))
        ):
            shifts.append(shift)
    if not shifts:
        raise ValueError("no translate of the training set is disjoint from it")
    shift = random.Random(seed).choice(shifts)
    return [HarnessConfig.from_levels((row + shift) % LEVELS) for row in train]


def locality_assignment(training: Sequence[HarnessConfig], k: int, rng: random.Random) -> list[HarnessConfig]:
    """K harnesses for one task: a uniformly random anchor from ``training``, then the K-1 training
    configurations nearest to it by Hamming distance, ties broken by ``rng``. The scheduler uses entry j at
    the j-th of K successive steps."""
    pool = list(dict.fromkeys(training))
    if not 1 <= k <= len(pool):
        raise ValueError(f"k={k}: must be between 1 and the {len(pool)} distinct training configurations")
    anchor = rng.choice(pool)
    rest = [c for c in pool if c != anchor]
    tie = {c: rng.random() for c in rest}
    rest.sort(key=lambda c: (anchor.distance(c), tie[c]))
    return [anchor, *rest[: k - 1]]


AssignmentRule = Literal["locality", "random", "repeat"]
ASSIGNMENTS: tuple[str, ...] = get_args(AssignmentRule)


def assign(training: Sequence[HarnessConfig], k: int, rng: random.Random,
           rule: AssignmentRule = "locality") -> list[HarnessConfig]:
    """K harnesses for one task, entry j used at the j-th of K successive steps, by ``rule``:

    - ``"locality"``: :func:`locality_assignment` (an anchor and its K-1 nearest);
    - ``"random"``: K distinct configurations drawn uniformly from ``training``, with no regard to distance (the
      paper's random-assignment ablation);
    - ``"repeat"``: one configuration drawn uniformly, K times (Repeat-K: the same K passes over each task as the
      other rules, through one configuration, which tells the gain of K configurations from that of K passes).
    """
    if rule == "locality":
        return locality_assignment(training, k, rng)
    pool = list(dict.fromkeys(training))
    if rule == "repeat":
        if k < 1 or not pool:
            raise ValueError(f"k={k}: must be at least 1, with at least one training configuration")
        return [rng.choice(pool)] * k
    if rule == "random":
        if not 1 <= k <= len(pool):
            raise ValueError(f"k={k}: must be between 1 and the {len(pool)} distinct training configurations")
        return rng.sample(pool, k)
    raise ValueError(f"assignment {rule!r}: expected one of {', '.join(map(repr, ASSIGNMENTS))}")
