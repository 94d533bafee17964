"""The paged KV cache's operations: writes through a page table, the gathered view a prefill
chunk attends over, and decode attention that reads each row's live pages, chosen by the
platform the program is LOWERED for (``jax.lax.platform_dependent``), as ``decode.py`` is.

The cache is a pool of N pages of P slots per layer, in the model's cache layouts
(``Transformer.init_cache(batch_size=N, max_len=P)``): keys [N, K, h, P], values [N, K, P, h].
A row is a page table ``pages_BxW`` (int32, W pages): its slot j is slot j % P of page
``pages_BxW[b, j // P]``; a negative entry is a page the row does not have. The engine's host
side owns the tables (``rao_jax.rollout.engine.pages``); several rows may name one page (a
shared prompt prefix), and a write only ever lands in a page its row owns alone.

Decode attention (one new query per row, seeing slots [0, start_b]) by platform:

  * ``cpu``: the C++ FFI kernel (``decode_cpu.attend_paged``), which follows the table and
    reads the live pages in place, where the ``kernels`` choice takes it; else XLA's;
  * ``cuda``: a Pallas (Triton) kernel (``gpu_paged_decode_attention``), one program per
    (row, kv head, part of the row's pages), looping over live pages only. JAX's
    ``pallas.ops.gpu.paged_attention`` wants pages as [K, N, P, h], keys like values; this pool
    keeps the keys [h, P] per page, the layout the scores' product reads without a transpose
    (the CPU kernel and the contiguous cache share it);
  * ``tpu``: a Pallas TPU kernel (``tpu_paged_decode_attention``): grid (row, page), the table
    and lengths prefetched into scalar memory; a step past the row's last live page maps to that
    page again, which the pipeline does not fetch twice, and its compute is skipped. JAX's
    ragged paged attention (``pallas.ops.tpu.ragged_paged_attention``) takes pages natively but
    as [N, P, 2K, h] with keys and values interleaved: the layout of every platform's pool would
    have to follow the TPU's, and the CPU kernel and prefill view read [h, P] keys;
  * anything else, and shapes a kernel does not take: the row's pages gathered into a
    contiguous view and XLA's masked attention over it (``xla_paged_decode_attention``: every
    one of the W pages, live or not).

Prefill chunks (T > 1 queries a row) attend over ``view``: the row's first V pages gathered,
V the static width the engine's program was compiled for, with XLA's attention.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rao_jax.kernels import decode_cpu, mkl
from rao_jax.kernels.attention import MASK_VALUE, cache_rows_attention, cached_attention
from rao_jax.kernels.decode import (_GPU_MIN_ROWS, _online_softmax_step, _scaled_groups,
                                    xla_decode_attention)


def _check(q, k, v, pages, start):
  B, T, H, h = q.shape
  N, K, h_k, P = k.shape
  if (T != 1 or h_k != h or v.shape != (N, K, P, h) or H % K or pages.ndim != 2
      or pages.shape[0] != B or start.shape != (B,)):
    raise ValueError(f"paged_decode_attention: q {q.shape}, k {k.shape}, v {v.shape}, pages "
                     f"{pages.shape} and start {start.shape} do not fit [B, 1, H, h] / "
                     "[N, K, h, P] / [N, K, P, h] / [B, W] / [B], K | H")


# ---- writes and views (XLA, every platform) --------------------------------------------------
def slot_pages(pages_BxW, slots_BxT, num_pages: int, page_size: int):
  """(page_BxT, offset_BxT) of each row's slots: the page holding it, or ``num_pages`` (out of
  range, so a write there is dropped) where the row has no page (a negative entry, a padding
  row) or the slot is past its table."""
  W = pages_BxW.shape[1]
  w_BxT = slots_BxT // page_size
  page_BxT = jnp.take_along_axis(pages_BxW, jnp.minimum(w_BxT, W - 1), axis=1)
  page_BxT = jnp.where((w_BxT < W) & (page_BxT >= 0), page_BxT, num_pages)
  return page_BxT, slots_BxT % page_size


def write(k_NxKxhxP, v_NxKxPxh, k_BxTxKxh, v_BxTxKxh, page_BxT, offset_BxT):
  """The pool with the T new keys and values of each row written at (page, offset); writes
  to page N (``slot_pages``' no page) are dropped. In place when the pool is donated."""
  # Advanced indices split by slices: the indexed block is laid out [B, T, K, h].
  k = k_NxKxhxP.at[page_BxT, :, :, offset_BxT].set(k_BxTxKxh.astype(k_NxKxhxP.dtype),
                                                   mode="drop")
  v = v_NxKxPxh.at[page_BxT, :, offset_BxT, :].set(v_BxTxKxh.astype(v_NxKxPxh.dtype),
                                                   mode="drop")
  return k, v


def view(k_NxKxhxP, v_NxKxPxh, pages_BxW):
  """Each row's W pages gathered into a contiguous cache row of S = W P slots, the layout of
  ``Transformer.init_cache``: (keys [B, K, h, S], values [B, K, S, h]). A page the row does not
  have reads page 0: the caller masks slots past the row's length."""
  B, W = pages_BxW.shape
  N, K, h, P = k_NxKxhxP.shape
  pages_BxW = jnp.maximum(pages_BxW, 0)
  k_BxKxhxS = jnp.take(k_NxKxhxP, pages_BxW, axis=0).transpose(0, 2, 3, 1, 4)
  v_BxKxSxh = jnp.take(v_NxKxPxh, pages_BxW, axis=0).transpose(0, 2, 1, 3, 4)
  return k_BxKxhxS.reshape(B, K, h, W * P), v_BxKxSxh.reshape(B, K, W * P, h)


def view_attention(q_BxTxHxh, k_NxKxhxP, v_NxKxPxh, pages_BxW, visible_BxTxS, dtype):
  """XLA's attention of T queries per row over its gathered pages (a prefill chunk)."""
  return cached_attention(q_BxTxHxh, *view(k_NxKxhxP, v_NxKxPxh, pages_BxW), visible_BxTxS,
                          dtype)


# ---- XLA (every platform) --------------------------------------------------------------------
def xla_paged_decode_attention(q_Bx1xHxh, k_NxKxhxP, v_NxKxPxh, pages_BxW, start_B):
  """The reference: XLA's masked attention over each row's W pages gathered into a view."""
  if pages_BxW.shape[1] == 1:
    # One page a row is a contiguous cache whose rows are pages: read in place on CPU (no
    # gather), as the unpaged engine's decode did.
    P = k_NxKxhxP.shape[-1]
    visible_Bx1xP = (jnp.arange(P, dtype=jnp.int32)[None, None, :]
                     <= jnp.asarray(start_B, jnp.int32)[:, None, None])
    return cache_rows_attention(q_Bx1xHxh, k_NxKxhxP, v_NxKxPxh, visible_Bx1xP,
                                q_Bx1xHxh.dtype, jnp.maximum(pages_BxW[:, 0], 0))
  k_BxKxhxS, v_BxKxSxh = view(k_NxKxhxP, v_NxKxPxh, pages_BxW)
  return xla_decode_attention(q_Bx1xHxh, k_BxKxhxS, v_BxKxSxh, start_B)


# ---- GPU: Pallas (Triton) --------------------------------------------------------------------
def _gpu_fits(h: int, P: int) -> bool:
  # Triton's dot wants power-of-two operands of 16+ in each dimension: a page is one block.
  return h >= 16 and h & (h - 1) == 0 and P >= 16 and P & (P - 1) == 0


def _gpu_splits(W: int, P: int) -> int:
  """Parts a row's W pages are split into, each its own program (as ``decode._gpu_splits``:
  few long rows would otherwise run as few programs as the GPU has SMs): a whole number of
  pages of at least 1,024 slots each, at most 16 parts."""
  p = 16
  while p > 1 and (W * P // p < 1024 or W % p):
    p //= 2
  return p


def gpu_paged_decode_attention(q_Bx1xHxh, k_NxKxhxP, v_NxKxPxh, pages_BxW, start_B, *,
                               interpret: bool = False):
  """Paged decode attention by a Pallas Triton kernel (NVIDIA GPUs; ``interpret`` runs it on any
  backend, for tests). h and P must be powers of two >= 16.

  Grid (row, kv head, part of the row's pages): each program holds its g query heads (padded to
  16 rows for Triton's dot) and loops over its part's pages up to the row's last live one,
  loading each page's keys [h, P] and values [P, h] where the table says, with flash
  attention's running softmax in float32; the parts are combined outside the kernel.
  """
  from jax.experimental import pallas as pl   # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import triton as plgpu   # pylint: disable=g-import-not-at-top
  start_B = jnp.asarray(start_B, jnp.int32)
  _check(q_Bx1xHxh, k_NxKxhxP, v_NxKxPxh, pages_BxW, start_B)
  B, _, H, h = q_Bx1xHxh.shape
  N, K, _, P = k_NxKxhxP.shape
  W = pages_BxW.shape[1]
  g = H // K
  if not _gpu_fits(h, P):
    raise ValueError(f"gpu_paged_decode_attention: head dim {h} and page size {P} must be "
                     "powers of two >= 16")
  G = max(_GPU_MIN_ROWS, 1 << (g - 1).bit_length())
  q = jnp.pad(_scaled_groups(q_Bx1xHxh, K), ((0, 0), (0, 0), (0, G - g), (0, 0)))
  # A start past the table (the caller keeps it inside) reads every page, as XLA's mask.
  lengths_B = jnp.minimum(start_B + 1, W * P)
  pages_BxW = jnp.maximum(jnp.asarray(pages_BxW, jnp.int32), 0)
  parts = _gpu_splits(W, P)
  part_pages = W // parts
  f32 = q.dtype == jnp.float32

  def dot(a, b):
    # Full float32 products for float32 caches (Triton would use TF32 otherwise).
    return plgpu.dot(a, b, allow_tf32=not f32) if f32 else plgpu.dot(a, b)

  def kernel(len_ref, pages_ref, q_ref, k_ref, v_ref, o_ref, l_ref, m_ref):
    n = len_ref[()]
    first = pl.program_id(2) * part_pages
    q_Gxh = q_ref[...]

    def body(i, carry):
      o_prev, m_prev, l_prev = carry
      page = pages_ref[i]
      s = dot(q_Gxh, k_ref[page])                                   # [G, P]
      idx = i * P + jnp.arange(P, dtype=jnp.int32)[None, :]
      s = jnp.where(idx < n, s, MASK_VALUE)
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
      corr = jnp.exp(m_prev - m_next)
      p = jnp.exp(s - m_next[:, None])
      v_Pxh = v_ref[page]
      o_next = corr[:, None] * o_prev + dot(p.astype(v_Pxh.dtype), v_Pxh)
      return o_next, m_next, corr * l_prev + jnp.sum(p, axis=1)

    init = (jnp.zeros((G, h), jnp.float32), jnp.full((G,), MASK_VALUE, jnp.float32),
            jnp.zeros((G,), jnp.float32))
    last = jnp.minimum(pl.cdiv(n, P), first + part_pages)
    o, m, l = jax.lax.fori_loop(first, jnp.maximum(last, first), body, init)
    o_ref[...], l_ref[...], m_ref[...] = o, l, m

  part = lambda b, kv, j: (b, kv, j, 0, 0)   # noqa: E731
  o, l, m = pl.pallas_call(
      kernel,
      grid=(B, K, parts),
      in_specs=[pl.BlockSpec((None,), lambda b, kv, j: (b,)),
                pl.BlockSpec((None, W), lambda b, kv, j: (b, 0)),
                pl.BlockSpec((None, None, G, h), lambda b, kv, j: (b, kv, 0, 0)),
                pl.BlockSpec((N, None, h, P), lambda b, kv, j: (0, kv, 0, 0)),
                pl.BlockSpec((N, None, P, h), lambda b, kv, j: (0, kv, 0, 0))],
      out_specs=[pl.BlockSpec((None, None, None, G, h), part),
                 pl.BlockSpec((None, None, None, G), lambda b, kv, j: (b, kv, j, 0)),
                 pl.BlockSpec((None, None, None, G), lambda b, kv, j: (b, kv, j, 0))],
      out_shape=[jax.ShapeDtypeStruct((B, K, parts, G, h), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, parts, G), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, parts, G), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="rao_paged_decode_attention_gpu",
  )(lengths_B, pages_BxW, q, k_NxKxhxP, v_NxKxPxh)
  # Part 0 always holds a live slot, so the largest m is a real score's; parts past the row's
  # length (m = MASK_VALUE, l = 0) get weight 0.
  w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))
  out = jnp.sum(w[..., None] * o, axis=2) / jnp.sum(w * l, axis=2)[..., None]
  return out[:, :, :g].astype(q.dtype).reshape(B, 1, H, h)


# ---- TPU: Pallas -----------------------------------------------------------------------------
def tpu_paged_decode_attention(q_Bx1xHxh, k_NxKxhxP, v_NxKxPxh, pages_BxW, start_B, *,
                               interpret: bool = False):
  """Paged decode attention by a Pallas TPU kernel (``interpret`` runs it on any backend, for
  tests). Any page size; a multiple of 128 fills the vector lanes.

  Grid (row, page), the row lengths and the flattened page table prefetched into scalar
  memory; each program holds all K kv heads of its row. A step past the row's last live page
  maps to that page's block again, which the pipeline does not fetch twice, and its compute is
  skipped: a row's DMA covers its live pages. The running softmax lives in VMEM scratch.
  """
  from jax.experimental import pallas as pl   # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu   # pylint: disable=g-import-not-at-top
  start_B = jnp.asarray(start_B, jnp.int32)
  _check(q_Bx1xHxh, k_NxKxhxP, v_NxKxPxh, pages_BxW, start_B)
  B, _, H, h = q_Bx1xHxh.shape
  _, K, _, P = k_NxKxhxP.shape
  W = pages_BxW.shape[1]
  g = H // K
  q = _scaled_groups(q_Bx1xHxh, K)
  # A start past the table (the caller keeps it inside) reads every page, as XLA's mask.
  lengths_B = jnp.minimum(start_B + 1, W * P)
  # 1-D: scalar memory pads a 2-D array's last dimension.
  pages_BW = jnp.maximum(jnp.asarray(pages_BxW, jnp.int32), 0).reshape(B * W)

  def live_page(b, j, lens, pages):
    # lax.div (truncating; lens >= 1): jnp's floor division lowers through a sign, which Mosaic
    # lowers per TPU generation, so it would not export from a host without a TPU.
    return pages[b * W + jnp.minimum(j, jax.lax.div(lens[b] - 1, P))]

  def dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

  def kernel(len_ref, pages_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc):
    del pages_ref   # read by the index maps
    b, j = pl.program_id(0), pl.program_id(1)
    n = len_ref[b]

    @pl.when(j == 0)
    def _():
      m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
      l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
      acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j * P < n)
    def _():
      idx = j * P + jax.lax.broadcasted_iota(jnp.int32, (g, P), 1)
      for kv in range(K):   # K is small (1-8): unrolled 2-D products, as Mosaic likes them
        s = jnp.where(idx < n, dot(q_ref[kv], k_ref[kv]), MASK_VALUE)
        m, l, acc = _online_softmax_step(s, v_ref[kv], m_sc[kv], l_sc[kv], acc_sc[kv], dot)
        m_sc[kv], l_sc[kv], acc_sc[kv] = m, l, acc

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(B, W),
      in_specs=[
          pl.BlockSpec((None, K, g, h), lambda b, j, lens, pages: (b, 0, 0, 0)),
          pl.BlockSpec((None, K, h, P),
                       lambda b, j, lens, pages: (live_page(b, j, lens, pages), 0, 0, 0)),
          pl.BlockSpec((None, K, P, h),
                       lambda b, j, lens, pages: (live_page(b, j, lens, pages), 0, 0, 0)),
      ],
      out_specs=pl.BlockSpec((None, K, g, h), lambda b, j, lens, pages: (b, 0, 0, 0)),
      scratch_shapes=[pltpu.VMEM((K, g, 1), jnp.float32), pltpu.VMEM((K, g, 1), jnp.float32),
                      pltpu.VMEM((K, g, h), jnp.float32)])
  out = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((B, K, g, h), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret, name="rao_paged_decode_attention_tpu",
  )(lengths_B, pages_BW, q, k_NxKxhxP, v_NxKxPxh)
  return out.reshape(B, 1, H, h)


# ---- the entry point ---------------------------------------------------------------------------
def paged_decode_attention(q_Bx1xHxh, k_NxKxhxP, v_NxKxPxh, pages_BxW, start_B, *,
                           kernels: str = "auto"):
  """Attention of one new query per row over the slots [0, start_b] of its pages.

  The implementation follows the platform the program is lowered for (see the module doc);
  all compute the same function. Not differentiable (the engine's decode only).

  Args:
    q_Bx1xHxh: each row's query (after RoPE), in the cache's dtype.
    k_NxKxhxP, v_NxKxPxh: one layer's pool of N pages of P slots; H a multiple of K.
    pages_BxW: int32, each row's page table; the entries of the pages holding slots
      [0, start_b] must name pages in [0, N) (a row with negative entries there, a batch's
      padding row, reads page 0 and gets garbage).
    start_B: int, each row's write position (its query sees slots [0, start_b]).
    kernels: "auto" | "mkl" | "xla", the CPU kernel choice (the model's ``ModelConfig.kernels``).

  Returns:
    [B, 1, H, h] in q's dtype.
  """
  mkl.check_mode(kernels, "paged_decode_attention(kernels=...)")
  start_B = jnp.asarray(start_B, jnp.int32)
  pages_BxW = jnp.maximum(jnp.asarray(pages_BxW, jnp.int32), 0)
  _check(q_Bx1xHxh, k_NxKxhxP, v_NxKxPxh, pages_BxW, start_B)
  h, P = q_Bx1xHxh.shape[-1], k_NxKxhxP.shape[-1]
  same_dtype = q_Bx1xHxh.dtype == k_NxKxhxP.dtype == v_NxKxPxh.dtype
  xla = xla_paged_decode_attention

  def cpu(q, k, v, pages, start):
    if same_dtype and decode_cpu.usable(q.dtype, kernels):
      return decode_cpu.attend_paged(q, k, v, pages, start)
    return xla(q, k, v, pages, start)

  cuda = gpu_paged_decode_attention if same_dtype and _gpu_fits(h, P) else xla
  tpu = tpu_paged_decode_attention if same_dtype else xla
  return jax.lax.platform_dependent(q_Bx1xHxh, k_NxKxhxP, v_NxKxPxh, pages_BxW, start_B,
                                    cpu=cpu, cuda=cuda, tpu=tpu, default=xla)


__all__ = ["gpu_paged_decode_attention", "paged_decode_attention", "slot_pages",
           "tpu_paged_decode_attention", "view", "view_attention", "write",
           "xla_paged_decode_attention"]
