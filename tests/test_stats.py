"""rao_jax/stats.py: intervals that stay inside the values' range, rliable's IQM, the two-level
bootstrap over seeds and tasks, and the exact sign-flip test, on known vectors."""
import numpy as np
import pytest

from rao_jax import stats


@pytest.mark.parametrize("k,n", [(0, 2), (1, 2), (2, 2), (0, 64), (62, 64), (64, 64), (1, 1)])
def test_wilson_interval_stays_in_unit_interval(k, n):
  lo, hi = stats.wilson_ci95(k, n)
  assert 0.0 <= lo <= k / n <= hi <= 1.0
  if 0 < k < n:
    assert lo > 0 and hi < 1


def test_wilson_matches_a_known_value_and_refuses_no_trials():
  # 1 success of 2: the normal approximation gives [-0.19, 1.19]; Wilson [0.095, 0.905].
  lo, hi = stats.wilson_ci95(1, 2)
  assert (round(lo, 3), round(hi, 3)) == (0.095, 0.905)
  with pytest.raises(ValueError, match=r"k=0, n=0.*at least one trial"):
    stats.wilson_ci95(0, 0)
  with pytest.raises(ValueError, match=r"k=3, n=2"):
    stats.wilson_ci95(3, 2)


def test_binomial_ci():
  # Wilson's interval on 100 tasks, half solved: close to the normal one there.
  lo, hi = stats.binomial_ci95([1.0] * 50 + [0.0] * 50)
  assert lo < 0.5 < hi and hi - lo == pytest.approx(2 * 1.96 * 0.5025 / 10, rel=3e-2)
  # Few tasks and the ends stay inside [0, 1] (the normal interval gave [-0.48, 1.48]).
  assert stats.binomial_ci95([1.0, 0.0]) == pytest.approx((0.0945, 0.9055), abs=1e-3)
  lo, hi = stats.binomial_ci95([1.0] * 15 + [0.0])
  assert 0.0 <= lo < 0.9375 < hi <= 1.0
  assert stats.binomial_ci95([1.0] * 4)[1] == 1.0 and stats.binomial_ci95([1.0] * 4)[0] > 0.4
  # Fractional scores: the normal interval of the mean, clipped.
  assert stats.binomial_ci95([1.0, 0.9, 1.0])[1] == 1.0
  assert stats.mean_ci95([-1.0, 1.0, -1.0], (-1.0, 1.0))[0] == -1.0
  assert stats.binomial_ci95([]) == (0.0, 0.0)


def test_iqm_is_rliables_trimmed_mean_on_known_vectors():
  # Five values: floor(5/4) = 1 dropped at each end, the mean of the middle three.
  assert stats.iqm([0.9, -0.5, 0.2, 0.1, 0.3]) == pytest.approx(0.2)
  # Eight values: two dropped at each end.
  assert stats.iqm([8, 1, 7, 2, 6, 3, 5, 100]) == pytest.approx((3 + 5 + 6 + 7) / 4)
  # Under four values nothing is dropped: the mean.
  assert stats.iqm([0.1, 0.5, 3.0]) == pytest.approx(3.6 / 3)
  # Row-wise over a bootstrap's [reps, seeds].
  np.testing.assert_allclose(stats.iqm(np.array([[0.9, -0.5, 0.2, 0.1, 0.3], [1, 2, 3, 4, 50]]),
                                       axis=1), [0.2, 3.0])
  with pytest.raises(ValueError, match="no values"):
    stats.iqm([])


def _two_level_means(rows, reps, seed=0):
  return stats.stratified_bootstrap_means(rows, reps, np.random.default_rng(seed)).mean(axis=1)


def test_bootstrap_intervals_stay_inside_the_unit_interval():
  near_one = [np.r_[np.ones(31), 0.0]] + [np.ones(32)] * 7   # a t-interval would pass 1
  lo, hi = stats.percentile_ci95(_two_level_means(near_one, 2000))
  assert 0.0 <= lo < np.mean([r.mean() for r in near_one]) <= hi <= 1.0
  assert stats.percentile_ci95(_two_level_means([np.ones(32)] * 8, 500)) == [1.0, 1.0]
  lo, hi = stats.percentile_ci95(stats.task_bootstrap_means(np.r_[np.ones(3), 0.0], 2000,
                                                            np.random.default_rng(0)))
  assert 0.0 <= lo < 0.75 < hi == 1.0


def test_two_level_bootstrap_weighs_seeds_alike_and_resamples_each_drawn_seed():
  # Seeds weigh alike whatever their task counts: a seed of one 0 and a seed of three 1s.
  assert np.allclose(_two_level_means([[0.0], [1.0, 1.0, 1.0]], 4000).mean(), 0.5, atol=0.03)
  # Per-slot means: one seed only, so every slot is that seed's task resample; its spread is
  # the task bootstrap's (a seed drawn twice gets two independent draws of its tasks).
  slots = stats.stratified_bootstrap_means([np.r_[np.ones(8), np.zeros(8)]] * 2, 4000,
                                           np.random.default_rng(1))
  assert slots.shape == (4000, 2)
  assert np.corrcoef(slots[:, 0], slots[:, 1])[0, 1] == pytest.approx(0.0, abs=0.05)
  assert slots.std() == pytest.approx(0.5 / 4, rel=0.1)   # sqrt(p(1-p)/16)
  with pytest.raises(ValueError, match="every seed needs a value"):
    stats.stratified_bootstrap_means([[1.0], []], 10, np.random.default_rng(0))


def test_sign_flip_p_is_exact():
  assert np.isclose(stats.sign_flip_p(np.ones(8)), 2 / 256)
  assert stats.sign_flip_p([1.0, -1.0, 2.0, -2.0]) == 1.0
  assert np.isclose(stats.sign_flip_p([3.0, 1.0, 1.0]), 2 / 8)
