"""rao_jax.host_memory: freed big blocks are reused, not re-faulted from the OS (real processes),
only where the CPU computes and only when an entry point asks (importing rao_jax changes nothing)."""
import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import json, os, resource
import rao_jax
from rao_jax import host_memory
after_import = host_memory.in_effect()
applied = host_memory.keep_freed_memory()   # as an entry point does, before its heavy imports
import numpy as np

def rss_mb():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def touch_and_free_block():
  a = np.empty(64 << 20, np.uint8)   # 64 MB: over glibc's largest mmap threshold (32 MB)
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  a[::4096] = 1                       # one write per page
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
  held = rss_mb()
  del a
  return faults, held - rss_mb()

touch_and_free_block()
faults, released_mb = touch_and_free_block()
print(json.dumps({"after_import": after_import, "applied": applied,
                  "in_effect": host_memory.in_effect(), "faults": faults,
                  "released_mb": released_mb}))
"""


def _probe(**env):
  out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=120, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_keep_freed_memory_reuses_blocks_on_cpu_only():
  reused = _probe(RAO_JAX_SYSTEM_MALLOC="0", JAX_PLATFORMS="cpu")
  assert not reused["after_import"], reused    # importing the package changed nothing
  assert reused["applied"] and reused["in_effect"], reused
  # The freed block stays with the process, and the next one is served from it: no new pages.
  assert reused["released_mb"] < 8 and reused["faults"] < 100, reused
  system = _probe(RAO_JAX_SYSTEM_MALLOC="1", JAX_PLATFORMS="cpu")   # the opt-out keeps
  assert not system["in_effect"], system                             # glibc's behaviour:
  assert system["released_mb"] > 56, system    # unmapped on free, mapped afresh next time
  # A process whose compute backend is a GPU (or TPU) keeps glibc's defaults too.
  gpu = _probe(RAO_JAX_SYSTEM_MALLOC="0", JAX_PLATFORMS="cuda,cpu")
  assert not gpu["applied"] and not gpu["in_effect"], gpu
  assert gpu["released_mb"] > 56, gpu


_ENGINE_PROBE = r"""
import json, os
from rao_jax import host_memory
host_memory.keep_freed_memory()   # in effect unless RAO_JAX_SYSTEM_MALLOC=1
from rao_jax.testing import tiny_model
from rao_jax.rollout.engine import EmbeddedEngine, EngineConfig

def rss_mb():
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

# KV caches of 67, 134 and 268 MB (64 slots at 4K, 8K and 16K tokens): warm-up runs every resize.
engine = EmbeddedEngine(tiny_model(0), EngineConfig(
    num_slots=64, max_len=16384, cache_lens=(4096, 8192, 16384), chunk_sizes=(32,),
    prefill_rows=(1,), decode_rows=(64,), share_prefix_min=0))
before = rss_mb()
engine.warmup()
print(json.dumps({"grown_mb": rss_mb() - before, "kept": host_memory.in_effect()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_kept_memory_fragments_under_cache_resizes_so_generating_processes_leave_malloc_alone():
  """Why evaluation and serving load with keep_freed_memory=False (rao_jax.evaluation's
  load_checkpoint; test_trainer checks that it does): with freed memory kept, caches of
  different sizes leave holes the next size cannot use, ~1.6 GB more for this warm-up."""
  def grown(system):
    out = subprocess.run([sys.executable, "-c", _ENGINE_PROBE], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu",
                              "RAO_JAX_SYSTEM_MALLOC": "1" if system else "0"},
                         timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
  system, kept = grown(True), grown(False)
  assert not system["kept"] and kept["kept"], (system, kept)
  assert system["grown_mb"] < 500, system    # about the largest cache (268 MB) and code
  assert kept["grown_mb"] > system["grown_mb"] + 800, (system, kept)
