"""The RAO loss and the jitted sharded step on a tiny model: gradients, packing, accumulation,
sharding, loss variants, non-finite refusal, compilation count."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.learner import (Learner, LearnerConfig, NonFiniteUpdateError,
                             compute_rewards_and_advantages, pack_trees)
from rao_jax.learner import step as step_lib
from rao_jax.learner import testing
from rao_jax.learner.testing import synthetic_trees, tiny_model_config, worked_example_trees
from rao_jax.model import sharding
from rao_jax.model.config import ModelConfig
from rao_jax.model.logprobs import token_logprobs
from rao_jax.model.transformer import Transformer

VOCAB = 64
SPEC_WA = [1.0417, 1.25, 0.0, 1.6667, -1.0417]   # RAO_SPEC worked example, w_d * A
SPEC_WA_EXACT = [1.25 * 5 / 6, 1.5 * 5 / 6, 0.0, 1.0 * 5 / 3, -1.25 * 5 / 6]


def lcfg(**kw) -> LearnerConfig:
  base = dict(row_len=32, micro_batch_rows=4, bucket_rows=(4, 8), lr=1e-3, seed=0)
  base.update(kw)
  return LearnerConfig(**base)


MODEL_CFG = tiny_model_config()
GRAPHDEF = nnx.split(nnx.eval_shape(lambda: Transformer(MODEL_CFG, rngs=nnx.Rngs(0))),
                     nnx.Param)[0]


@functools.lru_cache(maxsize=None)
def init_params(seed):
  return testing.init_params(MODEL_CFG, seed)   # numpy draws: no compilation


@jax.jit
def forward(params, tokens_BxT, positions_BxT, segment_ids_BxT, targets_BxT):
  """(hidden, logp) of rows; jitted once for all tests (same shapes)."""
  model = nnx.merge(GRAPHDEF, params)
  hidden = model(tokens_BxT, positions_BxT, segment_ids_BxT)
  return hidden, token_logprobs(model, hidden, targets_BxT)


@functools.lru_cache(maxsize=None)
def _loss_and_grads_fn(cfg):
  statics = step_lib.StepStatics(GRAPHDEF, cfg, None)
  return jax.jit(lambda p, b: step_lib.loss_and_grads(p, None, b, statics))


def loss_and_grads(cfg, params, batch):
  return _loss_and_grads_fn(cfg)(params, {k: jnp.asarray(v) for k, v in batch.arrays().items()})


def unpacked_rows(nodes, rows=8, T=32):
  """One node per row (no packing): tokens, positions, segments, targets, loss mask [rows, T]."""
  out = [np.zeros((rows, T), np.int32) for _ in range(4)] + [np.zeros((rows, T), bool)]
  for r, node in enumerate(nodes):
    n = len(node.token_ids)
    out[0][r, :n] = node.token_ids
    out[1][r, :n] = np.arange(n)
    out[2][r, :n] = 1
    out[3][r, :n - 1] = node.token_ids[1:]
    out[4][r, :n - 1] = np.asarray(node.gen_mask[1:]) > 0
  return out


@pytest.fixture(scope="module")
def example():
  trees = worked_example_trees(vocab=VOCAB, seed=1, lengths=(12, 9, 7, 10, 6))
  # The spec's table is the paper's estimator (its baseline over the other roots' R).
  adv = compute_rewards_and_advantages(trees, lam=0.5, baseline="loo")
  batch = pack_trees(trees, adv, row_len=32, bucket_rows=(8,))
  return trees, adv, batch


FULL = lcfg(micro_batch_rows=8, bucket_rows=(8,))


@pytest.mark.slow
def test_gradient_matches_unpacked_spec_reference(example):
  """L = -(1/N) sum_v w_d A / |M_v| sum_t log pi, with the SPEC table's w_d * A, node by node."""
  trees, _, batch = example
  assert batch.num_rows_used < 5   # several nodes share rows: the packed path is exercised
  params = init_params(3)
  nodes = [n for t in trees for n in t.nodes]
  tok, pos, seg, tgt, mask = unpacked_rows(nodes)
  coef = np.zeros((8, 1), np.float32)
  for r, node in enumerate(nodes):
    coef[r] = SPEC_WA_EXACT[r] / sum(node.gen_mask[1:])

  def reference(p):
    _, logp = forward(p, tok, pos, seg, tgt)
    return -jnp.sum(jnp.where(mask, coef * logp, 0.0)) / 5.0

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(params)
  loss, grads, _ = loss_and_grads(FULL, params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
  # The table's 4-digit values are these exact ones.
  np.testing.assert_allclose(SPEC_WA, SPEC_WA_EXACT, atol=1e-4)


def test_lm_head_gradient_matches_closed_form(example):
  """dL/dW_head = -sum_t c_t (onehot(y_t) - softmax(W h_t)) h_t^T / normalizer, by hand."""
  _, _, batch = example
  params = init_params(4)
  _, grads, _ = loss_and_grads(FULL, params, batch)
  hidden, _ = forward(params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT,
                      batch.targets_BxT)
  hidden = np.asarray(hidden, np.float64)
  w = np.asarray(params["lm_head"][...], np.float64)
  logits = hidden @ w.T
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  onehot = np.eye(VOCAB)[batch.targets_BxT]
  c = np.where(batch.loss_mask_BxT, batch.coef_BxT, 0.0)[..., None]
  expected = -np.einsum("btv,btd->vd", c * (onehot - p), hidden) / batch.normalizer
  np.testing.assert_allclose(grads["lm_head"][...], expected, rtol=1e-4, atol=1e-7)


def test_packed_logprobs_equal_unpacked(example):
  trees, _, batch = example
  params = init_params(5)
  _, logp = forward(params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT,
                    batch.targets_BxT)
  nodes = [n for t in trees for n in t.nodes]
  _, alone = forward(params, *unpacked_rows(nodes)[:4])
  logp, alone = np.asarray(logp), np.asarray(alone)
  for pl in batch.placements:
    np.testing.assert_allclose(logp[pl.row, pl.start:pl.start + pl.length - 1],
                               alone[pl.node_index, :pl.length - 1], rtol=1e-5, atol=1e-5)


def test_accumulated_equals_full_batch(example):
  _, _, batch = example
  params = init_params(6)
  loss1, g1, aux1 = loss_and_grads(FULL, params, batch)
  loss4, g4, aux4 = loss_and_grads(lcfg(micro_batch_rows=2, bucket_rows=(8,)), params, batch)
  np.testing.assert_allclose(loss4, loss1, rtol=1e-5, atol=1e-7)
  assert aux1["loss_tokens"] == aux4["loss_tokens"] == batch.loss_mask_BxT.sum()
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
    # Summation order differs (float32): tolerance 1e-5 relative to each tensor's scale.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


@pytest.mark.parametrize("loss", ["ppo_clip", "cispo"])
def test_ratio_losses_have_the_default_gradient_on_policy(example, loss):
  """With rollout logprobs = the current policy's (one on-policy epoch), ratio = 1."""
  _, _, batch = example
  params = init_params(8)
  _, own = forward(params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT,
                   batch.targets_BxT)
  on_policy = dataclasses.replace(
      batch, rollout_logp_BxT=np.where(batch.loss_mask_BxT, own, 0.0).astype(np.float32))
  _, g_rao, _ = loss_and_grads(FULL, params, on_policy)
  cfg = dataclasses.replace(FULL, loss=loss)
  _, g_var, aux = loss_and_grads(cfg, params, on_policy)
  np.testing.assert_allclose(aux["clip_frac"], 0.0)
  for a, b in zip(jax.tree.leaves(g_rao), jax.tree.leaves(g_var)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  # Off-policy (rollout logprobs much lower: ratio e^2 > 1 + eps and > cispo_ratio_max) the
  # variants clip and their gradients differ from the default.
  stale = dataclasses.replace(on_policy, rollout_logp_BxT=on_policy.rollout_logp_BxT - 2.0)
  _, g_stale, aux = loss_and_grads(cfg, params, stale)
  assert aux["clip_frac"] > 0
  assert not np.allclose(g_stale["lm_head"][...], g_rao["lm_head"][...])


@pytest.mark.slow
def test_kl_penalty_is_zero_at_the_reference_and_positive_after_update(example):
  _, _, batch = example
  cfg = lcfg(kl_coef=0.5, lr=1e-2, micro_batch_rows=8, bucket_rows=(8,))
  learner = Learner(cfg, MODEL_CFG, params=init_params(9))
  m1 = learner.step(batch)
  assert abs(m1["kl"]) < 1e-6   # the first step's policy is the reference
  m2 = learner.step(batch)
  assert m2["kl"] > 1e-6
  assert m2["loss"] == pytest.approx(m2["pg_loss"] + 0.5 * m2["kl"], rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def learner_pair():
  """A one-device learner and an 8-device (data=2, fsdp=2, tensor=2) one, same init."""
  # eps = 1e-2: with Adam's default 1e-8, a weight whose gradient is near 0 moves by up to lr
  # on the 1e-9 that the sharded sum's other order gives; the updates stay ~1e-4.
  cfg = lcfg(eps=1e-2)
  single = Learner(cfg, MODEL_CFG, params=init_params(0))
  sharded = Learner(cfg, MODEL_CFG, mesh=sharding.make_mesh(2, 2, 2), params=init_params(0))
  return single, sharded


def _batches(seed, n):
  out = []
  for i in range(n):
    trees = synthetic_trees(1, 2, VOCAB, seed=seed + i, max_len=32, mean_len=10, max_depth=2,
                            max_children=2)
    adv = compute_rewards_and_advantages(trees, drop_equal_groups=False)
    out.append(pack_trees(trees, adv, row_len=32, bucket_rows=(4, 8)))
  return out


@pytest.mark.slow
def test_sharded_step_equals_unsharded(learner_pair):
  single, sharded = learner_pair
  assert len(sharded.params["layers"]["wq"][...].sharding.device_set) == 8
  batches = _batches(40, 2)
  assert {b.shape for b in batches} == {(4, 32)}   # one bucket: one compilation per learner
  for batch in batches:
    m1 = single.step(batch)
    m8 = sharded.step(batch)
    for k in ("loss", "grad_norm", "logp_mean"):
      np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_no_recompilation_after_warmup_across_buckets(learner_pair):
  single, _ = learner_pair
  batches = _batches(40, 8)
  shapes = {b.shape for b in batches}
  assert shapes == {(4, 32), (8, 32)}, shapes   # both buckets occur
  for shape in sorted(shapes):   # warm-up: one step per bucket
    single.step(next(b for b in batches if b.shape == shape))
  traces = step_lib.TRACE_COUNT
  cache = single._step_fn._cache_size()
  for b in batches:
    single.step(b)
  assert step_lib.TRACE_COUNT == traces
  assert single._step_fn._cache_size() == cache == 2


def test_nonfinite_update_is_refused_and_state_untouched(learner_pair):
  single, _ = learner_pair
  batch = _batches(60, 1)[0]
  before = jax.tree.map(np.asarray, single.state)
  bad = dataclasses.replace(batch, coef_BxT=np.where(batch.loss_mask_BxT, np.inf,
                                                      0.0).astype(np.float32))
  with pytest.raises(NonFiniteUpdateError, match="refused"):
    single.step(bad)
  after = jax.tree.map(np.asarray, single.state)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  single.step(batch)   # the learner goes on
  assert int(single.state.step) == int(before.step) + 1


def test_bad_batches_are_clear_errors(learner_pair):
  single, _ = learner_pair
  batch = _batches(70, 1)[0]
  arrays = batch.arrays()
  odd = {k: (v[:3] if np.ndim(v) == 2 else v) for k, v in arrays.items()}
  with pytest.raises(ValueError, match="bucket_rows"):
    single.step(odd)
  big = dict(arrays, tokens_BxT=np.full_like(arrays["tokens_BxT"], VOCAB))
  with pytest.raises(ValueError, match="vocabulary"):
    single.step(big)
  with pytest.raises(ValueError, match="token_sum"):
    single.step(dataclasses.replace(batch, normalization="token_sum"))
  with pytest.raises(ValueError, match="micro_batch_rows"):
    Learner(lcfg(micro_batch_rows=2, bucket_rows=(4,)), MODEL_CFG,
            mesh=sharding.make_mesh(4, 1, 2), params=init_params(0))


def test_config_validation_names_field_and_fix():
  with pytest.raises(ValueError, match=r"LearnerConfig\.loss='nope'.*rao"):
    LearnerConfig(loss="nope")
  with pytest.raises(ValueError, match=r"bucket_rows.*multiple of micro_batch_rows"):
    LearnerConfig(micro_batch_rows=4, bucket_rows=(4, 6))
  with pytest.raises(ValueError, match="clip_eps"):
    LearnerConfig(clip_eps=1.5)


@pytest.mark.parametrize("warmup_steps", [1, 3])
def test_every_update_moves_the_weights_from_the_first_warmup_step(warmup_steps):
  # optax's linear warm-up starts at 0: with it the first update of a run ran at lr 0 and left
  # the weights exactly where they were (with warmup_steps=1, that was one RL step in six).
  cfg = lcfg(lr=1e-3, warmup_steps=warmup_steps, total_steps=10)
  sched = step_lib._schedule(cfg)
  lrs = [float(sched(i)) for i in range(warmup_steps + 2)]
  np.testing.assert_allclose(lrs[:warmup_steps],
                             [1e-3 * (i + 1) / warmup_steps for i in range(warmup_steps)],
                             rtol=1e-6)
  assert lrs[warmup_steps:] == pytest.approx([1e-3, 1e-3])
  learner = Learner(cfg, MODEL_CFG, mesh=sharding.make_mesh(1, 1, 1), params=init_params(0))
  trees = synthetic_trees(1, 2, vocab=VOCAB, seed=3, max_len=30, mean_len=16)
  batch, _ = learner.prepare(trees)
  before = jax.tree.map(np.asarray, learner.params)
  m = learner.step(batch)
  after = jax.tree.map(np.asarray, learner.params)
  assert m["lr"] == pytest.approx(1e-3 / warmup_steps)
  moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(after),
                                                          jax.tree.leaves(before)))
  assert moved > 0, "the first update left every weight unchanged"
  learner.close()
