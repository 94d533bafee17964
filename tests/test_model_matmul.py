"""rao_jax.kernels.matmul: MKL's sgemm through XLA FFI for the model's float32 CPU products."""
import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.kernels import matmul, mkl

X86_LINUX = platform.system() == "Linux" and platform.machine() == "x86_64"
# The kernels under test on any x86-64 Linux CPU ("auto" takes them on Intel only).
MODE = "mkl" if X86_LINUX else "xla"
dense = functools.partial(matmul.dense, kernels=MODE)


def _hlo(fn, *args):
  return jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_dense_matches_xla_values_and_gradients(trans_a, trans_b):
  # 300 rows: several chunks of unequal size over the pool's threads.
  rng = np.random.default_rng(0)
  m, k, n = 300, 96, 130
  a = jnp.asarray(rng.standard_normal((k, m) if trans_a else (m, k)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((n, k) if trans_b else (k, n)), jnp.float32)

  def ours(a, b):
    return dense(a, b, trans_a, trans_b)

  def ref(a, b):
    return (a.T if trans_a else a) @ (b.T if trans_b else b)

  if X86_LINUX:
    assert "rao_mkl_gemm" in _hlo(ours, a, b)
  np.testing.assert_allclose(jax.jit(ours)(a, b), ref(a, b), rtol=1e-5, atol=1e-4)
  loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))   # noqa: E731
  got = jax.jit(jax.grad(loss(ours), (0, 1)))(a, b)
  want = jax.grad(loss(ref), (0, 1))(a, b)
  for g, w in zip(got, want):
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_small_bf16_and_mixed_products_stay_with_xla():
  a = jnp.ones((8, 96), jnp.float32)     # a decode step's rows: below MIN_ROWS
  w = jnp.ones((96, 128), jnp.float32)
  assert "rao_mkl_gemm" not in _hlo(dense, a, w)
  big = jnp.ones((128, 96), jnp.bfloat16)
  out = jax.jit(lambda x, y: dense(x, y, preferred_element_type=jnp.float32))(
      big, w.astype(jnp.bfloat16))
  assert out.dtype == jnp.float32 and float(out[0, 0]) == 96.0
  assert "rao_mkl_gemm" not in _hlo(dense, big, w.astype(jnp.bfloat16))


def test_shape_errors_name_the_shapes():
  with pytest.raises(ValueError, match=r"\[4, 5\].*\[6, 7\]"):
    dense(jnp.ones((4, 5)), jnp.ones((6, 7)))
  with pytest.raises(ValueError, match="2-D"):
    dense(jnp.ones((2, 4, 5)), jnp.ones((5, 7)))


@pytest.mark.skipif(not X86_LINUX, reason="MKL path is x86-64 Linux only")
def test_model_gradients_agree_between_mkl_and_xla():
  # The whole model's loss and gradients through MKL (every block's products and attention)
  # equal XLA's.
  from rao_jax.model import ModelConfig, Transformer, token_logprob_sum
  cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=16, mlp_dim=128, dtype="float32", param_dtype="float32",
                    kernels="mkl")
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(1)
  B, T = 2, 48
  tokens = jnp.asarray(rng.integers(0, 256, (B, T + 1)))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  seg = jnp.ones((B, T), jnp.int32)
  coef = jnp.full((B, T), -1.0 / (B * T))

  def loss(state, graphdef):
    m = nnx.merge(graphdef, state)
    return token_logprob_sum(m, m(tokens[:, :-1], pos, seg), tokens[:, 1:], coef, chunk=64)[0]

  fn = jax.jit(jax.value_and_grad(loss), static_argnums=1)

  def run(graphdef):
    return fn.lower(state, graphdef).as_text(), fn(state, graphdef)

  hlo_mkl, (l_mkl, g_mkl) = run(graphdef)
  assert hlo_mkl.count("rao_mkl_gemm") >= 10
  assert mkl.ATTENTION_FWD in hlo_mkl and mkl.ATTENTION_BWD in hlo_mkl
  hlo_xla, (l_xla, g_xla) = run(nnx.split(Transformer(cfg.replace(kernels="xla"),
                                                     rngs=nnx.Rngs(0)))[0])
  assert "rao_mkl_gemm" not in hlo_xla and mkl.ATTENTION_FWD not in hlo_xla
  np.testing.assert_allclose(l_mkl, l_xla, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_mkl), jax.tree.leaves(g_xla)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_sharded_operands_give_the_same_result_and_gradients():
  # Sharded operands and no mesh set (jax.set_mesh): the opaque call gets gathered operands
  # (a CPU mesh is for tests; accelerators take XLA's dot), and results must not change.
  # Under a mesh set around the trace (the learner's step) dense is XLA's dot.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((128, 192)), jnp.float32)
  a_s = jax.device_put(a, NamedSharding(mesh, P("data", None)))
  w_s = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
  loss = lambda f: lambda a, w: jnp.sum(jnp.sin(f(a, w)))   # noqa: E731
  got = jax.jit(jax.value_and_grad(loss(dense), (0, 1)))(a_s, w_s)
  want = jax.value_and_grad(loss(jnp.dot), (0, 1))(a, w)
  for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w_, rtol=1e-4, atol=1e-4)
