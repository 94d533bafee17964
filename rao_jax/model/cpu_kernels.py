"""The model's float32 CPU kernels on MKL: building, loading and choosing them.

``csrc/`` holds XLA FFI handlers that run on XLA:CPU's intra-op thread pool and call
single-threaded MKL: ``rao_mkl_gemm`` (the dense products of ``matmul.dense``) and
``rao_mkl_attention_fwd``/``_bwd`` (the training forward's causal attention,
``cpu_attention.py``). On an Intel Xeon, XLA:CPU's own dot kernels ran the SmolLM2 training
step's products up to 30% below MKL (the peer, PyTorch, uses MKL too), and its attention spent
more time in masks, softmax passes and transposed copies than in products
(benchmarks/bench_cpu_kernels.py, bench_model.py).

The handlers are compiled once per machine on first use (a C++ compiler, ~10 s, for this CPU:
``-march=native``) into ``$XDG_CACHE_HOME/rao_jax`` (default ``~/.cache/rao_jax``) and linked
against the ``mkl`` wheel. ``RAO_JAX_CPU_KERNELS`` chooses: ``auto`` (default: MKL where it can be
built on an Intel CPU, else XLA's own ops; a failed build logs one warning naming the reason),
``mkl`` (any x86 CPU; an error if it cannot be built) or ``xla``. On AMD CPUs MKL's sgemm ran at
half of XLA's speed (``_cpu_vendor``). GPUs, TPUs and bfloat16 always use XLA's ops.
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
from absl import logging

ENV = "RAO_JAX_CPU_KERNELS"
GEMM = "rao_mkl_gemm"
ATTENTION_FWD = "rao_mkl_attention_fwd"
ATTENTION_BWD = "rao_mkl_attention_bwd"
# FFI target -> the handler symbol csrc/ exports for it.
_SYMBOLS = {GEMM: "RaoMklGemm", ATTENTION_FWD: "RaoMklAttentionFwd",
            ATTENTION_BWD: "RaoMklAttentionBwd"}
_SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_MKL_LIBS = ("mkl_intel_lp64", "mkl_sequential", "mkl_core")


class CpuKernelsUnavailable(RuntimeError):
  """The MKL kernels cannot be used here (the message says why and what to install)."""


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
  raise CpuKernelsUnavailable("the 'mkl' package is not installed (pip install mkl; x86-64 Linux)")


def _lib_file(lib_dir: str, name: str) -> str:
  found = sorted(glob.glob(os.path.join(lib_dir, f"lib{name}.so*")))
  if not found:
    raise CpuKernelsUnavailable(f"lib{name}.so not found in {lib_dir}: reinstall 'mkl'")
  return os.path.basename(found[-1])


def _cache_dir() -> str:
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "rao_jax")


def cpuinfo(field: str) -> str:
  """The first value of ``field`` in /proc/cpuinfo ('vendor_id', 'model name', 'flags'); '' where
  there is none (not Linux, or a container that hides it)."""
  try:
    with open("/proc/cpuinfo") as f:
      return next((line.split(":", 1)[1].strip() for line in f
                   if line.split(":", 1)[0].strip() == field), "")
  except OSError:
    return ""


def _cpu_vendor() -> str:
  """/proc/cpuinfo's vendor_id ('GenuineIntel', 'AuthenticAMD', ...), '' where unknown.

  ``auto`` uses MKL on Intel CPUs only. Measured with benchmarks/bench_cpu_kernels.py on two
  2-core machines: on a Sapphire Rapids Xeon MKL ran the SmolLM2 step's products 1.2-1.4x
  faster than XLA:CPU and the whole 4 x 512 step 1.1x faster; on an AMD EPYC (Zen 5) MKL's
  sgemm reached half of XLA's speed (176-200 against 342-443 GF/s) and the step took 10.9 s
  against XLA's 6.2 s.
  """
  return cpuinfo("vendor_id")


def _sources() -> list[str]:
  return sorted(glob.glob(os.path.join(_SOURCE_DIR, "*.cc")) +
                glob.glob(os.path.join(_SOURCE_DIR, "*.h")))


def _build() -> str:
  """Path of the compiled kernel library, compiling it if this machine has none yet."""
  if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
    raise CpuKernelsUnavailable(f"MKL needs x86-64 Linux, this is {platform.system()} "
                                f"{platform.machine()}")
  lib_dir = _mkl_lib_dir()
  libs = [_lib_file(lib_dir, n) for n in _MKL_LIBS]
  cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if not cxx:
    raise CpuKernelsUnavailable("no C++ compiler found (apt-get install g++, or set CXX)")
  sources = _sources()
  # The CPU's flags are part of the key: the library is built for this CPU (-march=native), and
  # a home folder shared by machines with other CPUs must not load it there.
  parts = [jax.__version__.encode(), lib_dir.encode(), cxx.encode(), cpuinfo("flags").encode(),
           *(l.encode() for l in libs)]
  for path in sources:
    with open(path, "rb") as f:
      parts += [os.path.basename(path).encode(), f.read()]
  key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
  out = os.path.join(_cache_dir(), f"cpu_kernels-{key}.so")
  if os.path.exists(out):
    return out
  os.makedirs(_cache_dir(), exist_ok=True)
  # Compiled to a temporary name and renamed: processes building at once never load half a file.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
  os.close(fd)
  # -ffast-math lets the softmax loops call the vectorised expf of glibc's libmvec; the kernels
  # never meet infinities or NaNs of their own making (masked scores are skipped, not -inf).
  cmd = [cxx, "-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC", "-w",
         f"-I{jax.ffi.include_dir()}", *(s for s in sources if s.endswith(".cc")), "-o", tmp,
         f"-L{lib_dir}", *(f"-l:{l}" for l in libs), "-lmvec", f"-Wl,-rpath,{lib_dir}"]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
      raise CpuKernelsUnavailable(f"compiling {_SOURCE_DIR} failed ({' '.join(cmd)}):\n"
                                  f"{proc.stderr[-2000:]}")
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out


@functools.cache
def ready() -> bool:
  """Whether the MKL kernels are registered (building them once); honours RAO_JAX_CPU_KERNELS."""
  mode = _mode()
  if mode == "xla":
    return False
  vendor = _cpu_vendor()
  if mode == "auto" and vendor != "GenuineIntel":
    logging.info("CPU products and attention use XLA's ops: MKL runs below XLA on %s CPUs "
                 "(%s=mkl to use it anyway)", vendor or "non-Intel", ENV)
    return False
  try:
    lib = ctypes.cdll.LoadLibrary(_build())
    for target, symbol in _SYMBOLS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                  platform="cpu")
  except (CpuKernelsUnavailable, OSError, AttributeError, subprocess.SubprocessError) as e:
    if mode == "mkl":
      raise CpuKernelsUnavailable(f"{ENV}=mkl but the MKL kernels cannot be used: {e}") from e
    logging.warning("CPU products and attention use XLA's ops (%s=xla to silence): %s", ENV, e)
    return False
  logging.info("float32 CPU products and attention use MKL through XLA FFI")
  return True


def active() -> bool:
  """Whether traced float32 code on the default backend should call the MKL kernels."""
  return jax.default_backend() == "cpu" and ready()


def select(mode: str) -> None:
  """Sets ``RAO_JAX_CPU_KERNELS`` for this process; functions traced afterwards use the choice.

  A function JAX has already traced for the same shapes keeps its trace (and its choice).
  """
  os.environ[ENV] = _checked(mode)   # a bad value is named here, not at the next trace
  ready.cache_clear()


def backend() -> str:
  """'mkl' or 'xla': what runs eligible float32 products and attention in this process."""
  return "mkl" if active() else "xla"
