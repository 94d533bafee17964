"""The float32 CPU kernels on MKL: building, loading and choosing them.

``csrc/`` holds XLA FFI handlers that run on XLA:CPU's intra-op thread pool and call
single-threaded MKL: ``rao_mkl_gemm`` (the dense products of ``matmul.dense``) and
``rao_mkl_attention_fwd``/``_bwd`` (the training forward's causal attention,
``mkl_attention.py``). On an Intel Xeon, XLA:CPU's own dot kernels ran the SmolLM2 training
step's products up to 30% below MKL (the peer, PyTorch, uses MKL too), and its attention spent
more time in masks, softmax passes and transposed copies than in products
(benchmarks/bench_cpu_kernels.py, bench_model.py).

The handlers are compiled once per machine on first use (a C++ compiler, ~10 s, for this CPU:
``-march=native``) into ``$XDG_CACHE_HOME/rao_jax`` (default ``~/.cache/rao_jax``) and linked
against the ``mkl`` wheel. The model chooses with its static config field ``ModelConfig.kernels``
(a ``mode`` here): ``auto`` (MKL where it can be built on an Intel CPU, else XLA's own ops; a
failed build logs one warning naming the reason), ``mkl`` (any x86 CPU; an error if it cannot be
built) or ``xla``. The mode is part of every traced function's static arguments, so jit caches
keep one trace per mode; what a mode resolves to depends only on this machine (its CPU, the
``mkl`` wheel, a compiler), which is fixed for the process. On AMD CPUs MKL's sgemm ran at half
of XLA's speed (``_cpu_vendor``). GPUs, TPUs and bfloat16 always use XLA's ops.
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

MODES = ("auto", "mkl", "xla")
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


def check_mode(mode, field: str = "ModelConfig.kernels") -> str:
  """``mode`` if it is one of MODES, else a ValueError naming ``field``, the value and the fix."""
  if mode not in MODES:
    raise ValueError(f"{field}={mode!r} is not a kernel choice; use 'auto' (MKL on Intel CPUs "
                     "where it builds, else XLA), 'mkl' (MKL on any x86 CPU, an error if it "
                     "cannot be built) or 'xla' (XLA's own ops).")
  return mode


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


def cpu_kind() -> dict:
  """The CPU a number was measured on: its model name and the vector instruction sets that
  change XLA's kernels, and so its speed and the last bits of its float results (a cloud VM
  often names a Zen 2 and a Zen 4 EPYC alike, "AMD EPYC")."""
  flags = set(cpuinfo("flags").split())
  return {"model": cpuinfo("model name") or platform.processor() or "unknown CPU",
          "isa": [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in flags]}


def cpu_name() -> str:
  """`cpu_kind` in one string, e.g. 'AMD EPYC (avx2, avx512f, avx512_bf16)'."""
  k = cpu_kind()
  return f"{k['model']} ({', '.join(k['isa']) or 'no AVX2'})"


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
  # The MKL handlers only: csrc/ also holds kernels without MKL (decode_cpu.py builds those).
  return sorted(glob.glob(os.path.join(_SOURCE_DIR, "mkl_*.cc")) +
                glob.glob(os.path.join(_SOURCE_DIR, "*.h")))


def compile_library(tag: str, sources: list[str], flags: list[str], link: list[str],
                    key_parts: list[bytes] = ()) -> str:
  """Path of a shared library of XLA FFI handlers compiled from ``sources`` (``.cc`` files
  compiled, headers only hashed) for this CPU, compiling it if this machine has none yet.

  The library is named by a hash of the sources, the compiler, the flags, this CPU's flags and
  jax's version (``key_parts`` adds the caller's), so an edit or another machine gets its own.

  Raises:
    CpuKernelsUnavailable: no C++ compiler, or the compilation failed (the message has its
      command and the compiler's last output).
  """
  cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if not cxx:
    raise CpuKernelsUnavailable("no C++ compiler found (apt-get install g++, or set CXX)")
  # The CPU's flags are part of the key: the library is built for this CPU (-march=native), and
  # a home folder shared by machines with other CPUs must not load it there.
  parts = [jax.__version__.encode(), cxx.encode(), cpuinfo("flags").encode(),
           *(f.encode() for f in flags + link), *key_parts]
  for path in sources:
    with open(path, "rb") as f:
      parts += [os.path.basename(path).encode(), f.read()]
  key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
  out = os.path.join(_cache_dir(), f"{tag}-{key}.so")
  if os.path.exists(out):
    return out
  os.makedirs(_cache_dir(), exist_ok=True)
  # Compiled to a temporary name and renamed: processes building at once never load half a file.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
  os.close(fd)
  cmd = [cxx, *flags, "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
         *(s for s in sources if s.endswith(".cc")), "-o", tmp, *link]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
      names = " ".join(os.path.basename(s) for s in sources if s.endswith(".cc"))
      raise CpuKernelsUnavailable(f"compiling {names} from {os.path.dirname(sources[0])} "
                                  f"failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out


def _build() -> str:
  """Path of the compiled MKL kernel library, compiling it if this machine has none yet."""
  if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
    raise CpuKernelsUnavailable(f"MKL needs x86-64 Linux, this is {platform.system()} "
                                f"{platform.machine()}")
  lib_dir = _mkl_lib_dir()
  libs = [_lib_file(lib_dir, n) for n in _MKL_LIBS]
  # -ffast-math lets the softmax loops call the vectorised expf of glibc's libmvec; the kernels
  # never meet infinities or NaNs of their own making (masked scores are skipped, not -inf).
  return compile_library(
      "cpu_kernels", _sources(), ["-O3", "-march=native", "-ffast-math"],
      [f"-L{lib_dir}", *(f"-l:{l}" for l in libs), "-lmvec", f"-Wl,-rpath,{lib_dir}"],
      [lib_dir.encode()])


@functools.cache
def _registration_error() -> str | None:
  """Builds and registers the kernels once per process: None when they are registered, else why
  not (kept, so a failed build is not retried at every trace)."""
  try:
    lib = ctypes.cdll.LoadLibrary(_build())
    for target, symbol in _SYMBOLS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                  platform="cpu")
  except (CpuKernelsUnavailable, OSError, AttributeError, subprocess.SubprocessError) as e:
    return str(e)
  logging.info("the MKL kernels are registered with XLA FFI")
  return None


def registered() -> None:
  """Registers the kernels (building them once); CpuKernelsUnavailable says why it cannot."""
  error = _registration_error()
  if error is not None:
    raise CpuKernelsUnavailable(error)


@functools.cache
def available(mode: str) -> bool:
  """Whether kernel choice ``mode`` runs the MKL kernels on this machine (building them once).

  Raises:
    ValueError: ``mode`` is not one of MODES.
    CpuKernelsUnavailable: ``mode`` is "mkl" and the kernels cannot be built or loaded here.
  """
  check_mode(mode)
  if mode == "xla":
    return False
  vendor = _cpu_vendor()
  if mode == "auto" and vendor != "GenuineIntel":
    logging.info("CPU products and attention use XLA's ops: MKL runs below XLA on %s CPUs "
                 "(ModelConfig.kernels='mkl' to use it anyway)", vendor or "non-Intel")
    return False
  error = _registration_error()
  if error is not None:
    if mode == "mkl":
      raise CpuKernelsUnavailable(f"ModelConfig.kernels='mkl' but the MKL kernels cannot be "
                                  f"used: {error}")
    logging.warning("CPU products and attention use XLA's ops (ModelConfig.kernels='xla' to "
                    "silence): %s", error)
    return False
  return True


def active(mode: str) -> bool:
  """Whether traced float32 code on the default backend calls the MKL kernels under ``mode``."""
  return jax.default_backend() == "cpu" and available(mode)


def backend(mode: str = "auto") -> str:
  """'mkl' or 'xla': what runs eligible float32 products and attention under ``mode`` here."""
  return "mkl" if active(mode) else "xla"


def reset() -> None:
  """Forgets the cached build and choices (tests that change what this machine looks like)."""
  _registration_error.cache_clear()
  available.cache_clear()
