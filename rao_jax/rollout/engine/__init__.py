"""The embedded JAX engine: continuous batching over fixed slots, sessions, in-process weights.

Who owns what (each module stands alone; only ``programs`` and ``scheduler`` import JAX):

    config.py        EngineConfig (shapes, pages, buckets, policies) and the bucket helpers
    pages.py         the KV page pool's bookkeeping: free list, reference counts, table rows
    slot_table.py    slots, sessions, eviction, prefix sharing by pages, admission, page
                     reservation (copy before writing a shared page, preemption), batch
                     grouping (plain Python, tested without JAX)
    programs.py      struct dataclasses (PrefillBatch, DecodeBatch, SamplingArrays, Penalties,
                     DeviceState) and the pure jitted programs (prefill, sample, decode,
                     score, copy_page); traces counted per engine
    scheduler.py     one scheduler step: admit, prefill a chunk, decode; builds the batches
    frontend.py      EmbeddedEngine: the asyncio API and the scheduler thread

The KV cache is one pool of pages (``EngineConfig.page_size`` positions each, ``num_pages`` of
them): a context holds the pages its length needs, so the pool holds as many contexts as their
actual lengths fit, and a decode step reads each row's live pages only
(``rao_jax.kernels.paged``). After ``EmbeddedEngine.warmup()`` every shape the scheduler can
produce has been compiled: nothing compiles during a run (``EmbeddedEngine.trace_counts``).
Prefix sharing matters on CPU, where prefill is compute-bound: an agent node of ~600 tokens
whose first ~430 are the system prompt prefills ~170.
"""
import importlib

from rao_jax.rollout.engine.config import EngineConfig  # noqa: F401


def __getattr__(name):
  # Lazy: importing the plain-Python modules of the package (slot_table, pages, config) must
  # not load JAX.
  if name == "EmbeddedEngine":
    return importlib.import_module("rao_jax.rollout.engine.frontend").EmbeddedEngine
  raise AttributeError(f"module 'rao_jax.rollout.engine' has no attribute {name!r}")


__all__ = ["EmbeddedEngine", "EngineConfig"]
