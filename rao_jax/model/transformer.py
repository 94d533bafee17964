"""A Llama-family decoder (Llama, Qwen2, Qwen3) in Flax NNX.

Parameters of the L blocks are stacked along a leading "layers" axis and run with ``lax.scan``
(one compiled block, fast compiles) or unrolled (``cfg.scan_layers=False``). All three call
paths share the same parameters:

  * ``model(tokens_BxT, positions_BxT, segment_ids_BxT)``: full forward over packed rows;
  * ``model.forward_cached(tokens_BxT, positions_BxT, cache, write_index_B)``: prefill (T > 1)
    and decode (T = 1) against a KV cache. It is ``CachedForward`` over
    ``model.inference_params()`` (the same weights, one dict per layer, layers unrolled): the
    rollout engine calls that pure form directly and keeps only the per-layer copy.

Einsum letters follow the package legend (B T S D F V H K h L); ``g`` is the number of query
heads that share one key/value head (H = K * g).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rao_jax.kernels import attention, decode, paged
from rao_jax.kernels.matmul import dense
from rao_jax.model import lora as lora_lib
from rao_jax.model.config import ModelConfig, rope_inv_freq

Cache = dict[str, list]   # {"k": L x [B, K, h, S], "v": L x [B, K, S, h]}

_MASK_VALUE = attention.MASK_VALUE

# Names (and logical sharding axes) of the per-layer parameters, stacked over "layers".
LAYER_PARAM_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("layers", "norm"),
    "wq": ("layers", "embed", "q_heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    "wo": ("layers", "q_heads", "head_dim", "embed"),
    "bq": ("layers", "q_heads", "head_dim"),
    "bk": ("layers", "kv_heads", "head_dim"),
    "bv": ("layers", "kv_heads", "head_dim"),
    "bo": ("layers", "norm"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "mlp_norm": ("layers", "norm"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
}


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Shapes of the stacked per-layer parameters this config uses."""
  L, D, F, H, K, h = (cfg.n_layers, cfg.d_model, cfg.mlp_dim, cfg.n_heads, cfg.n_kv_heads,
                      cfg.head_dim)
  shapes = {
      "attn_norm": (L, D), "wq": (L, D, H, h), "wk": (L, D, K, h), "wv": (L, D, K, h),
      "wo": (L, H, h, D), "mlp_norm": (L, D), "w_gate": (L, D, F), "w_up": (L, D, F),
      "w_down": (L, F, D),
  }
  if cfg.qkv_bias:
    shapes.update(bq=(L, H, h), bk=(L, K, h), bv=(L, K, h))
  if cfg.o_bias:
    shapes["bo"] = (L, D)
  if cfg.qk_norm:
    shapes.update(q_norm=(L, h), k_norm=(L, h))
  return shapes


def _param(value, axes: tuple[str, ...]) -> nnx.Param:
  # Logical axis names only (no eager placement): rao_jax.model.sharding maps them to a mesh.
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _draw_normals(rngs: nnx.Rngs, shapes: dict[str, tuple[int, ...]], dtype):
  """Unit normals for several shapes from ONE random draw (each distinct random shape costs an
  XLA compile of the PRNG, seconds on CPU; one flat draw per model keeps init fast)."""
  sizes = [int(np.prod(s)) for s in shapes.values()]
  key = rngs.params()
  if isinstance(key, jax.core.Tracer):
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
  else:
    # Eagerly, numpy seeded from the key is faster still (no compile at all); deterministic.
    seed = np.asarray(jax.random.key_data(key)).astype(np.uint64).tolist()
    flat = jnp.asarray(np.random.default_rng(seed).standard_normal(sum(sizes), np.float32))
  out, start = {}, 0
  for (name, shape), n in zip(shapes.items(), sizes):
    out[name] = flat[start:start + n].reshape(shape).astype(dtype)
    start += n
  return out


class Layers(nnx.Module):
  """The L decoder blocks' parameters, stacked along a leading "layers" axis."""

  def __init__(self, cfg: ModelConfig, normals: dict[str, jax.Array]):
    fan_in = {"wq": cfg.d_model, "wk": cfg.d_model, "wv": cfg.d_model,
              "wo": cfg.n_heads * cfg.head_dim, "w_gate": cfg.d_model, "w_up": cfg.d_model,
              "w_down": cfg.mlp_dim}
    pdt = cfg.jnp_param_dtype
    for name, shape in layer_param_shapes(cfg).items():
      if name.endswith("norm"):
        value = jnp.ones(shape, pdt)
      elif name.startswith("b"):
        value = jnp.zeros(shape, pdt)
      else:
        value = (normals[name] * fan_in[name] ** -0.5).astype(pdt)
      setattr(self, name, _param(value, LAYER_PARAM_AXES[name]))

  def arrays(self) -> dict[str, jax.Array]:
    return {name: getattr(self, name)[...] for name in LAYER_PARAM_AXES if hasattr(self, name)}


def rms_norm(x, weight, eps: float):
  """RMSNorm computed in float32, cast back to x's dtype before the weight (as HF does)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * x32.astype(x.dtype)


def rope_cos_sin(cfg: ModelConfig, positions_BxT):
  """cos/sin tables [B, T, h] (float32) for the given positions, HF "rotate_half" layout."""
  inv = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
  ang_BxTxh2 = positions_BxT.astype(jnp.float32)[..., None] * inv
  ang_BxTxh = jnp.concatenate([ang_BxTxh2, ang_BxTxh2], axis=-1)
  return jnp.cos(ang_BxTxh), jnp.sin(ang_BxTxh)


def apply_rope(x_BxTxNxh, cos_BxTxh, sin_BxTxh):
  x = x_BxTxNxh.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  out = x * cos_BxTxh[:, :, None, :] + rotated * sin_BxTxh[:, :, None, :]
  return out.astype(x_BxTxNxh.dtype)


def _fused_qkv_weight(p):
  """The q, k and v projections side by side, [D, (H + 2K) h]: one product for all three.

  Its backward is then one row-major [B*T, (H + 2K) h] gradient feeding two products. With
  three einsums, XLA:CPU built each weight gradient from a transposed copy of dq/dk/dv fused
  with the RoPE backward, a strided write at ~0.5 GB/s (0.6 s of the 4 x 512 SmolLM2 step in
  benchmarks/bench_model.py).
  """
  D = p["wq"].shape[0]
  return jnp.concatenate([p[n].reshape(D, -1) for n in ("wq", "wk", "wv")], axis=1)


def _qkv(cfg: ModelConfig, p, w_qkv, x_BxTxD, cos, sin):
  dt = cfg.jnp_dtype
  y = rms_norm(x_BxTxD, p["attn_norm"], cfg.rms_eps)
  B, T, D = y.shape
  H, K, h = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  qkv = dense(y.reshape(B * T, D), w_qkv.astype(dt), kernels=cfg.kernels)
  q = qkv[:, :H * h].reshape(B, T, H, h)
  k = qkv[:, H * h:(H + K) * h].reshape(B, T, K, h)
  v = qkv[:, (H + K) * h:].reshape(B, T, K, h)
  if "lora_q_a" in p or "lora_k_a" in p or "lora_v_a" in p:
    y_NxD = y.reshape(B * T, D)
    q, k, v = (x + _lora(cfg, p, y_NxD, t, 0).reshape(x.shape) if f"lora_{t}_a" in p else x
               for x, t in ((q, "q"), (k, "k"), (v, "v")))
  if cfg.qkv_bias:
    q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
  if cfg.qk_norm:
    q = rms_norm(q, p["q_norm"], cfg.rms_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_eps)
  return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _mlp(y_BxTxD, wg_DxF, wu_DxF, wd_FxD, kernels: str = "auto"):
  """SwiGLU MLP, down(silu(y gate) * (y up)), with a hand-written backward pass.

  Autodiff's backward computed each weight gradient from a transposed copy of the
  [B*T, F] activation gradient, fused with its elementwise producer into a strided transpose
  that ran at a few hundred MB/s on CPU (a tenth of the step at 4 x 512). Here each weight
  gradient is one explicit [B*T, .]^T x [B*T, .] product and the SwiGLU derivative is one
  sigmoid: the 4 x 512 SmolLM2 step went from 23 s to 20 s (benchmarks/bench_model.py).
  ``kernels`` is the model's CPU kernel choice (ModelConfig.kernels).
  """
  return _mlp_fwd(y_BxTxD, wg_DxF, wu_DxF, wd_FxD, kernels)[0]


def _mlp_fwd(y_BxTxD, wg, wu, wd, kernels):
  B, T, D = y_BxTxD.shape
  y = y_BxTxD.reshape(B * T, D)
  mm = functools.partial(dense, kernels=kernels)
  g, u = mm(y, wg), mm(y, wu)
  return mm(jax.nn.silu(g) * u, wd).reshape(B, T, D), (y, g, u, wg, wu, wd)


def _mlp_bwd(kernels, res, d_out_BxTxD):
  y_NxD, g_NxF, u_NxF, wg, wu, wd = res
  B, T, D = d_out_BxTxD.shape
  d_out_NxD = d_out_BxTxD.reshape(B * T, D)
  sig = jax.nn.sigmoid(g_NxF)
  silu = g_NxF * sig
  mm = functools.partial(dense, kernels=kernels)
  d_a = mm(d_out_NxD, wd, trans_b=True)
  d_u = d_a * silu
  d_g = d_a * u_NxF * (sig * (1 + g_NxF * (1 - sig)))
  d_y = mm(d_g, wg, trans_b=True) + mm(d_u, wu, trans_b=True)
  d_wd = mm(silu * u_NxF, d_out_NxD, trans_a=True)
  d_wg = mm(y_NxD, d_g, trans_a=True)
  d_wu = mm(y_NxD, d_u, trans_a=True)
  return d_y.reshape(B, T, D), d_wg, d_wu, d_wd


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def _lora(cfg: ModelConfig, p, x_NxI, target: str, salt: int):
  """The adapter's share of projection ``target`` (``rao_jax.model.lora``), with dropout on
  its input when the layer's params carry a dropout key ("lora_key", training only)."""
  keep = None
  if "lora_key" in p:
    rate = cfg.lora.dropout
    key = jax.random.fold_in(p["lora_key"], salt)
    keep = jax.random.bernoulli(key, 1.0 - rate, x_NxI.shape).astype(x_NxI.dtype) / (1 - rate)
  return lora_lib.project(x_NxI, p, target, cfg.lora.scale, cfg.jnp_dtype, keep)


def _mlp_lora(cfg: ModelConfig, p, y_BxTxD):
  """The SwiGLU MLP with adapters on some of its projections, by autodiff. The base weights
  are frozen here, so the hand-written backward of ``_mlp`` (which exists for the weight
  gradients' layout) has nothing to save."""
  dt = cfg.jnp_dtype
  B, T, D = y_BxTxD.shape
  y = y_BxTxD.reshape(B * T, D)
  mm = functools.partial(dense, kernels=cfg.kernels)

  def proj(x, name, target, salt):
    out = mm(x, p[name].astype(dt))
    return out + _lora(cfg, p, x, target, salt) if f"lora_{target}_a" in p else out
  a = jax.nn.silu(proj(y, "w_gate", "gate", 4)) * proj(y, "w_up", "up", 5)
  return proj(a, "w_down", "down", 6).reshape(B, T, D)


def _post_attention(cfg: ModelConfig, p, x_BxTxD, attn_BxTxHxh):
  dt = cfg.jnp_dtype
  B, T, H, h = attn_BxTxHxh.shape
  a_NxHh = attn_BxTxHxh.reshape(B * T, H * h)
  o = dense(a_NxHh, p["wo"].astype(dt).reshape(H * h, -1), kernels=cfg.kernels)
  if "lora_o_a" in p:
    o = o + _lora(cfg, p, a_NxHh, "o", 3)
  o = o.reshape(B, T, -1)
  if cfg.o_bias:
    o = o + p["bo"].astype(dt)
  x = x_BxTxD + o
  y = rms_norm(x, p["mlp_norm"], cfg.rms_eps)
  if any(f"lora_{t}_a" in p for t in ("gate", "up", "down")):
    return x + _mlp_lora(cfg, p, y)
  return x + _mlp(y, p["w_gate"].astype(dt), p["w_up"].astype(dt), p["w_down"].astype(dt),
                  cfg.kernels)


def _block(cfg: ModelConfig, p, x_BxTxD, cos, sin, attend):
  """One decoder block; ``attend(q, k, v)`` is the causal attention of the row over itself."""
  q, k, v = _qkv(cfg, p, _fused_qkv_weight(p), x_BxTxD, cos, sin)
  return _post_attention(cfg, p, x_BxTxD, attend(q, k, v))


def _self_attention(cfg: ModelConfig, segment_ids_BxT, shared_prefix: bool):
  """``attend(q, k, v)`` for the full forward: the platform's kernel (``rao_jax.kernels``)."""
  return lambda q, k, v: attention.causal_attention(q, k, v, segment_ids_BxT,
                                                    block=cfg.attention_block,
                                                    kernels=cfg.kernels,
                                                    shared_prefix=shared_prefix)


def _remat(cfg: ModelConfig, fn):
  if cfg.remat == "full":
    return jax.checkpoint(fn)
  if cfg.remat == "dots":
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  return fn


class Transformer(nnx.Module):
  """The policy: token embeddings, L decoder blocks, final RMSNorm, LM head.

  Args:
    cfg: the ModelConfig.
    rngs: ``nnx.Rngs`` for random initialisation (real weights are loaded over these).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pdt = cfg.jnp_param_dtype
    shapes = {k: v for k, v in layer_param_shapes(cfg).items()
              if not k.endswith("norm") and not k.startswith("b")}
    shapes["embed"] = (cfg.vocab_size, cfg.d_model)
    if not cfg.tie_embeddings:
      shapes["lm_head"] = (cfg.vocab_size, cfg.d_model)
    normals = _draw_normals(rngs, shapes, jnp.float32)
    self.embed = _param((normals["embed"] * 0.02).astype(pdt), ("vocab", "embed"))
    self.layers = Layers(cfg, normals)
    self.final_norm = _param(jnp.ones((cfg.d_model,), pdt), ("norm",))
    if cfg.lora.enabled:
      # nnx.LoRAParam leaves: what a learner trains when LoRA is on (the rest stays frozen).
      self.lora = lora_lib.LoraAdapters(cfg)
    if not cfg.tie_embeddings:
      self.lm_head = _param((normals["lm_head"] * cfg.d_model ** -0.5).astype(pdt),
                            ("vocab", "embed"))

  # ---- helpers ---------------------------------------------------------------------------------
  def head_weight(self) -> jax.Array:
    """The [V, D] output projection (the embedding table when tied)."""
    return (self.embed if self.cfg.tie_embeddings else self.lm_head)[...]

  def _embed(self, tokens_BxT):
    return jnp.take(self.embed[...], tokens_BxT, axis=0).astype(self.cfg.jnp_dtype)

  def _run_layers(self, x, layer_fn, xs_extra=None, lora_key=None):
    """Applies ``layer_fn(params_of_one_layer, x, extra) -> (x, y)`` over the L layers."""
    params = self._layer_arrays()
    if lora_key is not None and self.cfg.lora.enabled and self.cfg.lora.dropout > 0:
      # One dropout key per layer, read by the adapters (training forward only).
      params["lora_key"] = jax.random.split(lora_key, self.cfg.n_layers)
    if self.cfg.scan_layers:
      return jax.lax.scan(lambda c, a: layer_fn(a[0], c, a[1]), x, (params, xs_extra))
    ys = []
    for i in range(self.cfg.n_layers):
      p_i = {k: v[i] for k, v in params.items()}
      extra_i = None if xs_extra is None else jax.tree.map(lambda a: a[i], xs_extra)
      x, y = layer_fn(p_i, x, extra_i)
      ys.append(y)
    if ys[0] is None:
      return x, None
    return x, jax.tree.map(lambda *a: jnp.stack(a), *ys)

  def _layer_arrays(self) -> dict[str, jax.Array]:
    """The stacked per-layer arrays, with the adapter's ("lora_*") when LoRA is on."""
    params = self.layers.arrays()
    if self.cfg.lora.enabled:
      params.update(self.lora.arrays())
    return params

  # ---- 1) full forward over packed rows -------------------------------------------------------
  def __call__(self, tokens_BxT, positions_BxT, segment_ids_BxT, *, shared_prefix=False,
               lora_key=None):
    """Final-normed hidden states [B, T, D] (dtype cfg.dtype) of packed rows.

    Args:
      tokens_BxT: int token ids.
      positions_BxT: int position of each token within its trajectory (RoPE uses these).
      segment_ids_BxT: int; tokens attend causally and only within the same segment id.
        0 marks padding (padding attends only to padding, so nothing real ever reads it).
      shared_prefix: static; True when the ids may name shared prefixes, whose suffixes also
        see their prefix (``rao_jax.kernels.segments``; the learner's packing).
      lora_key: a PRNG key for the adapters' dropout (``model.lora.dropout`` > 0, training);
        None: no dropout.
    """
    return self.forward_embeddings(self._embed(tokens_BxT), positions_BxT, segment_ids_BxT,
                                   shared_prefix=shared_prefix, lora_key=lora_key)

  def forward_embeddings(self, x_BxTxD, positions_BxT, segment_ids_BxT, *, shared_prefix=False,
                         lora_key=None):
    """As ``__call__`` but from input embeddings [B, T, D] instead of token ids."""
    cfg = self.cfg
    cos, sin = rope_cos_sin(cfg, positions_BxT)
    attend = _self_attention(cfg, segment_ids_BxT, shared_prefix)
    block = _remat(cfg, lambda p, x: _block(cfg, p, x, cos, sin, attend))
    x, _ = self._run_layers(x_BxTxD.astype(cfg.jnp_dtype), lambda p, x, _: (block(p, x), None),
                            lora_key=lora_key)
    return rms_norm(x, self.final_norm[...], cfg.rms_eps)

  def logits(self, hidden_BxTxD):
    """float32 logits [..., V] for final-normed hidden states."""
    return _logits(self.head_weight(), hidden_BxTxD, self.cfg.jnp_dtype)

  # ---- 2) + 3) KV cache -----------------------------------------------------------------------
  def init_cache(self, batch_size: int, max_len: int) -> Cache:
    """An empty KV cache in cfg.dtype: {"k": L x [B, K, h, S], "v": L x [B, K, S, h]}.

    One array per layer (not one stacked [L, ...] array): a decode step then reads each layer's
    cache in place, where slicing a layer out of a stacked array copies it. Keys are stored
    transposed (h before S) so both attention products read the cache as plain row-major
    matrices, with no transpose (another copy) of the cache.
    """
    cfg = self.cfg
    B, S, K, h = batch_size, max_len, cfg.n_kv_heads, cfg.head_dim
    return {"k": [jnp.zeros((B, K, h, S), cfg.jnp_dtype) for _ in range(cfg.n_layers)],
            "v": [jnp.zeros((B, K, S, h), cfg.jnp_dtype) for _ in range(cfg.n_layers)]}

  def inference_params(self) -> dict[str, Any]:
    """The weights with one dict per layer, for ``CachedForward``.

    Called outside jit this copies each layer out of the stacked arrays once (the rollout
    engine does so on every weight update). A decode step is memory-bound on CPU: slicing the
    stacked arrays inside it copied the whole model each step and doubled its time. For the
    same reason each layer holds q, k and v fused once here ("wqkv", [D, (H + 2K) h]) in place
    of "wq", "wk", "wv": the training forward fuses them per step, a decode step must not.

    The copies are in the compute dtype ``cfg.dtype``: with float32 master weights (the
    learner's) and bfloat16 compute, the rollout engine holds and reads bfloat16 weights (half
    the memory and half the bytes per decode step), and computes exactly what the forward
    computes (which casts each weight to ``cfg.dtype`` at its use).
    """
    dt = self.cfg.jnp_dtype
    own = lambda x: x if x.dtype == dt else x.astype(dt)
    stacked = self.layers.arrays()
    if self.cfg.lora.enabled:   # merged once here: a decode step pays nothing for the adapter
      stacked = lora_lib.merged_layer_arrays(self.cfg, stacked, self.lora.arrays())
    layers = []
    for i in range(self.cfg.n_layers):
      p = {k: own(v[i]) for k, v in stacked.items()}
      p["wqkv"] = _fused_qkv_weight(p)
      layers.append({k: v for k, v in p.items() if k not in ("wq", "wk", "wv")})
    embed = own(self.embed[...])
    head = embed if self.cfg.tie_embeddings else own(self.lm_head[...])   # one copy when tied
    return {"embed": embed, "head": head, "final_norm": own(self.final_norm[...]),
            "layers": layers}

  def inference_fns(self) -> "CachedForward":
    """The pure prefill/decode functions over ``inference_params()`` (hashable, jit-static)."""
    return CachedForward(self.cfg)

  def forward_cached(self, tokens_BxT, positions_BxT, cache: Cache, write_index_B):
    """Prefill (T > 1) or decode (T = 1) against the KV cache; see ``CachedForward``.

    Returns:
      (final-normed hidden [B, T, D], the updated cache).
    """
    return CachedForward(self.cfg)(self.inference_params(), tokens_BxT, positions_BxT, cache,
                                   write_index_B)


@dataclasses.dataclass(frozen=True)
class CachedForward:
  """Prefill and decode as pure functions of ``Transformer.inference_params()``.

  Hashable by value (its config), so jitted engine functions take it as a static argument and
  every engine over the same architecture shares their compiled programs. The layers run
  unrolled over per-layer weights and per-layer caches: nothing is sliced or copied per step.
  """
  cfg: ModelConfig

  def __call__(self, params, tokens_BxT, positions_BxT, cache: Cache, write_index_B,
               rows_B=None, pages_BxW=None):
    """Writes the T new tokens' keys/values into slots [w_b, w_b + T) of cache row r_b (w =
    write_index_B, r = rows_B) and lets query i of input row b attend to slots j <= w_b + i of
    that cache row. Rows are independent (continuous batching). Slots past S are dropped;
    tokens past a row's real length are padding whose K/V land beyond the row's length, are
    overwritten by the next write and never read.

    rows_B=None uses cache rows [0, B). Given rows_B, only the new keys and values are
    scattered into the full cache (repeated rows must carry identical inputs) and attention
    reads the rows it needs (``attention.cache_rows_attention``: in place on CPU). A decode
    step (T = 1, rows [0, B)) reads only the slots each row holds (``kernels.decode``).

    Given pages_BxW (int32 [B, W]) the cache is a paged pool, ``init_cache(batch_size=N pages,
    max_len=P slots a page)`` (the embedded engine's): row b's slot j is slot j % P of page
    pages_BxW[b, j // P], S = W P, and a slot without a page (negative entry) is not written
    (``kernels.paged``). Decode reads each row's live pages; a prefill chunk attends over its
    W pages gathered. A page written must belong to its row alone.
    Jittable with the cache donated, so the writes happen in place; S is a static shape.

    Returns:
      (final-normed hidden [B, T, D], the updated cache).
    """
    cfg = self.cfg
    dt = cfg.jnp_dtype
    B, T = tokens_BxT.shape
    N, _, P, _ = cache["v"][0].shape
    is_paged = pages_BxW is not None
    if is_paged and rows_B is not None:
      raise ValueError("CachedForward: rows_B and pages_BxW are exclusive (a paged row is its "
                       "page table).")
    S = pages_BxW.shape[1] * P if is_paged else P
    start_B = jnp.asarray(write_index_B, jnp.int32)
    slots_BxT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    visible_BxTxS = jnp.arange(S, dtype=jnp.int32)[None, None, :] <= slots_BxT[:, :, None]
    gather = rows_B is not None
    rows_B = jnp.asarray(rows_B, jnp.int32) if gather else jnp.arange(B, dtype=jnp.int32)
    if is_paged:   # rows_BxT and slots_BxT become each slot's page and offset in its page
      rows_BxT, offs_BxT = paged.slot_pages(jnp.asarray(pages_BxW, jnp.int32), slots_BxT, N, P)
    else:
      rows_BxT, offs_BxT = jnp.broadcast_to(rows_B[:, None], (B, T)), slots_BxT
    cos, sin = rope_cos_sin(cfg, positions_BxT)
    x = jnp.take(params["embed"], tokens_BxT, axis=0).astype(dt)
    ks, vs = list(cache["k"]), list(cache["v"])
    for i, p in enumerate(params["layers"]):
      q, k, v = _qkv(cfg, p, p["wqkv"], x, cos, sin)
      ks[i], vs[i] = paged.write(ks[i], vs[i], k, v, rows_BxT, offs_BxT)
      if is_paged and T == 1:
        attn = paged.paged_decode_attention(q, ks[i], vs[i], pages_BxW, start_B,
                                            kernels=cfg.kernels)
      elif is_paged:
        attn = paged.view_attention(q, ks[i], vs[i], pages_BxW, visible_BxTxS, dt)
      elif T == 1 and not gather:
        # The engine's decode: each row reads only the slots it holds (the platform's kernel).
        attn = decode.decode_attention(q, ks[i], vs[i], start_B, kernels=cfg.kernels)
      else:
        attn = attention.cache_rows_attention(q, ks[i], vs[i], visible_BxTxS, dt,
                                              rows_B if gather else None)
      x = _post_attention(cfg, p, x, attn)
    return rms_norm(x, params["final_norm"], cfg.rms_eps), {"k": ks, "v": vs}

  def logits(self, params, hidden_BxTxD):
    """float32 logits [..., V]."""
    return _logits(params["head"], hidden_BxTxD, self.cfg.jnp_dtype)


def _logits(w_VxD, hidden_BxTxD, dtype):
  return jnp.einsum("...D,VD->...V", hidden_BxTxD, w_VxD.astype(dtype),
                    preferred_element_type=jnp.float32)


# The XLA attentions live with the platform kernels; these names stay for callers and tests.
_attention = attention.cached_attention
_causal_attention = attention.blocked_causal_attention


def make_packed_inputs(lengths_per_row: list[list[int]], T: int):
  """positions and segment ids [B, T] (numpy) for rows packed with segments of given lengths."""
  B = len(lengths_per_row)
  positions = np.zeros((B, T), np.int32)
  segments = np.zeros((B, T), np.int32)
  for b, lengths in enumerate(lengths_per_row):
    start = 0
    for s, n in enumerate(lengths):
      if start + n > T:
        raise ValueError(f"row {b}: segments {lengths} do not fit in T={T}.")
      positions[b, start:start + n] = np.arange(n)
      segments[b, start:start + n] = s + 1
      start += n
  return positions, segments


def count_params(model: Any) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
