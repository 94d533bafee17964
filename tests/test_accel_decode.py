"""Decode attention over each row's live cache slots (rao_jax.kernels.decode): the CPU FFI
kernel, and the GPU and TPU Pallas kernels in interpret mode, against XLA's masked attention;
each reads only the slots its row holds (garbage past them changes nothing); the entry point
picks by kernel choice; and the model's cached decode with the kernel gives the tokens XLA's
gives and the logits of the full forward.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.kernels import attention, decode, decode_cpu, mkl
from rao_jax.model.transformer import Transformer
from rao_jax.testing import tiny_config

pytestmark = pytest.mark.slow

N, K, g, h, S = 5, 2, 3, 16, 1024      # 5 cache rows, 2 kv heads of 3 query heads each
START = np.array([0, 63, 64, 700, 1023], np.int32)  # block edges, a full row, a one-slot row

KERNELS = {
    "cpu_ffi": lambda q, k, v, s: decode_cpu.attend(q, k, v, jnp.arange(q.shape[0],
                                                                          dtype=jnp.int32), s),
    "gpu_pallas": functools.partial(decode.gpu_decode_attention, interpret=True),
    "tpu_pallas": functools.partial(decode.tpu_decode_attention, interpret=True),
}
# The granularity each kernel reads at: a Pallas kernel loads whole blocks of slots and masks
# the scores past the row's length inside its last block.
BLOCK = {"cpu_ffi": 1, "gpu_pallas": decode._GPU_BLOCK,   # pylint: disable=protected-access
         "tpu_pallas": decode._tpu_block(S)}              # pylint: disable=protected-access
TOL = {"float32": 2e-6, "bfloat16": 1e-2}


def _cache(dtype, garbage=0.0, block=1, B=4, seed=0):
  """q for the first B rows and a cache whose slots past each row's start hold ``garbage``
  from the end of the row's last block of ``block`` slots on, and 1000 before that."""
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (B, 1, K * g, h), jnp.float32).astype(dtype)
  k = np.array(jax.random.normal(keys[1], (N, K, h, S), jnp.float32))
  v = np.array(jax.random.normal(keys[2], (N, K, S, h), jnp.float32))
  for r, s in enumerate(START):
    end = -(-(s + 1) // block) * block
    k[r, :, :, s + 1:end], v[r, :, s + 1:end, :] = 1000.0, 1000.0
    k[r, :, :, end:], v[r, :, end:, :] = garbage, garbage
  return q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(START[:B])


@pytest.fixture(scope="module", autouse=True)
def cpu_kernel_builds():
  if not decode_cpu.available("auto"):
    pytest.skip("the CPU decode kernel cannot be built here (no C++ compiler)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_matches_xla_and_reads_only_live_slots(name, dtype):
  # XLA's reference reads every slot (zeros past each row's length); the kernel gets NaN past
  # the block holding the row's last slot, which would reach its output if it read a single
  # one of those slots, and large values inside that block, which its mask must remove.
  q, k, v, start = _cache(dtype, garbage=0.0)
  k = jnp.where(jnp.arange(S) <= jnp.asarray(START)[:, None, None, None], k, 0)
  v = jnp.where(jnp.arange(S)[:, None] <= jnp.asarray(START)[:, None, None, None], v, 0)
  want = np.asarray(jax.jit(decode.xla_decode_attention)(q, k, v, start), np.float32)
  _, k_nan, v_nan, _ = _cache(dtype, garbage=np.nan, block=BLOCK[name])
  got = np.asarray(jax.jit(KERNELS[name])(q, k_nan, v_nan, start), np.float32)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_gpu_kernel_splits_long_rows_into_parts():
  """At 4,096 slots the GPU kernel runs each row as 4 parts (own programs) and combines their
  softmaxes: rows ending in each part, and the export for cuda, as at 1,024 slots."""
  S_long = 4096
  assert decode._gpu_splits(S_long) == 4   # pylint: disable=protected-access
  keys = jax.random.split(jax.random.key(2), 3)
  q = jax.random.normal(keys[0], (4, 1, K * g, h), jnp.float32)
  k = jax.random.normal(keys[1], (4, K, h, S_long), jnp.float32)
  v = jax.random.normal(keys[2], (4, K, S_long, h), jnp.float32)
  start = jnp.asarray([5, 1500, 3071, 4095], jnp.int32)
  kernel = jax.jit(functools.partial(decode.gpu_decode_attention, interpret=True))
  np.testing.assert_allclose(kernel(q, k, v, start), decode.xla_decode_attention(q, k, v, start),
                             atol=2e-6, rtol=2e-6)
  exported = jax.export.export(
      jax.jit(decode.gpu_decode_attention), platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          q, k, v, start)
  assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_cpu_kernel_reads_scattered_rows_and_several_queries():
  """The FFI kernel's general form: T queries per row over cache rows in any order, query t
  seeing slots [0, start + t], against XLA's attention over the gathered rows."""
  T = 3
  _, k, v, _ = _cache("float32", garbage=0.0)
  rows = jnp.asarray([4, 1, 1, 3], jnp.int32)
  start = jnp.asarray([10, 0, 60, 253], jnp.int32)
  q = jax.random.normal(jax.random.key(1), (4, T, K * g, h), jnp.float32)
  visible = jnp.arange(S)[None, None, :] <= (start[:, None] + jnp.arange(T)[None])[:, :, None]
  want = attention.cached_attention(q, jnp.take(k, rows, axis=0), jnp.take(v, rows, axis=0),
                                    visible, jnp.float32)
  got = jax.jit(decode_cpu.attend)(q, k, v, rows, start)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


def test_cpu_kernel_refuses_a_row_outside_the_cache():
  q, k, v, _ = _cache("float32", garbage=0.0, B=1)
  with pytest.raises(Exception, match="outside the cache"):
    jax.block_until_ready(decode_cpu.attend(q, k, v, jnp.asarray([N], jnp.int32),
                                            jnp.asarray([3], jnp.int32)))


@pytest.mark.parametrize("choice,has_kernel", [("auto", True), ("xla", False)])
def test_entry_point_follows_the_kernel_choice(choice, has_kernel):
  q, k, v, start = _cache("float32", garbage=0.0)
  fn = jax.jit(functools.partial(decode.decode_attention, kernels=choice))
  text = fn.lower(q, k, v, start).as_text()
  assert (decode_cpu.TARGET in text) == has_kernel
  want = decode.xla_decode_attention(q, k, v, start)
  np.testing.assert_allclose(fn(q, k, v, start), want, atol=2e-6, rtol=2e-6)


def test_entry_point_rejects_bad_shapes():
  q, k, v, start = _cache("float32", garbage=0.0)
  with pytest.raises(ValueError, match="do not fit"):
    decode.decode_attention(jnp.concatenate([q, q], axis=1), k, v, start)
  with pytest.raises(ValueError, match="do not fit"):
    decode.decode_attention(q, k, v, start[:2])
  with pytest.raises(ValueError, match="not a kernel choice"):
    decode.decode_attention(q, k, v, start, kernels="fast")


def _greedy(model, prompt_1xP, n_new: int, S_cache: int = 64):
  """Prefill then greedy cached decode one token at a time; (tokens, each step's logits)."""
  fns, params = model.inference_fns(), model.inference_params()
  step = jax.jit(fns, donate_argnums=(3,))
  cache = model.init_cache(batch_size=2, max_len=S_cache)
  P = prompt_1xP.shape[1]
  # Two rows: row 1 holds a shorter context, so rows of different lengths share each step.
  tokens_2xP = jnp.concatenate([prompt_1xP, prompt_1xP[:, ::-1]])
  lens = jnp.asarray([P, P - 5], jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (2, P))
  hidden, cache = step(params, tokens_2xP, pos, cache, jnp.zeros(2, jnp.int32))
  last = jnp.take_along_axis(hidden, (lens - 1)[:, None, None], axis=1)
  logits = [fns.logits(params, last)[:, 0]]
  toks = [jnp.argmax(logits[-1], -1).astype(jnp.int32)]
  for _ in range(n_new - 1):
    hidden, cache = step(params, toks[-1][:, None], lens[:, None], cache, lens)
    logits.append(fns.logits(params, hidden)[:, 0])
    toks.append(jnp.argmax(logits[-1], -1).astype(jnp.int32))
    lens = lens + 1
  return np.stack(toks, 1), np.stack(logits, 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_decode_with_the_kernel_equals_xla_tokens_and_full_forward(dtype):
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, 49152, (1, 12)), jnp.int32)
  n_new = 20
  runs = {}
  for choice in ("auto", "xla"):
    model = Transformer(tiny_config(kernels=choice, dtype=dtype), rngs=nnx.Rngs(0))
    runs[choice] = _greedy(model, prompt, n_new)
  np.testing.assert_array_equal(runs["auto"][0], runs["xla"][0])
  tol = 1e-4 if dtype == "float32" else 5e-2
  np.testing.assert_allclose(runs["auto"][1], runs["xla"][1], atol=tol, rtol=tol)
  # Row 0's decode logits against the full forward over its whole sequence.
  toks, logits = runs["auto"]
  seq = np.concatenate([np.asarray(prompt[0]), toks[0]])[None]
  n = seq.shape[1] - 1
  hidden = model(jnp.asarray(seq[:, :n]), jnp.arange(n)[None], jnp.ones((1, n), jnp.int32))
  full = np.asarray(model.logits(hidden))[0, prompt.shape[1] - 1:]
  np.testing.assert_allclose(logits[0], full, atol=tol, rtol=tol)


def test_mkl_library_leaves_the_decode_kernel_out():
  """The MKL library is built from the MKL handlers only: the decode kernel needs no MKL."""
  names = [s.rsplit("/", 1)[-1] for s in mkl._sources()]   # pylint: disable=protected-access
  assert "decode_attention.cc" not in names and "mkl_attention.cc" in names
