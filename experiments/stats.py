"""Seed statistics: paired differences, a test across datasets and the seeds a difference needs.

Runs of two methods with the same seed share the few-shot draw, so their accuracies are paired:
the statistics below work on per-seed differences, never on two independent means.

- :func:`paired_diff`: the mean difference over the seeds both methods have, with a Student-t
  confidence interval (``mean +- t_{n-1} * sd / sqrt(n)``, ``sd`` the sample std of the
  differences). One seed gives no interval.
- :func:`across_datasets`: the average row of a table (a mean over datasets). Its interval is a
  two-level percentile bootstrap over dataset x seed (datasets resampled with replacement, then
  seeds within each dataset, pairs kept together); its test is a two-sided Wilcoxon signed-rank
  test of the per-dataset differences (exact for small counts, ``scipy.stats.wilcoxon``).
- :func:`seeds_needed`: how many seeds a paired t-test needs to resolve a difference of a given
  size with the observed seed spread: the smallest ``n`` with
  ``(t_{n-1, 1-alpha/2} + t_{n-1, power}) * sd / sqrt(n) <= |delta|`` (95% interval, 80% power).

Used by ``tools/make_tables.py`` and ``experiments/report.py``; ``hm`` and ``per_seed_hm`` are the
harmonic mean of base and new accuracy as everywhere in this code base.

Example::

    >>> d = paired_diff({1: 71.0, 2: 72.0, 3: 73.5}, {1: 70.0, 2: 70.0, 3: 70.5})
    >>> round(d.mean, 3), round(d.lo, 3), round(d.hi, 3), d.contains_zero
    (2.0, -0.484, 4.484, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
POWER = 0.8
N_BOOT = 10_000
BOOT_SEED = 0
MAX_SEEDS = 1000  # seeds_needed gives up above this (a difference of ~0)

T_METHOD = "t"
BOOT_METHOD = "bootstrap"


def hm(base: float | None, new: float | None) -> float | None:
    """Harmonic mean ``2BN/(B+N)`` (None if either is None; 0 if both are 0)."""
    if base is None or new is None:
        return None
    return 0.0 if base + new == 0 else 2 * base * new / (base + new)


def per_seed_hm(base: Mapping[int, float], new: Mapping[int, float]) -> dict[int, float]:
    """``{seed: HM}`` over the seeds that have both a base and a new accuracy."""
    return {s: hm(base[s], new[s]) for s in sorted(set(base) & set(new))}


@dataclass(frozen=True)
class Diff:
    """A difference ``a - b`` with its confidence interval.

    Attributes:
        mean: the point estimate (for the average row: the statistic of a minus that of b).
        lo, hi: the interval's ends; None when it cannot be computed (one seed).
        n: the number of seeds (paired) or of datasets (average row).
        method: ``t`` (over seeds) or ``bootstrap`` (over dataset x seed).
        sd: the sample std of the per-seed differences (``t`` only; None for one seed).
        p: the two-sided p-value of the Wilcoxon signed-rank test (``bootstrap`` only).
        seeds: the paired seeds used.
        confidence: the interval's confidence level.
    """

    mean: float
    lo: float | None
    hi: float | None
    n: int
    method: str = T_METHOD
    sd: float | None = None
    p: float | None = None
    seeds: tuple[int, ...] = ()
    confidence: float = CONFIDENCE

    @property
    def contains_zero(self) -> bool:
        """True when the interval contains 0 or does not exist: the difference is not resolved."""
        return self.lo is None or self.hi is None or self.lo <= 0 <= self.hi

    @property
    def half_width(self) -> float | None:
        return None if self.lo is None else (self.hi - self.lo) / 2


def t_interval(diffs, confidence: float = CONFIDENCE) -> tuple[float, float | None, float | None]:
    """``(mean, lo, hi)`` of the Student-t interval of ``diffs`` (lo/hi None for n < 2)."""
    from scipy import stats

    x = np.asarray(list(diffs), dtype=float)
    if x.size == 0:
        raise ValueError("t_interval needs at least one value")
    mean = float(x.mean())
    if x.size < 2:
        return mean, None, None
    half = stats.t.ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return mean, float(mean - half), float(mean + half)


def paired_diff(
    a: Mapping[int, float], b: Mapping[int, float], confidence: float = CONFIDENCE
) -> Diff | None:
    """The mean of ``a[s] - b[s]`` over the seeds both have, with its t-interval.

    Args:
        a, b: ``{seed: value}`` of two methods.
        confidence: the interval's level.

    Returns:
        A :class:`Diff` (``lo``/``hi`` None for one common seed), or None without common seeds.
    """
    seeds = tuple(sorted(set(a) & set(b)))
    if not seeds:
        return None
    diffs = [a[s] - b[s] for s in seeds]
    mean, lo, hi = t_interval(diffs, confidence)
    sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else None
    return Diff(mean, lo, hi, len(seeds), T_METHOD, sd, seeds=seeds, confidence=confidence)


def wilcoxon_p(diffs) -> float | None:
    """Two-sided Wilcoxon signed-rank p-value of ``diffs`` (None if fewer than 2 non-zero)."""
    from scipy import stats

    x = [d for d in diffs if d != 0]
    if len(x) < 2:
        return None
    return float(stats.wilcoxon(x, alternative="two-sided").pvalue)


# A unit is one (dataset, seed) pair: a vector of components (e.g. base and new accuracy).
# A statistic maps per-dataset component means, shape [..., datasets, components], to [...].
Statistic = Callable[[np.ndarray], np.ndarray]


def mean_of(component: int = 0) -> Statistic:
    """The mean over datasets of one component."""
    return lambda m: m[..., component].mean(axis=-1)


MEAN = mean_of(0)  # the statistic of one-component units (accuracy)


def hm_of_means(m: np.ndarray) -> np.ndarray:
    """HM of the dataset-averaged base (component 0) and new (component 1)."""
    b, n = m[..., 0].mean(axis=-1), m[..., 1].mean(axis=-1)
    return np.where(b + n == 0, 0.0, 2 * b * n / np.where(b + n == 0, 1.0, b + n))


def mean_of_hms(m: np.ndarray) -> np.ndarray:
    """Mean over datasets of the HM of each dataset's base and new means."""
    b, n = m[..., 0], m[..., 1]
    return np.where(b + n == 0, 0.0, 2 * b * n / np.where(b + n == 0, 1.0, b + n)).mean(axis=-1)


def across_datasets(
    a: list[np.ndarray],
    b: list[np.ndarray],
    statistic: Statistic = MEAN,
    confidence: float = CONFIDENCE,
    n_boot: int = N_BOOT,
    seed: int = BOOT_SEED,
) -> Diff:
    """The difference of an across-dataset statistic, bootstrapped over dataset x seed.

    Args:
        a, b: one array per dataset, shape ``[seeds, components]``; row ``i`` of ``a[d]`` and
            of ``b[d]`` is the same seed (pairs are resampled together).
        statistic: maps per-dataset component means ``[..., datasets, components]`` to ``[...]``
            (:func:`mean_of`, :func:`hm_of_means`, :func:`mean_of_hms`).
        confidence: the percentile interval's level.
        n_boot: bootstrap resamples.
        seed: the resampling RNG's seed (results are reproducible).

    Returns:
        A :class:`Diff` with ``method="bootstrap"``, ``n`` = the number of datasets and ``p`` the
        Wilcoxon signed-rank p-value of the per-dataset differences of ``statistic``.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"across_datasets: {len(a)} vs {len(b)} datasets; need equal, >= 1")
    a = [np.asarray(x, dtype=float).reshape(len(x), -1) for x in a]
    b = [np.asarray(x, dtype=float).reshape(len(x), -1) for x in b]
    for x, y in zip(a, b):
        if x.shape != y.shape or not len(x):
            raise ValueError(f"across_datasets: unpaired or empty dataset {x.shape} vs {y.shape}")
    means_a = np.stack([x.mean(axis=0) for x in a])  # [datasets, components]
    means_b = np.stack([y.mean(axis=0) for y in b])
    point = float(statistic(means_a) - statistic(means_b))
    per_dataset = statistic(means_a[:, None, :]) - statistic(means_b[:, None, :])  # [datasets]
    rng = np.random.default_rng(seed)
    n_data = len(a)
    boot_a, boot_b = [], []  # per dataset: resampled seed means, [n_boot, components]
    for x, y in zip(a, b):
        pick = rng.integers(len(x), size=(n_boot, len(x)))  # [n_boot, seeds]
        boot_a.append(x[pick].mean(axis=1))
        boot_b.append(y[pick].mean(axis=1))
    which = rng.integers(n_data, size=(n_boot, n_data))  # [n_boot, datasets]
    rows = np.arange(n_boot)[:, None]
    stat_a = statistic(np.stack(boot_a)[which, rows])  # [n_boot, datasets, components] -> [n_boot]
    stat_b = statistic(np.stack(boot_b)[which, rows])
    lo, hi = np.quantile(stat_a - stat_b, [0.5 - confidence / 2, 0.5 + confidence / 2])
    p = wilcoxon_p(per_dataset)
    return Diff(point, float(lo), float(hi), n_data, BOOT_METHOD, p=p, confidence=confidence)


def seeds_needed(
    sd: float | None, delta: float, confidence: float = CONFIDENCE, power: float = POWER
) -> int | None:
    """Seeds a paired t-test needs to resolve ``delta`` given the per-seed difference std ``sd``.

    The smallest ``n >= 2`` with ``(t_{n-1, (1+confidence)/2} + t_{n-1, power}) * sd / sqrt(n)
    <= |delta|``. None when ``sd`` is unknown (one seed) or more than ``MAX_SEEDS`` are needed.
    """
    from scipy import stats

    if sd is None:
        return None
    if sd == 0:
        return 2
    for n in range(2, MAX_SEEDS + 1):
        t = stats.t.ppf((1 + confidence) / 2, n - 1) + stats.t.ppf(power, n - 1)
        if t * sd / math.sqrt(n) <= abs(delta):
            return n
    return None


def describe_methods(
    confidence: float = CONFIDENCE, n_boot: int = N_BOOT, averages: bool = True
) -> str:
    """One sentence stating the interval and test methods (printed under every comparison);
    ``averages``: include the average rows' bootstrap and Wilcoxon test."""
    c = f"{confidence:.0%}"
    text = f"differences a - b over paired seeds with a {c} Student-t interval"
    if not averages:
        return text
    return (
        f"{text}; average rows: {c} percentile bootstrap over dataset x seed ({n_boot:,} "
        f"resamples, RNG seed {BOOT_SEED}) and p of a two-sided Wilcoxon signed-rank test over "
        "datasets"
    )
