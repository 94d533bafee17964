"""Shared prefixes in the learner's packed rows: nodes that start with the same prompt tokens
share one copy of them, and the loss and gradient equal those of unshared packing."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.kernels import mkl
from rao_jax.kernels import segments
from rao_jax.learner import LearnerConfig, compute_rewards_and_advantages, pack_trees
from rao_jax.learner import step as step_lib
from rao_jax.learner import testing
from rao_jax.model.transformer import Transformer

VOCAB, SYSTEM, T = 64, 24, 128


def trees_with_shared_prompts(seed=0):
  """Two groups of two trees; every node starts with the same 24-token system prompt, the
  trees of a group with the same root goal; children have goals of their own."""
  rng = np.random.default_rng(seed)
  system = rng.integers(1, VOCAB, SYSTEM).tolist()
  trees = []
  for g in range(2):
    root_goal = rng.integers(1, VOCAB, 6).tolist()
    for k in range(2):
      nodes = []
      for n, (nid, parent, depth) in enumerate([("0", None, 0), ("0.1", "0", 1),
                                                ("0.2", "0", 1)][:2 + k]):
        goal = root_goal if depth == 0 else rng.integers(1, VOCAB, 5).tolist()
        turns, gen = [], []
        for _ in range(2):
          out, obs = int(rng.integers(4, 9)), int(rng.integers(2, 5))
          turns += rng.integers(1, VOCAB, out + obs).tolist()
          gen += [1] * out + [0] * obs
        tokens = system + goal + turns
        mask = [0] * (len(system) + len(goal)) + gen
        children = ["0.1", "0.2"][:1 + k] if depth == 0 else []
        nodes.append(testing.make_node(nid, parent, depth, children,
                                       float(rng.integers(0, 2)), "verifier", tokens, mask,
                                       (-rng.uniform(0.1, 3.0, len(tokens))).tolist()))
        del n
      trees.append(testing.make_tree(f"t{g}{k}", f"g{g}", nodes))
  return trees


def model_cfg(kernels):
  return testing.tiny_model_config(kernels=kernels)


@functools.lru_cache(maxsize=None)
def _loss_fn(kernels, share):
  mcfg = model_cfg(kernels)
  graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))),
                       nnx.Param)[0]
  cfg = LearnerConfig(row_len=T, micro_batch_rows=4, bucket_rows=(8,), share_prefix_min=share)
  statics = step_lib.StepStatics(graphdef, cfg, None)
  return jax.jit(lambda p, b: step_lib.loss_and_grads(p, None, b, statics))


def loss_and_grads(kernels, share, params, batch):
  arrays = {k: jnp.asarray(v) for k, v in batch.arrays().items()}
  loss, grads, _ = _loss_fn(kernels, share)(params, arrays)
  return float(loss), grads


def test_segments_see_its_prefix_and_itself_only():
  p1, p2 = segments.shared_prefix_id(1), segments.shared_prefix_id(2)
  s11, s12, s21 = (segments.suffix_id(1, 1), segments.suffix_id(1, 2),
                   segments.suffix_id(2, 1))
  q = np.array([s11, s11, s11, s11, p1, 3, 3, 0, 0, s21, s21])
  k = np.array([s11, p1, s12, p2, s11, 3, p1, 0, p1, p2, p1])
  np.testing.assert_array_equal(np.asarray(segments.segments_see(q, k)),
                                [1, 1, 0, 0, 0, 1, 0, 1, 0, 1, 0])
  with pytest.raises(ValueError, match="member 0"):
    segments.suffix_id(1, 0)


def test_packing_shares_prompts_and_keeps_each_nodes_tokens():
  trees = trees_with_shared_prompts()
  adv = compute_rewards_and_advantages(trees, lam=0.5, drop_equal_groups=False)
  plain = pack_trees(trees, adv, T, (8,))
  shared = pack_trees(trees, adv, T, (8,), share_prefix_min=8)
  assert plain.stats["shared_prefix_saved"] == 0
  assert shared.stats["shared_prefix_units"] >= 2
  assert shared.stats["real_tokens"] == plain.stats["real_tokens"]
  assert shared.stats["loss_tokens"] == plain.stats["loss_tokens"]
  # Every unit saves at least its system prompt once per extra member.
  assert shared.stats["shared_prefix_saved"] >= SYSTEM * (len(plain.placements) - 4)
  nodes = {(t.tree_id, n.node_id): n for t in trees for n in t.nodes}
  for p in shared.placements:
    node = nodes[(p.tree_id, p.node_id)]
    row = shared.tokens_BxT[p.row]
    got = (list(row[p.prefix_start:p.prefix_start + p.prefix_len]) if p.prefix_len else [])
    got += list(row[p.start:p.start + p.length])
    assert got == node.token_ids   # prefix + suffix is the trajectory
    assert list(shared.positions_BxT[p.row, p.start:p.start + p.length]) == list(
        range(p.prefix_len, len(node.token_ids)))
    # No generated token, and not the token after it, lies in the shared prefix.
    assert p.prefix_len == 0 or not any(node.gen_mask[:p.prefix_len + 1])
  assert int(shared.loss_mask_BxT.sum()) == int(plain.loss_mask_BxT.sum())


@pytest.mark.parametrize("kernels", ["xla", "mkl"])
def test_loss_and_gradient_equal_unshared_packing(kernels):
  if kernels == "mkl" and not mkl.available("mkl"):
    pytest.skip("the MKL kernels cannot be built here")
  trees = trees_with_shared_prompts(seed=1)
  adv = compute_rewards_and_advantages(trees, lam=0.5, drop_equal_groups=False)
  plain = pack_trees(trees, adv, T, (8,))
  shared = pack_trees(trees, adv, T, (8,), share_prefix_min=8)
  assert shared.stats["shared_prefix_units"] >= 2
  params = testing.init_params(model_cfg(kernels), 3)
  loss0, grads0 = loss_and_grads(kernels, 0, params, plain)
  loss1, grads1 = loss_and_grads(kernels, 8, params, shared)
  assert loss0 != 0.0
  np.testing.assert_allclose(loss1, loss0, rtol=1e-5, atol=1e-7)
  for g1, g0 in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0)):
    np.testing.assert_allclose(g1, g0, rtol=2e-4, atol=2e-6)

  # The control: a suffix that also saw the member before it (both given one id) changes the
  # loss, so the equality above holds only because suffixes see their prefix and themselves.
  seg = shared.segment_ids_BxT.copy()
  unit = next(p for p in shared.placements if p.prefix_len)
  sibling = next(p for p in shared.placements
                 if p.row == unit.row and p.prefix_start == unit.prefix_start and p is not unit)
  seg[seg == seg[sibling.row, sibling.start]] = seg[unit.row, unit.start]
  leaky = dataclasses.replace(shared, segment_ids_BxT=seg)
  loss2, _ = loss_and_grads(kernels, 8, params, leaky)
  assert abs(loss2 - loss0) > 1e-4 * abs(loss0)


def test_share_prefix_min_is_validated_and_resolved():
  with pytest.raises(ValueError, match="share_prefix_min"):
    LearnerConfig(share_prefix_min=-2)
  assert LearnerConfig(share_prefix_min=0).shared_prefix_tokens() == 0
  assert LearnerConfig(share_prefix_min=32).shared_prefix_tokens() == 32
  expected = 64 if jax.default_backend() == "cpu" else 0
  assert LearnerConfig().shared_prefix_tokens() == expected
