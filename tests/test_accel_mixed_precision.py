"""Mixed precision through the experiment path: float32 master weights and AdamW moments, compute
in config.model.dtype (bfloat16 here, as on accelerators), checkpoints of the masters, and an
engine that holds its own bfloat16 copies.

The policy is a random-weights ``tiny()`` SmolLM2 written as an HF folder, loaded by
``rao_jax.experiment.load_policy`` as the trainer loads it.
"""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.configs import base
from rao_jax import experiment as X
from rao_jax.learner import Learner
from rao_jax.learner.checkpoint import flatten_with_names
from rao_jax.learner.testing import synthetic_trees

pytestmark = pytest.mark.slow

ROW = 64


@pytest.fixture(scope="module")
def policy_config(tmp_path_factory):
  from flax import nnx
  from rao_jax.model import ModelConfig, Transformer, export_hf, resolve_model_path
  from rao_jax.model.tokenizer import Tokenizer
  gguf = resolve_model_path("smollm2-135m")
  cfg = dataclasses.replace(ModelConfig.from_gguf(gguf).tiny(), dtype="float32",
                            param_dtype="float32")
  out = str(tmp_path_factory.mktemp("tiny_hf"))
  export_hf(Transformer(cfg, rngs=nnx.Rngs(0)), cfg, Tokenizer.from_gguf(gguf), out)
  c = base.base_config()
  c.model.name = out
  c.model.dtype = "bfloat16"
  c.model.remat = "none"
  c.agent.context_window = ROW
  c.learner.row_len = ROW
  c.learner.mesh = "data=1,fsdp=1,tensor=1"
  c.optim.warmup_steps = 0
  c.optim.lr = 1e-5
  c.total_steps = 20
  return c


def _learner(config, workdir, **replace):
  model, tokenizer = X.load_policy(config)
  lcfg = dataclasses.replace(X.learner_config(config, workdir), **replace)
  learner = Learner(lcfg, model.cfg, mesh=X.make_mesh(config.learner.mesh), params=model)
  return learner, tokenizer


def _dtypes(tree):
  return {jnp.dtype(x.dtype).name for x in jax.tree.leaves(tree)
          if jnp.issubdtype(x.dtype, jnp.floating)}


def _matrices(params):
  """{name: float32 numpy array} of every weight matrix (one per layer for stacked ones)."""
  flat, _ = flatten_with_names(params)
  out = {}
  for name, x in flat.items():
    x = np.asarray(jax.device_get(x), np.float32)
    if name.startswith("layers."):        # stacked [L, ...]: matrices are [L, a, b, ...]
      if x.ndim >= 3:
        out.update({f"{name}[{i}]": x[i] for i in range(x.shape[0])})
    elif x.ndim >= 2:
      out[name] = x
  return out


def _train(learner, steps):
  # Two small trees (one micro-batch of rows): bfloat16 products are slow on CPU.
  trees = synthetic_trees(1, 2, vocab=learner.model_cfg.vocab_size, seed=3, max_len=ROW,
                          mean_len=40, max_children=1, max_depth=1)
  batch, _ = learner.prepare(trees)
  before = _matrices(learner.params)
  for _ in range(steps):
    learner.step(batch)
  after = _matrices(learner.params)
  return {k: float(np.mean(after[k] != before[k])) for k in before}


def test_masters_and_moments_are_float32_compute_and_engine_bfloat16(policy_config, tmp_path):
  learner, tokenizer = _learner(policy_config, str(tmp_path))
  assert learner.model_cfg.dtype == "bfloat16" and learner.model_cfg.param_dtype == "float32"
  assert _dtypes(learner.state.params) == {"float32"}
  mu_nu = [s for s in jax.tree.leaves(learner.state.opt_state,
                                      is_leaf=lambda s: hasattr(s, "mu"))
           if hasattr(s, "mu")]
  assert mu_nu, "no AdamW state found"
  for s in mu_nu:
    assert _dtypes(s.mu) == {"float32"} and _dtypes(s.nu) == {"float32"}
  # The forward computes in bfloat16 (hidden states), the log-probs in float32.
  model = learner.model
  tokens = jnp.ones((1, 8), jnp.int32)
  pos = jnp.arange(8, dtype=jnp.int32)[None]
  hidden = model(tokens, pos, jnp.ones((1, 8), jnp.int32))
  assert hidden.dtype == jnp.bfloat16 and model.logits(hidden).dtype == jnp.float32
  # The rollout engine holds its own copies in the compute dtype.
  engine = X.make_engine(policy_config, learner.model, tokenizer)   # no thread started yet
  assert _dtypes(engine.params) == {"bfloat16"}
  learner.close()


def test_twenty_small_steps_move_every_weight_matrix_in_bf16_compute(policy_config, tmp_path):
  learner, _ = _learner(policy_config, str(tmp_path / "f32"))
  changed = _train(learner, 20)
  learner.close()
  # Every element of every matrix gets a gradient (the tied head touches every vocab row), and
  # a float32 master keeps AdamW's ~1e-5 steps.
  assert min(changed.values()) > 0.95, sorted(changed.items(), key=lambda kv: kv[1])[:5]
  # The failure this guards against: bfloat16 masters round most of those steps away.
  bf16, _ = _learner(policy_config, str(tmp_path / "bf16"), master_dtype="bfloat16")
  assert _dtypes(bf16.state.params) == {"bfloat16"}
  changed_bf16 = _train(bf16, 20)
  bf16.close()
  assert np.median(list(changed_bf16.values())) < 0.5, changed_bf16


def test_checkpoint_stores_the_float32_masters(policy_config, tmp_path):
  learner, _ = _learner(policy_config, str(tmp_path))
  _train(learner, 1)
  learner.save()
  learner.wait_for_checkpoints()
  want, _ = flatten_with_names(learner.state)
  path = os.path.join(learner.cfg.ckpt_dir, str(learner.step_count), "state")
  stored = ocp.StandardCheckpointer().restore(path)
  params = {k: v for k, v in stored.items() if k.startswith("params.")}
  assert params and {np.dtype(v.dtype).name for v in params.values()} == {"float32"}
  for k, v in params.items():
    np.testing.assert_array_equal(np.asarray(v), np.asarray(jax.device_get(want[k])), err_msg=k)
  learner.close()
