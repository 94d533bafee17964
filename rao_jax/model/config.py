"""ModelConfig: the validated, frozen description of a Llama-family decoder.

Built from a Hugging Face ``config.json`` (LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM), from GGUF metadata, or derived (``tiny()``) for fast tests.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from rao_jax.model.lora import LoraConfig
from rao_jax.model.lora import from_dict as lora_from_dict

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_DTYPES = ("float32", "bfloat16", "float16")
_REMAT = ("none", "full", "dots")
KERNELS = ("auto", "mkl", "xla")   # rao_jax.kernels.mkl.MODES (kept here: config stays light)


class UnsupportedModelError(ValueError):
  """A checkpoint or config describes a model this package cannot run."""


def _default_dtype() -> str:
  # float32 on CPU (exact parity, fast matmuls there); bfloat16 on GPU/TPU.
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling, as in HF ``rope_scaling`` / ``rope_parameters``.

  Attributes:
    rope_type: "linear" (positions divided by ``factor``) or "llama3" (Llama 3.1 smooth
      frequency-dependent scaling).
    factor: the scaling factor (> 0).
    low_freq_factor: llama3 only.
    high_freq_factor: llama3 only.
    original_max_position_embeddings: llama3 only: the pre-scaling context length.
  """
  rope_type: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in ("linear", "llama3"):
      raise UnsupportedModelError(
          f"RopeScaling.rope_type={self.rope_type!r} is not supported; supported: 'linear', "
          "'llama3' (or no scaling).")
    if not self.factor > 0:
      raise ValueError(f"RopeScaling.factor={self.factor!r} must be > 0.")
    if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(
          f"RopeScaling: high_freq_factor={self.high_freq_factor} must exceed "
          f"low_freq_factor={self.low_freq_factor}.")

  def to_hf(self) -> dict:
    if self.rope_type == "linear":
      return {"rope_type": "linear", "factor": self.factor}
    return {"rope_type": "llama3", "factor": self.factor,
            "low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder (Llama, Qwen2, Qwen3).

  Attributes:
    vocab_size: V, rows of the embedding table.
    d_model: D, the residual width (HF ``hidden_size``).
    n_layers: L, decoder blocks.
    n_heads: H, query heads.
    n_kv_heads: K, key/value heads; H must be a multiple of K (grouped-query attention).
    head_dim: h, per-head width (HF ``head_dim``, default D / H).
    mlp_dim: F, SwiGLU hidden width (HF ``intermediate_size``).
    rms_eps: epsilon of every RMSNorm.
    rope_theta: RoPE base frequency.
    rope_scaling: optional RopeScaling.
    rope_freq_factors: optional per-frequency divisors (h / 2 of them) as stored by llama.cpp
      in a GGUF ``rope_freqs.weight`` tensor; overrides ``rope_scaling``.
    tie_embeddings: the LM head reuses the embedding table.
    qk_norm: RMSNorm over head_dim on queries and keys before RoPE (Qwen3).
    qkv_bias: biases on the q/k/v projections (Qwen2; Llama with ``attention_bias``).
    o_bias: bias on the output projection (Llama with ``attention_bias``).
    max_seq_len: the context length the model was trained for (HF ``max_position_embeddings``).
    architecture: the HF class name written to an exported ``config.json``.
    param_dtype: dtype of parameters ("float32" | "bfloat16" | "float16"; "auto" resolves to
      float32 on CPU and bfloat16 on accelerators).
    dtype: dtype of activations (same choices). Logits, log-softmax and losses are float32.
    remat: "none" (store activations; fastest on CPU), "full" (recompute each block in the
      backward pass) or "dots" (save only matmul outputs).
    scan_layers: run the L blocks with ``lax.scan`` (one compiled block; fast compiles) rather
      than unrolled.
    logits_chunk: tokens per chunk in ``token_logprobs`` (bounds the [chunk, V] float32 buffer).
    attention_block: queries per block in the full forward's causal attention: the queries of
      block [a, a + n) only meet keys [0, a + n), so the masked upper triangle is mostly never
      computed (at 4 x 512 on CPU, n=128 made attention forward+backward 1.7x faster). XLA's
      attention only: the MKL kernel (rao_jax.kernels.mkl_attention) blocks by 64 queries on its
      own.
    kernels: the CPU kernels of float32 products and training attention: "auto" (MKL on Intel
      CPUs where it builds, else XLA's ops), "mkl" (MKL on any x86 CPU; an error if it cannot be
      built) or "xla" (XLA's own). Static like every field here: jit caches keep one trace per
      value. GPU and TPU lowerings take their own kernels whatever it says (rao_jax.kernels).
    bos_token_id, eos_token_id, pad_token_id: ids written to an exported ``config.json``.
    lora: the LoRA adapters' shape (``rao_jax.model.lora.LoraConfig``; rank 0 = none).
  """
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  rms_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rope_freq_factors: tuple[float, ...] | None = None
  tie_embeddings: bool = True
  qk_norm: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  max_seq_len: int = 8192
  architecture: str = "LlamaForCausalLM"
  param_dtype: str = "auto"
  dtype: str = "auto"
  remat: str = "none"
  scan_layers: bool = True
  logits_chunk: int = 1024
  attention_block: int = 128
  kernels: str = "auto"
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  pad_token_id: int | None = None
  lora: LoraConfig = LoraConfig()

  def __post_init__(self):
    # A saved config (JSON) holds the adapter section as a dict.
    object.__setattr__(self, "lora", lora_from_dict(self.lora))
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "mlp_dim", "max_seq_len", "logits_chunk", "attention_block"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer.")
      object.__setattr__(self, name, int(value))
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads="
          f"{self.n_kv_heads} (grouped-query attention); fix the head counts.")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE.")
    if not self.rms_eps > 0:
      raise ValueError(f"ModelConfig.rms_eps={self.rms_eps!r} must be > 0.")
    if not self.rope_theta > 0:
      raise ValueError(f"ModelConfig.rope_theta={self.rope_theta!r} must be > 0.")
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise UnsupportedModelError(
          f"ModelConfig.architecture={self.architecture!r} is not supported; supported: "
          f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
    if self.rope_freq_factors is not None:
      factors = tuple(float(f) for f in self.rope_freq_factors)
      if len(factors) != self.head_dim // 2:
        raise ValueError(
            f"ModelConfig.rope_freq_factors has {len(factors)} entries; it needs head_dim / 2 = "
            f"{self.head_dim // 2}.")
      object.__setattr__(self, "rope_freq_factors", factors)
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    for name in ("param_dtype", "dtype"):
      value = getattr(self, name)
      if value == "auto":
        object.__setattr__(self, name, _default_dtype())
      elif value not in _DTYPES:
        raise ValueError(
            f"ModelConfig.{name}={value!r} is not a dtype this model runs in; use one of "
            f"{', '.join(_DTYPES)} or 'auto'.")
    if self.remat not in _REMAT:
      raise ValueError(f"ModelConfig.remat={self.remat!r}; use one of {', '.join(_REMAT)}.")
    if self.kernels not in KERNELS:
      raise ValueError(
          f"ModelConfig.kernels={self.kernels!r} is not a kernel choice; use 'auto' (MKL on "
          "Intel CPUs where it builds, else XLA), 'mkl' (MKL on any x86 CPU) or 'xla'.")

  # ---- derived --------------------------------------------------------------------------------
  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def n_params(self) -> int:
    """Number of parameters (embedding counted once when tied)."""
    D, F, H, K, h, L = (self.d_model, self.mlp_dim, self.n_heads, self.n_kv_heads,
                        self.head_dim, self.n_layers)
    per_layer = 2 * D + D * H * h + 2 * D * K * h + H * h * D + 3 * D * F
    per_layer += (H * h + 2 * K * h) * self.qkv_bias + D * self.o_bias + 2 * h * self.qk_norm
    head = 0 if self.tie_embeddings else self.vocab_size * D
    return self.vocab_size * D + L * per_layer + D + head

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def tiny(self, n_layers: int = 2, d_model: int = 64, head_dim: int = 16,
           mlp_dim: int = 128) -> "ModelConfig":
    """A small random-weights config with this one's architecture flags and vocabulary.

    Keeps V (so the real tokenizer works), the tied/untied head, QK-norm, biases, RoPE theta and
    scaling, and the query/key-value head ratio; shrinks L, D, h and F.
    """
    group = self.n_heads // self.n_kv_heads
    n_kv = 2 if group <= 2 else 1
    freq = None
    if self.rope_freq_factors is not None:
      # Subsample the divisors so the tiny model keeps the same kind of frequency scaling.
      idx = np.linspace(0, len(self.rope_freq_factors) - 1, head_dim // 2).round().astype(int)
      freq = tuple(self.rope_freq_factors[i] for i in idx)
    return self.replace(n_layers=n_layers, d_model=d_model, n_heads=n_kv * group,
                        n_kv_heads=n_kv, head_dim=head_dim, mlp_dim=mlp_dim,
                        rope_freq_factors=freq)

  # ---- Hugging Face config.json ---------------------------------------------------------------
  @classmethod
  def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike, **overrides
                     ) -> "ModelConfig":
    """Builds a config from an HF ``config.json`` (a dict, the file, or its folder).

    Args:
      config: the parsed dict, or a path to ``config.json`` or to the folder holding it.
      **overrides: ModelConfig fields to set (e.g. ``dtype="bfloat16"``).

    Raises:
      UnsupportedModelError: the architecture or one of its options is not supported.
    """
    source = "config dict"
    if not isinstance(config, Mapping):
      path = os.fspath(config)
      if os.path.isdir(path):
        path = os.path.join(path, "config.json")
      source = path
      try:
        with open(path) as f:
          config = json.load(f)
      except FileNotFoundError as e:
        raise FileNotFoundError(f"No HF config at {path}: expected a config.json there.") from e
      except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    c = dict(config)
    if "text_config" in c and "hidden_size" not in c:
      c = {**c, **c["text_config"]}
    archs = c.get("architectures") or []
    arch = archs[0] if archs else {
        "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"
    }.get(c.get("model_type"), f"model_type={c.get('model_type')!r}")
    if arch not in SUPPORTED_ARCHITECTURES:
      raise UnsupportedModelError(
          f"{source}: architecture {arch!r} is not supported; supported: "
          f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
    try:
      D, H = int(c["hidden_size"]), int(c["num_attention_heads"])
      fields = dict(
          vocab_size=int(c["vocab_size"]), d_model=D, n_layers=int(c["num_hidden_layers"]),
          n_heads=H, n_kv_heads=int(c.get("num_key_value_heads") or H),
          head_dim=int(c.get("head_dim") or D // H), mlp_dim=int(c["intermediate_size"]))
    except KeyError as e:
      raise ValueError(f"{source}: missing required field {e.args[0]!r}.") from None
    if c.get("mlp_bias"):
      raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported.")
    if c.get("use_sliding_window") and arch != "LlamaForCausalLM":
      raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported.")
    if c.get("hidden_act", "silu") != "silu":
      raise UnsupportedModelError(
          f"{source}: hidden_act={c.get('hidden_act')!r} is not supported (only silu).")
    rope = dict(c.get("rope_parameters") or {})
    rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    scaling = c.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    rope_scaling = None
    if rope_type not in ("default", None):
      if rope_type not in ("linear", "llama3"):
        raise UnsupportedModelError(
            f"{source}: rope scaling type {rope_type!r} is not supported; supported: default, "
            "linear, llama3.")
      kw = {"rope_type": rope_type, "factor": float(scaling["factor"])}
      if rope_type == "llama3":
        kw.update(low_freq_factor=float(scaling["low_freq_factor"]),
                  high_freq_factor=float(scaling["high_freq_factor"]),
                  original_max_position_embeddings=int(
                      scaling["original_max_position_embeddings"]))
      rope_scaling = RopeScaling(**kw)
    if arch == "Qwen2ForCausalLM":
      qkv_bias, o_bias = True, False
    else:
      qkv_bias = o_bias = bool(c.get("attention_bias", False))
    eos = c.get("eos_token_id")
    if isinstance(eos, (list, tuple)):
      eos = eos[0] if eos else None
    fields.update(
        rms_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        rope_scaling=rope_scaling, tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qk_norm=arch == "Qwen3ForCausalLM", qkv_bias=qkv_bias, o_bias=o_bias,
        max_seq_len=int(c.get("max_position_embeddings", 8192)), architecture=arch,
        bos_token_id=c.get("bos_token_id"), eos_token_id=eos, pad_token_id=c.get("pad_token_id"))
    fields.update(overrides)
    return cls(**fields)

  def to_hf_config(self) -> dict:
    """The HF ``config.json`` dict for this model (transformers and SGLang load it)."""
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3"}[self.architecture]
    if self.rope_freq_factors is not None:
      raise UnsupportedModelError(
          "This model's RoPE uses llama.cpp per-frequency factors (rope_freqs), which an HF "
          "config.json cannot express; export is not possible.")
    c = {
        "architectures": [self.architecture], "model_type": model_type,
        "vocab_size": self.vocab_size, "hidden_size": self.d_model,
        "intermediate_size": self.mlp_dim, "num_hidden_layers": self.n_layers,
        "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
        "head_dim": self.head_dim, "hidden_act": "silu",
        "max_position_embeddings": self.max_seq_len, "rms_norm_eps": self.rms_eps,
        "rope_theta": self.rope_theta,
        "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling else None,
        "tie_word_embeddings": self.tie_embeddings, "torch_dtype": self.param_dtype,
        "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        "pad_token_id": self.pad_token_id, "use_cache": True, "initializer_range": 0.02,
    }
    if self.architecture == "Qwen2ForCausalLM":
      if self.o_bias or not self.qkv_bias:
        raise UnsupportedModelError("Qwen2ForCausalLM needs qkv_bias=True and o_bias=False.")
      c.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.n_layers)
    else:
      if self.qkv_bias != self.o_bias:
        raise UnsupportedModelError(
            f"{self.architecture} has one attention_bias flag for q/k/v/o; this config has "
            f"qkv_bias={self.qkv_bias}, o_bias={self.o_bias}.")
      c.update(attention_bias=self.qkv_bias, mlp_bias=False)
    if self.architecture == "Qwen3ForCausalLM":
      c.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.n_layers)
    return c

  # ---- GGUF ------------------------------------------------------------------------------------
  @classmethod
  def from_gguf(cls, path: str | os.PathLike, **overrides) -> "ModelConfig":
    """Builds a config from a GGUF file's metadata (llama, qwen2 and qwen3 files)."""
    from rao_jax.model import gguf_file  # local: keeps config import light
    return gguf_file.config_from_gguf(os.fspath(path), **overrides)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """The h/2 RoPE inverse frequencies (float64 numpy), with the config's scaling applied."""
  h = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
  if cfg.rope_freq_factors is not None:
    return inv / np.asarray(cfg.rope_freq_factors, np.float64)
  s = cfg.rope_scaling
  if s is None:
    return inv
  if s.rope_type == "linear":
    return inv / s.factor
  # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
  smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor))
  blended = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, blended, scaled)
