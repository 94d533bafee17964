"""Decode attention over the KV cache slots each row holds, chosen by the platform the program
is LOWERED for (``jax.lax.platform_dependent``), as ``attention.causal_attention`` is.

``decode_attention(q, k_cache, v_cache, start_B)`` is the attention of each row's new query
against cache rows [0, B) of one layer's cache (``Transformer.init_cache``: keys [N, K, h, S],
values [N, K, S, h], N >= B), where row b's query sees slots [0, start_b] (the slots it held
plus the one just written). XLA's attention (``attention.cached_attention``) reads all S slots
of the cache's length bucket for every row and masks those past the row's length; the engine's
rows hold a fraction of it (a held-out evaluation's rows: at most 925 slots, mean 703, in
buckets of 1,024 and 2,048). Each kernel here reads [0, start_b] of row b and stops:

  * ``cpu``: a C++ XLA FFI handler (``decode_cpu``; threads over rows x kv heads, float32 and
    bfloat16) where the ``kernels`` choice takes it (``decode_cpu.usable``), else XLA's;
  * ``cuda``: a Pallas (Triton) kernel (``gpu_decode_attention``), one program per (row, kv
    head, part of a long row's slots) looping over blocks of live slots only. JAX's ``pallas.ops.gpu.decode_attention``
    takes keys and values as [B, S, K, h], so calling it on this cache would transpose (copy)
    the whole cache of every layer at every step, the read this exists to avoid; the cache's
    key layout [h, S] is what the scores' product wants without a transpose;
  * ``tpu``: a Pallas TPU kernel (``tpu_decode_attention``) over blocks of 128-512 slots
    whose block index stops at the row's last live block: a repeated block index is not fetched
    again and its compute is skipped, so each row's DMA covers its live slots only. JAX's
    ragged paged attention (``pallas.ops.tpu.ragged_paged_attention``) wants a paged cache of
    [pages, page size, 2K, h] with keys and values interleaved by head; this cache is
    contiguous per row, and converting it per step would copy it whole;
  * anything else, and shapes a kernel does not take (a head dim or cache length its blocks
    do not fit, more than one query per row): XLA's ``cached_attention``, as before.

All compute the same function; the tests run the Pallas kernels in interpret mode on CPU
against XLA's, and the engine's greedy tokens with the CPU kernel against XLA's.

Prefill chunks (T > 1 queries a row) stay on XLA's attention: their scores are [T g, S]
products that XLA's GEMMs run well, and a prefill is a small share of a rollout's attention.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rao_jax.kernels import decode_cpu, mkl
from rao_jax.kernels.attention import MASK_VALUE, cache_rows_attention

_GPU_BLOCK = 64         # slots per step of the Triton loop (a power of two, as Triton wants)
_GPU_MIN_ROWS = 16      # Triton's dot wants 16+ rows: a kv head's g query heads are padded to it
# Slots per TPU block, largest first: multiples of the 128 lanes; a row over-reads less than
# one block, and fewer grid steps cost less.
_TPU_BLOCKS = (512, 256, 128)


def _check(q, k, v, start):
  B, T, H, h = q.shape
  N, K, h_k, S = k.shape
  if T != 1 or h_k != h or v.shape != (N, K, S, h) or H % K or N < B or start.shape != (B,):
    raise ValueError(f"decode_attention: q {q.shape}, k {k.shape}, v {v.shape} and start "
                     f"{start.shape} do not fit [B, 1, H, h] / [N, K, h, S] / [N, K, S, h] / "
                     "[B], K | H, N >= B")


# ---- XLA (every platform) --------------------------------------------------------------------
def xla_decode_attention(q_Bx1xHxh, k_NxKxhxS, v_NxKxSxh, start_B):
  """The reference: XLA's attention of cache rows [0, B) over all S slots, masked past each
  row's start (``attention.cache_rows_attention``: rows read in place on CPU)."""
  S = k_NxKxhxS.shape[-1]
  visible_Bx1xS = (jnp.arange(S, dtype=jnp.int32)[None, None, :]
                   <= start_B.astype(jnp.int32)[:, None, None])
  return cache_rows_attention(q_Bx1xHxh, k_NxKxhxS, v_NxKxSxh, visible_Bx1xS, q_Bx1xHxh.dtype)


def _scaled_groups(q_Bx1xHxh, K: int):
  """q scaled by h^-1/2 in its dtype (as XLA's attention scales it), as [B, K, g, h]."""
  B, _, H, h = q_Bx1xHxh.shape
  q = q_Bx1xHxh * jnp.asarray(h ** -0.5, q_Bx1xHxh.dtype)
  return q.reshape(B, K, H // K, h)


def _online_softmax_step(s_gxn, v_nxh, m_gx1, l_gx1, acc_gxh, dot):
  """One block of flash attention's running softmax: (m, l, acc) after scores s and values v."""
  m_new = jnp.maximum(m_gx1, jnp.max(s_gxn, axis=-1, keepdims=True))
  corr = jnp.exp(m_gx1 - m_new)
  p = jnp.exp(s_gxn - m_new)
  l_new = corr * l_gx1 + jnp.sum(p, axis=-1, keepdims=True)
  acc_new = corr * acc_gxh + dot(p.astype(v_nxh.dtype), v_nxh)
  return m_new, l_new, acc_new


# ---- GPU: Pallas (Triton) --------------------------------------------------------------------
def _gpu_fits(h: int, S: int) -> bool:
  return h >= 16 and h & (h - 1) == 0 and S % _GPU_BLOCK == 0


def _gpu_splits(S: int) -> int:
  """Parts the slots of a row are split into, each its own program: a long context with few
  rows (8 rows x 8 kv heads at 40K) would otherwise run as few programs as the GPU has SMs.
  Each part is at least 1,024 slots, a whole number of blocks, and there are at most 16."""
  p = 16
  while p > 1 and (S // p < 1024 or S % (p * _GPU_BLOCK)):
    p //= 2
  return p


def gpu_decode_attention(q_Bx1xHxh, k_NxKxhxS, v_NxKxSxh, start_B, *, interpret: bool = False):
  """Decode attention by a Pallas Triton kernel (NVIDIA GPUs; ``interpret`` runs it on any
  backend, for tests). h must be a power of two >= 16 and S a multiple of 64.

  Grid (row, kv head, part of the slots): each program holds its g query heads (padded to 16
  rows for Triton's dot) and loops over blocks of 64 slots of its part up to the row's last
  live slot, with flash attention's running softmax in float32; slots past the row's length
  are never loaded. The parts' partial softmaxes are combined outside the kernel (a part past
  the row's length contributes nothing).
  """
  from jax.experimental import pallas as pl   # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import triton as plgpu   # pylint: disable=g-import-not-at-top
  _check(q_Bx1xHxh, k_NxKxhxS, v_NxKxSxh, start_B)
  B, _, H, h = q_Bx1xHxh.shape
  _, K, _, S = k_NxKxhxS.shape
  g = H // K
  if not _gpu_fits(h, S):
    raise ValueError(f"gpu_decode_attention: head dim {h} (a power of two >= 16) or cache "
                     f"length {S} (a multiple of {_GPU_BLOCK}) does not fit")
  G = max(_GPU_MIN_ROWS, 1 << (g - 1).bit_length())
  q = jnp.pad(_scaled_groups(q_Bx1xHxh, K), ((0, 0), (0, 0), (0, G - g), (0, 0)))
  # A start past the cache (the caller keeps it inside) reads the whole row, as XLA's mask.
  lengths_B = jnp.minimum(start_B.astype(jnp.int32) + 1, S)
  blk = _GPU_BLOCK
  parts = _gpu_splits(S)
  part_blocks = S // parts // blk
  f32 = q.dtype == jnp.float32

  def dot(a, b):
    # Full float32 products for float32 caches (Triton would use TF32 otherwise).
    return plgpu.dot(a, b, allow_tf32=not f32) if f32 else plgpu.dot(a, b)

  def kernel(len_ref, q_ref, k_ref, v_ref, o_ref, l_ref, m_ref):
    n = len_ref[()]
    first = pl.program_id(2) * part_blocks
    q_Gxh = q_ref[...]

    def body(i, carry):
      o_prev, m_prev, l_prev = carry
      start = pl.multiple_of(i * blk, blk)
      s = dot(q_Gxh, k_ref[:, pl.ds(start, blk)])
      idx = start + jnp.arange(blk, dtype=jnp.int32)[None, :]
      s = jnp.where(idx < n, s, MASK_VALUE)
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
      corr = jnp.exp(m_prev - m_next)
      p = jnp.exp(s - m_next[:, None])
      v_nxh = v_ref[pl.ds(start, blk), :]
      o_next = corr[:, None] * o_prev + dot(p.astype(v_nxh.dtype), v_nxh)
      return o_next, m_next, corr * l_prev + jnp.sum(p, axis=1)

    init = (jnp.zeros((G, h), jnp.float32), jnp.full((G,), MASK_VALUE, jnp.float32),
            jnp.zeros((G,), jnp.float32))
    last = jnp.minimum(pl.cdiv(n, blk), first + part_blocks)
    o, m, l = jax.lax.fori_loop(first, jnp.maximum(last, first), body, init)
    o_ref[...], l_ref[...], m_ref[...] = o, l, m

  part = lambda b, kv, j: (b, kv, j, 0, 0)   # noqa: E731
  o, l, m = pl.pallas_call(
      kernel,
      grid=(B, K, parts),
      in_specs=[pl.BlockSpec((None,), lambda b, kv, j: (b,)),
                pl.BlockSpec((None, None, G, h), lambda b, kv, j: (b, kv, 0, 0)),
                pl.BlockSpec((None, None, h, S), lambda b, kv, j: (b, kv, 0, 0)),
                pl.BlockSpec((None, None, S, h), lambda b, kv, j: (b, kv, 0, 0))],
      out_specs=[pl.BlockSpec((None, None, None, G, h), part),
                 pl.BlockSpec((None, None, None, G), lambda b, kv, j: (b, kv, j, 0)),
                 pl.BlockSpec((None, None, None, G), lambda b, kv, j: (b, kv, j, 0))],
      out_shape=[jax.ShapeDtypeStruct((B, K, parts, G, h), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, parts, G), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, parts, G), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="rao_decode_attention_gpu",
  )(lengths_B, q, k_NxKxhxS, v_NxKxSxh)
  # Part 0 always holds a live slot, so the largest m is a real score's; parts past the row's
  # length (m = MASK_VALUE, l = 0) get weight 0.
  w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))
  out = jnp.sum(w[..., None] * o, axis=2) / jnp.sum(w * l, axis=2)[..., None]
  return out[:, :, :g].astype(q.dtype).reshape(B, 1, H, h)


# ---- TPU: Pallas -----------------------------------------------------------------------------
def _tpu_block(S: int) -> int | None:
  return next((b for b in _TPU_BLOCKS if S % b == 0), None)


def tpu_decode_attention(q_Bx1xHxh, k_NxKxhxS, v_NxKxSxh, start_B, *, interpret: bool = False):
  """Decode attention by a Pallas TPU kernel (``interpret`` runs it on any backend, for tests).
  S must be a multiple of 128.

  Grid (row, slot block), the row lengths prefetched into scalar memory; each program holds all
  K kv heads of its row (a grid step costs about as much as a small block's DMA, so the grid is
  kept to B x S / block steps). A block past the row's last live one maps to that last block's
  index, which the pipeline does not fetch again, and its compute is skipped: a row's DMA covers
  its live slots rounded up to the block. The running softmax lives in VMEM scratch.
  """
  from jax.experimental import pallas as pl   # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu   # pylint: disable=g-import-not-at-top
  _check(q_Bx1xHxh, k_NxKxhxS, v_NxKxSxh, start_B)
  B, _, H, h = q_Bx1xHxh.shape
  _, K, _, S = k_NxKxhxS.shape
  g = H // K
  blk = _tpu_block(S)
  if blk is None:
    raise ValueError(f"tpu_decode_attention: cache length {S} is not a multiple of 128")
  q = _scaled_groups(q_Bx1xHxh, K)
  # A start past the cache (the caller keeps it inside) reads the whole row, as XLA's mask.
  lengths_B = jnp.minimum(start_B.astype(jnp.int32) + 1, S)

  def live_block(b, j, lens):
    # lax.div (truncating; lens >= 1): jnp's floor division lowers through a sign, which Mosaic
    # lowers per TPU generation, so it would not export from a host without a TPU.
    return jnp.minimum(j, jax.lax.div(lens[b] - 1, blk))

  def dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

  def kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc):
    b, j = pl.program_id(0), pl.program_id(1)
    n = len_ref[b]

    @pl.when(j == 0)
    def _():
      m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
      l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
      acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j * blk < n)
    def _():
      idx = j * blk + jax.lax.broadcasted_iota(jnp.int32, (g, blk), 1)
      for kv in range(K):   # K is small (1-8): unrolled 2-D products, as Mosaic likes them
        s = jnp.where(idx < n, dot(q_ref[kv], k_ref[kv]), MASK_VALUE)
        m, l, acc = _online_softmax_step(s, v_ref[kv], m_sc[kv], l_sc[kv], acc_sc[kv], dot)
        m_sc[kv], l_sc[kv], acc_sc[kv] = m, l, acc

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(B, S // blk),
      in_specs=[
          pl.BlockSpec((None, K, g, h), lambda b, j, lens: (b, 0, 0, 0)),
          pl.BlockSpec((None, K, h, blk), lambda b, j, lens: (b, 0, 0, live_block(b, j, lens))),
          pl.BlockSpec((None, K, blk, h), lambda b, j, lens: (b, 0, live_block(b, j, lens), 0)),
      ],
      out_specs=pl.BlockSpec((None, K, g, h), lambda b, j, lens: (b, 0, 0, 0)),
      scratch_shapes=[pltpu.VMEM((K, g, 1), jnp.float32), pltpu.VMEM((K, g, 1), jnp.float32),
                      pltpu.VMEM((K, g, h), jnp.float32)])
  out = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((B, K, g, h), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret, name="rao_decode_attention_tpu",
  )(lengths_B, q, k_NxKxhxS, v_NxKxSxh)
  return out.reshape(B, 1, H, h)


# ---- the entry point ---------------------------------------------------------------------------
def decode_attention(q_Bx1xHxh, k_NxKxhxS, v_NxKxSxh, start_B, *, kernels: str = "auto"):
  """Attention of one new query per row over the slots [0, start_b] of cache row b < B.

  The implementation follows the platform the program is lowered for (see the module doc);
  all compute the same function. Not differentiable (the engine's decode only).

  Args:
    q_Bx1xHxh: each row's query (after RoPE), in the cache's dtype.
    k_NxKxhxS, v_NxKxSxh: one layer's cache, N >= B rows; H a multiple of K.
    start_B: int, each row's write position (its query sees slots [0, start_b]).
    kernels: "auto" | "mkl" | "xla", the CPU kernel choice (``decode_cpu.available``; the
      model's static ``ModelConfig.kernels``).

  Returns:
    [B, 1, H, h] in q's dtype.
  """
  mkl.check_mode(kernels, "decode_attention(kernels=...)")
  start_B = jnp.asarray(start_B, jnp.int32)
  _check(q_Bx1xHxh, k_NxKxhxS, v_NxKxSxh, start_B)
  h, S = q_Bx1xHxh.shape[-1], k_NxKxhxS.shape[-1]
  same_dtype = q_Bx1xHxh.dtype == k_NxKxhxS.dtype == v_NxKxSxh.dtype
  xla = xla_decode_attention

  def cpu(q, k, v, start):
    if same_dtype and decode_cpu.usable(q.dtype, kernels):
      rows_B = jnp.arange(q.shape[0], dtype=jnp.int32)
      return decode_cpu.attend(q, k, v, rows_B, start)
    return xla(q, k, v, start)

  cuda = gpu_decode_attention if same_dtype and _gpu_fits(h, S) else xla
  tpu = tpu_decode_attention if same_dtype and _tpu_block(S) is not None else xla
  return jax.lax.platform_dependent(q_Bx1xHxh, k_NxKxhxS, v_NxKxSxh, start_B,
                                    cpu=cpu, cuda=cuda, tpu=tpu, default=xla)


__all__ = ["decode_attention", "gpu_decode_attention", "tpu_decode_attention",
           "xla_decode_attention"]
