"""The CPU decode attention: a C++ XLA FFI handler (``csrc/decode_attention.cc``) that reads
only the cache slots each row holds.

``attend(q, k_cache, v_cache, rows_B, start_B)`` is what ``attention.cached_attention``
computes for T new queries per row against cache rows ``rows_B`` with query t of row b seeing
slots j <= start_b + t, in float32 or bfloat16, without touching slots past start_b + T - 1
and without copying rows out of the cache. ``attend_paged(q, k_pages, v_pages, pages_BxW,
start_B)`` is the same over a paged cache (the engine's: a pool of pages of P slots, row b's
slot j in page ``pages_BxW[b, j // P]``), reading only the pages that hold live slots; the
contiguous form is the paged one with one page of S slots per row. C++ with GCC's vector
extensions (register blocks of query rows by key or value vectors, AVX-512 or AVX2 wide as
-march=native allows) over XLA's intra-op thread pool (tasks are rows x kv heads): no MKL, so
it builds on any CPU with GCC or clang, AMD included. The blocks sum each score and output in
the plain loop's order, so the result is the same bits whatever the page or vector width.

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
  # A row of S slots is one page of S slots: the paged kernel with a one-column page table.
  rows_Bx1 = jnp.asarray(rows_B, jnp.int32)[:, None]
  return attend_paged(q_BxTxHxh, k_NxKxhxS, v_NxKxSxh, rows_Bx1, start_B)


def attend_paged(q_BxTxHxh, k_NxKxhxP, v_NxKxPxh, pages_BxW, start_B):
  """``attend`` over a paged cache: row b's slot j is slot j % P of page pages_BxW[b, j // P].

  Args:
    q_BxTxHxh: queries (after RoPE), in the cache's dtype (float32 or bfloat16).
    k_NxKxhxP, v_NxKxPxh: the pool of N pages of P slots (one layer); H a multiple of K.
    pages_BxW: int32, each row's page table; only the entries of pages holding slots
      [0, start_b + T) are read, and those must be in [0, N) (the kernel fails otherwise).
    start_B: int32, slots each row held before these T queries; query t sees slots
      [0, start_b + t] (at most W P).

  Returns:
    [B, T, H, h] in q's dtype.
  """
  B, T, H, h = q_BxTxHxh.shape
  N, K, h_k, P = k_NxKxhxP.shape
  if (h_k != h or v_NxKxPxh.shape != (N, K, P, h) or H % K or jnp.ndim(pages_BxW) != 2
      or jnp.shape(pages_BxW)[0] != B
      or q_BxTxHxh.dtype != k_NxKxhxP.dtype or k_NxKxhxP.dtype != v_NxKxPxh.dtype):
    raise ValueError(f"decode_cpu.attend: q {q_BxTxHxh.shape} {q_BxTxHxh.dtype}, k "
                     f"{k_NxKxhxP.shape} {k_NxKxhxP.dtype}, v {v_NxKxPxh.shape} "
                     f"{v_NxKxPxh.dtype} and pages {jnp.shape(pages_BxW)} do not fit "
                     "[B, T, H, h] / [N, K, h, P] / [N, K, P, h] / [B, W], K | H, one dtype")
  if _registration_error() is not None:
    raise mkl.CpuKernelsUnavailable(f"decode_cpu.attend needs the CPU decode kernel, which "
                                    f"cannot be used here ({_registration_error()}); call it "
                                    "where usable(dtype, mode) is True")
  out = jax.ShapeDtypeStruct((B, T, H, h), q_BxTxHxh.dtype)
  # The scale rounded to the dtype first, as XLA's attention multiplies by it in that dtype.
  scale = np.float32(np.asarray(h ** -0.5, q_BxTxHxh.dtype).astype(np.float32))
  return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
      q_BxTxHxh, k_NxKxhxP, v_NxKxPxh, jnp.asarray(pages_BxW, jnp.int32),
      jnp.asarray(start_B, jnp.int32), scale=scale)


def reset() -> None:
  """Forgets the cached build and choices (tests that change what this machine looks like)."""
  _registration_error.cache_clear()
  available.cache_clear()
