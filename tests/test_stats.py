"""experiments/stats.py against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments import stats

T_975_2 = 4.302652729749462  # t quantile 0.975, 2 degrees of freedom (tables: 4.303)


def test_paired_diff_t_interval_by_hand():
    # differences 1, 2, 3: mean 2, sample sd 1, half-width t_{2,0.975} / sqrt(3) = 2.4841
    d = stats.paired_diff({1: 71.0, 2: 72.0, 3: 73.5}, {1: 70.0, 2: 70.0, 3: 70.5})
    assert (d.mean, d.n, d.sd, d.seeds, d.method) == (2.0, 3, 1.0, (1, 2, 3), "t")
    assert d.half_width == pytest.approx(T_975_2 / math.sqrt(3))
    assert d.lo == pytest.approx(2 - 2.48413, abs=1e-5) and d.hi == pytest.approx(4.48413, abs=1e-5)
    assert d.contains_zero
    # differences 2.0, 2.2, 1.8: sd 0.2, half-width 0.4968: resolved
    d = stats.paired_diff({1: 2.0, 2: 2.2, 3: 1.8}, {1: 0.0, 2: 0.0, 3: 0.0})
    assert d.lo == pytest.approx(2 - 0.2 * T_975_2 / math.sqrt(3)) and not d.contains_zero


def test_paired_diff_pairs_by_seed():
    # only seeds 2 and 3 are in both: differences 1 and 3
    d = stats.paired_diff({1: 50.0, 2: 61.0, 3: 63.0}, {2: 60.0, 3: 60.0, 4: 10.0})
    assert (d.seeds, d.mean, d.sd) == ((2, 3), 2.0, pytest.approx(math.sqrt(2)))
    one = stats.paired_diff({1: 3.0}, {1: 1.0})
    assert (one.mean, one.lo, one.hi, one.sd) == (2.0, None, None, None) and one.contains_zero
    assert stats.paired_diff({1: 3.0}, {2: 1.0}) is None


def test_hm_helpers():
    assert stats.hm(80.0, 60.0) == pytest.approx(2 * 80 * 60 / 140)
    assert stats.hm(0.0, 0.0) == 0.0 and stats.hm(None, 3.0) is None
    assert stats.per_seed_hm({1: 80.0, 2: 50.0}, {1: 60.0, 3: 1.0}) == {
        1: pytest.approx(68.5714, abs=1e-4)
    }


def test_wilcoxon_exact_by_hand():
    # ranks 1..5 all positive: W- = 0, exact two-sided p = 2 * 1/32
    assert stats.wilcoxon_p([1, 2, 3, 4, 5]) == pytest.approx(0.0625)
    # W- = 2 (the rank-2 difference is negative): subsets of ranks with sum <= 2 are {}, {1},
    # {2}, so p = 2 * 3/32
    assert stats.wilcoxon_p([1, -2, 3, 4, 5]) == pytest.approx(0.1875)
    assert stats.wilcoxon_p([0.0, 1.0]) is None  # one non-zero difference: no test


def test_bootstrap_across_datasets():
    # every (dataset, seed) difference is 0.5: the interval is the point [0.5, 0.5]
    a = [np.array([[70.5], [71.5]]), np.array([[60.5], [62.5], [61.5]])]
    b = [np.array([[70.0], [71.0]]), np.array([[60.0], [62.0], [61.0]])]
    d = stats.across_datasets(a, b)
    assert (d.mean, d.lo, d.hi, d.n, d.method) == (0.5, 0.5, 0.5, 2, "bootstrap")
    assert not d.contains_zero and d.p == pytest.approx(0.5)  # two positive: 2 * 1/4
    # differences of mixed sign: 95% interval contains 0, and it is reproducible
    rng = np.random.default_rng(1)
    a = [rng.normal(0, 1, size=(3, 1)) for _ in range(6)]
    b = [np.zeros((3, 1)) for _ in range(6)]
    d1, d2 = stats.across_datasets(a, b, n_boot=2000), stats.across_datasets(a, b, n_boot=2000)
    assert d1 == d2 and d1.contains_zero
    assert d1.mean == pytest.approx(np.mean([x.mean() for x in a]))
    assert d1.lo < d1.mean < d1.hi
    with pytest.raises(ValueError, match="unpaired"):
        stats.across_datasets([np.zeros((2, 1))], [np.zeros((3, 1))])


def test_bootstrap_statistics_hm_of_means_and_mean_of_hms():
    # two datasets, one seed, components (base, new)
    a = [np.array([[80.0, 60.0]]), np.array([[90.0, 70.0]])]
    b = [np.array([[80.0, 60.0]]), np.array([[80.0, 60.0]])]
    d = stats.across_datasets(a, b, stats.hm_of_means, n_boot=200)
    assert d.mean == pytest.approx(stats.hm(85.0, 65.0) - stats.hm(80.0, 60.0))
    d = stats.across_datasets(a, b, stats.mean_of_hms, n_boot=200)
    assert d.mean == pytest.approx((stats.hm(90.0, 70.0) - stats.hm(80.0, 60.0)) / 2)
    d = stats.across_datasets(a, b, stats.mean_of(1), n_boot=200)
    assert d.mean == pytest.approx(5.0)
    # resampling datasets: the interval spans the per-dataset differences 0 and 10
    assert d.lo == pytest.approx(0.0) and d.hi == pytest.approx(10.0)


def test_seeds_needed_by_hand():
    # sd 1, delta 1: n = 9 gives (2.306 + 0.889) / 3 = 1.065 > 1, n = 10 gives
    # (2.262 + 0.883) / sqrt(10) = 0.995 <= 1
    assert stats.seeds_needed(1.0, 1.0) == 10
    assert stats.seeds_needed(2.0, -2.0) == 10  # scale-free and sign-free
    assert stats.seeds_needed(0.0, 0.3) == 2
    assert stats.seeds_needed(None, 1.0) is None  # one seed: no variance
    assert stats.seeds_needed(1.0, 0.0) is None  # nothing resolves a zero difference
    assert stats.seeds_needed(0.1, 5.0) == 2


def test_describe_states_the_methods():
    text = stats.describe_methods()
    assert "Student-t" in text and "bootstrap over dataset x seed" in text and "Wilcoxon" in text
