"""Dense 2-D products of the model: MKL's sgemm on x86 CPUs, XLA's dot everywhere else.

``dense(a, b, trans_a, trans_b)`` is ``op(a) @ op(b)``. On CPU in float32 with both sides of
the result at least ``MIN_ROWS`` long it calls MKL's ``cblas_sgemm`` through an XLA FFI handler
(``csrc/mkl_gemm.cc``): on the SmolLM2 training step's product shapes XLA:CPU's own kernels ran
up to 30% below MKL (the peer PyTorch uses MKL too), and the whole 4 x 512 forward+backward step
ran 1.09x faster with MKL (benchmarks/bench_cpu_gemm.py). Anywhere else (GPU, TPU, bfloat16,
decode-sized products) it is ``jax.lax.dot_general``; results agree to float32 rounding. Under a
CPU device mesh (tests) XLA gathers the call's sharded operands first: correct, not fast.

The handler is compiled once per machine on first use (a C++ compiler, ~5 s) into
``$XDG_CACHE_HOME/rao_jax`` (default ``~/.cache/rao_jax``) and linked against the ``mkl``
wheel. ``RAO_JAX_CPU_GEMM`` chooses: ``auto`` (default: MKL where it can be built, else XLA with
one warning naming the reason), ``mkl`` (an error if it cannot be built) or ``xla``.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from absl import logging

ENV = "RAO_JAX_CPU_GEMM"
MIN_ROWS = 64            # smaller products (decode steps) stay with XLA: no call overhead
_TARGET = "rao_mkl_gemm"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "mkl_gemm.cc")
_MKL_LIBS = ("mkl_intel_lp64", "mkl_sequential", "mkl_core")


class CpuGemmUnavailable(RuntimeError):
  """MKL's sgemm cannot be used here (the message says why and what to install)."""


def _checked(mode: str) -> str:
  mode = mode.strip().lower() or "auto"
  if mode not in ("auto", "mkl", "xla"):
    raise ValueError(f"{ENV}={mode!r}: expected 'auto', 'mkl' or 'xla'")
  return mode


def _mode() -> str:
  return _checked(os.environ.get(ENV, "auto"))


def _mkl_lib_dir() -> str:
  """The folder holding the mkl wheel's shared libraries."""
  try:
    files = importlib.metadata.files("mkl") or []
  except importlib.metadata.PackageNotFoundError:
    files = []
  for f in files:
    if os.path.basename(str(f)).startswith("libmkl_core.so"):
      return os.path.dirname(str(f.locate()))
  raise CpuGemmUnavailable("the 'mkl' package is not installed (pip install mkl; x86-64 Linux)")


def _lib_file(lib_dir: str, name: str) -> str:
  found = sorted(glob.glob(os.path.join(lib_dir, f"lib{name}.so*")))
  if not found:
    raise CpuGemmUnavailable(f"lib{name}.so not found in {lib_dir}: reinstall 'mkl'")
  return os.path.basename(found[-1])


def _cache_dir() -> str:
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "rao_jax")


def _build() -> str:
  """Path of the compiled handler library, compiling it if this machine has none yet."""
  if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
    raise CpuGemmUnavailable(f"MKL needs x86-64 Linux, this is {platform.system()} "
                             f"{platform.machine()}")
  lib_dir = _mkl_lib_dir()
  libs = [_lib_file(lib_dir, n) for n in _MKL_LIBS]
  cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if not cxx:
    raise CpuGemmUnavailable("no C++ compiler found (apt-get install g++, or set CXX)")
  with open(_SOURCE, "rb") as f:
    source = f.read()
  key = hashlib.sha256(b"\0".join([source, jax.__version__.encode(), lib_dir.encode(),
                                   cxx.encode(), *(l.encode() for l in libs)])).hexdigest()[:16]
  out = os.path.join(_cache_dir(), f"mkl_gemm-{key}.so")
  if os.path.exists(out):
    return out
  os.makedirs(_cache_dir(), exist_ok=True)
  # Compiled to a temporary name and renamed: processes building at once never load half a file.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
  os.close(fd)
  cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
         _SOURCE, "-o", tmp, f"-L{lib_dir}", *(f"-l:{l}" for l in libs),
         f"-Wl,-rpath,{lib_dir}"]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
      raise CpuGemmUnavailable(f"compiling {_SOURCE} failed ({' '.join(cmd)}):\n"
                               f"{proc.stderr[-2000:]}")
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out


@functools.cache
def _mkl_ready() -> bool:
  """Whether the MKL handler is registered (building it once); honours RAO_JAX_CPU_GEMM."""
  mode = _mode()
  if mode == "xla":
    return False
  try:
    lib = ctypes.cdll.LoadLibrary(_build())
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.RaoMklGemm), platform="cpu")
  except (CpuGemmUnavailable, OSError, subprocess.SubprocessError) as e:
    if mode == "mkl":
      raise CpuGemmUnavailable(f"{ENV}=mkl but MKL's sgemm cannot be used: {e}") from e
    logging.warning("CPU matmuls use XLA's dot (%s=xla to silence): %s", ENV, e)
    return False
  logging.info("CPU matmuls >= %d rows use MKL sgemm through XLA FFI", MIN_ROWS)
  return True


def select(mode: str) -> None:
  """Sets ``RAO_JAX_CPU_GEMM`` for this process; functions traced afterwards use the choice.

  A function JAX has already traced for the same shapes keeps its trace (and its choice).
  """
  os.environ[ENV] = _checked(mode)   # a bad value is named here, not at the next trace
  _mkl_ready.cache_clear()


def backend() -> str:
  """'mkl' or 'xla': what ``dense`` uses for eligible float32 products in this process."""
  return "mkl" if jax.default_backend() == "cpu" and _mkl_ready() else "xla"


def _uses_mkl(a, b, m: int, n: int, preferred_element_type) -> bool:
  return (a.dtype == jnp.float32 and b.dtype == jnp.float32
          and (preferred_element_type is None or jnp.dtype(preferred_element_type) == jnp.float32)
          and min(m, n) >= MIN_ROWS and jax.default_backend() == "cpu" and _mkl_ready())


def _mkl_call(a, b, trans_a: bool, trans_b: bool):
  m = a.shape[1] if trans_a else a.shape[0]
  n = b.shape[0] if trans_b else b.shape[1]
  return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32),
                          vmap_method="sequential")(a, b, trans_a=trans_a, trans_b=trans_b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mkl_dense(a, b, trans_a, trans_b):
  return _mkl_call(a, b, trans_a, trans_b)


def _mkl_dense_fwd(a, b, trans_a, trans_b):
  return _mkl_call(a, b, trans_a, trans_b), (a, b)


def _mkl_dense_bwd(trans_a, trans_b, res, g_MxN):
  # C = op(A) op(B): dop(A) = g op(B)^T and dop(B) = op(A)^T g, each written as one product
  # of the stored operands (no transposed copies).
  a, b = res
  da = dense(g_MxN, b, False, not trans_b) if not trans_a else dense(b, g_MxN, trans_b, True)
  db = dense(a, g_MxN, not trans_a, False) if not trans_b else dense(g_MxN, a, True, trans_a)
  return da, db


_mkl_dense.defvjp(_mkl_dense_fwd, _mkl_dense_bwd)


def dense(a, b, trans_a: bool = False, trans_b: bool = False, preferred_element_type=None):
  """``op(a) @ op(b)`` for 2-D arrays, op = transpose where asked; differentiable.

  Args:
    a: [M, K], or [K, M] with ``trans_a``.
    b: [K, N], or [N, K] with ``trans_b``.
    preferred_element_type: as in ``jax.lax.dot_general`` (e.g. float32 for bfloat16 inputs).
  """
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"dense takes 2-D operands, got {a.shape} and {b.shape}")
  m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
  kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
  if k != kb:
    raise ValueError(f"dense: op(a) is [{m}, {k}] but op(b) is [{kb}, {n}]")
  if _uses_mkl(a, b, m, n, preferred_element_type):
    return _mkl_dense(a, b, trans_a, trans_b)
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=preferred_element_type)
