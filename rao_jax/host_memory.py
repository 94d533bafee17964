"""Host memory: let the process reuse freed memory instead of handing it back to the OS.

XLA:CPU allocates an executable's temporaries as one block per run (2.6 GB for the 4 x 512
SmolLM2 training step). glibc's malloc serves any block over 32 MB with a fresh ``mmap`` and
unmaps it on free, so every step first-touches its whole working set again: ~900k page faults
and 2-2.5 s of kernel time per step on a 2-core machine (benchmarks/bench_model.py). With
``mmap`` off and no trimming, freed blocks stay in malloc's heap and the next step reuses them
(0 faults). All threads then share one arena: a thread's own arena cannot grow past 64 MB and
would fall back to ``mmap``.

XLA:CPU frees a run's temporaries on its own thread just after the outputs are ready, so a step
dispatched the instant the previous one returns can find its block still held and grow the heap
by another (one more 0.6M-fault step, and the heap holds two blocks from then on). Measured on
the step above, 8 back-to-back steps: 3 such steps and 9.4 GB resident; with 0.3 s of host work
between steps (rollouts, in training): none, 4.3 GB.

The cost: the process keeps its peak heap for its lifetime (a training process does anyway).
It pays only where XLA:CPU computes: on a GPU or TPU host the step's temporaries live on the
device, and a host that keeps every freed block would only hold more memory. So nothing happens
at import (``import rao_jax`` leaves the process as it was); an entry point calls
``keep_freed_memory()`` before JAX starts its threads (``rao_jax.experiment.load_policy`` does,
the CPU benchmarks do), and it changes malloc only when the CPU is the compute backend
(``cpu_is_compute_backend``). Set ``RAO_JAX_SYSTEM_MALLOC=1`` to keep glibc's defaults
everywhere. A no-op off glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import sys

# mallopt(3) parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

OPT_OUT_ENV = "RAO_JAX_SYSTEM_MALLOC"
_state = {"applied": False}


# Distributions that give JAX a GPU or TPU backend (PJRT plugins and libtpu).
_ACCELERATOR_DISTS = ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt",
                      "jax-cuda13-pjrt", "jax-rocm60-plugin", "jax-rocm7-plugin", "libtpu",
                      "libtpu-nightly", "jax-tpu")


def _installed(dist: str) -> bool:
  try:
    importlib.metadata.distribution(dist)
    return True
  except importlib.metadata.PackageNotFoundError:
    return False


def cpu_is_compute_backend() -> bool:
  """Whether JAX computes on the CPU in this process, decided without starting a backend.

  Once JAX has started its backends, their choice decides (``jax.default_backend()``).
  Before that (when this matters: malloc must be set before JAX starts its threads), the
  platforms JAX is told to use decide (``JAX_PLATFORMS`` or ``jax.config.jax_platforms``: the
  first one listed is the default backend); else the CPU is the backend exactly when no GPU or
  TPU plugin is installed (JAX prefers an accelerator whenever one initialises).
  """
  jax = sys.modules.get("jax")
  if jax is not None:
    from jax._src import xla_bridge   # pylint: disable=g-import-not-at-top
    if xla_bridge.backends_are_initialized():
      return jax.default_backend() == "cpu"
    platforms = jax.config.jax_platforms or ""
  else:
    platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms.strip():
    return platforms.split(",")[0].strip().lower() == "cpu"
  return not any(_installed(d) for d in _ACCELERATOR_DISTS)


def keep_freed_memory() -> bool:
  """Configures glibc malloc to keep and reuse freed memory; True when it is in effect.

  Call it before JAX starts its backends (before the first array or device query): the setting
  that keeps one malloc arena cannot take back arenas that threads already own. Idempotent.
  Returns False, changing nothing, when the CPU is not the compute backend
  (``cpu_is_compute_backend``), when ``RAO_JAX_SYSTEM_MALLOC`` is set to a non-empty value
  other than "0", or when the C library is not glibc.
  """
  if _state["applied"]:
    return True
  if os.environ.get(OPT_OUT_ENV, "0") not in ("", "0"):
    return False
  if not cpu_is_compute_backend():
    return False
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name or "libc.so.6")
    mallopt = libc.mallopt
    libc.gnu_get_libc_version   # glibc only: musl and macOS have no such symbol
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  # Order matters: one arena first, so no thread starts its own after mmap is off.
  ok = (mallopt(_M_ARENA_MAX, 1) == 1 and mallopt(_M_TRIM_THRESHOLD, -1) == 1   # -1: never trim
        and mallopt(_M_MMAP_MAX, 0) == 1)
  _state["applied"] = bool(ok)
  _state["libc"] = libc
  return _state["applied"]


def release_free_memory() -> bool:
  """Hands the free pages inside malloc's heap back to the OS (``malloc_trim``); True when it ran.

  With freed memory kept, blocks of different sizes fragment the heap: the rollout engine's
  unpaged KV cache had one size per cache-length bucket (0.75, 1.5 and 3 GB for 32 SmolLM2
  slots at 512, 1,024 and 2,048 tokens), and each resize freed one size and allocated another,
  which the freed hole could not hold. Warming up every resize took an evaluation process from
  2.2 to 19.3 GB resident; trimming after each resize returned the holes (6.5 GB after the same
  warm-up). The paged cache is one pool allocated once; the engine still trims after its
  warm-up, whose compilations leave fragments (tests/test_host_memory.py). A no-op where
  ``keep_freed_memory`` is not in effect (glibc's own defaults return large blocks by
  themselves).
  """
  if not _state["applied"]:
    return False
  _state["libc"].malloc_trim(0)
  return True


def in_effect() -> bool:
  """Whether ``keep_freed_memory`` has configured this process."""
  return _state["applied"]
