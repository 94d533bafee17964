"""Dense 2-D products of the model: MKL's sgemm on x86 CPUs, XLA's dot everywhere else.

``dense(a, b, trans_a, trans_b)`` is ``op(a) @ op(b)``. On CPU in float32 with both sides of
the result at least ``MIN_ROWS`` long it calls MKL's ``cblas_sgemm`` through an XLA FFI handler
(``csrc/mkl_gemm.cc``; built by ``mkl``, chosen by the ``kernels`` argument, the model's
``ModelConfig.kernels``: Intel CPUs under "auto"), in the program's CPU lowering only
(``jax.lax.platform_dependent``: lowered for a GPU or TPU, the same trace is XLA's dot). On an Intel Xeon, XLA:CPU's own kernels ran the
SmolLM2 training step's product shapes up to 30% below MKL (benchmarks/bench_cpu_kernels.py).
Anywhere else (GPU, TPU, bfloat16, decode-sized products) it is ``jax.lax.dot_general``;
results agree to float32 rounding. Traced under a multi-device mesh (``jax.set_mesh``: the
learner's step on a CPU device mesh, in tests) it is XLA's dot too: the partitioner splits a
dot over the mesh, where it would gather the FFI call's sharded operands onto every device.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rao_jax.kernels import mkl

MIN_ROWS = 64            # smaller products (decode steps) stay with XLA: no call overhead


def _uses_mkl(a, b, m: int, n: int, preferred_element_type, mode: str) -> bool:
  mesh = jax.sharding.get_abstract_mesh()
  return (a.dtype == jnp.float32 and b.dtype == jnp.float32
          and (preferred_element_type is None or jnp.dtype(preferred_element_type) == jnp.float32)
          and min(m, n) >= MIN_ROWS and (mesh.empty or mesh.size == 1) and mkl.active(mode))


def _mkl_call(a, b, trans_a: bool, trans_b: bool):
  m = a.shape[1] if trans_a else a.shape[0]
  n = b.shape[0] if trans_b else b.shape[1]
  return jax.ffi.ffi_call(mkl.GEMM, jax.ShapeDtypeStruct((m, n), jnp.float32),
                          vmap_method="sequential")(a, b, trans_a=trans_a, trans_b=trans_b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _mkl_dense(a, b, trans_a, trans_b, mode):
  return _mkl_call(a, b, trans_a, trans_b)


def _mkl_dense_fwd(a, b, trans_a, trans_b, mode):
  return _mkl_call(a, b, trans_a, trans_b), (a, b)


def _mkl_dense_bwd(trans_a, trans_b, mode, res, g_MxN):
  # C = op(A) op(B): dop(A) = g op(B)^T and dop(B) = op(A)^T g, each written as one product
  # of the stored operands (no transposed copies).
  a, b = res
  mm = functools.partial(dense, kernels=mode)
  da = mm(g_MxN, b, False, not trans_b) if not trans_a else mm(b, g_MxN, trans_b, True)
  db = mm(a, g_MxN, not trans_a, False) if not trans_b else mm(g_MxN, a, True, trans_a)
  return da, db


_mkl_dense.defvjp(_mkl_dense_fwd, _mkl_dense_bwd)


def dense(a, b, trans_a: bool = False, trans_b: bool = False, preferred_element_type=None,
          *, kernels: str = "auto"):
  """``op(a) @ op(b)`` for 2-D arrays, op = transpose where asked; differentiable.

  Args:
    a: [M, K], or [K, M] with ``trans_a``.
    b: [K, N], or [N, K] with ``trans_b``.
    preferred_element_type: as in ``jax.lax.dot_general`` (e.g. float32 for bfloat16 inputs).
    kernels: "auto" | "mkl" | "xla", the CPU kernel choice (``mkl.available``); a static
      Python string, so a jitted caller traces once per choice.
  """
  mkl.check_mode(kernels, "dense(kernels=...)")
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"dense takes 2-D operands, got {a.shape} and {b.shape}")
  m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
  kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
  if k != kb:
    raise ValueError(f"dense: op(a) is [{m}, {k}] but op(b) is [{kb}, {n}]")
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  xla = lambda a, b: jax.lax.dot_general(a, b, dims,
                                         preferred_element_type=preferred_element_type)
  if _uses_mkl(a, b, m, n, preferred_element_type, kernels):
    # MKL only in the program's CPU lowering: lowered (or exported) for a GPU or TPU, the same
    # trace carries XLA's dot and no CPU-only custom call.
    return jax.lax.platform_dependent(
        a, b, cpu=lambda a, b: _mkl_dense(a, b, trans_a, trans_b, kernels), default=xla)
  return xla(a, b)
