"""The default baseline ("loo_success") against RAO_SPEC's requirements for lambda > 0, the
paper's baseline ("loo") kept as an option, and groups and batches without signal."""
import numpy as np
import pytest

from rao_jax.learner import compute_rewards_and_advantages
from rao_jax.learner.testing import make_node, make_tree, synthetic_trees, worked_example_trees


def _solo(tid, gid, s):
  return make_tree(tid, gid, [make_node("r", None, 0, [], s, "verifier")])


def _delegating(tid, gid, root_s, child_s):
  """A root with one helper per entry of `child_s` (leaves)."""
  kids = [f"c{i}" for i in range(len(child_s))]
  return make_tree(tid, gid, [make_node("r", None, 0, kids, root_s, "verifier")]
                   + [make_node(k, "r", 1, [], s, "verifier") for k, s in zip(kids, child_s)])


def _by(adv):
  return {(t, n): i for i, (t, n) in enumerate(zip(adv.tree_ids, adv.node_ids))}


def test_worked_example_under_the_default_baseline():
  # The roots' successes are 1 and 0: tree 1's baseline is 0, tree 2's is s(r1) = 1 (the
  # paper's is R(r1) = 1.25). Rewards and depth weights are the spec's.
  adv = compute_rewards_and_advantages(worked_example_trees(), lam=0.5)
  np.testing.assert_allclose(adv.reward_N, [1.25, 1.5, 0.0, 1.0, 0.0])
  np.testing.assert_allclose(adv.baseline_N, [0.0, 0.0, 0.0, 0.0, 1.0])
  np.testing.assert_allclose(adv.advantage_N, [1.25, 1.5, 0.0, 1.0, -1.0])
  np.testing.assert_allclose(adv.weight_N, [5 / 6, 5 / 6, 5 / 6, 5 / 3, 5 / 6])
  assert adv.has_signal and adv.stats["signal"] == 1.0


def test_alike_trees_give_every_node_zero_advantage():
  # Three trees of the same shape and successes (a root with a good and a failed helper).
  trees = [_delegating(f"t{k}", "g", 1.0, [1.0, 0.0]) for k in range(3)]
  for baseline in ("loo_success", "loo"):
    adv = compute_rewards_and_advantages(trees, lam=0.5, baseline=baseline)
    np.testing.assert_array_equal(adv.advantage_N, 0.0)
    np.testing.assert_array_equal(adv.weight_N, 0.0)
    assert not adv.train_N.any() and not adv.has_signal
    assert adv.stats["groups_dropped"] == 1 and adv.stats["signal"] == 0.0
  # Without the filter, the paper's estimator trains the failed helper at -1.25 and the good
  # one at -0.25 although nothing differs between the trees.
  kept = compute_rewards_and_advantages(trees, lam=0.5, baseline="loo", drop_equal_groups=False)
  np.testing.assert_allclose(kept.advantage_N[:3], [0.0, -0.25, -1.25])
  assert kept.has_signal


def test_no_successful_leaf_is_pushed_below_zero_when_every_root_succeeded():
  # Every root succeeds; two delegated to helpers that succeeded, one worked alone (a leaf).
  trees = [_delegating("t0", "g", 1.0, [1.0]), _delegating("t1", "g", 1.0, [1.0, 1.0]),
           _solo("t2", "g", 1.0)]
  default = compute_rewards_and_advantages(trees, lam=0.5)
  paper = compute_rewards_and_advantages(trees, lam=0.5, baseline="loo")
  leaves = [i for i, n in enumerate(default.node_ids)
            if (default.tree_ids[i], n) in {("t0", "c0"), ("t1", "c0"), ("t1", "c1"), ("t2", "r")}]
  assert len(leaves) == 4 and default.success_N[leaves].min() == 1.0
  assert default.advantage_N[leaves].min() == 0.0
  # The paper's baseline charges them the bonus the other roots earned: -0.25 to -0.5.
  np.testing.assert_allclose(paper.advantage_N[leaves], [-0.25, -0.25, -0.25, -0.5])


def test_the_bonus_still_pays_for_productive_delegation():
  # A group where the bonus is the only difference between the trees: both roots succeed, one
  # with a helper that succeeded, one alone.
  trees = [_delegating("del", "g", 1.0, [1.0]), _solo("alone", "g", 1.0)]
  adv = compute_rewards_and_advantages(trees, lam=0.5)
  i = _by(adv)
  assert adv.advantage_N[i["del", "r"]] == pytest.approx(0.5)
  assert adv.advantage_N[i["del", "c0"]] == pytest.approx(0.0)
  assert adv.advantage_N[i["alone", "r"]] == pytest.approx(0.0)
  assert adv.has_signal and adv.stats["groups_dropped"] == 0
  # With the paper's baseline the lone root is charged -0.5 for its success.
  paper = compute_rewards_and_advantages(trees, lam=0.5, baseline="loo")
  np.testing.assert_allclose(paper.advantage_N, [0.5, 0.0, -0.5])
  # Delegation that fails pays nothing more than working alone does.
  trees = [_delegating("del", "g", 1.0, [0.0]), _solo("alone", "g", 1.0)]
  adv = compute_rewards_and_advantages(trees, lam=0.5)
  assert not adv.has_signal and adv.stats["groups_all_equal"] == 1


def test_a_nodes_baseline_never_depends_on_its_own_tree():
  rng = np.random.default_rng(0)
  base = synthetic_trees(num_groups=3, group_size=4, vocab=32, seed=1)
  for baseline in ("loo_success", "loo"):
    ref = compute_rewards_and_advantages(base, lam=0.5, baseline=baseline)
    for k in range(len(base)):
      # Replace tree k by another tree of the same group (other shape, other successes).
      other = synthetic_trees(num_groups=1, group_size=1, vocab=32, seed=100 + k)[0]
      other.tree_id, other.group_id = base[k].tree_id, base[k].group_id
      for n in other.nodes:
        n.success = float(rng.integers(0, 2))
      trees = list(base)
      trees[k] = other
      adv = compute_rewards_and_advantages(trees, lam=0.5, baseline=baseline)
      np.testing.assert_array_equal(adv.baseline_N[adv.tree_index_N == k],
                                    ref.baseline_N[ref.tree_index_N == k][0])


def test_at_lambda_zero_the_default_is_the_papers_estimator():
  trees = synthetic_trees(num_groups=4, group_size=4, vocab=32, seed=3)
  for drop in (True, False):
    a = compute_rewards_and_advantages(trees, lam=0.0, drop_equal_groups=drop)
    b = compute_rewards_and_advantages(trees, lam=0.0, baseline="loo", drop_equal_groups=drop)
    np.testing.assert_array_equal(a.advantage_N, b.advantage_N)
    np.testing.assert_array_equal(a.weight_N, b.weight_N)
  # ... and at lambda > 0 they differ on the same trees.
  a = compute_rewards_and_advantages(trees, lam=0.5)
  b = compute_rewards_and_advantages(trees, lam=0.5, baseline="loo")
  assert not np.array_equal(a.advantage_N, b.advantage_N)


def test_equal_groups_leave_the_batch_and_the_others_keep_their_weights():
  # Group "same" has equal root rewards (all fail); group "diff" carries a comparison.
  trees = [_delegating("s0", "same", 0.0, [1.0]), _delegating("s1", "same", 0.0, [1.0]),
           _delegating("d0", "diff", 1.0, [1.0]), _solo("d1", "diff", 0.0)]
  adv = compute_rewards_and_advantages(trees, lam=0.5)
  i = _by(adv)
  for node in (("s0", "r"), ("s0", "c0"), ("s1", "r"), ("s1", "c0")):
    assert adv.advantage_N[i[node]] == 0.0 and not adv.train_N[i[node]]
  # The depth weights are those of the kept batch: depth 0 twice, depth 1 once; N = 3.
  np.testing.assert_allclose(adv.weight_N[[i["d0", "r"], i["d0", "c0"], i["d1", "r"]]],
                             [0.75, 1.5, 0.75])
  assert adv.num_train_nodes == 3 and adv.stats["groups_all_equal_frac"] == 0.5
  with pytest.raises(ValueError, match="drop_equal_groups"):
    compute_rewards_and_advantages(trees, drop_equal_groups="yes")
