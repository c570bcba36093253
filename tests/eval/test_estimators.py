"""pass@k / pass^k against hand-computed values and brute-force enumeration of every k-subset."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.eval.estimators import Z95, mean_ci, paired_difference, pass_at_k, pass_hat_k, wilson


def test_hand_computed_values():
    # n=4, c=1: a 2-subset misses the one success in C(3,2)=3 of C(4,2)=6 cases
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=4, c=2: a 2-subset is all-success in C(2,2)=1 of 6 cases
    assert pass_hat_k(4, 2, 2) == pytest.approx(1 / 6)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_hat_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 5, 3) == 1.0 and pass_hat_k(5, 5, 5) == 1.0
    assert pass_at_k(5, 3, 3) == 1.0  # only 2 failures: every 3-subset holds a success
    # k = 1: both are the plain success rate
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8) == pass_hat_k(8, 3, 1)


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_equal_to_brute_force_over_every_k_subset(case):
    n, c, k = case
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    assert pass_hat_k(n, c, k) == pytest.approx(sum(all(s) for s in subsets) / len(subsets), abs=1e-12)


def test_large_n_stays_finite_and_exact():
    n, c, k = 2000, 700, 50
    exact_miss = math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(1 - exact_miss, rel=1e-12)
    assert pass_hat_k(n, c, k) == pytest.approx(math.comb(c, k) / math.comb(n, k), rel=1e-9)


def test_k_above_n_names_the_setting():
    with pytest.raises(ValueError, match=r"k=5 needs 1 <= k <= n=4 .*\[eval\].samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="successes c=5"):
        pass_hat_k(4, 5, 1)


def test_interval_from_the_spread_over_tasks():
    est = mean_ci([0.0, 1.0, 0.5, 0.5], lo=None, hi=None)
    sd = math.sqrt(((0.5**2) * 2) / 3)
    assert est.mean == 0.5 and est.n == 4
    assert est.se == pytest.approx(sd / 2)
    assert est.low == pytest.approx(0.5 - Z95 * sd / 2) and est.high == pytest.approx(0.5 + Z95 * sd / 2)
    rate = mean_ci([0.0, 1.0, 0.5, 0.5])  # as a rate: the wider of the normal and Wilson intervals
    w_low, w_high = wilson(0.5, 4)
    assert (rate.low, rate.high) == (pytest.approx(min(est.low, w_low)), pytest.approx(max(est.high, w_high)))
    assert mean_ci([1.0, 1.0, 0.9]).high == 1.0  # clipped


def test_no_spread_is_not_certainty():
    zero = mean_ci([0.0] * 4)
    assert zero.low == 0.0 and zero.high == pytest.approx(Z95**2 / (4 + Z95**2))  # Wilson: 0 of 4
    assert mean_ci([1.0] * 4).low == pytest.approx(4 / (4 + Z95**2))
    assert mean_ci([0.0] * 400).high < 0.01  # many tasks: tight
    assert paired_difference({"a": 0.5, "b": 0.5}, {"a": 0.5, "b": 0.5}, rates=False).high == 0.0  # unbounded


def test_no_interval_is_reported_as_missing_not_as_zero_width():
    assert mean_ci([]).mean is None and mean_ci([]).text() == "n/a (n=0)"
    one = mean_ci([1.0])
    assert one.mean == 1.0 and one.low is None and "no CI" in one.text()


def test_paired_difference_uses_common_tasks_only():
    a = {"t1": 1.0, "t2": 0.5, "t3": 1.0}
    b = {"t1": 0.5, "t2": 0.0, "t4": 0.0}
    d = paired_difference(a, b)
    assert d.n == 2 and d.mean == pytest.approx(0.5) and d.se == 0.0
    # identical differences: no spread, so the interval is Newcombe's for 1.0 vs 0.5 and 0.25 vs 0 over 2 tasks
    assert d.low < 0.5 < d.high and d.low > -1 and d.high <= 1.5
    zero = paired_difference({"a": 0.0, "b": 0.0}, {"a": 0.0, "b": 0.0})
    assert zero.mean == 0 and zero.low < 0 < zero.high  # both scored 0 everywhere: not a certain 0
    assert paired_difference({"a": 1.0, "b": 1.0}, {"a": 0.0, "b": 0.0}, rates=False).low == 1.0
