"""LoRA adapters on the decoder's projections: W_eff = W + (alpha / r) A B.

For each target projection t (q, k, v, o, gate, up, down) the adapter holds, stacked over the
L layers like the base weights,

    A_t: [L, in_t, r]   (initialised uniform in +-1/sqrt(in_t), as PEFT's kaiming init)
    B_t: [L, r, out_t]  (initialised to zero, so a fresh adapter leaves the model unchanged)

and a projection y = x W becomes y = x W + (alpha / r) (dropout(x) A) B (Hu et al., 2021).
``in``/``out`` are the projection's flattened input and output widths: q is D -> H h, k and v
D -> K h, o H h -> D, gate and up D -> F, down F -> D.

The training forward applies the adapter beside the frozen weight (two thin products; the base
weight gets no gradient, so the backward computes no [in, out] weight gradient). Inference
(``Transformer.inference_params``, the rollout engine) merges it into its own copy of the
weights once per sync, so a decode step costs what it costs without an adapter.

The parameters are ``nnx.LoRAParam`` (a subclass of ``nnx.Param``): the learner splits the model
with that filter into the trained adapter and the frozen base. Flax's ``nnx.LoRA`` module wraps
one 2-D ``Linear``; the model here keeps each projection as one [L, ...] array run under
``lax.scan`` and fuses q, k and v, so the adapter is stacked the same way (see BUILD.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Adapter target -> the stacked base weight it adapts (rao_jax.model.transformer).
TARGET_WEIGHTS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up",
                  "down": "w_down"}
TARGETS = tuple(TARGET_WEIGHTS)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """The adapter's shape (``config.model.lora``).

  Attributes:
    rank: r, the adapter's inner width; 0 turns LoRA off (full fine-tuning, the default).
    alpha: the scale numerator: the update is (alpha / rank) A B.
    targets: which projections carry an adapter, any of q, k, v, o, gate, up, down.
    dropout: dropout probability on the adapter's input while training (0: none). Inference
      never drops.
  """
  rank: int = 0
  alpha: float = 32.0
  targets: tuple[str, ...] = TARGETS
  dropout: float = 0.0

  def __post_init__(self):
    if isinstance(self.targets, str):
      object.__setattr__(self, "targets", tuple(
          t.strip() for t in self.targets.split(",") if t.strip()))
    object.__setattr__(self, "targets", tuple(self.targets))
    if not isinstance(self.rank, (int, np.integer)) or isinstance(self.rank, bool) \
        or self.rank < 0:
      raise ValueError(f"model.lora.rank={self.rank!r} must be an int >= 0 (0 turns LoRA off).")
    if not self.alpha > 0:
      raise ValueError(f"model.lora.alpha={self.alpha!r} must be > 0 (the update is "
                       "alpha / rank * A B).")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"model.lora.dropout={self.dropout!r} must be in [0, 1).")
    bad = [t for t in self.targets if t not in TARGET_WEIGHTS]
    if bad or (self.rank > 0 and not self.targets) or len(set(self.targets)) != len(self.targets):
      raise ValueError(f"model.lora.targets={self.targets!r}: name each of "
                       f"{', '.join(TARGETS)} at most once (at least one when rank > 0).")

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return float(self.alpha) / self.rank


def from_dict(d: Mapping[str, Any] | None) -> LoraConfig:
  """A LoraConfig from a config section (``config.model.lora``) or a saved model config."""
  if d is None:
    return LoraConfig()
  if isinstance(d, LoraConfig):
    return d
  d = dict(d)
  unknown = sorted(set(d) - {f.name for f in dataclasses.fields(LoraConfig)})
  if unknown:
    raise ValueError(f"model.lora has unknown fields {unknown}; use rank, alpha, targets, "
                     "dropout.")
  if "targets" in d and not isinstance(d["targets"], str):
    d["targets"] = tuple(d["targets"])
  if "rank" in d:
    d["rank"] = int(d["rank"])
  return LoraConfig(**d)


def io_dims(cfg, target: str) -> tuple[int, int]:
  """(in, out) widths of the projection ``target`` in a model of ModelConfig ``cfg``."""
  D, F, H, K, h = cfg.d_model, cfg.mlp_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  return {"q": (D, H * h), "k": (D, K * h), "v": (D, K * h), "o": (H * h, D), "gate": (D, F),
          "up": (D, F), "down": (F, D)}[target]


class LoraAdapters(nnx.Module):
  """The adapter of every target projection, stacked over layers: ``{t}_a``, ``{t}_b``."""

  def __init__(self, cfg, seed: int = 0):
    lcfg = cfg.lora
    if not lcfg.enabled:
      raise ValueError("LoraAdapters: model.lora.rank is 0 (LoRA off); nothing to build.")
    rng = np.random.default_rng(seed)
    L, r = cfg.n_layers, lcfg.rank
    for t in lcfg.targets:
      n_in, n_out = io_dims(cfg, t)
      bound = n_in ** -0.5
      a = rng.uniform(-bound, bound, (L, n_in, r)).astype(np.float32)
      setattr(self, f"{t}_a", nnx.LoRAParam(jnp.asarray(a, cfg.jnp_param_dtype),
                                            out_sharding=("layers", None, None),
                                            eager_sharding=False))
      setattr(self, f"{t}_b", nnx.LoRAParam(jnp.zeros((L, r, n_out), cfg.jnp_param_dtype),
                                            out_sharding=("layers", None, None),
                                            eager_sharding=False))

  def arrays(self) -> dict[str, jax.Array]:
    """{"lora_{t}_a": [L, in, r], "lora_{t}_b": [L, r, out]} for the layers' scan."""
    return {f"lora_{k}": v[...] for k, v in _attrs(self).items()}


def _attrs(module: LoraAdapters) -> dict[str, Any]:
  return {k: v for k, v in vars(module).items() if isinstance(v, nnx.LoRAParam)}


def add_adapters(model, lora: LoraConfig | Mapping[str, Any] | None, seed: int = 0):
  """Gives ``model`` (a Transformer) fresh adapters of config ``lora``; returns the model.

  A fresh adapter leaves the model's outputs unchanged (B = 0). With rank 0 the model is
  returned as it is.
  """
  lora = from_dict(lora)
  if not lora.enabled:
    return model
  if getattr(model, "lora", None) is not None:
    raise ValueError("add_adapters: the model already has adapters; build it anew to change "
                     "model.lora.")
  model.cfg = dataclasses.replace(model.cfg, lora=lora)
  model.lora = LoraAdapters(model.cfg, seed)
  return model


def trainable(cfg) -> type:
  """The nnx filter of the parameters a learner trains: the adapter with LoRA, else all."""
  return nnx.LoRAParam if cfg.lora.enabled else nnx.Param


def project(x_NxI, p: Mapping[str, jax.Array], target: str, scale: float, dtype, keep=None):
  """The adapter's share of projection ``target`` for inputs [N, in]: scale (x A) B, [N, out].

  ``keep``: a [N, in] dropout mask already scaled by 1 / (1 - rate), or None.
  """
  a, b = p[f"lora_{target}_a"].astype(dtype), p[f"lora_{target}_b"].astype(dtype)
  if keep is not None:
    x_NxI = x_NxI * keep
  return (x_NxI @ a) @ (b * jnp.asarray(scale, dtype))


def delta(a_LxIxR, b_LxRxO, scale: float) -> jax.Array:
  """The merged update scale * A B, [L, in, out], in float32."""
  return jnp.einsum("lir,lro->lio", a_LxIxR.astype(jnp.float32),
                    b_LxRxO.astype(jnp.float32)) * scale


def merged_layer_arrays(cfg, stacked: dict[str, jax.Array], adapter: dict[str, jax.Array]
                        ) -> dict[str, jax.Array]:
  """The stacked base weights with each target's adapter merged in (same shapes, dtypes)."""
  out = dict(stacked)
  for t in cfg.lora.targets:
    name = TARGET_WEIGHTS[t]
    w = stacked[name]
    d = delta(adapter[f"lora_{t}_a"], adapter[f"lora_{t}_b"], cfg.lora.scale)
    out[name] = (w.astype(jnp.float32) + d.reshape(w.shape)).astype(w.dtype)
  return out


def fingerprint(params) -> str:
  """A short digest of a parameter tree (names, shapes, dtypes and a sample of values): the
  reference an adapter checkpoint keeps to its base model."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    # A sample of ~4096 values per array, taken on its device: no host copy of the model.
    step = max(int(np.prod(leaf.shape)) // 4096, 1)
    sample = np.asarray(jax.device_get(jnp.ravel(leaf)[::step]), np.float32)
    h.update(jax.tree_util.keystr(path).encode())
    h.update(str((tuple(leaf.shape), jnp.dtype(leaf.dtype))).encode())
    h.update(np.ascontiguousarray(sample).tobytes())
  return h.hexdigest()[:16]
