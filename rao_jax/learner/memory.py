"""The learner's memory plan: bytes of one train step per device, and the remat it can afford.

``estimate`` counts what the step holds per device for a model, a row length, micro-batch rows
and an activation-checkpointing policy (``ModelConfig.remat``). ``choose_remat`` picks the least
recomputation that fits a memory budget: "none" (every activation stored) before "dots" (the
products' outputs) before "full" (each block's input only). Recomputing costs time (about a
third more forward work for "full"), so a step that fits without it should not pay for it.
``device_budget`` is the budget of the device the learner runs on: XLA's ``bytes_limit`` on a
GPU/TPU, a share of the host's available memory on CPU. ``benchmarks/bench_memory_plan.py``
checks the estimate against XLA's own memory analysis of the compiled step.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from rao_jax.model.config import ModelConfig

log = logging.getLogger(__name__)

REMATS = ("none", "dots", "full")   # least recomputation first
HEADROOM = 0.9                     # XLA's own buffers, fragmentation, the runtime
# On CPU the learner shares the host with the embedded engine (weights and KV cache), the
# sandbox processes and the trees in flight; it plans with half of what is available.
CPU_SHARE = 0.5


def _itemsize(dtype: str) -> int:
  return int(np.dtype({"bfloat16": np.float16}.get(dtype, dtype)).itemsize)


def n_params(cfg: ModelConfig) -> tuple[int, int]:
  """(all parameters, parameters of one layer)."""
  from rao_jax.model.transformer import layer_param_shapes  # pylint: disable=g-import-not-at-top
  per_layer = sum(int(np.prod(s[1:])) for s in layer_param_shapes(cfg).values())
  head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
  return cfg.vocab_size * cfg.d_model + head + cfg.d_model + cfg.n_layers * per_layer, per_layer


def n_adapter_params(cfg: ModelConfig) -> int:
  """Parameters of the LoRA adapter (``cfg.lora``; 0 without one)."""
  if not cfg.lora.enabled:
    return 0
  from rao_jax.model.lora import io_dims  # pylint: disable=g-import-not-at-top
  return cfg.n_layers * cfg.lora.rank * sum(sum(io_dims(cfg, t)) for t in cfg.lora.targets)


def estimate(cfg: ModelConfig, T: int, rows: int, remat: str, *, shards: int = 1,
             tensor: int = 1, act_dtype: str | None = None) -> dict[str, float]:
  """Per-device bytes of one train step.

  Args:
    cfg: the model (its ``dtype`` is the activations' unless ``act_dtype`` is given; float32
      master weights and AdamW moments).
    T: tokens per row. rows: rows of one micro-batch on this device.
    remat: "none" | "dots" | "full".
    shards: devices the parameters, moments and gradients are split over (fsdp x tensor).
    tensor: devices the heads and the MLP are split over.
    act_dtype: activation dtype name ("float32" on CPU, "bfloat16" on accelerators).

  Parameters, moments and the float32 gradient accumulator are split over ``shards``; a
  micro-batch's gradient is a second such copy while it is added in. Activations: what the
  backward pass keeps per layer (remat "full": the block input; "dots": the outputs of the
  products; "none": every intermediate), one layer's working set in the backward pass, one copy
  of a layer's gathered weights, and the LM head's [chunk, V / tensor] float32 logits. The
  attention kernels keep O(T) per head. With a LoRA adapter (``cfg.lora``) moments and gradients
  exist for the adapter alone; the frozen base is stored once.
  """
  if remat not in REMATS:
    raise ValueError(f"remat={remat!r}; use one of {', '.join(REMATS)}.")
  act = act_dtype or (cfg.dtype if cfg.dtype != "auto" else "float32")
  a, f32 = _itemsize(act), 4
  P, P_layer = n_params(cfg)
  D, F, V, L = cfg.d_model, cfg.mlp_dim // tensor, cfg.vocab_size, cfg.n_layers
  qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim // tensor
  attn = cfg.n_heads * cfg.head_dim // tensor
  tok = rows * T
  saved_per_token = {
      "full": D * a,
      "dots": D * a + (qkv + attn + D + 3 * F) * a,
      "none": D * a * 4 + (2 * qkv + 2 * attn + D + 5 * F) * a + attn // cfg.head_dim * f32,
  }[remat]
  # One layer recomputed and differentiated: its intermediates and their gradients, a few
  # float32 (norms, the MLP's gate) and the residual stream's gradient.
  working_per_token = (2 * qkv + 2 * attn + 6 * F) * a + 4 * D * f32
  lse = cfg.n_heads // tensor * f32 * 2
  logits = min(cfg.logits_chunk, tok) * V // tensor * f32 * 3
  trained = n_adapter_params(cfg) or P
  out = {
      "params": (P + (trained if cfg.lora.enabled else 0)) * f32 / shards,
      "optimizer": 2 * trained * f32 / shards,
      "gradients": 2 * trained * f32 / shards,
      "weights_layer": 2 * P_layer * a / tensor,
      "activations": tok * (L * (saved_per_token + lse) + working_per_token) + logits,
  }
  out["total"] = sum(out.values())
  return out


def choose_remat(cfg: ModelConfig, T: int, rows: int, budget_bytes: float, **kw) -> str:
  """The least recomputation whose ``estimate`` fits ``HEADROOM`` of ``budget_bytes``
  ("full" when nothing does: it is the least memory there is)."""
  for remat in REMATS:
    if estimate(cfg, T, rows, remat, **kw)["total"] <= HEADROOM * budget_bytes:
      return remat
  return "full"


def _host_available() -> float:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return float(line.split()[1]) * 1024
  except OSError:
    pass
  return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def device_budget(device=None) -> float:
  """Bytes the learner may plan for on ``device`` (default: the first JAX device)."""
  import jax  # pylint: disable=g-import-not-at-top
  device = device or jax.devices()[0]
  if device.platform != "cpu":
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
      return float(stats["bytes_limit"])
  return CPU_SHARE * _host_available()


def plan_remat(cfg: ModelConfig, T: int, rows: int, *, shards: int = 1, tensor: int = 1,
               budget_bytes: float | None = None) -> str:
  """The remat the memory plan picks for this step on this device (``budget_bytes`` default:
  ``device_budget()``), logged with its figures."""
  import jax  # pylint: disable=g-import-not-at-top
  budget = device_budget() if budget_bytes is None else budget_bytes
  act = cfg.dtype if cfg.dtype != "auto" else (
      "float32" if jax.default_backend() == "cpu" else "bfloat16")
  remat = choose_remat(cfg, T, rows, budget, shards=shards, tensor=tensor, act_dtype=act)
  need = estimate(cfg, T, rows, remat, shards=shards, tensor=tensor, act_dtype=act)["total"]
  log.info("memory plan: remat=%r (step %.1f GB of a %.1f GB budget; %d rows x %d tokens)",
           remat, need / 1e9, budget / 1e9, rows, T)
  return remat
