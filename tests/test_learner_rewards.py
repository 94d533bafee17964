"""RAO rewards, leave-one-out advantages, depth weights and packing (host side, numpy), under
the paper's estimator (baseline "loo", equal groups kept); tests/test_learner_baseline.py tests
the default."""
import functools

import numpy as np
import pytest

from rao_jax.learner import compute_rewards_and_advantages, pack_trees
from rao_jax.learner.testing import make_node, make_tree, synthetic_trees, worked_example_trees

# The paper's estimator as RAO_SPEC first states it: the other roots' R as the baseline, and a
# group of equal root rewards kept (its descendants keep R(v) - R(root)).
_paper = functools.partial(compute_rewards_and_advantages, baseline="loo", drop_equal_groups=False)

# RAO_SPEC worked example table, rows r1, a, b, a1, r2 (flat node order of the two trees).
SPEC_R = [1.25, 1.5, 0.0, 1.0, 0.0]
SPEC_B = [0.0, 0.0, 0.0, 0.0, 1.25]
SPEC_A = [1.25, 1.5, 0.0, 1.0, -1.25]
SPEC_W = [0.8333, 0.8333, 0.8333, 1.6667, 0.8333]
SPEC_WA = [1.0417, 1.25, 0.0, 1.6667, -1.0417]


def test_worked_example_matches_spec_table():
  adv = _paper(worked_example_trees(), lam=0.5)
  assert adv.node_ids == ("r1", "a", "b", "a1", "r2")
  np.testing.assert_allclose(adv.reward_N, SPEC_R, atol=1e-12)
  np.testing.assert_allclose(adv.baseline_N, SPEC_B, atol=1e-12)
  np.testing.assert_allclose(adv.advantage_N, SPEC_A, atol=1e-12)
  np.testing.assert_allclose(adv.weight_N, SPEC_W, atol=1e-4)
  np.testing.assert_allclose(adv.weighted_advantage_N, SPEC_WA, atol=1e-4)
  assert adv.weight_N.sum() == pytest.approx(5.0)
  assert adv.stats["nodes/depth_0"] == 2 and adv.stats["nodes/depth_2"] == 1
  assert adv.stats["reward/depth_1"] == pytest.approx(0.75)
  assert adv.stats["success/depth_0"] == pytest.approx(0.5)
  assert adv.stats["source_frac/judge"] == pytest.approx(0.2)
  assert adv.stats["source_frac/verifier"] == pytest.approx(0.8)
  assert adv.stats["groups_all_equal"] == 0


def test_proxy_success_and_lambda():
  # Child "c" is unscored: it takes s(root) = 0.5 as a proxy; the root's bonus uses it.
  t1 = make_tree("t1", "g", [make_node("r", None, 0, ["c"], 0.5, "verifier"),
                             make_node("c", "r", 1, [], None)])
  t2 = make_tree("t2", "g", [make_node("r", None, 0, [], 0.0, "verifier")])
  t3 = make_tree("t3", "g", [make_node("r", None, 0, [], 1.0, "judge")])
  adv = _paper([t1, t2, t3], lam=2.0)
  assert adv.source_N == ("verifier", "proxy", "verifier", "judge")
  np.testing.assert_allclose(adv.success_N, [0.5, 0.5, 0.0, 1.0])
  np.testing.assert_allclose(adv.reward_N, [0.5 + 2.0 * 0.5, 0.5, 0.0, 1.0])
  # LOO baselines over root rewards (1.5, 0, 1): tree k gets the mean of the other two.
  np.testing.assert_allclose(adv.baseline_N, [0.5, 0.5, 1.25, 0.75])
  # Depths: n0 = 3, n1 = 1, N = 4, D' = 2 -> w0 = 4/6, w1 = 2.
  np.testing.assert_allclose(adv.weight_N, [2 / 3, 2.0, 2 / 3, 2 / 3])
  assert adv.stats["source_frac/proxy"] == pytest.approx(0.25)


def test_all_equal_groups_are_counted():
  trees = [make_tree(f"{g}t{k}", g, [make_node("r", None, 0, [], s)])
           for g, s in (("g1", 1.0), ("g2", 0.0)) for k in range(2)]
  trees.append(make_tree("t9", "g2", [make_node("r", None, 0, [], 1.0)]))
  adv = _paper(trees)
  assert adv.stats["groups_all_equal"] == 1 and adv.stats["num_groups"] == 2
  np.testing.assert_allclose(adv.advantage_N[:2], 0.0)


def test_group_of_one_is_a_clear_error():
  trees = [make_tree("t1", "lonely", [make_node("r", None, 0, [], 1.0)])]
  with pytest.raises(ValueError, match=r"lonely.*K >= 2.*group.size"):
    _paper(trees)


@pytest.mark.parametrize("bad", [1.5, float("nan"), -0.1])
def test_bad_success_is_rejected(bad):
  trees = [make_tree(f"t{k}", "g", [make_node("r", None, 0, [], 1.0 if k else bad)])
           for k in range(2)]
  with pytest.raises(ValueError, match="success"):
    _paper(trees)


def test_unscored_root_and_negative_lambda_are_errors():
  trees = [make_tree(f"t{k}", "g", [make_node("r", None, 0, [], None if k else 1.0)])
           for k in range(2)]
  with pytest.raises(ValueError, match="root"):
    _paper(trees)
  with pytest.raises(ValueError, match="lam"):
    _paper(worked_example_trees(), lam=-1.0)


def test_packing_layout_shift_and_coefficients():
  trees = worked_example_trees()
  adv = _paper(trees, lam=0.5)
  batch = pack_trees(trees, adv, row_len=16, bucket_rows=(2, 4, 8))
  assert batch.shape == (4, 16)   # 35 tokens -> 3 rows, padded to the bucket of 4
  nodes = [n for t in trees for n in t.nodes]
  total_gen = 0
  for p in batch.placements:
    node = nodes[p.node_index]
    sl = slice(p.start, p.start + p.length)
    np.testing.assert_array_equal(batch.tokens_BxT[p.row, sl], node.token_ids)
    np.testing.assert_array_equal(batch.positions_BxT[p.row, sl], np.arange(p.length))
    seg = batch.segment_ids_BxT[p.row, sl]
    assert seg.min() == seg.max() >= 1
    pred = slice(p.start, p.start + p.length - 1)
    np.testing.assert_array_equal(batch.targets_BxT[p.row, pred], node.token_ids[1:])
    np.testing.assert_array_equal(batch.loss_mask_BxT[p.row, pred], np.array(node.gen_mask[1:]) > 0)
    assert not batch.loss_mask_BxT[p.row, p.start + p.length - 1]
    m = sum(node.gen_mask[1:])
    total_gen += m
    coef = batch.coef_BxT[p.row, pred][np.array(node.gen_mask[1:]) > 0]
    np.testing.assert_allclose(coef, SPEC_WA[p.node_index] / m, atol=1e-4 / m)
    np.testing.assert_allclose(batch.rollout_logp_BxT[p.row, pred],
                               np.array(node.logprobs[1:], np.float32))
  assert batch.loss_mask_BxT.sum() == total_gen
  assert batch.normalizer == 5.0
  assert batch.stats["packing_efficiency"] == pytest.approx(35 / 64)
  # Padding is segment 0 and never in the loss.
  assert not batch.loss_mask_BxT[batch.segment_ids_BxT == 0].any()


def test_token_sum_coefficients_and_normalizer():
  trees = worked_example_trees()
  adv = _paper(trees)
  batch = pack_trees(trees, adv, row_len=16, bucket_rows=(4,), loss="token_sum",
                     token_sum_normalizer=100.0)
  for p in batch.placements:
    c = batch.coef_BxT[p.row, p.start:p.start + p.length][
        batch.loss_mask_BxT[p.row, p.start:p.start + p.length]]
    np.testing.assert_allclose(c, SPEC_WA[p.node_index], atol=1e-4)
  assert batch.normalizer == 100.0


def test_too_long_trajectory_names_node_and_fix():
  trees = worked_example_trees()
  adv = _paper(trees)
  with pytest.raises(ValueError, match=r"'t1' node 'r1'.*9 tokens.*row_len=8.*Fix"):
    pack_trees(trees, adv, row_len=8, bucket_rows=(8,))


def test_too_many_rows_names_the_fix():
  trees = worked_example_trees()
  adv = _paper(trees)
  with pytest.raises(ValueError, match="largest bucket"):
    pack_trees(trees, adv, row_len=10, bucket_rows=(1, 2))


def test_packing_efficiency_on_realistic_trees():
  trees = synthetic_trees(num_groups=4, group_size=4, vocab=1000, seed=3, max_len=1024)
  adv = _paper(trees)
  rows = tuple(range(4, 257, 4))
  batch = pack_trees(trees, adv, row_len=1024, bucket_rows=rows)
  # Every generated target appears exactly once in the loss mask.
  expected = sum(sum(n.gen_mask[1:]) for t in trees for n in t.nodes)
  assert batch.loss_mask_BxT.sum() == expected
  assert batch.stats["row_fill"] > 0.9
  assert len({(p.row, p.start) for p in batch.placements}) == len(batch.placements)


def test_ablation_options_on_the_worked_example():
  trees = worked_example_trees()
  # Per-tree GRPO: every node of a tree takes its root's advantage.
  tree_adv = _paper(trees, lam=0.5, advantage="tree")
  np.testing.assert_allclose(tree_adv.advantage_N, [1.25, 1.25, 1.25, 1.25, -1.25])
  np.testing.assert_allclose(tree_adv.reward_N, SPEC_R)   # rewards are RAO's
  # No depth weights: w = 1 everywhere, advantages unchanged.
  flat = _paper(trees, lam=0.5, depth_weights=False)
  np.testing.assert_allclose(flat.weight_N, 1.0)
  np.testing.assert_allclose(flat.advantage_N, SPEC_A)
  # Root-only: children keep their rewards (and shape R(root) through the bonus) but leave the
  # learner batch; the roots are one depth, so w = 1, and N = 2.
  roots = _paper(trees, lam=0.5, train_nodes="root")
  np.testing.assert_allclose(roots.weight_N, [1, 0, 0, 0, 1])
  np.testing.assert_allclose(roots.reward_N, SPEC_R)
  assert roots.num_train_nodes == 2 and roots.num_nodes == 5
  batch = pack_trees(trees, roots, row_len=32, bucket_rows=(1, 2, 4, 8))
  assert float(batch.normalizer) == 2.0
  assert sorted(p.node_id for p in batch.placements) == ["r1", "r2"]
  with pytest.raises(ValueError, match="advantage='leaf'"):
    _paper(trees, advantage="leaf")
  with pytest.raises(ValueError, match="train_nodes='kids'"):
    _paper(trees, train_nodes="kids")


def test_children_take_their_own_groups_baseline_when_groups_are_interleaved():
  # Two groups whose trees alternate in the batch; every child's baseline must be its own
  # tree's leave-one-out mean over ITS group's roots (a baseline taken from the other group,
  # or from batch neighbours, changes these numbers).
  def tree(tid, gid, root_s, child_s):
    return make_tree(tid, gid, [make_node("r", None, 0, ["c"], root_s, "verifier"),
                                make_node("c", "r", 1, [], child_s, "verifier")])
  trees = [tree("a1", "A", 1.0, 1.0), tree("b1", "B", 0.0, 1.0),
           tree("a2", "A", 0.0, 0.0), tree("b2", "B", 0.0, 0.0),
           tree("a3", "A", 1.0, 0.0), tree("b3", "B", 1.0, 1.0)]
  adv = _paper(trees, lam=0.5)
  root_r = {"a1": 1.5, "b1": 0.5, "a2": 0.0, "b2": 0.0, "a3": 1.0, "b3": 1.5}
  groups = {"A": ["a1", "a2", "a3"], "B": ["b1", "b2", "b3"]}
  for i, (t, n) in enumerate(zip(adv.tree_ids, adv.node_ids)):
    mates = [u for u in groups[t[0].upper()] if u != t]
    assert adv.baseline_N[i] == pytest.approx(np.mean([root_r[u] for u in mates])), (t, n)
    assert adv.advantage_N[i] == pytest.approx(adv.reward_N[i] - adv.baseline_N[i])


def _node(node_id, parent, depth, children=(), s=1.0, goal=None):
  n = make_node(node_id, parent, depth, children, s, "verifier")
  if goal is not None:
    n.goal = goal
  return n


def test_count_bonus_group_mean_baseline_and_root_rewards_on_the_worked_example():
  trees = worked_example_trees()
  # Count: R(v) = s(v) + lambda * sum s(c). r1: 1 + 0.5 * (1 + 0) = 1.5; a: 1 + 0.5 * 1.
  count = _paper(trees, lam=0.5, bonus="count")
  np.testing.assert_allclose(count.reward_N, [1.5, 1.5, 0.0, 1.0, 0.0])
  np.testing.assert_allclose(count.baseline_N, [0.0, 0.0, 0.0, 0.0, 1.5])
  # Group mean: b = (R(r1) + R(r2)) / 2 = 0.625 for both trees (own root included).
  mean = _paper(trees, lam=0.5, baseline="group_mean")
  np.testing.assert_allclose(mean.baseline_N, 0.625)
  np.testing.assert_allclose(mean.advantage_N, np.asarray(SPEC_R) - 0.625)
  # Root rewards: every node of tree 1 takes s(r1) = 1 (b's own 0 is ignored), so
  # R = 1 + 0.5 * 1 for nodes with children, 1 for leaves; tree 2 is all 0.
  root = _paper(trees, lam=0.5, node_rewards="root")
  np.testing.assert_allclose(root.reward_N, [1.5, 1.5, 1.0, 1.0, 0.0])
  np.testing.assert_allclose(root.success_N, [1, 1, 0, 1, 0])   # the record's s stays
  np.testing.assert_allclose(root.advantage_N, [1.5, 1.5, 1.0, 1.0, -1.5])
  for kw, msg in (({"bonus": "sum"}, "bonus='sum'"), ({"baseline": "median"}, "baseline"),
                  ({"node_rewards": "sparse"}, "node_rewards"),
                  ({"child_keep_prob": 0.0}, "child_keep_prob"),
                  ({"child_keep_prob": 1.5}, "child_keep_prob")):
    with pytest.raises(ValueError, match=msg):
      _paper(trees, **kw)


def test_pass_through_gate_zeroes_a_node_that_only_forwards_its_own_goal():
  # Tree 1: r forwards its own goal to p (one child: a pass-through), p splits into two
  # leaves. Tree 2: r launches two helpers with its own goal (an echo: not a single child).
  # Tree 3: r answers itself.
  g, h1, h2 = "Finish with 1 then 2.", "Finish with 1.", "Finish with 2."
  t1 = make_tree("t1", "G", [_node("r", None, 0, ["p"], 1.0, g),
                             _node("p", "r", 1, ["x", "y"], 1.0, g),
                             _node("x", "p", 2, (), 1.0, h1), _node("y", "p", 2, (), 1.0, h2)])
  t2 = make_tree("t2", "G", [_node("r", None, 0, ["e1", "e2"], 1.0, g),
                             _node("e1", "r", 1, (), 1.0, g), _node("e2", "r", 1, (), 0.0, g)])
  t3 = make_tree("t3", "G", [_node("r", None, 0, (), 0.0, g)])
  plain = _paper([t1, t2, t3], lam=0.5)
  np.testing.assert_allclose(plain.reward_N, [1.5, 1.5, 1, 1, 1.25, 1, 0, 0])
  assert plain.stats["pass_through_nodes"] == 1
  gated = _paper([t1, t2, t3], lam=0.5, pass_through_gate=True)
  # Only t1's root is gated: R = 0 (no success, no bonus), and its tree's root reward 0 feeds
  # the other trees' baselines. The echoing root of t2 keeps its reward.
  np.testing.assert_allclose(gated.reward_N, [0, 1.5, 1, 1, 1.25, 1, 0, 0])
  np.testing.assert_allclose(gated.baseline_N, [0.625] * 4 + [0.0] * 3 + [0.625])
  # A whitespace difference is still the same goal; a different goal is a real delegation.
  t1.nodes[1].goal = "  " + g + "\n"
  assert _paper([t1, t2, t3], pass_through_gate=True).reward_N[0] == 0
  t1.nodes[1].goal = h1
  assert _paper([t1, t2, t3], pass_through_gate=True).reward_N[0] == 1.5


def test_child_subsampling_keeps_every_root_and_about_p_of_the_children():
  trees = synthetic_trees(16, 4, vocab=64, seed=3, max_len=64, mean_len=30)
  adv = _paper(trees, child_keep_prob=0.25, seed=7)
  roots, kids = adv.depth_N == 0, adv.depth_N > 0
  assert adv.train_N[roots].all()
  share = adv.train_N[kids].mean()
  assert 0.15 < share < 0.35, share
  assert adv.stats["train_nodes"] == adv.train_N.sum() == adv.num_train_nodes
  # Dropped children get weight 0; the kept ones are not scaled by 1/p: with depth weights
  # off every kept node has w = 1, and rewards and advantages are those of the full batch.
  flat = _paper(trees, child_keep_prob=0.25, seed=7, depth_weights=False)
  full = _paper(trees)
  np.testing.assert_array_equal(flat.weight_N, flat.train_N.astype(float))
  np.testing.assert_allclose(flat.advantage_N, full.advantage_N)
  # Same batch and seed: the same draw; another seed: another draw.
  again = _paper(trees, child_keep_prob=0.25, seed=7)
  np.testing.assert_array_equal(again.train_N, adv.train_N)
  other = _paper(trees, child_keep_prob=0.25, seed=8)
  assert not np.array_equal(other.train_N, adv.train_N)
  batch = pack_trees(trees, flat, row_len=64, bucket_rows=(1024,))
  assert float(batch.normalizer) == flat.num_train_nodes


def test_learner_config_validates_the_ablation_options_and_the_run_config_reaches_them():
  from experiments.configs import base
  from rao_jax import experiment as X
  from rao_jax.learner import LearnerConfig
  for field, bad in (("bonus", "sum"), ("baseline", "median"), ("node_rewards", "sparse"),
                     ("pass_through_gate", 1), ("child_keep_prob", 0.0)):
    with pytest.raises(ValueError, match=f"LearnerConfig.{field}="):
      LearnerConfig(**{field: bad})
  c = base.base_config()
  c.rl.bonus, c.rl.baseline, c.rl.node_rewards = "count", "group_mean", "root"
  c.rl.pass_through_gate, c.rl.child_keep_prob = True, 0.25
  lc = X.learner_config(c, "/tmp/unused")
  assert (lc.bonus, lc.baseline, lc.node_rewards, lc.pass_through_gate, lc.child_keep_prob) == (
      "count", "group_mean", "root", True, 0.25)
  # Supervised warm-up steps never take RL's credit options.
  sft = X.learner_config(c, "/tmp/unused", sft=True)
  assert (sft.bonus, sft.node_rewards, sft.pass_through_gate, sft.child_keep_prob) == (
      "rate", "dense", False, 1.0)
