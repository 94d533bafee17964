"""PEFT adapter files (rao_jax.model.peft) against the real `peft` package and transformers.

A tiny random model is written as an HF folder (export_hf) so transformers and rao_jax hold the
same base weights; an adapter saved by rao_jax must give PEFT's PeftModel our logits, and one
saved by PEFT must give ours PEFT's. The adapters use alpha != r, non-square projections (q is
D -> H h with H h != D) and a nonzero B, so a wrong scale or a missing transpose changes the
logits by far more than the tolerance (each test checks the adapter's own effect is large).
"""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from rao_jax.model import ModelConfig, Transformer, export_hf
from rao_jax.model import lora as lora_lib
from rao_jax.model import peft as peft_lib
from rao_jax.model.weights import load_model

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# float32 logits, ours vs torch: their sums over the model width round differently (up to
# 1.5e-4 on an AMD EPYC with torch 2.13), 100x below MIN_EFFECT, the least an adapter applied
# wrongly would move them.
ATOL = 2e-4
MIN_EFFECT = 2e-2    # the adapter must move the logits this much for the comparison to mean much
# Three architectures: GQA with a tied head (Llama), q/k/v biases and an untied head (Qwen2),
# QK-norm after the adapted q/k projections (Qwen3).
ARCHS = {
    "llama": dict(architecture="LlamaForCausalLM"),
    "qwen2": dict(architecture="Qwen2ForCausalLM", qkv_bias=True, tie_embeddings=False),
    "qwen3": dict(architecture="Qwen3ForCausalLM", qk_norm=True, tie_embeddings=False),
}
TARGETS = {"llama": lora_lib.TARGETS, "qwen2": ("q", "v", "o", "down"),
           "qwen3": ("q", "k", "gate", "down")}


def _config(arch: str, **kw) -> ModelConfig:
  base = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24,
              mlp_dim=96, rope_theta=10000.0, dtype="float32", param_dtype="float32",
              bos_token_id=1, eos_token_id=2)
  return ModelConfig(**{**base, **ARCHS[arch], **kw})


@pytest.fixture(scope="module", params=sorted(ARCHS))
def base(request, tmp_path_factory):
  """(arch, HF folder of a tiny random base model); the weights are scaled up from the init so
  the logits are O(1) and biases are nonzero (the init's are zero)."""
  arch = request.param
  cfg = _config(arch)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  model.embed.set_value(model.embed[...] * 25.0)
  if not cfg.tie_embeddings:
    model.lm_head.set_value(model.lm_head[...] * 8.0)
  for name in ("bq", "bk", "bv"):
    if hasattr(model.layers, name):
      var = getattr(model.layers, name)
      var.set_value(jnp.asarray(rng.normal(0, 0.3, var.shape), jnp.float32))
  folder = str(tmp_path_factory.mktemp(f"base_{arch}"))
  export_hf(model, cfg, None, folder)
  return arch, folder


def _ours(folder):
  return load_model(folder, dtype="float32")


def _hf(folder):
  m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  return m.eval()


def _prompts(seed=7, B=3, T=11, V=512):
  return np.random.default_rng(seed).integers(3, V, (B, T))


def _our_logits(model, ids):
  B, T = ids.shape
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  fwd = nnx.jit(lambda m, t, p: m.logits(m(t, p, jnp.ones((B, T), jnp.int32))))
  return np.asarray(fwd(model, jnp.asarray(ids), pos))


def _torch_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.float().numpy()


def _randomize(model, seed=1, b_std=0.5):
  """Nonzero B (a fresh adapter's is zero) and A redrawn, both from ``seed``."""
  rng = np.random.default_rng(seed)
  for name, var in lora_lib._attrs(model.lora).items():  # pylint: disable=protected-access
    std = b_std if name.endswith("_b") else 0.3
    var.set_value(jnp.asarray(rng.normal(0, std, var.shape), jnp.float32))


def _adapted(folder, arch, rank=4, alpha=12.0, seed=1):
  model = _ours(folder)
  lora_lib.add_adapters(model, dict(rank=rank, alpha=alpha, targets=TARGETS[arch]))
  _randomize(model, seed)
  return model


def test_our_adapter_gives_peft_our_logits(base, tmp_path):
  arch, folder = base
  model = _adapted(folder, arch)
  out = peft_lib.save_adapter(model, str(tmp_path / "adapter"), base_model=folder)
  ids = _prompts()
  ours = _our_logits(model, ids)
  policy = peft.PeftModel.from_pretrained(_hf(folder), out)
  ref = _torch_logits(policy, ids)
  plain = _torch_logits(_hf(folder), ids)
  assert np.abs(ref - plain).max() > MIN_EFFECT, "the adapter barely changes the logits"
  np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)
  cfg = json.load(open(os.path.join(out, "adapter_config.json")))
  assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (4, 12, folder)
  assert cfg["target_modules"] == [peft_lib.HF_MODULES[t].split(".")[1] for t in TARGETS[arch]]


@pytest.mark.parametrize("base", ["llama"], indirect=True)
def test_save_then_load_adapter_round_trips(base, tmp_path):
  arch, folder = base
  model = _adapted(folder, arch, rank=3, alpha=5.0, seed=2)
  out = peft_lib.save_adapter(model, str(tmp_path / "adapter"))
  again = peft_lib.load_adapter(out, _ours(folder))
  assert again.cfg.lora == model.cfg.lora
  for k, v in model.lora.arrays().items():
    np.testing.assert_array_equal(np.asarray(again.lora.arrays()[k]), np.asarray(v))
  ids = _prompts(seed=8)
  np.testing.assert_array_equal(_our_logits(again, ids), _our_logits(model, ids))
  # Into a model that already has an adapter of the same shape: replaced in place.
  other = _adapted(folder, arch, rank=3, alpha=5.0, seed=3)
  peft_lib.load_adapter(out, other)
  np.testing.assert_array_equal(_our_logits(other, ids), _our_logits(model, ids))
  # bfloat16 storage: the tensors are bf16 and load back as the rounded values.
  bf = peft_lib.save_adapter(model, str(tmp_path / "bf16"), dtype="bfloat16")
  t = peft_lib.read_adapter_arrays(bf, model.cfg, model.cfg.lora)
  q = np.asarray(model.lora.q_a[...])
  np.testing.assert_array_equal(t["q_a"], q.astype(jnp.bfloat16).astype(np.float32))
  assert peft_lib.adapter_bytes(model) == sum(v.size * 4 for v in model.lora.arrays().values())


def test_peft_made_adapter_gives_us_peft_logits(base, tmp_path):
  _check_peft_made_adapter(*base, tmp_path, "list")


@pytest.mark.parametrize("base", ["llama"], indirect=True)
def test_peft_made_adapter_with_regex_targets(base, tmp_path):
  _check_peft_made_adapter(*base, tmp_path, "regex")


def _check_peft_made_adapter(arch, folder, tmp_path, spec):
  names = [peft_lib.HF_MODULES[t].split(".")[1] for t in TARGETS[arch]]
  targets = names if spec == "list" else r"model\.layers\.\d+\.(self_attn|mlp)\.(%s)" % (
      "|".join(names))
  torch.manual_seed(0)
  # init_lora_weights=False: PEFT draws B at random too (its default B = 0 is a no-op).
  policy = peft.get_peft_model(_hf(folder), peft.LoraConfig(
      r=4, lora_alpha=6, target_modules=targets, lora_dropout=0.1, init_lora_weights=False))
  policy.eval()
  out = str(tmp_path / "peft_adapter")
  policy.save_pretrained(out)
  ids = _prompts(seed=9)
  ref = _torch_logits(policy, ids)
  assert np.abs(ref - _torch_logits(_hf(folder), ids)).max() > MIN_EFFECT
  model = peft_lib.load_adapter(out, _ours(folder))
  np.testing.assert_allclose(_our_logits(model, ids), ref, atol=ATOL, rtol=0)
  assert model.cfg.lora == lora_lib.LoraConfig(rank=4, alpha=6.0, targets=TARGETS[arch],
                                               dropout=0.1)


# ---- refusals -----------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
  """(config, a saved llama adapter folder) with no HF folder: what the refusal tests edit."""
  cfg = _config("llama")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  lora_lib.add_adapters(model, dict(rank=2, alpha=4.0, targets=("q", "down")))
  return cfg, peft_lib.save_adapter(model, str(tmp_path / "adapter"))


def _edit_config(folder, **fields):
  path = os.path.join(folder, "adapter_config.json")
  c = json.load(open(path))
  c.update(fields)
  json.dump(c, open(path, "w"))


@pytest.mark.parametrize("fields,match", [
    (dict(use_dora=True), "use_dora=True"),
    (dict(use_rslora=True), "use_rslora=True"),
    (dict(bias="all"), "bias='all'"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(layers_to_transform=[0]), "layers_to_transform"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(peft_type="IA3"), "peft_type='IA3'"),
    (dict(target_modules=["q_proj", "c_attn"]), r"entries \['c_attn'\]"),
    (dict(target_modules=["q_proj", "lm_head"]), "selects lm_head"),
    (dict(target_modules=r"model\.layers\.0\..*q_proj"), r"in layers \[0\] only"),
    (dict(r=0), "r=0"),
])
def test_unsupported_config_fields_are_refused_by_name(saved, fields, match):
  cfg, folder = saved
  _edit_config(folder, **fields)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(peft_lib.AdapterFormatError, match=match):
    peft_lib.load_adapter(folder, model)
  assert not model.cfg.lora.enabled, "a refused adapter must leave the model unchanged"


def test_bad_tensors_are_refused(saved, tmp_path):
  cfg, folder = saved
  path = os.path.join(folder, "adapter_model.safetensors")
  tensors = load_file(path)
  key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
  assert tensors[key].shape == (64, 2)
  # An adapter of a wider model: the shape names the tensor and both shapes.
  save_file({**tensors, key: np.zeros((80, 2), np.float32)}, path)
  with pytest.raises(peft_lib.AdapterFormatError, match=r"down_proj.lora_B.weight has shape "
                     r"\(80, 2\), this model needs \(64, 2\)"):
    peft_lib.load_adapter(folder, Transformer(cfg, rngs=nnx.Rngs(0)))
  save_file({k: v for k, v in tensors.items() if k != key}, path)
  with pytest.raises(peft_lib.AdapterFormatError, match="1 tensors .* are missing"):
    peft_lib.load_adapter(folder, Transformer(cfg, rngs=nnx.Rngs(0)))
  # Fewer layers in the model than in the adapter: layer 1's tensors are unexpected.
  save_file(tensors, path)
  with pytest.raises(peft_lib.AdapterFormatError, match="unexpected tensors"):
    peft_lib.load_adapter(folder, Transformer(cfg.replace(n_layers=1), rngs=nnx.Rngs(0)))


def test_adapter_config_must_match_an_existing_adapter(saved):
  cfg, folder = saved
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  lora_lib.add_adapters(model, dict(rank=2, alpha=8.0, targets=("q", "down")))
  with pytest.raises(peft_lib.AdapterFormatError, match="lora_alpha=4.0 but the model's "
                     "adapter has 8.0"):
    peft_lib.load_adapter(folder, model)


def test_missing_files_and_no_adapter(saved, tmp_path):
  cfg, folder = saved
  with pytest.raises(FileNotFoundError, match="adapter_config.json does not exist"):
    peft_lib.load_adapter(str(tmp_path / "nowhere"), Transformer(cfg, rngs=nnx.Rngs(0)))
  os.remove(os.path.join(folder, "adapter_model.safetensors"))
  open(os.path.join(folder, "adapter_model.bin"), "wb").close()
  with pytest.raises(FileNotFoundError, match="safe_serialization=True"):
    peft_lib.load_adapter(folder, Transformer(cfg, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="the model has no LoRA adapter"):
    peft_lib.save_adapter(Transformer(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "x"))
  assert peft_lib.adapter_bytes(Transformer(cfg, rngs=nnx.Rngs(0))) == 0
