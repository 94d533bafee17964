"""Overlap without aliasing: the embedded engine never reads a buffer the learner donates.

With float32 compute, `inference_params()` hands back the embedding (and the tied head, the
final norm) as the learner's own arrays; the learner donates its state to every step, so an
engine built from `learner.model` (or updated from it) lost those arrays under rollouts in flight
("Array has been deleted"). The engine now copies exactly the leaves that share a buffer.
"""
import asyncio

import jax
import numpy as np

from rao_jax.learner import Learner, LearnerConfig
from rao_jax.learner import testing as lt
from rao_jax.model import ModelConfig
from rao_jax.rollout import base as rollout
from rao_jax.rollout.embedded import EmbeddedEngine

CFG = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=64, tie_embeddings=True, dtype="float32", param_dtype="float32")


def _generate(engine, seed):
  req = rollout.GenerateRequest(
      prompt_ids=[1, 2, 3, 4, 5],
      params=rollout.SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed,
                                    stop_token_ids=()))
  return asyncio.run(engine.generate(req))


def _ptrs(tree):
  out = set()
  for x in jax.tree.leaves(tree):
    out |= {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
  return out


def test_engine_survives_learner_steps_that_donate_its_source():
  learner = Learner(LearnerConfig(row_len=64, micro_batch_rows=1, bucket_rows=(1, 2, 4, 8, 16),
                                  lr=1e-2), CFG)
  engine = EmbeddedEngine(learner.model, num_slots=4, max_len=64)
  try:
    # The engine's arrays share no buffer with the learner's state...
    assert not _ptrs(engine._params) & _ptrs(learner.state)
    # ...yet are equal to it, and the tied head stays one array.
    np.testing.assert_array_equal(np.asarray(engine._params["embed"]),
                                  np.asarray(learner.model.inference_params()["embed"]))
    assert engine._params["head"] is engine._params["embed"]
    trees = lt.synthetic_trees(1, 2, vocab=97, seed=1, max_len=60, mean_len=30)
    for step in range(2):
      learner.step(learner.prepare(trees)[0])   # donates the state the engine was built from
      res = _generate(engine, seed=step)
      assert res.finish_reason != rollout.FinishReason.ABORT, res.message
      assert len(res.token_ids) == 6
      # The same after an update from the (new) learner state.
      engine.update_weights(learner.model, version=step + 1)
      assert not _ptrs(engine._params) & _ptrs(learner.state)
    learner.step(learner.prepare(trees)[0])
    res = _generate(engine, seed=9)
    assert res.finish_reason != rollout.FinishReason.ABORT, res.message
    assert res.weight_version == 2
  finally:
    asyncio.run(engine.close())
    learner.close()
