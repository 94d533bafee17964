"""Rollout correction (``LearnerConfig.tis_cap``): token-level truncated importance weights
min(pi_learner / pi_rollout, cap), constant in the gradient, on the REINFORCE losses; its
metrics; and the gap it corrects on rollouts from a bf16 embedded engine (no SGLang needed)."""
import asyncio
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.learner import (Learner, LearnerConfig, compute_rewards_and_advantages,
                             pack_trees)
from rao_jax.learner import losses
from rao_jax.learner import step as step_lib
from rao_jax.learner import testing
from rao_jax.model.logprobs import token_logprobs
from rao_jax.model.transformer import Transformer

MODEL_CFG = testing.tiny_model_config()
GRAPHDEF = nnx.split(nnx.eval_shape(lambda: Transformer(MODEL_CFG, rngs=nnx.Rngs(0))),
                     nnx.Param)[0]


def lcfg(**kw) -> LearnerConfig:
  base = dict(row_len=32, micro_batch_rows=4, bucket_rows=(8,), lr=1e-3, seed=0)
  base.update(kw)
  return LearnerConfig(**base)


@functools.lru_cache(maxsize=None)
def _grads_fn(cfg):
  statics = step_lib.StepStatics(GRAPHDEF, cfg, None)
  return jax.jit(lambda p, b: step_lib.loss_and_grads(p, None, b, statics))


def grads(cfg, params, batch):
  return _grads_fn(cfg)(params, {k: jnp.asarray(v) for k, v in batch.arrays().items()})


@jax.jit
def _own_logp(params, tokens, positions, segments, targets):
  model = nnx.merge(GRAPHDEF, params)
  return token_logprobs(model, model(tokens, positions, segments), targets)


@pytest.fixture(scope="module")
def on_policy():
  """(params, a packed batch whose rollout log-probs are the learner's own)."""
  trees = testing.worked_example_trees(vocab=64, seed=1, lengths=(12, 9, 7, 10, 6))
  batch = pack_trees(trees, compute_rewards_and_advantages(trees, lam=0.5, baseline="loo"),
                     row_len=32, bucket_rows=(8,))
  params = testing.init_params(MODEL_CFG, 3)
  own = np.asarray(_own_logp(params, batch.tokens_BxT, batch.positions_BxT,
                             batch.segment_ids_BxT, batch.targets_BxT))
  return params, dataclasses.replace(
      batch, rollout_logp_BxT=np.where(batch.loss_mask_BxT, own, 0.0).astype(np.float32))


def test_weights_diagnostics_and_no_gradient_through_the_weight():
  logp = jnp.array([[-1.0, -2.0, -0.5, -3.0]])
  batch = {"loss_mask_BxT": jnp.array([[True, True, True, False]]),
           "rollout_logp_BxT": jnp.array([[-1.0, -2.5, -2.0, 9.0]]),
           "coef_BxT": jnp.array([[0.5, -1.0, 2.0, 7.0]])}
  w, diag = losses.truncated_is_weight(logp, batch, 2.0)
  ratio = np.exp([0.0, 0.5, 1.5])
  np.testing.assert_allclose(w[0, :3], [1.0, ratio[1], 2.0], rtol=1e-6)
  assert float(w[0, 3]) == 1.0          # not a loss token: its rollout value is never read
  np.testing.assert_allclose(diag["tis_weight_mean"], 1.0 + ratio[1] + 2.0, rtol=1e-6)
  assert float(diag["tis_clip_frac"]) == 1.0
  np.testing.assert_allclose(diag["rollout_kl"], np.sum(ratio - 1.0 - np.log(ratio)), rtol=1e-5)
  # The weight is a constant of the gradient: d loss / d logp = -coef * w on loss tokens.
  cfg = lcfg(tis_cap=2.0)
  g = jax.grad(lambda lp: losses.rao_loss(lp, batch, cfg)[0])(logp)
  np.testing.assert_allclose(g[0], [-0.5, 1.0 * ratio[1], -4.0, 0.0], rtol=1e-6)
  # Off (the default): the plain REINFORCE term and no diagnostics.
  assert losses.rao_loss(logp, batch, lcfg())[1] == {}


@pytest.mark.slow
def test_on_policy_weights_are_one_and_the_gradient_is_the_default(on_policy):
  params, batch = on_policy
  _, g_off, _ = grads(lcfg(), params, batch)
  _, g_on, aux = grads(lcfg(tis_cap=2.0), params, batch)
  n = float(aux["loss_tokens"])
  np.testing.assert_allclose(aux["tis_weight_mean"] / n, 1.0, atol=1e-5)
  assert float(aux["tis_clip_frac"]) == 0.0 and abs(float(aux["rollout_kl"])) < 1e-6
  for a, b in zip(jax.tree.leaves(g_off), jax.tree.leaves(g_on)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("loss", ["rao", "token_sum"])
def test_off_policy_gradient_is_the_weighted_reinforce_gradient(on_policy, loss):
  """Rollout log-probs off the learner's by delta per token: the gradient is exactly the
  default loss's with each coefficient times min(exp(delta), cap)."""
  params, batch = on_policy
  cap = 2.0
  delta = np.random.default_rng(0).uniform(-1.5, 1.5, batch.rollout_logp_BxT.shape)
  mask = batch.loss_mask_BxT
  stale = dataclasses.replace(batch, rollout_logp_BxT=np.where(
      mask, batch.rollout_logp_BxT - delta, 0.0).astype(np.float32))
  _, g_tis, aux = grads(lcfg(loss=loss, tis_cap=cap), params, stale)
  w = np.minimum(np.exp(delta), cap)
  weighted = dataclasses.replace(batch, coef_BxT=(batch.coef_BxT * w).astype(np.float32))
  _, g_ref, _ = grads(lcfg(loss=loss), params, weighted)
  for a, b in zip(jax.tree.leaves(g_tis), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6 * float(np.abs(b).max()))
  assert float(aux["tis_clip_frac"]) == np.sum(mask & (delta > np.log(cap)))
  np.testing.assert_allclose(aux["tis_weight_mean"], np.sum(np.where(mask, w, 0.0)), rtol=1e-4)
  # And it is not the uncorrected gradient.
  _, g_plain, _ = grads(lcfg(loss=loss), params, stale)
  assert not np.allclose(g_plain["lm_head"][...], g_tis["lm_head"][...], rtol=1e-3)


def test_config_validates_the_cap():
  assert LearnerConfig().tis_cap == 0.0       # off by default
  for bad in (0.5, -1.0, float("inf"), float("nan")):
    with pytest.raises(ValueError, match=r"LearnerConfig\.tis_cap=.* 0 \(off\) or a finite cap"):
      LearnerConfig(tis_cap=bad)
  for loss in ("ppo_clip", "cispo"):
    with pytest.raises(ValueError, match=rf"tis_cap=2.0.*loss '{loss}' already weights"):
      LearnerConfig(loss=loss, tis_cap=2.0)
  assert LearnerConfig(loss="token_sum", tis_cap=1.0).tis_cap == 1.0


def _rollout_trees(engine, prompts, n):
  """One group of one-node trees sampled by ``engine`` (temperature 1), half of them scored
  1 so the advantages are not zero."""
  from rao_jax.rollout import GenerateRequest, SamplingParams

  async def go():
    return await asyncio.gather(*[engine.generate(GenerateRequest(p, SamplingParams(
        temperature=1.0, max_new_tokens=n, stop_token_ids=(), seed=i)))
        for i, p in enumerate(prompts)])
  trees = []
  for i, (p, r) in enumerate(zip(prompts, asyncio.run(go()))):
    node = testing.make_node("0", None, 0, [], float(i % 2), "verifier", p + r.token_ids,
                             [0] * len(p) + [1] * len(r.token_ids),
                             [0.0] * len(p) + list(r.logprobs))
    trees.append(testing.make_tree(f"t{i}", "g", [node]))
  return trees


@pytest.mark.slow
def test_bf16_engine_rollouts_show_the_gap_the_weights_correct():
  """Rollouts from a bf16 embedded engine, learned by the float32 learner: the step reports
  the log-prob gap, weights off 1 and a positive KL; from a float32 engine, none of it."""
  from rao_jax.rollout import EmbeddedEngine
  params = testing.init_params(MODEL_CFG, 5)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 64, size=6).tolist() for _ in range(8)]
  out = {}
  for dtype in ("bfloat16", "float32"):
    cfg = testing.tiny_model_config(dtype=dtype, param_dtype=dtype)
    graphdef = nnx.split(nnx.eval_shape(lambda c=cfg: Transformer(c, rngs=nnx.Rngs(0))),
                         nnx.Param)[0]
    served = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dtype), params))
    engine = EmbeddedEngine(served, num_slots=8, max_len=32, cache_lens=(32,),
                            chunk_sizes=(8,), prefill_rows=(8,), decode_rows=(8,))
    trees = _rollout_trees(engine, prompts, 20)
    asyncio.run(engine.close())
    batch = pack_trees(trees, compute_rewards_and_advantages(trees, lam=0.5, baseline="loo"),
                       row_len=32, bucket_rows=(8,))
    learner = Learner(lcfg(tis_cap=2.0), MODEL_CFG, params=params)
    out[dtype] = learner.step(batch)
  bf16, fp32 = out["bfloat16"], out["float32"]
  assert bf16["rollout_logp_abs_diff"] > 1e-3, bf16
  assert abs(bf16["tis_weight_mean"] - 1.0) > 1e-4 and 0.8 < bf16["tis_weight_mean"] < 1.2
  assert bf16["rollout_kl"] > 0
  assert fp32["rollout_logp_abs_diff"] < 1e-4, fp32
  assert abs(fp32["tis_weight_mean"] - 1.0) < 1e-4 and fp32["tis_clip_frac"] == 0.0


def test_run_config_field_reaches_the_learner():
  """`--config.rl.tis_cap=2` turns it on for RL; supervised warm starts never weight."""
  from experiments.configs import textcraft_synth
  from rao_jax import experiment as X
  c = textcraft_synth.get_config("recursive,smoke")
  assert X.learner_config(c, "/tmp/unused").tis_cap == 0.0
  c.rl.tis_cap = 2.0
  assert X.learner_config(c, "/tmp/unused").tis_cap == 2.0
  assert X.learner_config(c, "/tmp/unused", sft=True).tis_cap == 0.0
