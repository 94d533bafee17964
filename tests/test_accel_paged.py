"""The paged KV cache's kernels (rao_jax.kernels.paged): decode attention through a page table by
the CPU FFI kernel and the GPU and TPU Pallas kernels (interpret mode) against XLA's attention
over the gathered pages, each reading only the live pages its table names (pages it does not
name, and its pages past the live ones, hold NaN); writes through the table (a slot without a
page is dropped); and the model's cached forward over a paged pool gives the tokens and logits
of the contiguous cache.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.kernels import attention, decode, decode_cpu, paged
from rao_jax.model.transformer import Transformer
from rao_jax.testing import tiny_config

pytestmark = pytest.mark.slow

N, K, g, h, P, W = 24, 2, 3, 16, 16, 6   # a pool of 24 pages of 16 slots; rows of up to 6 pages
START = np.array([0, 15, 16, 40, 95], np.int32)   # page edges, a full table, a one-slot row

KERNELS = {
    "cpu_ffi": decode_cpu.attend_paged,
    "gpu_pallas": functools.partial(paged.gpu_paged_decode_attention, interpret=True),
    "tpu_pallas": functools.partial(paged.tpu_paged_decode_attention, interpret=True),
}
TOL = {"float32": 2e-6, "bfloat16": 1e-2}


def _pool(dtype, seed=0):
  """q, a pool and each row's page table: scattered pages, -1 past the live ones; the live
  pages' slots past a row's start hold 1000 (a kernel must mask them), every page no live slot
  lives in holds NaN (a kernel must never read it)."""
  rng = np.random.default_rng(seed)
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (len(START), 1, K * g, h), jnp.float32).astype(dtype)
  k = np.full((N, K, h, P), np.nan, np.float32)
  v = np.full((N, K, P, h), np.nan, np.float32)
  kv_k = np.asarray(jax.random.normal(keys[1], (N, K, h, P), jnp.float32))
  kv_v = np.asarray(jax.random.normal(keys[2], (N, K, P, h), jnp.float32))
  order = rng.permutation(N)
  pages = np.full((len(START), W), -1, np.int32)
  used = 0
  for b, s in enumerate(START):
    live = s // P + 1
    pages[b, :live] = order[used:used + live]
    # A page past the live ones in the table (reserved for the next writes): NaN too.
    if live < W:
      pages[b, live] = order[used + live]
    used += live + 1
    for w in range(live):
      p = pages[b, w]
      k[p], v[p] = kv_k[p], kv_v[p]
      if w == live - 1:
        k[p, :, :, s % P + 1:], v[p, :, s % P + 1:, :] = 1000.0, 1000.0
  return (q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(pages),
          jnp.asarray(START))


def _clean(k, v):
  """The pool with NaN and 1000 replaced by 0 (what XLA's reference, which reads every slot of
  the gathered view and masks by length, may read)."""
  bad = lambda x: jnp.isnan(x) | (x == 1000)   # noqa: E731
  return jnp.where(bad(k), 0, k), jnp.where(bad(v), 0, v)


@pytest.fixture(scope="module", autouse=True)
def cpu_kernel_builds():
  if not decode_cpu.available("auto"):
    pytest.skip("the CPU decode kernel cannot be built here (no C++ compiler)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_matches_xla_and_reads_only_live_pages(name, dtype):
  q, k, v, pages, start = _pool(dtype)
  want = np.asarray(jax.jit(paged.xla_paged_decode_attention)(q, *_clean(k, v), pages, start),
                    np.float32)
  got = np.asarray(jax.jit(KERNELS[name])(q, k, v, jnp.maximum(pages, 0), start), np.float32)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_paged_cpu_kernel_equals_the_contiguous_one_bit_for_bit():
  """A row gathered into contiguous slots and the same row read through its pages give the
  same bits: the kernel sums each score over the head dim in one order whatever the pages."""
  q, k, v, pages, start = _pool("float32")
  k0, v0 = _clean(k, v)
  rows_k, rows_v = paged.view(k0, v0, pages)
  contiguous = decode_cpu.attend(q, rows_k, rows_v, jnp.arange(len(START), dtype=jnp.int32),
                                 start)
  np.testing.assert_array_equal(decode_cpu.attend_paged(q, k0, v0, pages, start), contiguous)
  # XLA's reference over a one-page table (rows read in place) is its contiguous attention.
  rows_B1 = jnp.asarray([[4], [0], [3], [1], [2]], jnp.int32)
  np.testing.assert_array_equal(
      paged.xla_paged_decode_attention(q, rows_k, rows_v, rows_B1, start),
      decode.xla_decode_attention(q, jnp.take(rows_k, rows_B1[:, 0], axis=0),
                                  jnp.take(rows_v, rows_B1[:, 0], axis=0), start))


# (T, H, K, h, P): SmolLM2-135M's heads and page; Llama-3.2-1B's and Qwen3-4B's (h 128, 4 query
# heads a kv head); more query rows a group than one register block (T g = 12) on pages of 33
# slots (whole vectors and a tail in each page); a head dim of no whole vector (the plain loop).
MODEL_SHAPES = [(1, 9, 3, 64, 64), (1, 32, 8, 128, 64), (4, 6, 2, 64, 33), (2, 6, 2, 40, 16)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T,H,Kh,hd,Ps", MODEL_SHAPES)
def test_cpu_kernel_at_model_shapes(T, H, Kh, hd, Ps, dtype):
  """The CPU kernel's register blocks (kv vectors of 16 or 8 floats, groups of query rows) at
  the head shapes of the models the engine serves: against XLA's attention over the gathered
  rows, and read through pages bit for bit as through the contiguous rows (each score and
  output sums in one order wherever a page, a vector or a register block begins)."""
  rng = np.random.default_rng(hd + Ps)
  Wd, B = 4, 3
  start = np.array([0, Ps - 1, Wd * Ps - T], np.int32)   # one slot, a page edge, a full table
  q = jnp.asarray(rng.standard_normal((B, T, H, hd)), dtype)
  k = jnp.asarray(rng.standard_normal((B * Wd + 2, Kh, hd, Ps)) * 2, dtype)
  v = jnp.asarray(rng.standard_normal((B * Wd + 2, Kh, Ps, hd)), dtype)
  pages = jnp.asarray(rng.permutation(B * Wd + 2)[:B * Wd].reshape(B, Wd), jnp.int32)
  rows_k, rows_v = paged.view(k, v, pages)
  visible = (jnp.arange(Wd * Ps)[None, None, :]
             <= (jnp.asarray(start)[:, None] + jnp.arange(T)[None])[:, :, None])
  want = attention.cached_attention(q, rows_k, rows_v, visible, q.dtype)   # as the model calls it
  got = jax.jit(decode_cpu.attend_paged)(q, k, v, pages, jnp.asarray(start))
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=TOL[dtype], rtol=TOL[dtype])
  contiguous = decode_cpu.attend(q, rows_k, rows_v, jnp.arange(B, dtype=jnp.int32),
                                 jnp.asarray(start))
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(contiguous, np.float32))


def test_gpu_kernel_splits_long_rows_into_parts():
  """At 4,096 slots a row runs as 4 parts of 16 pages (own programs) whose softmaxes are
  combined; rows ending in each part, and the export for cuda."""
  Pl, Wl, B = 64, 64, 4
  assert paged._gpu_splits(Wl, Pl) == 4   # pylint: disable=protected-access
  keys = jax.random.split(jax.random.key(2), 3)
  q = jax.random.normal(keys[0], (B, 1, K * g, h), jnp.float32)
  k = jax.random.normal(keys[1], (B * Wl, K, h, Pl), jnp.float32)
  v = jax.random.normal(keys[2], (B * Wl, K, Pl, h), jnp.float32)
  pages = jnp.asarray(np.random.default_rng(3).permutation(B * Wl).reshape(B, Wl), jnp.int32)
  start = jnp.asarray([5, 1500, 3071, 4095], jnp.int32)
  kernel = jax.jit(functools.partial(paged.gpu_paged_decode_attention, interpret=True))
  np.testing.assert_allclose(kernel(q, k, v, pages, start),
                             paged.xla_paged_decode_attention(q, k, v, pages, start),
                             atol=2e-6, rtol=2e-6)
  exported = jax.export.export(
      jax.jit(paged.gpu_paged_decode_attention), platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          q, k, v, pages, start)
  assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_cpu_kernel_refuses_a_page_outside_the_pool():
  q, k, v, pages, start = _pool("float32")
  with pytest.raises(Exception, match="outside the cache"):
    jax.block_until_ready(decode_cpu.attend_paged(q, k, v, pages.at[3, 1].set(N), start))


@pytest.mark.parametrize("choice,has_kernel", [("auto", True), ("xla", False)])
def test_entry_point_follows_the_kernel_choice(choice, has_kernel):
  q, k, v, pages, start = _pool("float32")
  k, v = _clean(k, v)
  fn = jax.jit(functools.partial(paged.paged_decode_attention, kernels=choice))
  assert (decode_cpu.TARGET in fn.lower(q, k, v, pages, start).as_text()) == has_kernel
  want = paged.xla_paged_decode_attention(q, k, v, pages, start)
  np.testing.assert_allclose(fn(q, k, v, pages, start), want, atol=2e-6, rtol=2e-6)
  with pytest.raises(ValueError, match="do not fit"):
    paged.paged_decode_attention(q, k, v, pages[:2], start, kernels=choice)


def test_writes_follow_the_table_and_drop_slots_without_a_page():
  k = jnp.zeros((4, 1, 2, 4))
  v = jnp.zeros((4, 1, 4, 2))
  pages_BxW = jnp.asarray([[2, 0], [3, -1]], jnp.int32)
  slots_BxT = jnp.asarray([[3, 4], [3, 4]], jnp.int32)    # row 1's slot 4 has no page
  page, off = paged.slot_pages(pages_BxW, slots_BxT, 4, 4)
  np.testing.assert_array_equal(page, [[2, 0], [3, 4]])
  np.testing.assert_array_equal(off, [[3, 0], [3, 0]])
  new_k = jnp.arange(1, 5, dtype=jnp.float32).reshape(2, 2, 1, 1) * jnp.ones((2, 2, 1, 2))
  k2, v2 = paged.write(k, v, new_k, new_k, page, off)
  assert float(k2[2, 0, 0, 3]) == 1 and float(k2[0, 0, 0, 0]) == 2 and float(k2[3, 0, 0, 3]) == 3
  assert float(jnp.sum(k2)) == 2 * (1 + 2 + 3) and float(jnp.sum(v2)) == 2 * (1 + 2 + 3)


def _greedy(model, prompt_1xT, n_new, paged_pool: bool):
  """Prefill then greedy cached decode of two rows of different lengths, on a contiguous cache
  or a pool whose pages each row names in scattered order; (tokens, logits per step)."""
  fns, params = model.inference_fns(), model.inference_params()
  step = jax.jit(fns, donate_argnums=(3,))
  Pg, Wg = 8, 8
  if paged_pool:
    cache = model.init_cache(batch_size=2 * Wg + 3, max_len=Pg)
    kw = {"pages_BxW": jnp.asarray(np.random.default_rng(0).permutation(2 * Wg + 3)[:2 * Wg]
                                   .reshape(2, Wg), jnp.int32)}
  else:
    cache, kw = model.init_cache(batch_size=2, max_len=Pg * Wg), {}
  T = prompt_1xT.shape[1]
  tokens_2xT = jnp.concatenate([prompt_1xT, prompt_1xT[:, ::-1]])
  lens = jnp.asarray([T, T - 5], jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
  hidden, cache = step(params, tokens_2xT, pos, cache, jnp.zeros(2, jnp.int32), **kw)
  last = jnp.take_along_axis(hidden, (lens - 1)[:, None, None], axis=1)
  logits = [fns.logits(params, last)[:, 0]]
  toks = [jnp.argmax(logits[-1], -1).astype(jnp.int32)]
  for _ in range(n_new - 1):
    hidden, cache = step(params, toks[-1][:, None], lens[:, None], cache, lens, **kw)
    logits.append(fns.logits(params, hidden)[:, 0])
    toks.append(jnp.argmax(logits[-1], -1).astype(jnp.int32))
    lens = lens + 1
  return np.stack(toks, 1), np.stack(logits, 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_decode_over_pages_equals_the_contiguous_cache(dtype):
  """Prefill writes through the table and attends over the gathered pages; decode reads the
  live pages (the CPU kernel): the same greedy tokens as the contiguous cache, and the same
  logits up to the sums' order (the prefill's view is laid out as the contiguous row)."""
  prompt = jnp.asarray(np.random.default_rng(1).integers(0, 49152, (1, 13)), jnp.int32)
  model = Transformer(tiny_config(dtype=dtype), rngs=nnx.Rngs(0))
  toks_p, logits_p = _greedy(model, prompt, 24, paged_pool=True)    # crosses 3 pages
  toks_c, logits_c = _greedy(model, prompt, 24, paged_pool=False)
  np.testing.assert_array_equal(toks_p, toks_c)
  tol = 1e-5 if dtype == "float32" else 2e-2
  np.testing.assert_allclose(logits_p, logits_c, atol=tol, rtol=tol)
