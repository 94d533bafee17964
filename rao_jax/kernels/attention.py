"""The training attention of packed rows, chosen by the platform the program is LOWERED for, and
XLA's attention against a KV cache.

``causal_attention(q, k, v, segment_ids)`` is the training forward's attention of packed rows
over themselves (query i sees key j iff j <= i in the same segment; grouped-query heads). It
stages every implementation with ``jax.lax.platform_dependent`` and the lowering keeps only the
branch of its target platform, so one traced program carries the right kernel for CPU, TPU and
GPU, and exporting it for ``cuda`` or ``tpu`` from a CPU host never meets a CPU-only custom
call (``matmul.dense`` does the same for the MKL product):

  * ``cpu``: the MKL kernel (``mkl_attention``, float32, where the ``kernels`` choice takes it:
    ``mkl.available``), which reads each query block's keys from the first position of its
    segments on (packed rows of short nodes skip most of the lower triangle too), else XLA's
    blocked attention (``blocked_causal_attention``, causal blocks skipped only);
  * ``tpu``: Pallas splash attention (``tpu_splash_attention``) with the causal mask and the
    segment ids (``SegmentIds``): flash-style, nothing T x T in HBM, fully masked blocks skipped;
  * ``cuda``: the Pallas GPU (Triton) flash attention (``gpu_flash_attention``), which takes
    the segment ids and the causal flag itself. cuDNN through ``jax.nn.dot_product_attention``
    does not: its public API has one segment per row (``query_seq_lengths`` /
    ``key_value_seq_lengths``, i.e. padding) and otherwise a dense boolean mask of
    [B, H, T, T], which is the T x T array in HBM this kernel exists to avoid (cuDNN's packed
    "THD" layout is only reachable through JAX's private ``jax._src.cudnn`` module);
  * anything else, and shapes a kernel does not take (T not a multiple of its block): XLA's
    blocked attention.

``cached_attention`` is XLA's attention against the KV cache (prefill chunks, and the
reference and fallback of the decode step's kernels in ``decode.py``, which read only the slots
each row holds); ``cache_rows_attention`` picks the cache rows it reads: in place on CPU, taken
elsewhere. A prefill chunk's scores are at most ``EngineConfig`` prefill chunk x S, never the
T x T training case.

Under a multi-device mesh the Pallas and FFI calls are opaque to XLA's partitioner, which would
gather their operands onto every device. With a mesh set by ``jax.set_mesh`` around the trace
(the learner traces its step under its mesh), they run per device under ``shard_map`` on whole
rows and local heads (tested on a CPU mesh: the MKL kernel, and the Pallas ones in interpret
mode).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rao_jax.kernels import mkl, mkl_attention
# Segment ids, shared prefixes included: which key a query may see.
from rao_jax.kernels.segments import segments_see
from rao_jax.model import sharding

# Large negative instead of -inf: a fully masked row then gives a finite (uniform) softmax, so
# padding never produces NaNs that could leak into gradients through a 0 * NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Query/key blocks tried, largest first; a kernel runs only when one divides T.
_TPU_BLOCKS = (512, 256, 128)     # splash: multiples of the 128 lanes
_GPU_BLOCKS = (128, 64)           # Triton: the forward's query and key tiles


# ---- XLA (every platform) ------------------------------------------------------------------
def cached_attention(q_BxTxHxh, k_BxKxhxS, v_BxKxSxh, visible_BxTxS, dtype):
  """Grouped-query attention of T queries over S keys (a cache, or the row itself); softmax
  in float32.

  The g query heads of a key/value head and the T queries form the rows of one matrix per
  (row, kv head), so each product is a plain [T*g, h] x [h, S] (and [T*g, S] x [S, h]) matmul.
  """
  B, T, H, h = q_BxTxHxh.shape
  K = k_BxKxhxS.shape[1]
  S = k_BxKxhxS.shape[-1]
  g = H // K
  q = (q_BxTxHxh.reshape(B, T, K, g, h).transpose(0, 2, 1, 3, 4).reshape(B, K, T * g, h)
       * jnp.asarray(h ** -0.5, dtype))
  batch = ((0, 1), (0, 1))
  scores = jax.lax.dot_general(q, k_BxKxhxS, (((3,), (2,)), batch),
                               preferred_element_type=jnp.float32)            # [B, K, Tg, S]
  mask = jnp.broadcast_to(visible_BxTxS[:, None, :, None, :], (B, 1, T, g, S))
  scores = jnp.where(mask.reshape(B, 1, T * g, S), scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jax.lax.dot_general(probs, v_BxKxSxh, (((3,), (2,)), batch))         # [B, K, Tg, h]
  return out.reshape(B, K, T, g, h).transpose(0, 2, 1, 3, 4).reshape(B, T, H, h)


def cache_rows_attention(q_BxTxHxh, k_NxKxhxS, v_NxKxSxh, visible_BxTxS, dtype, rows_B=None):
  """``cached_attention`` of B query rows over rows ``rows_B`` (default: the first B) of a
  cache holding N >= B rows, without copying those rows out of the cache on CPU.

  XLA:CPU copies a sliced or gathered operand out before a product: decoding 16 of a 32-slot
  SmolLM2 cache at length 2,048 copied 16 x 3 MB a layer, and the call cost what 32 rows cost
  (benchmarks/bench_decode_rows.py). On CPU the rows are attended one at a time (``lax.map``),
  each reading its cache row in place; the whole cache in order (rows_B None, B == N) is one
  batched product, faster than the loop. Elsewhere the rows are taken and attended as one batch
  (a copy at device bandwidth, against a loop of small kernels).
  """
  B, N = q_BxTxHxh.shape[0], k_NxKxhxS.shape[0]
  if rows_B is None and B == N:
    return cached_attention(q_BxTxHxh, k_NxKxhxS, v_NxKxSxh, visible_BxTxS, dtype)
  rows_B = jnp.arange(B, dtype=jnp.int32) if rows_B is None else jnp.asarray(rows_B, jnp.int32)

  def batched(q, k, v, vis, rows):
    return cached_attention(q, jnp.take(k, rows, axis=0), jnp.take(v, rows, axis=0), vis, dtype)

  def per_row(q, k, v, vis, rows):
    def one(args):
      q_TxHxh, vis_TxS, r = args
      k_1xKxhxS = jax.lax.dynamic_index_in_dim(k, r, 0, keepdims=True)
      v_1xKxSxh = jax.lax.dynamic_index_in_dim(v, r, 0, keepdims=True)
      return cached_attention(q_TxHxh[None], k_1xKxhxS, v_1xKxSxh, vis_TxS[None], dtype)[0]
    return jax.lax.map(one, (q, vis, rows))

  return jax.lax.platform_dependent(q_BxTxHxh, k_NxKxhxS, v_NxKxSxh, visible_BxTxS, rows_B,
                                    cpu=per_row, default=batched)


@functools.partial(jax.checkpoint, static_argnums=(4, 5))
def blocked_causal_attention(q_BxTxHxh, k_BxKxhxT, v_BxKxTxh, mask_BxTxT, dtype, block: int):
  """Attention of a row over itself under a causal mask, by blocks of ``block`` queries.

  The queries of block [a, b) can only see keys [0, b), so each block attends over that prefix
  alone: the fully masked upper triangle is skipped but for the diagonal blocks (5/8 of the
  full work at 4 blocks). Exact: a skipped key has probability 0 either way. Within the prefix,
  ``mask_BxTxT`` still applies (segments of packed rows, causality in the diagonal block).

  Rematerialised: the backward pass recomputes the [B, K, g*T, T] scores and probabilities from
  q, k, v instead of storing them. Stored, they filled a zeroed [L, B, K, g*T, T] buffer (1.1 GB
  at 4 x 512 on SmolLM2) written and read back once per layer, which cost more than the
  recompute (4 x 512 step on CPU: 27.7 s -> 23.2 s). The forward still holds one block's
  [B, K, g*block, T] float32 scores at a time: at T = 40,960 that is the memory the TPU and GPU
  kernels avoid.
  """
  T = q_BxTxHxh.shape[1]
  outs = [cached_attention(q_BxTxHxh[:, a:a + block], k_BxKxhxT[..., :a + block],
                           v_BxKxTxh[:, :, :a + block], mask_BxTxT[:, a:a + block, :a + block],
                           dtype)
          for a in range(0, T, block)]
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def xla_causal_attention(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segment_ids_BxT, block: int = 128):
  """The reference: XLA's blocked causal attention of packed rows, [B, T, H, h] in q's dtype."""
  T = segment_ids_BxT.shape[1]
  idx = jnp.arange(T)
  mask_BxTxT = (segments_see(segment_ids_BxT[:, :, None], segment_ids_BxT[:, None, :])
                & (idx[:, None] >= idx[None, :])[None])
  # Keys and values in the cache's layouts (small copies): the [B, K, g*T, T] scores and
  # probabilities then never need a transpose, forward or backward.
  return blocked_causal_attention(q_BxTxHxh, jnp.transpose(k_BxTxKxh, (0, 2, 3, 1)),
                                  jnp.transpose(v_BxTxKxh, (0, 2, 1, 3)), mask_BxTxT,
                                  q_BxTxHxh.dtype, block)


# ---- TPU: Pallas splash attention -----------------------------------------------------------
def _block_for(T: int, blocks) -> int | None:
  return next((b for b in blocks if T % b == 0), None)


@functools.lru_cache(maxsize=None)
def _splash_kernel(T: int, H: int, block: int, interpret: bool):
  # The mask is static (causal, per head); its block structure is computed here once with numpy.
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as splash, splash_attention_mask as masks)
  mask = masks.MultiHeadMask([masks.CausalMask((T, T)) for _ in range(H)])
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                            block_q_dq=block, block_kv_dq=block)
  # Built eagerly even when first called inside a trace, and its block tables kept as numpy
  # constants: traced, they became extra program arguments that jax.export (0.10) could not map
  # back to the caller's arguments.
  with jax.ensure_compile_time_eval():
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    mask_value=MASK_VALUE, interpret=interpret)
    return jax.tree.map(np.asarray, kernel)


def tpu_splash_attention(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segment_ids_BxT, *,
                         interpret: bool = False):
  """Causal attention of packed rows by Pallas splash attention (TPU; ``interpret`` runs the
  kernel's Pallas program on any backend, for tests). T must be a multiple of 128.

  Splash takes grouped-query heads as they are (H a multiple of K) and the segment ids as
  ``SegmentIds(q, kv)``; it does not scale, so q is scaled by h^-1/2 first, in its dtype, as
  the XLA reference does.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as splash)
  B, T, H, h = q_BxTxHxh.shape
  block = _block_for(T, _TPU_BLOCKS)
  if block is None:
    raise ValueError(f"tpu_splash_attention: T={T} is not a multiple of 128")
  kernel = _splash_kernel(T, H, block, interpret)
  q = jnp.transpose(q_BxTxHxh * jnp.asarray(h ** -0.5, q_BxTxHxh.dtype), (0, 2, 1, 3))
  k = jnp.transpose(k_BxTxKxh, (0, 2, 1, 3))
  v = jnp.transpose(v_BxTxKxh, (0, 2, 1, 3))
  seg = segment_ids_BxT.astype(jnp.int32)
  out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(s1, s1))
                 )(q, k, v, seg)                                           # [B, H, T, h]
  return jnp.transpose(out, (0, 2, 1, 3)).astype(q_BxTxHxh.dtype)


# ---- GPU: Pallas (Triton) flash attention ---------------------------------------------------
def gpu_flash_attention(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segment_ids_BxT, *,
                        interpret: bool = False):
  """Causal attention of packed rows by the Pallas GPU flash-attention kernel (Triton on
  NVIDIA GPUs; ``interpret`` runs it on any backend, for tests). T must be a multiple of 64.

  The kernel reads q, k, v in the model's [B, T, heads, h] layout and masks by segment id and
  causality inside its loop (blocks past the diagonal are never visited); it wants as many key
  heads as query heads, so each key/value head is repeated for its g query heads (autodiff sums
  their gradients back).
  """
  from jax.experimental.pallas.ops.gpu import attention as pallas_gpu  # pylint: disable=g-import-not-at-top
  B, T, H, h = q_BxTxHxh.shape
  g = H // k_BxTxKxh.shape[2]
  block = _block_for(T, _GPU_BLOCKS)
  if block is None:
    raise ValueError(f"gpu_flash_attention: T={T} is not a multiple of 64")
  k = jnp.repeat(k_BxTxKxh, g, axis=2) if g > 1 else k_BxTxKxh
  v = jnp.repeat(v_BxTxKxh, g, axis=2) if g > 1 else v_BxTxKxh
  sizes = pallas_gpu.BlockSizes(block_q=block, block_k=block, block_q_dkv=32, block_kv_dkv=32,
                                block_q_dq=32, block_kv_dq=32)
  return pallas_gpu.mha(q_BxTxHxh, k, v, segment_ids_BxT.astype(jnp.int32), sm_scale=h ** -0.5,
                        causal=True, block_sizes=sizes, interpret=interpret)


# ---- the entry point --------------------------------------------------------------------------
def _check(q, k, v, segment_ids):
  B, T, H, h = q.shape
  if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != h or H % k.shape[2]:
    raise ValueError(f"causal_attention: q {q.shape}, k {k.shape} and v {v.shape} do not fit "
                     "[B, T, H, h] / [B, T, K, h], K | H")
  if segment_ids.shape != (B, T):
    raise ValueError(f"causal_attention: segment ids {segment_ids.shape}, expected {(B, T)}")


def _sharded(fn, q, k, v, segment_ids):
  """``fn`` per device under the mesh set with ``jax.set_mesh`` (rows over the data axes, heads
  over "tensor"); plain ``fn`` without one. Pallas calls are opaque to XLA's partitioner."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return fn(q, k, v, segment_ids)
  # Query heads split like their key/value heads (head i*g + j belongs to kv head i), so both
  # take the kv heads' spec; rows that the data axes do not divide stay whole.
  qkv = sharding.logical_to_spec(("batch", None, "kv_heads", None), shape=k.shape, mesh=mesh)
  seg = sharding.logical_to_spec(("batch", None), shape=segment_ids.shape, mesh=mesh)
  return jax.shard_map(fn, mesh=mesh, in_specs=(qkv, qkv, qkv, seg), out_specs=qkv,
                       check_vma=False)(q, k, v, segment_ids)


def causal_attention(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segment_ids_BxT, block: int = 128,
                     kernels: str = "auto", shared_prefix: bool = False):
  """softmax(q k^T / sqrt(h) + causal segment mask) v of packed rows, [B, T, H, h] in q's dtype.

  The implementation follows the platform the program is lowered for (see the module doc);
  all of them compute the same function. Differentiable.

  Args:
    q_BxTxHxh: queries (after RoPE).
    k_BxTxKxh, v_BxTxKxh: keys (after RoPE) and values; H must be a multiple of K.
    segment_ids_BxT: int; a query sees earlier keys of its own segment id only (0 = padding,
      which sees earlier padding only), and a shared prefix's suffix also sees its prefix
      (``segments_see``).
    block: queries per block of XLA's blocked attention.
    kernels: "auto" | "mkl" | "xla", the CPU kernel choice (``mkl.available``; the model's
      ``ModelConfig.kernels``); a static Python string.
    shared_prefix: static; True when the ids may name shared prefixes. The TPU and GPU kernels
      compare segment ids for equality only, so such rows take XLA's blocked attention there;
      the CPU kernel and XLA's follow ``segments_see`` either way.
  """
  mkl.check_mode(kernels, "causal_attention(kernels=...)")
  _check(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segment_ids_BxT)
  T = q_BxTxHxh.shape[1]
  xla = functools.partial(xla_causal_attention, block=block)

  def mkl_kernel(q, k, v, s):
    return mkl_attention.causal_attention(q, k, v, s).astype(q.dtype)

  def cpu(q, k, v, s):
    if mkl_attention.usable(q.dtype, kernels):
      return _sharded(mkl_kernel, q, k, v, s)
    return xla(q, k, v, s)

  tpu = xla if shared_prefix or _block_for(T, _TPU_BLOCKS) is None else functools.partial(
      _sharded, tpu_splash_attention)
  cuda = xla if shared_prefix or _block_for(T, _GPU_BLOCKS) is None else functools.partial(
      _sharded, gpu_flash_attention)
  return jax.lax.platform_dependent(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segment_ids_BxT,
                                    cpu=cpu, tpu=tpu, cuda=cuda, default=xla)
