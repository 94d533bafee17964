"""LoRA adapters: the model's math, the learner training the adapter alone, rank 0 unchanged,
checkpoints that keep the adapter and refuse another base."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.learner import Learner, LearnerConfig, pack_trees
from rao_jax.learner.testing import synthetic_trees, tiny_model_config
from rao_jax.model import lora as lora_lib
from rao_jax.model.transformer import Transformer

VOCAB = 64
LORA = {"rank": 4, "alpha": 8.0}


def lcfg(**kw) -> LearnerConfig:
  base = dict(row_len=32, micro_batch_rows=4, bucket_rows=(4, 8, 16, 32), lr=1e-2, seed=0)
  base.update(kw)
  return LearnerConfig(**base)


def _inputs(B=2, T=12, seed=0):
  toks = jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (B, T)), jnp.int32)
  return toks, jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones((B, T), jnp.int32)


def _randomize_b(model, seed=1):
  rng = np.random.default_rng(seed)
  for name, var in vars(model.lora).items():
    if name.endswith("_b"):
      var[...] = jnp.asarray(rng.normal(0, 0.1, var.shape), var[...].dtype)


def test_lora_config_validates_each_field():
  with pytest.raises(ValueError, match="rank=-1"):
    lora_lib.LoraConfig(rank=-1)
  with pytest.raises(ValueError, match="alpha"):
    lora_lib.LoraConfig(rank=2, alpha=0)
  with pytest.raises(ValueError, match="targets"):
    lora_lib.LoraConfig(rank=2, targets=("q", "wq"))
  with pytest.raises(ValueError, match="dropout"):
    lora_lib.LoraConfig(rank=2, dropout=1.0)
  with pytest.raises(ValueError, match="unknown fields"):
    lora_lib.from_dict({"rank": 2, "r": 4})
  assert lora_lib.LoraConfig(rank=2, targets="q, v").targets == ("q", "v")
  assert lora_lib.LoraConfig(rank=8, alpha=16).scale == 2.0


def test_fresh_adapter_is_the_identity_and_a_trained_one_merges_exactly():
  """B = 0 changes nothing; with B != 0 the unmerged training forward equals the engine's
  merged inference path, and equals the base with W + (alpha/r) A B written into it."""
  cfg = tiny_model_config()
  toks, pos, seg = _inputs()
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  base_h = model(toks, pos, seg)
  lora_lib.add_adapters(model, LORA)
  np.testing.assert_array_equal(model(toks, pos, seg), base_h)
  _randomize_b(model)
  h = model(toks, pos, seg)
  assert float(jnp.abs(h - base_h).max()) > 1e-2
  cached, _ = model.forward_cached(toks, pos, model.init_cache(2, 16), jnp.zeros((2,), jnp.int32))
  np.testing.assert_allclose(cached, h, atol=2e-5, rtol=0)
  # The same update written into a plain model's weights by hand.
  plain = Transformer(cfg, rngs=nnx.Rngs(0))
  ad = model.lora.arrays()
  for t, name in lora_lib.TARGET_WEIGHTS.items():
    w = getattr(plain.layers, name)
    d = np.einsum("lir,lro->lio", ad[f"lora_{t}_a"], ad[f"lora_{t}_b"]) * (8.0 / 4)
    w[...] = w[...] + d.reshape(w[...].shape)
  np.testing.assert_allclose(plain(toks, pos, seg), h, atol=2e-5, rtol=0)


def test_some_targets_only_leave_the_others_alone():
  cfg = tiny_model_config()
  model = lora_lib.add_adapters(Transformer(cfg, rngs=nnx.Rngs(0)),
                                {"rank": 2, "targets": ("v", "down")})
  assert set(model.lora.arrays()) == {"lora_v_a", "lora_v_b", "lora_down_a", "lora_down_b"}
  assert model.lora.arrays()["lora_down_a"].shape == (cfg.n_layers, cfg.mlp_dim, 2)


def _batch(cfg: LearnerConfig):
  trees = synthetic_trees(num_groups=1, group_size=3, vocab=VOCAB, seed=0, max_len=30,
                          mean_len=10, max_depth=2, max_children=2)
  # The pinned figures below were computed with the paper's credit assignment (the default
  # before the baseline moved to the roots' success): the batch keeps it.
  learner_adv = Learner.advantages(trees, dataclasses.replace(cfg, baseline="loo",
                                                              drop_equal_groups=False))
  return pack_trees(trees, learner_adv, cfg.row_len, cfg.bucket_rows, loss=cfg.loss)


# Two full fine-tuning steps of this file's tiny learner, computed by the code before LoRA
# existed (commit e76dfe5): the losses, the summed |update| and a fixed random projection of the
# update (leaves in path order, projection i drawn from default_rng(i)). The same figures came
# out bit for bit on this code; the tolerances leave room for another CPU's float rounding.
BEFORE_LORA = {"losses": (0.26482221484184265, 0.11528600752353668),
               "abs_update": 324.18779551540774, "signed_update": -2.028417168885838}


def _update_figures(before, after):
  paths = sorted(before)
  return (sum(float(np.abs(after[k] - before[k]).sum()) for k in paths),
          sum(float(((after[k] - before[k]) * np.random.default_rng(i).standard_normal(
              before[k].shape)).sum()) for i, k in enumerate(paths)))


def _flat(params):
  return {jax.tree_util.keystr(p): np.asarray(x, np.float64)
          for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_rank_zero_is_full_fine_tuning_as_before():
  """model.lora.rank = 0 is full fine-tuning as it was before adapters existed: the learner
  trains every parameter, with the losses and updates the pre-LoRA code computed (pinned
  above), and builds the same learner as a config without the field."""
  cfg = lcfg()
  plain_cfg = tiny_model_config()
  zero_cfg = dataclasses.replace(plain_cfg, lora=lora_lib.LoraConfig(rank=0))
  learner = Learner(cfg, zero_cfg)
  assert learner.frozen is None and not learner.lora
  assert jax.tree.structure(learner.params) == jax.tree.structure(
      Learner(cfg, plain_cfg).params)
  batch = _batch(cfg)
  before = _flat(learner.params)
  losses = [float(learner.step(batch)["loss"]) for _ in range(2)]
  np.testing.assert_allclose(losses, BEFORE_LORA["losses"], rtol=1e-4)
  abs_update, signed_update = _update_figures(before, _flat(learner.params))
  np.testing.assert_allclose(abs_update, BEFORE_LORA["abs_update"], rtol=1e-3)
  np.testing.assert_allclose(signed_update, BEFORE_LORA["signed_update"], atol=0.05)


def test_lora_learner_trains_the_adapter_alone():
  cfg = lcfg()
  mcfg = dataclasses.replace(tiny_model_config(), lora=lora_lib.from_dict(LORA))
  learner = Learner(cfg, mcfg)
  names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      learner.params)[0]}
  assert names and all("lora" in n for n in names)
  # AdamW's moments exist for the adapter's leaves only.
  n_adapter = sum(x.size for x in jax.tree.leaves(learner.params))
  n_opt = sum(x.size for x in jax.tree.leaves(learner.state.opt_state) if x.ndim > 0)
  assert n_opt == 2 * n_adapter
  base_before = [np.asarray(x) for x in jax.tree.leaves(learner.frozen)]
  adapter_before = [np.asarray(x) for x in jax.tree.leaves(learner.params)]
  batch = _batch(cfg)
  m1 = learner.step(batch)
  m2 = learner.step(batch)
  for x, y in zip(base_before, jax.tree.leaves(learner.frozen)):
    np.testing.assert_array_equal(x, y)
  moved = [float(np.abs(np.asarray(y) - x).max())
           for x, y in zip(adapter_before, jax.tree.leaves(learner.params))]
  assert max(moved) > 0
  # The first step moves B only (A's gradient is 0 while B = 0); the second moves A too.
  assert m2["loss"] != m1["loss"]
  # The learner's model is base + adapter: the merged engine weights see the update.
  model = learner.model
  toks, pos, seg = _inputs()
  h = model(toks, pos, seg)
  cached, _ = model.forward_cached(toks, pos, model.init_cache(2, 16), jnp.zeros((2,), jnp.int32))
  np.testing.assert_allclose(cached, h, atol=5e-5, rtol=0)


def test_lora_dropout_changes_the_training_loss_only():
  cfg = lcfg()
  drop = dataclasses.replace(tiny_model_config(), lora=lora_lib.from_dict(
      dict(LORA, dropout=0.5)))
  model = lora_lib.add_adapters(Transformer(tiny_model_config(), rngs=nnx.Rngs(0)),
                                dict(LORA, dropout=0.5))
  _randomize_b(model)
  toks, pos, seg = _inputs()
  h_eval = model(toks, pos, seg)
  h_a = model(toks, pos, seg, lora_key=jax.random.key(0))
  h_b = model(toks, pos, seg, lora_key=jax.random.key(1))
  assert float(jnp.abs(h_a - h_eval).max()) > 1e-3
  assert float(jnp.abs(h_a - h_b).max()) > 1e-3
  learner = Learner(cfg, drop)
  assert np.isfinite(learner.step(_batch(cfg))["loss"])


def test_lora_checkpoint_holds_the_adapter_and_refuses_another_base(tmp_path):
  cfg = lcfg(ckpt_dir=str(tmp_path / "ckpt"), ckpt_async=False)
  # Wide enough that the base (~2 MB) dwarfs Orbax's fixed metadata (~90 KB): on the tiniest
  # model the two are the same size and the comparison says nothing.
  wide = tiny_model_config(d_model=128, head_dim=32, mlp_dim=512)
  mcfg = dataclasses.replace(wide, lora=lora_lib.from_dict(LORA))
  learner = Learner(cfg, mcfg)
  learner.step(_batch(cfg))
  learner.save()
  learner.wait_for_checkpoints()
  saved = [np.asarray(x) for x in jax.tree.leaves(learner.params)]
  # The checkpoint stores the adapter and its optimizer: a few KB, not the base model.
  files = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
  size = sum(p.stat().st_size for p in files)
  base_bytes = sum(x.nbytes for x in jax.tree.leaves(learner.frozen))
  assert size < base_bytes / 4, (size, base_bytes)
  resumed = Learner(cfg, mcfg)
  resumed.restore()
  for x, y in zip(saved, jax.tree.leaves(resumed.params)):
    np.testing.assert_array_equal(x, y)
  assert resumed.step_count == 1
  # Another base (other random weights) is refused by name.
  other = Transformer(mcfg, rngs=nnx.Rngs(7))
  stranger = Learner(cfg, mcfg, params=other)
  with pytest.raises(ValueError, match="another base model"):
    stranger.restore()
  for l in (learner, resumed, stranger):
    l.close()


def test_memory_plan_counts_moments_and_gradients_of_the_adapter_only():
  from rao_jax.learner import memory
  cfg = tiny_model_config()
  lcfg_ = dataclasses.replace(cfg, lora=lora_lib.LoraConfig(rank=4))
  full, lora = memory.estimate(cfg, 64, 2, "none"), memory.estimate(lcfg_, 64, 2, "none")
  n_adapter = memory.n_adapter_params(lcfg_)
  model = lora_lib.add_adapters(Transformer(cfg, rngs=nnx.Rngs(0)), {"rank": 4})
  assert n_adapter == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
  assert lora["optimizer"] == 2 * n_adapter * 4 < full["optimizer"]
  assert lora["gradients"] < full["gradients"]
  assert lora["params"] > full["params"]   # the base plus the adapter


def test_lora_on_a_sharded_mesh_matches_one_device():
  """The adapter is replicated (small) while the frozen base shards over fsdp and tensor:
  the same update as on one device."""
  from rao_jax.model import sharding
  cfg = lcfg()
  mcfg = dataclasses.replace(tiny_model_config(), lora=lora_lib.from_dict(LORA))
  one = Learner(cfg, mcfg)
  mesh = Learner(cfg, mcfg, mesh=sharding.make_mesh(2, 2, 2))
  batch = _batch(cfg)
  m1, m8 = one.step(batch), mesh.step(batch)
  np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)
  for x, y in zip(jax.tree.leaves(one.params), jax.tree.leaves(mesh.params)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-6)
