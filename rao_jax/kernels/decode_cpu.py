"""The CPU decode attention: a C++ XLA FFI handler (``csrc/decode_attention.cc``) that reads
only the cache slots each row holds.

``attend(q, k_cache, v_cache, rows_B, start_B)`` is what ``attention.cached_attention``
computes for T new queries per row against cache rows ``rows_B`` with query t of row b seeing
slots j <= start_b + t, in float32 or bfloat16, without touching slots past start_b + T - 1
and without copying rows out of the cache. Plain C++ over XLA's intra-op thread pool (tasks
are rows x kv heads): no MKL, so it builds on any CPU with a C++ compiler, AMD included.

The library is compiled once per machine on first use (``mkl.compile_library``: g++, about
5 s) into the same cache folder as the MKL kernels. ``available(mode)`` says whether the
model's kernel choice ``ModelConfig.kernels`` takes it: "auto" and "mkl" do where it builds
("auto" logs one warning when it cannot; "mkl", which asks for the CPU kernels, raises), "xla"
never does.
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rao_jax.kernels import mkl

TARGET = "rao_decode_attention"
_SYMBOL = "RaoDecodeAttention"
_SOURCES = ("decode_attention.cc", "parallel_for.h")
DTYPES = (jnp.float32, jnp.bfloat16)


def _build() -> str:
  source_dir = mkl._SOURCE_DIR   # pylint: disable=protected-access
  sources = [os.path.join(source_dir, s) for s in _SOURCES]
  # No -ffast-math: glibc's exact expf and the written order of the sums keep the scores and
  # probabilities within rounding of XLA's, so greedy decoding picks the same tokens.
  return mkl.compile_library("decode_attention", sources, ["-O3", "-march=native"], [])


@functools.cache
def _registration_error() -> str | None:
  """Builds and registers the handler once per process: None when it is registered, else why
  not (kept, so a failed build is not retried at every trace)."""
  try:
    lib = ctypes.cdll.LoadLibrary(_build())
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, _SYMBOL)),
                                platform="cpu")
  except (mkl.CpuKernelsUnavailable, OSError, AttributeError, subprocess.SubprocessError) as e:
    return str(e)
  logging.info("the CPU decode attention kernel is registered with XLA FFI")
  return None


@functools.cache
def available(mode: str) -> bool:
  """Whether kernel choice ``mode`` runs the CPU decode kernel on this machine (building it once).

  Raises:
    ValueError: ``mode`` is not one of ``mkl.MODES``.
    CpuKernelsUnavailable: ``mode`` is "mkl" and the kernel cannot be built or loaded here.
  """
  mkl.check_mode(mode)
  if mode == "xla":
    return False
  error = _registration_error()
  if error is None:
    return True
  if mode == "mkl":
    raise mkl.CpuKernelsUnavailable(f"ModelConfig.kernels='mkl' but the CPU decode attention "
                                    f"kernel cannot be used: {error}")
  logging.warning("decode attention uses XLA's ops on CPU (ModelConfig.kernels='xla' to "
                  "silence): %s", error)
  return False


def usable(dtype, mode: str) -> bool:
  """Whether the CPU lowering of a trace under kernel choice ``mode`` calls the kernel for
  queries and cache of ``dtype``."""
  return jnp.dtype(dtype) in [jnp.dtype(d) for d in DTYPES] and available(mode)


def attend(q_BxTxHxh, k_NxKxhxS, v_NxKxSxh, rows_B, start_B):
  """Grouped-query attention of T queries per row over the cache slots the row holds.

  Args:
    q_BxTxHxh: queries (after RoPE), in the cache's dtype (float32 or bfloat16).
    k_NxKxhxS, v_NxKxSxh: the cache (one layer), N >= rows read; H must be a multiple of K.
    rows_B: int32, the cache row of each query row.
    start_B: int32, slots each row held before these T queries; query t sees slots
      [0, start_b + t].

  Returns:
    [B, T, H, h] in q's dtype.
  """
  B, T, H, h = q_BxTxHxh.shape
  N, K, h_k, S = k_NxKxhxS.shape
  if (h_k != h or v_NxKxSxh.shape != (N, K, S, h) or H % K
      or q_BxTxHxh.dtype != k_NxKxhxS.dtype or k_NxKxhxS.dtype != v_NxKxSxh.dtype):
    raise ValueError(f"decode_cpu.attend: q {q_BxTxHxh.shape} {q_BxTxHxh.dtype}, k "
                     f"{k_NxKxhxS.shape} {k_NxKxhxS.dtype} and v {v_NxKxSxh.shape} "
                     f"{v_NxKxSxh.dtype} do not fit [B, T, H, h] / [N, K, h, S] / [N, K, S, h], "
                     "K | H, one dtype")
  if _registration_error() is not None:
    raise mkl.CpuKernelsUnavailable(f"decode_cpu.attend needs the CPU decode kernel, which "
                                    f"cannot be used here ({_registration_error()}); call it "
                                    "where usable(dtype, mode) is True")
  out = jax.ShapeDtypeStruct((B, T, H, h), q_BxTxHxh.dtype)
  # The scale rounded to the dtype first, as XLA's attention multiplies by it in that dtype.
  scale = np.float32(np.asarray(h ** -0.5, q_BxTxHxh.dtype).astype(np.float32))
  return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
      q_BxTxHxh, k_NxKxhxS, v_NxKxSxh, jnp.asarray(rows_B, jnp.int32),
      jnp.asarray(start_B, jnp.int32), scale=scale)


def reset() -> None:
  """Forgets the cached build and choices (tests that change what this machine looks like)."""
  _registration_error.cache_clear()
  available.cache_clear()
