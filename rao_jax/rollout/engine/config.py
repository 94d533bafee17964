"""EngineConfig: the embedded engine's shapes and policies, and the bucket helpers.

Plain Python (no JAX): the slot table, the page pool and their tests import it.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
  """lo, 2 lo, 4 lo, ... below hi, then hi."""
  out, b = [], lo
  while b < hi:
    out.append(b)
    b *= 2
  out.append(hi)
  return tuple(out)


def bucket(buckets: Sequence[int], n: int) -> int:
  """The smallest bucket >= n (the largest when none is)."""
  for b in buckets:
    if b >= n:
      return b
  return buckets[-1]


# num_pages=0's pool: positions a slot holds on average. The held-out evaluation's agent
# contexts hold at most 925 positions (mean 703; bench_decode_floor.json), so the CPU runs'
# unpaged caches stayed at their 1,024 bucket: the same memory, now a budget longer contexts
# share instead of a length every slot pays for.
_DEFAULT_SLOT_POSITIONS = 1024


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Shapes and policies of the embedded engine.

  Attributes:
    num_slots: concurrent contexts (requests running + sessions kept).
    max_len: tokens one slot can hold.
    page_size: slots (token positions) per page of the paged KV cache. A context holds
      ceil(length / page_size) pages, allocated as it grows and returned when it ends; a
      shared prompt prefix is shared page by page. Decode kernels read whole pages: on GPU
      the Pallas kernel wants a power of two >= 16 (XLA's attention otherwise), on TPU a
      multiple of 128 fills the vector lanes.
    num_pages: pages in the KV pool (its memory: num_pages x page_size positions x layers x
      K x h x 2 (keys, values) x the dtype's bytes), allocated once. The pool holds as many
      contexts as their actual lengths fit: when a context must grow and no page is free, idle
      sessions are evicted (least recently used first), then the most recently admitted
      request is preempted (its pages freed; it waits and is recomputed, its output so far
      kept). At least ceil(max_len / page_size), so one context always fits. 0 = num_slots x
      ceil(min(max_len, 1024) / page_size) (and at least that one context): every slot can
      hold max_len at once up to max_len 1,024, and 1,024 positions a slot on average beyond
      (the agents' contexts measured here hold at most 925 positions, mean 703: on the CPU
      runs this is the memory the unpaged cache took). On a GPU or TPU size it to the device
      (``benchmarks/bench_memory_plan.py --engine``).
    cache_lens: lengths of the gathered view of a row that a prefill chunk attends over,
      ascending, ending at max_len (each rounded up to whole pages); a chunk uses the smallest
      covering its rows. () = doubling from min_cache_len up to max_len. Decode reads each
      row's pages directly (no view, no bucket).
    min_cache_len: the smallest view when cache_lens is ().
    chunk_sizes: prompt-chunk buckets, ascending; a prompt is prefilled in chunks of these.
    prefill_rows: prefill batch buckets, ascending; at most max(prefill_rows) slots per call.
    decode_rows: decode batch buckets, ascending, ending at num_slots; () = 1, 2, 4, 8, ... up
      to num_slots. The decoding requests run as R rows, R the smallest bucket covering them
      (a lone agent decodes one row, not num_slots: ~3x faster on CPU; on SmolLM2 at a 2,048
      cache a call over 16 rows took 2.7x one over 4).
    decode_steps: tokens generated per decode call (>1 trades scheduling latency for less
      per-call overhead).
    seed: base of the per-request seeds drawn for requests that give none.
    default_stop_token_ids: the stop ids of requests whose ``SamplingParams.stop_token_ids``
      is None (the default): give the tokenizer's ``stop_token_ids`` (end of turn, end of
      text) so generation ends where users expect; () = such requests never stop early.
    share_prefix_min: a new context shares another slot's KV pages for a common prompt prefix
      at least this many tokens longer than its own slot holds (0 = never share across slots).
    max_consecutive_faults: scheduler steps whose device work may fail in a row (a device
      error, out of memory) before the engine stops for good. Each failure ends the requests
      the engine holds with ``FinishReason.ERROR`` and rebuilds the KV cache and slot table;
      a step whose device calls complete resets the count. Past it every call raises
      ``EngineFailedError`` (a run stops with a checkpoint rather than retrying forever).
  """
  num_slots: int = 16
  max_len: int = 2048
  # 64: a power of two for the GPU kernel, and at most half a page wasted per context (the
  # held-out evaluation's contexts: mean 703 positions, so ~4.5%).
  page_size: int = 64
  num_pages: int = 0
  cache_lens: tuple[int, ...] = ()
  # Few buckets by default: each (rows, chunk, view length) shape is one compilation of the
  # unrolled model (seconds each on CPU), and a short run pays for every shape it meets.
  min_cache_len: int = 512
  chunk_sizes: tuple[int, ...] = (32, 256)
  prefill_rows: tuple[int, ...] = (1, 4)
  decode_rows: tuple[int, ...] = ()
  decode_steps: int = 1
  seed: int = 0
  default_stop_token_ids: tuple[int, ...] = ()
  share_prefix_min: int = 32
  max_consecutive_faults: int = 3

  def __post_init__(self):
    def ascending(name, vals):
      vals = tuple(int(v) for v in vals)
      if not vals or any(v < 1 for v in vals) or list(vals) != sorted(set(vals)):
        raise ValueError(f"EngineConfig.{name}={vals!r}: must be a non-empty, strictly "
                         "ascending tuple of positive ints.")
      object.__setattr__(self, name, vals)
      return vals

    try:
      stops = tuple(int(t) for t in self.default_stop_token_ids)
    except (TypeError, ValueError):
      stops = (-1,)
    if any(t < 0 for t in stops):
      raise ValueError(f"EngineConfig.default_stop_token_ids={self.default_stop_token_ids!r}: "
                       "must be a tuple of token ids (non-negative ints).")
    object.__setattr__(self, "default_stop_token_ids", tuple(dict.fromkeys(stops)))
    if int(self.share_prefix_min) < 0:
      raise ValueError(f"EngineConfig.share_prefix_min={self.share_prefix_min!r}: must be >= 0 "
                       "(0 turns cross-slot prefix sharing off).")
    faults = self.max_consecutive_faults
    if isinstance(faults, bool) or not isinstance(faults, numbers.Integral) or faults < 1:
      raise ValueError(f"EngineConfig.max_consecutive_faults={faults!r}: must be an int >= 1 "
                       "(failed device steps in a row before the engine stops; 1 = stop at "
                       "the first failure).")
    for name in ("num_slots", "max_len", "page_size", "min_cache_len", "decode_steps"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r}: must be >= 1.")
    if int(self.num_pages) == 0:
      per_slot = -(-min(self.max_len, _DEFAULT_SLOT_POSITIONS) // self.page_size)
      object.__setattr__(self, "num_pages", max(self.num_slots * per_slot, self.pages_per_row))
    if int(self.num_pages) < self.pages_per_row:
      raise ValueError(f"EngineConfig.num_pages={self.num_pages!r}: must be 0 (the default "
                       f"pool) or at least {self.pages_per_row} (max_len={self.max_len} / "
                       f"page_size={self.page_size}, rounded up), so that one context fits; "
                       "raise num_pages, or lower max_len.")
    if not self.cache_lens:
      object.__setattr__(self, "cache_lens",
                         pow2_buckets(min(self.min_cache_len, self.max_len), self.max_len))
    lens = ascending("cache_lens", self.cache_lens)
    if lens[-1] != self.max_len:
      raise ValueError(f"EngineConfig.cache_lens={lens!r}: the last bucket must equal "
                       f"max_len={self.max_len}.")
    ascending("chunk_sizes", self.chunk_sizes)
    ascending("prefill_rows", self.prefill_rows)
    if not self.decode_rows:
      ladder, r = [], 1
      while r < self.num_slots:
        ladder.append(r)
        r *= 2
      object.__setattr__(self, "decode_rows", tuple(ladder) + (self.num_slots,))
    rows = ascending("decode_rows", self.decode_rows)
    if rows[-1] != self.num_slots:
      raise ValueError(f"EngineConfig.decode_rows={rows!r}: the last bucket must equal "
                       f"num_slots={self.num_slots}.")
    if self.prefill_rows[-1] > self.num_slots:
      raise ValueError(f"EngineConfig.prefill_rows={self.prefill_rows!r}: buckets larger than "
                       f"num_slots={self.num_slots} can never fill; drop them.")
    if self.margin >= self.max_len:
      raise ValueError(f"EngineConfig.max_len={self.max_len}: must exceed the smallest chunk "
                       f"and decode_steps ({self.margin}); raise max_len.")

  @property
  def margin(self) -> int:
    # Slots past a row's length that a call may write (padding of a chunk, fused decode steps).
    return max(self.decode_steps, self.chunk_sizes[0])

  @property
  def pages_per_row(self) -> int:
    """Pages that hold max_len slots: the width of a decode call's page table."""
    return -(-self.max_len // self.page_size)

  def view_pages(self, n: int) -> int:
    """Pages of the prefill view covering slots [0, n): its length bucket, in whole pages."""
    return -(-bucket(self.cache_lens, n) // self.page_size)

  @property
  def capacity(self) -> int:
    """The most tokens (prompt + generated) one context may reach."""
    return self.max_len - self.margin
