"""Statistics of results: intervals of success rates, the interquartile mean, bootstrap
resampling over tasks and over seeds, and the exact sign-flip test.

numpy only (no JAX), so that report and documentation code can import it in a second. Every
interval here stays inside the range its values can take: Wilson's interval for 0/1 outcomes
and percentile intervals of bootstrap replicates (the normal approximation gives [-0.48, 1.48]
on two tasks, one solved).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


# --------------------------------------------------------------------- intervals of one rate


def wilson_ci95(k: int, n: int) -> tuple[float, float]:
  """Wilson's score 95% interval of k successes in n trials, inside [0, 1] for every k and n."""
  if n <= 0 or not 0 <= k <= n:
    raise ValueError(f"wilson_ci95(k={k}, n={n}): need n >= 1 and 0 <= k <= n "
                     "(an interval needs at least one trial).")
  z, p = 1.96, k / n
  mid = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * float(np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)
  return (max(0.0, mid - half), min(1.0, mid + half))


def mean_ci95(values: Sequence[float], bounds: tuple[float, float] = (-np.inf, np.inf)
              ) -> tuple[float, float]:
  """Normal-approximation 95% interval of a mean, clipped to `bounds` (the values' range: a
  paired difference of successes lies in [-1, 1])."""
  x = np.asarray(values, np.float64)
  if x.size == 0:
    return (0.0, 0.0)
  m = float(x.mean())
  half = 1.96 * float(x.std(ddof=1) if x.size > 1 else 0.0) / np.sqrt(x.size)
  return (max(bounds[0], m - half), min(bounds[1], m + half))


def binomial_ci95(successes: Sequence[float]) -> tuple[float, float]:
  """95% interval of a success rate (a mean of values in [0, 1]) that stays inside [0, 1].

  0/1 outcomes get Wilson's score interval: the normal one collapses to a point at 0 and 1
  and leaves [0, 1] on a few tasks. Fractional scores (a judge's, a share of parts) get the
  normal interval of their mean, clipped to [0, 1].
  """
  x = np.asarray(successes, np.float64)
  if x.size == 0:
    return (0.0, 0.0)
  if np.all((x == 0.0) | (x == 1.0)):
    return wilson_ci95(int(x.sum()), x.size)
  return mean_ci95(x, (0.0, 1.0))


# ------------------------------------------------------------------- across tasks and seeds


def iqm(x, axis: int = -1):
  """Interquartile mean as rliable defines it (scipy's trim_mean at 0.25): the mean of the
  values left after dropping floor(n / 4) of the lowest and as many of the highest."""
  x = np.sort(np.asarray(x, dtype=np.float64), axis=axis)
  n = x.shape[axis]
  if n == 0:
    raise ValueError("iqm: no values.")
  cut = n // 4
  return np.take(x, np.arange(cut, n - cut), axis=axis).mean(axis=axis)


def percentile_ci95(replicates) -> list[float]:
  """The 2.5th and 97.5th percentiles of bootstrap replicates (inside the values' range)."""
  lo, hi = np.percentile(np.asarray(replicates, dtype=np.float64), [2.5, 97.5])
  return [float(lo), float(hi)]


def task_bootstrap_means(d_N: np.ndarray, reps: int, rng: np.random.Generator) -> np.ndarray:
  """Means of `reps` resamples (with replacement) of the per-task values `d_N`."""
  d_N = np.asarray(d_N, dtype=np.float64)
  idx = rng.integers(0, len(d_N), size=(reps, len(d_N)))
  return d_N[idx].mean(axis=1)


def stratified_bootstrap_means(rows: Sequence[Sequence[float]], reps: int,
                               rng: np.random.Generator) -> np.ndarray:
  """Two-level (seeds, then tasks) bootstrap: [reps, seeds] per-slot means.

  Each resample draws as many seeds as there are, with replacement, and for each drawn slot
  resamples that seed's tasks with replacement (a seed drawn twice gets two independent task
  resamples, as a second run of it would). The mean over slots weighs every seed alike
  whatever its task count; percentiles of it count both the seeds' spread and the tasks'.

  Args:
    rows: one 1-D sequence per seed (its tasks' values; lengths may differ).
    reps: resamples.
    rng: the bootstrap's own randomness (fixed by the caller: a report is reproducible).
  """
  rows = [np.asarray(r, dtype=np.float64) for r in rows]
  n_K = np.asarray([len(r) for r in rows])
  if not len(rows) or n_K.min() == 0:
    raise ValueError(f"stratified_bootstrap_means: every seed needs a value; task counts {n_K}.")
  k, n_max = len(rows), int(n_K.max())
  padded_KxN = np.zeros((k, n_max))
  for i, r in enumerate(rows):
    padded_KxN[i, :len(r)] = r
  seed_RxK = rng.integers(0, k, size=(reps, k))
  n_RxK = n_K[seed_RxK]
  # Uniform draws scaled by each slot's task count: one array serves seeds of any count.
  task_RxKxN = (rng.random((reps, k, n_max)) * n_RxK[..., None]).astype(np.int64)
  vals = padded_KxN[seed_RxK[..., None], task_RxKxN]
  used = np.arange(n_max) < n_RxK[..., None]
  return (vals * used).sum(axis=-1) / n_RxK


def sign_flip_p(deltas) -> float:
  """Two-sided p of the exact sign-flip test of paired per-seed differences: under "no
  difference" each seed's difference is as likely negated, so the observed |mean| is ranked
  among the 2^n means of every sign pattern."""
  d = np.asarray(deltas, float)
  signs = np.array(np.meshgrid(*[[-1.0, 1.0]] * len(d))).reshape(len(d), -1)
  means = np.abs(d @ signs) / len(d)
  return float(np.mean(means >= abs(d.mean()) - 1e-12))
