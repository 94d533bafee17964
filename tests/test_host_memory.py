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
assert host_memory.keep_freed_memory()
from rao_jax.testing import tiny_model
from rao_jax.rollout.engine import EmbeddedEngine, EngineConfig

def rss_mb():
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

# A KV pool of 268 MB (16,384 pages of 64 slots: 64 slots at 16K tokens), allocated when the
# engine is built; the warm-up compiles decode and prefill views of 4K, 8K and 16K slots on it.
engine = EmbeddedEngine(tiny_model(0), EngineConfig(
    num_slots=64, max_len=16384, page_size=64, num_pages=16384, cache_lens=(4096, 8192, 16384),
    chunk_sizes=(32,), prefill_rows=(1,), decode_rows=(64,), share_prefix_min=0))
before = rss_mb()
engine.warmup()
print(json.dumps({"grown_mb": rss_mb() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_engine_warmup_holds_no_second_cache():
  """Freed memory is kept, so caches of different sizes fragmented the heap (the unpaged
  engine's resizes left ~1.6 GB resident without a trim). The paged engine allocates its pool
  once and never resizes it: the warm-up runs every program on that pool (its writes all
  dropped) and grows RSS by compile-time memory only (measured 49 MB, 107 without the trim),
  far less than another 268 MB pool."""
  out = subprocess.run([sys.executable, "-c", _ENGINE_PROBE], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "RAO_JAX_SYSTEM_MALLOC": "0"},
                       timeout=600, check=True)
  grown = json.loads(out.stdout.strip().splitlines()[-1])["grown_mb"]
  assert grown < 200, grown
