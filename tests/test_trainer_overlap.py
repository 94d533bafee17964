"""Overlap without aliasing: the embedded engine never reads a buffer the learner donates.

With float32 compute, `inference_params()` hands back the embedding (and the tied head, the
final norm) as the learner's own arrays; the learner donates its state to every step, so an
engine built from `learner.model` (or updated from it) lost those arrays under rollouts in flight
("Array has been deleted"). The engine now copies every array it takes in (at construction
and at every weight update): the sync boundary. A copy made by `jax.device_put` alone is not
enough: from weights replicated over the learner's data-parallel mesh it returns the engine
device's own shard (the trainer's run below met that buffer deleted under its rollouts).
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
  # Synthetic groups may have equal root rewards: kept, so that every step has nodes to train.
  learner = Learner(LearnerConfig(row_len=64, micro_batch_rows=1, bucket_rows=(1, 2, 4, 8, 16),
                                  lr=1e-2, drop_equal_groups=False), CFG)
  engine = EmbeddedEngine(learner.model, num_slots=4, max_len=64)
  try:
    # The engine's arrays share no buffer with the learner's state...
    assert not _ptrs(engine.params) & _ptrs(learner.state)
    # ...yet are equal to it, and the tied head stays one array.
    np.testing.assert_array_equal(np.asarray(engine.params["embed"]),
                                  np.asarray(learner.model.inference_params()["embed"]))
    assert engine.params["head"] is engine.params["embed"]
    trees = lt.synthetic_trees(1, 2, vocab=97, seed=1, max_len=60, mean_len=30)
    for step in range(2):
      learner.step(learner.prepare(trees)[0])   # donates the state the engine was built from
      res = _generate(engine, seed=step)
      assert res.finish_reason != rollout.FinishReason.ABORT, res.message
      assert len(res.token_ids) == 6
      # The same after an update from the (new) learner state.
      asyncio.run(engine.update_weights(learner.model, step + 1))
      assert not _ptrs(engine.params) & _ptrs(learner.state)
    learner.step(learner.prepare(trees)[0])
    res = _generate(engine, seed=9)
    assert res.finish_reason != rollout.FinishReason.ABORT, res.message
    assert res.weight_version == 2
  finally:
    asyncio.run(engine.close())
    learner.close()


def test_engine_copies_weights_replicated_over_a_data_parallel_mesh():
  # The trainer's learner (--config.learner.mesh=auto) replicates every weight over a "data"
  # mesh; device_put(may_alias=False) from such an array to one of its devices returns that
  # device's shard itself. An engine holding it served a buffer the learner's next step donates.
  from flax import nnx
  from rao_jax.model import Transformer, sharding
  mesh = sharding.make_mesh(2, 1, 1)
  graphdef, state = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
  state = jax.device_put(state, sharding.replicated(mesh))
  # What the learner's step does to its state: a jitted update that donates it.
  step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.5, s), donate_argnums=0)
  engine = EmbeddedEngine(nnx.merge(graphdef, state), num_slots=1, max_len=32,
                          chunk_sizes=(8,), prefill_rows=(1,))
  try:
    assert not _ptrs(engine.params) & _ptrs(state)
    asyncio.run(engine.update_weights(nnx.merge(graphdef, state), 1))   # the sync's path
    assert not _ptrs(engine.params) & _ptrs(state)
    state = step(state)
    assert not any(x.is_deleted() for x in jax.tree.leaves(engine.params))
    res = _generate(engine, seed=0)
    assert res.finish_reason != rollout.FinishReason.ABORT, res.message
    assert len(res.token_ids) == 6 and res.weight_version == 1
  finally:
    asyncio.run(engine.close())


# ---- the trainer end to end: overlap on the embedded engine, then non-finite updates --------

import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import pytest  # noqa: E402



def _config(model_dir, total_steps):
  from experiments.configs import textcraft_synth
  c = textcraft_synth.get_config("recursive,smoke")
  c.model.name = model_dir
  c.total_steps = total_steps
  c.agent.max_new_tokens = 16
  c.agent.max_steps_per_agent = 2
  c.agent.context_window = 1024
  c.rollout.max_cache_len = 1024
  c.rollout.num_slots = 4
  c.rl.kl_coef = 0.01          # keeps every node in the batch, and every step runs the learner
  c.rl.update_without_signal = True   # although the tiny policy's groups carry no signal
  c.rl.drop_equal_groups = False   # (its groups are all equal: keep them)
  c.rl.loss = "ppo_clip"
  c.rl.overlap = True
  c.learner.row_len = 1024
  c.eval.every = 0
  c.log.progress = False
  c.log.tensorboard = False
  return c


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f if "train/success" in l]


@pytest.mark.slow
@pytest.mark.long   # a full multi-step Trainer run: 77-121 s on an idle 2-core machine
def test_trainer_overlap_three_steps_without_generation_errors(tiny_hf_dir, tmp_path,
                                                              monkeypatch):
  import threading
  from rao_jax import collection, trainer
  from rao_jax.agent import records as R
  # On 2 busy CPU cores the learner's step can starve the engine until the new weights arrive,
  # so that no turn of the next step's rollouts ends on the old ones (every node fresh: the
  # overlap then shows nowhere). Each update that has rollouts beside it first waits for one
  # engine result, so some turn surely ends on the old weights.
  finished = threading.Event()
  real_finish, real_step = EmbeddedEngine._finish, Learner.step

  def finish(self, *args, **kwargs):
    try:
      return real_finish(self, *args, **kwargs)
    finally:
      finished.set()

  def step(self, *args, **kwargs):
    if self.step_count < 2:   # updates 1 and 2 run beside steps 2 and 3's rollouts
      finished.clear()        # this step's own rollouts have all ended
      finished.wait(timeout=120)
    return real_step(self, *args, **kwargs)

  monkeypatch.setattr(EmbeddedEngine, "_finish", finish)
  monkeypatch.setattr(Learner, "step", step)
  wd = str(tmp_path / "run")
  res = trainer.train(_config(tiny_hf_dir, 3), wd)
  assert res["step"] == 3 and not res["stopped"]
  stale = []
  for step in range(3):
    trees = R.load_trees_jsonl(os.path.join(wd, "trees", f"step_{step:06d}.jsonl"))
    for t in trees:
      assert collection.infra_error(t) is None, collection.infra_error(t)
      for n in t.nodes:
        assert "Array has been deleted" not in n.extras.get("error", "")
        assert n.end_reason != "error", n.extras
        assert n.extras["staleness"] == step - min([n.weight_version] + list(
            n.extras.get("weight_versions", [])))
        stale.append((step, n.extras["staleness"]))
  # Step 0 is on-policy; later batches were (at least partly) sampled while the learner
  # updated. A result carries the engine's version when it finished, so a turn that ended after
  # the swap counts as fresh: staleness is 0 or 1, and 1 somewhere.
  assert {s for st, s in stale if st == 0} == {0}
  assert {s for st, s in stale if st > 0} <= {0, 1}
  assert max(s for st, s in stale if st > 0) == 1
  rows = _rows(wd)
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert all(r["train/learner/update_applied"] == 1.0 for r in rows)
  assert max(r["train/rollout/staleness_max"] for r in rows) == 1.0
  assert rows[-1]["train/learner/applied_updates"] == 3.0


@pytest.mark.slow
@pytest.mark.long   # a full multi-step Trainer run: 77-121 s on an idle 2-core machine
def test_trainer_skips_nonfinite_updates_then_stops_with_a_checkpoint(tiny_hf_dir, tmp_path,
                                                                       monkeypatch):
  from rao_jax import trainer
  from rao_jax.learner import Learner
  # Every batch is poisoned: each update is refused and counted, the run goes on, and the
  # second in a row (max_nonfinite_steps=2) stops it with a clear error and a checkpoint.
  real_prepare = Learner.prepare

  def poisoned(self, trees):
    batch, adv = real_prepare(self, trees)
    return dataclasses.replace(batch, coef_BxT=np.full_like(batch.coef_BxT, np.nan)), adv

  monkeypatch.setattr(Learner, "prepare", poisoned)
  wd = str(tmp_path / "run")
  c = _config(tiny_hf_dir, 6)
  c.rl.overlap = False
  c.rl.max_nonfinite_steps = 2
  with pytest.raises(trainer.TrainingDivergedError, match="2 non-finite updates in a row"):
    trainer.train(c, wd)
  rows = _rows(wd)
  assert [r["step"] for r in rows] == [1, 2]
  assert [r["train/faults/nonfinite_steps"] for r in rows] == [1.0, 2.0]
  assert [r["train/learner/update_applied"] for r in rows] == [0.0, 0.0]
  assert [r["train/learner/applied_updates"] for r in rows] == [0.0, 0.0]
  steps = sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit())
  assert steps[-1] == 2
