"""rao_jax.kernels.mkl (building and choosing the MKL kernels), mkl_attention, and the static
ModelConfig.kernels choice that picks them per model."""
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.kernels import matmul, mkl, mkl_attention
from rao_jax.model import ModelConfig, Transformer, transformer

X86_LINUX = platform.system() == "Linux" and platform.machine() == "x86_64"
needs_mkl = pytest.mark.skipif(not X86_LINUX, reason="MKL kernels are x86-64 Linux only")
# The kernels under test on any x86-64 Linux CPU ("auto" takes them on Intel only).
MODE = "mkl" if X86_LINUX else "xla"


def _hlo(fn, *args):
  return jax.jit(fn).lower(*args).as_text()


def test_auto_takes_mkl_on_intel_only(fresh_kernels):
  # On an Intel CPU the package installs for (setup.py pulls mkl in on x86-64 Linux), auto must
  # use the kernels: a CI machine that silently fell back to XLA would pass every other test.
  if not X86_LINUX:
    pytest.skip("MKL kernels are x86-64 Linux only")
  assert mkl.backend("auto") == ("mkl" if mkl._cpu_vendor() == "GenuineIntel" else "xla")
  for vendor, want in (("GenuineIntel", "mkl"), ("AuthenticAMD", "xla"), ("", "xla")):
    fresh_kernels.setattr(mkl, "_cpu_vendor", lambda v=vendor: v)
    mkl.reset()
    assert mkl.backend("auto") == want, vendor
    assert mkl.backend("mkl") == "mkl", vendor        # asked for: used on any x86 CPU
    assert mkl.backend("xla") == "xla", vendor


def test_cpuinfo_reads_fields_and_names_nothing_it_lacks():
  if X86_LINUX:
    assert mkl.cpuinfo("vendor_id") in ("GenuineIntel", "AuthenticAMD", "HygonGenuine")
    assert "sse2" in mkl.cpuinfo("flags").split()
  assert mkl.cpuinfo("no such field") == ""


def test_cpu_kind_tells_apart_cpus_a_vm_names_alike(monkeypatch):
  # Two EPYC generations a cloud VM names "AMD EPYC" alike: their vector sets tell them apart.
  for flags, want in (("fpu sse2 avx avx2 fma", "AMD EPYC (avx2)"),
                      ("sse2 avx2 avx512f avx512_bf16 avx512bw", "AMD EPYC (avx2, avx512f, "
                                                                 "avx512_bf16)"),
                      ("sse2 sse4_2", "AMD EPYC (no AVX2)")):
    monkeypatch.setattr(mkl, "cpuinfo", lambda f, flags=flags: {
        "model name": "AMD EPYC", "flags": flags}.get(f, ""))
    assert mkl.cpu_name() == want
  monkeypatch.setattr(mkl, "cpuinfo", lambda f: "")
  assert mkl.cpu_kind()["model"]      # never empty: the platform's name, else "unknown CPU"


def test_xla_choice_turns_it_off_and_bad_value_is_named():
  a = jnp.ones((128, 64), jnp.float32)
  assert mkl.backend("xla") == "xla"
  assert "rao_mkl_gemm" not in _hlo(lambda x, y: matmul.dense(x, y, kernels="xla"), a, a.T)
  if X86_LINUX:
    assert "rao_mkl_gemm" in _hlo(lambda x, y: matmul.dense(x, y, kernels="mkl"), a, a.T)
  with pytest.raises(ValueError, match=r"dense\(kernels=...\)='fastest'.*'auto'.*'mkl'.*'xla'"):
    matmul.dense(a, a.T, kernels="fastest")
  with pytest.raises(ValueError, match="ModelConfig.kernels='fastest'.*use 'auto'"):
    ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                mlp_dim=64, kernels="fastest")


@needs_mkl
def test_models_with_different_kernels_trace_separately_in_one_process():
  # One jitted function, the model's graph static (as the learner's step takes it): the choice
  # is in the static config, so each model gets its own trace, in either order. (Read from the
  # environment at trace time, the second model would reuse the first one's trace.)
  cfgs = {mode: ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            head_dim=16, mlp_dim=128, dtype="float32", param_dtype="float32",
                            kernels=mode) for mode in ("xla", "mkl")}
  B, T = 2, 48
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (B, T)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  seg = jnp.ones((B, T), jnp.int32)
  traces = []

  def forward(graphdef, state, tokens, pos, seg):
    traces.append(nnx.merge(graphdef, state).cfg.kernels)
    return nnx.merge(graphdef, state)(tokens, pos, seg)

  fwd = jax.jit(forward, static_argnums=0)
  split = {mode: nnx.split(Transformer(cfg, rngs=nnx.Rngs(0))) for mode, cfg in cfgs.items()}
  hlo = {mode: fwd.lower(gd, st, tokens, pos, seg).as_text() for mode, (gd, st) in split.items()}
  assert traces == ["xla", "mkl"]
  assert "rao_mkl_gemm" not in hlo["xla"] and mkl.ATTENTION_FWD not in hlo["xla"]
  assert "rao_mkl_gemm" in hlo["mkl"] and mkl.ATTENTION_FWD in hlo["mkl"]
  out = {mode: fwd(gd, st, tokens, pos, seg) for mode, (gd, st) in split.items()}
  assert len(traces) == 2                        # the calls reuse the two traces
  np.testing.assert_allclose(out["mkl"], out["xla"], rtol=1e-4, atol=1e-4)


def test_missing_mkl_falls_back_or_fails_clearly(fresh_kernels, caplog):
  def missing():
    raise mkl.CpuKernelsUnavailable("the 'mkl' package is not installed (pip install mkl)")
  fresh_kernels.setattr(mkl, "_mkl_lib_dir", missing)
  fresh_kernels.setattr(mkl.platform, "machine", lambda: "x86_64")
  fresh_kernels.setattr(mkl.platform, "system", lambda: "Linux")
  fresh_kernels.setattr(mkl, "_cpu_vendor", lambda: "GenuineIntel")
  assert mkl.backend("auto") == "xla"                  # auto: a warning, then XLA
  assert "pip install mkl" in caplog.text
  with pytest.raises(mkl.CpuKernelsUnavailable,     # asked for explicitly: an error
                     match="ModelConfig.kernels='mkl'.*pip install mkl"):
    mkl.backend("mkl")


@pytest.mark.skipif(not X86_LINUX, reason="MKL path is x86-64 Linux only")
def test_compile_failure_names_the_source_and_compiler_output(fresh_kernels, tmp_path):
  src = tmp_path / "csrc"
  src.mkdir()
  (src / "mkl_gemm.cc").write_text("this is not C++\n")
  fresh_kernels.setattr(mkl, "_SOURCE_DIR", str(src))
  fresh_kernels.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  with pytest.raises(mkl.CpuKernelsUnavailable, match="compiling .*csrc failed(?s:.*)this is not C"):
    mkl.backend("mkl")
  assert not list((tmp_path / "cache" / "rao_jax").glob("*.so"))   # nothing half-built kept


# ---- mkl_attention ------------------------------------------------------------------------------
def _qkv(B, T, H, K, h, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((B, T, H, h), (B, T, K, h), (B, T, K, h), (B, T, H, h)))


def _xla_attention(q, k, v, seg):
  """The model's XLA attention (transformer._causal_attention) on the same inputs."""
  T = q.shape[1]
  idx = jnp.arange(T)
  mask = (seg[:, :, None] == seg[:, None, :]) & (idx[:, None] >= idx[None, :])[None]
  return transformer._causal_attention(q, jnp.transpose(k, (0, 2, 3, 1)),
                                       jnp.transpose(v, (0, 2, 1, 3)), mask, jnp.float32, 64)


def _segments(B, T):
  # Row 0 one segment; row 1 two; row 2 three and padding (0) at the end; boundaries off the
  # kernel's 64-query blocks.
  seg = np.ones((B, T), np.int32)
  seg[1, 70:] = 2
  seg[2, 30:100] = 2
  seg[2, 100:T - 9] = 3
  seg[2, T - 9:] = 0
  return jnp.asarray(seg)


@needs_mkl
@pytest.mark.parametrize("B,T,H,K,h", [(3, 150, 6, 2, 16), (3, 130, 4, 4, 32), (3, 200, 8, 1, 8)])
def test_attention_matches_xla_values_and_gradients(B, T, H, K, h):
  # GQA groups of 3, plain multi-head, one shared kv head; T not a multiple of the query block.
  q, k, v, w = _qkv(B, T, H, K, h)
  seg = _segments(B, T)
  ours = lambda q, k, v: mkl_attention.causal_attention(q, k, v, seg)   # noqa: E731
  ref = lambda q, k, v: _xla_attention(q, k, v, seg)                    # noqa: E731
  assert mkl.ATTENTION_FWD in _hlo(ours, q, k, v)
  np.testing.assert_allclose(jax.jit(ours)(q, k, v), jax.jit(ref)(q, k, v), atol=2e-5, rtol=1e-4)
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * w)     # noqa: E731
  got = jax.jit(jax.grad(loss(ours), (0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(ref), (0, 1, 2)))(q, k, v)
  for name, g_, w_ in zip("qkv", got, want):
    assert g_.shape == w_.shape, name
    np.testing.assert_allclose(g_, w_, atol=1e-4 * float(jnp.abs(w_).max()), rtol=1e-4,
                               err_msg=f"d{name}")


@needs_mkl
def test_attention_skips_earlier_segments_exactly():
  # A query block reads keys from the first position of its segments on: many short segments
  # (most blocks start past key 0, some span a block boundary), a segment id that comes back
  # after another one (the start is its FIRST occurrence), and padding at the end.
  B, T, H, K, h = 2, 400, 4, 2, 16
  q, k, v, w = _qkv(B, T, H, K, h)
  seg = np.zeros((B, T), np.int32)
  seg[0, :390] = 1 + np.arange(390) // 90            # 5 segments of 90, then 10 of padding
  seg[1, :] = 1
  seg[1, 150:260] = 2
  seg[1, 260:] = 1                                   # id 1 again: sees keys 0..149 as well
  seg = jnp.asarray(seg)
  ours = lambda q, k, v: mkl_attention.causal_attention(q, k, v, seg)   # noqa: E731
  ref = lambda q, k, v: _xla_attention(q, k, v, seg)                    # noqa: E731
  np.testing.assert_allclose(jax.jit(ours)(q, k, v), jax.jit(ref)(q, k, v), atol=2e-5, rtol=1e-4)
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * w)     # noqa: E731
  got = jax.jit(jax.grad(loss(ours), (0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(ref), (0, 1, 2)))(q, k, v)
  for name, g_, w_ in zip("qkv", got, want):
    np.testing.assert_allclose(g_, w_, atol=1e-4 * float(jnp.abs(w_).max()), rtol=1e-4,
                               err_msg=f"d{name}")


@needs_mkl
def test_attention_never_reads_another_segment_or_a_later_token():
  # Changing keys/values of a later token or of another segment leaves an output unchanged.
  B, T, H, K, h = 3, 150, 6, 2, 16
  q, k, v, _ = _qkv(B, T, H, K, h)
  seg = _segments(B, T)
  f = jax.jit(lambda q, k, v: mkl_attention.causal_attention(q, k, v, seg))
  base = f(q, k, v)
  k2, v2 = k.at[1, 70:].add(3.0), v.at[1, 70:].add(3.0)    # row 1's second segment only
  out = f(q, k2, v2)
  np.testing.assert_array_equal(out[1, :70], base[1, :70])
  assert not np.allclose(out[1, 70:], base[1, 70:])
  k3, v3 = k.at[0, 100].add(5.0), v.at[0, 100].add(5.0)    # one later token in row 0
  out = f(q, k3, v3)
  np.testing.assert_array_equal(out[0, :100], base[0, :100])
  assert not np.allclose(out[0, 100], base[0, 100])


def test_attention_shape_errors_name_the_shapes():
  q, k, v, _ = _qkv(2, 8, 6, 4, 16)    # 4 kv heads do not divide 6 query heads
  with pytest.raises(ValueError, match=r"q \(2, 8, 6, 16\), k \(2, 8, 4, 16\)"):
    mkl_attention.causal_attention(q, k, v, jnp.ones((2, 8), jnp.int32))
  q, k, v, _ = _qkv(2, 8, 6, 3, 16)
  with pytest.raises(ValueError, match=r"segment ids \(2, 7\), expected \(2, 8\)"):
    mkl_attention.causal_attention(q, k, v, jnp.ones((2, 7), jnp.int32))


def test_attention_usable_only_for_float32_on_mkl():
  assert not mkl_attention.usable(jnp.bfloat16, MODE)
  assert mkl_attention.usable(jnp.float32, MODE) == (X86_LINUX and jax.default_backend() == "cpu")
  assert not mkl_attention.usable(jnp.float32, "xla")


@needs_mkl
def test_attention_under_a_device_mesh():
  # Sharded operands and no mesh set (jax.set_mesh): XLA gathers the call's operands, and the
  # results must not change. The learner sets its mesh, and the kernel then runs per device
  # (tests/test_accel_learner_mesh.py).
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  B, T, H, K, h = 4, 96, 4, 2, 16
  q, k, v, w = _qkv(B, T, H, K, h)
  seg = jnp.ones((B, T), jnp.int32)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))   # noqa: E731
  args = (put(q, P("data", None, "model")), put(k, P("data")), put(v, P("data")))
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, seg) * w)          # noqa: E731
  got = jax.jit(jax.value_and_grad(loss(mkl_attention.causal_attention), (0, 1, 2)))(*args)
  want = jax.value_and_grad(loss(lambda q, k, v, s: _xla_attention(q, k, v, s)), (0, 1, 2))(
      q, k, v)
  for g_, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g_, w_, rtol=1e-4, atol=1e-4)


def test_attention_without_the_kernels_says_so(fresh_kernels):
  def missing():
    raise mkl.CpuKernelsUnavailable("the 'mkl' package is not installed (pip install mkl)")
  fresh_kernels.setattr(mkl, "_mkl_lib_dir", missing)
  fresh_kernels.setattr(mkl.platform, "machine", lambda: "x86_64")
  fresh_kernels.setattr(mkl.platform, "system", lambda: "Linux")
  q, k, v, _ = _qkv(1, 8, 2, 1, 8)
  with pytest.raises(mkl.CpuKernelsUnavailable, match="needs the MKL kernels.*pip install mkl"):
    mkl_attention.causal_attention(q, k, v, jnp.ones((1, 8), jnp.int32))
