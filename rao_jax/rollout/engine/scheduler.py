"""One scheduler step of the embedded engine: admission, prefill, decode.

The ``Scheduler`` owns the engine's state: the slot table (host: slots, sessions and the page
pool's bookkeeping) and the ``DeviceState`` (weights and the KV page pool). It runs on the
engine's scheduler thread only; each ``step`` admits waiting requests, prefills one chunk for
a group of slots and decodes every decoding slot. Before each device call the table reserves
the pages its writes need (and may preempt a request to find them); the page copies it asks
for run first, then the call, its batch a struct dataclass carrying the rows' page tables.
"""
from __future__ import annotations

import collections
import functools
import logging
import time
from typing import Callable

import jax
import numpy as np

from rao_jax import host_memory
from rao_jax.rollout.base import FinishReason
from rao_jax.rollout.engine import programs as P
from rao_jax.rollout.engine.config import EngineConfig, bucket
from rao_jax.rollout.engine.pages import table_row
from rao_jax.rollout.engine.slot_table import Req, Slot, SlotTable

log = logging.getLogger(__name__)


def time_split(delta, wall_s: float) -> dict[str, float]:
  """Where an engine's wall time went over a stretch of work, from the difference of its
  ``stats`` counters across it (``delta``: after - before) and the stretch's wall seconds.

  decode_s, prefill_s: device calls; engine_idle_s = wall - both: no request was ready (every
  agent in a sandbox cell, in host code, or between turns). occupancy = active requests over
  the rows the decode calls computed (a call of 3 requests in a 4-row bucket: 0.75). A decode
  token's cost grows with the rows of its call, so decode_rows_per_call against the slots says
  how much of the batch the workload kept busy.
  """
  g = lambda k: float(delta.get(k, 0))  # noqa: E731
  calls = max(g("decode_calls"), 1.0)
  busy = g("decode_s") + g("prefill_s")
  return {
      "decode_s": g("decode_s"), "prefill_s": g("prefill_s"), "engine_busy_s": busy,
      "engine_idle_s": max(float(wall_s) - busy, 0.0),
      "decode_calls": g("decode_calls"), "decode_tokens": g("decode_tokens"),
      "decode_rows_per_call": g("decode_rows") / calls,
      "active_requests_per_call": g("decode_active") / calls,
      "occupancy": g("decode_active") / max(g("decode_rows"), 1.0),
      "prefilled_tokens": g("prefill_tokens"), "prefill_padded_tokens": g("prefill_padded_tokens"),
      "prompt_tokens": g("prompt_tokens"), "cached_tokens": g("cached_tokens"),
      "preemptions": g("preemptions"), "page_waits": g("page_waits"),
  }


class Scheduler:
  """Slot table and device state of one engine, and its step.

  Args:
    config: the engine's config.
    model: the model (its ``inference_fns``, ``init_cache`` and cache layout are used).
    params: the engine's own inference params (already copied at the sync boundary).
    vocab_size: the model's vocabulary size.
    finish: ``finish(req, reason, message)``, the front end's way to end a request (it
      releases the request's slot through ``table.release`` and delivers the result).
    stats: counters shared with the engine.
  """

  def __init__(self, config: EngineConfig, model, params, vocab_size: int,
               finish: Callable[[Req, FinishReason, str], None],
               stats: collections.Counter):
    c = self.config = config
    self.vocab_size = vocab_size
    self.stats = stats
    self.table = SlotTable(config, stats)
    self._finish = finish
    self._init_cache = model.init_cache
    fns = model.inference_fns()
    self._prefill = functools.partial(P.prefill, fns)
    self._decode = functools.partial(P.decode, fns, c.decode_steps)
    # Also checks that every cache leaf has a batch axis (its pages).
    self._copy_page = functools.partial(P.copy_page, P.page_axes(model))
    self.score_fn = functools.partial(P.score, fns)
    self.state = P.DeviceState(params=params, cache=self._fresh_cache())

  def _fresh_cache(self):
    """The page pool: ``init_cache`` with a page per row and a page's slots as its length."""
    return self._init_cache(batch_size=self.config.num_pages, max_len=self.config.page_size)

  # ---- recovery ------------------------------------------------------------------------------
  def rebuild(self) -> None:
    """Starts the device state over after a failed device call: an empty slot table (no
    requests, no kept sessions, every page free) and a zeroed page pool; the weights are kept
    (no program donates them).

    A failed call may have consumed its donated cache, or left rows half written that the
    table believes hold a context; nothing of the old cache can be trusted. Its buffers are
    released first, so a failure from memory pressure does not hold two caches at once. The
    caller has already ended every request the old table held.
    """
    for x in jax.tree.leaves(self.state.cache):
      if not x.is_deleted():
        x.delete()
    self.table = SlotTable(self.config, self.stats)
    self.state = self.state.replace(cache=self._fresh_cache())
    jax.block_until_ready(self.state.cache)

  # ---- weights -------------------------------------------------------------------------------
  def set_params(self, params) -> None:
    """Serves ``params`` from the next device call on; kept KV of the old weights is dropped
    (or, for requests still running, never shared again)."""
    self.state = self.state.replace(params=params)
    self.table.new_weights()

  # ---- one step ------------------------------------------------------------------------------
  def step(self) -> bool:
    """Admits, prefills a chunk, decodes; returns whether a prefill or decode ran (its
    device results came back, so the device works)."""
    self.table.admit()
    ran = False
    if self.table.prefilling():
      ran = self._prefill_step()
    decoding = self.table.decoding()
    if decoding:
      ran = self._decode_step(decoding) or ran
    return ran

  def _reserve(self, slots: list[Slot], ends: list[int]) -> list[Slot]:
    """Reserves each slot's pages up to its end (oldest request first: a preemption takes the
    youngest running request, so a slot served earlier is never taken back), makes the page
    copies that asks for, and returns the slots whose requests still hold them."""
    # A slot may lose its request to an earlier slot's reservation (a younger request is
    # preempted before an older one's) or to its own; one served is never taken back.
    kept = [s for s, end in zip(slots, ends) if s.req is not None and self.table.reserve(s, end)]
    for src, dst in self.table.take_copies():
      self.state = self.state.replace(
          cache=self._copy_page(self.state.cache, np.int32(src), np.int32(dst)))
    return kept

  def _prefill_step(self) -> bool:
    c = self.config
    t0 = time.perf_counter()
    C, group = self.table.prefill_group()
    group = self._reserve(group, [len(s.tokens) + min(C, len(s.req.context) - len(s.tokens))
                                  for s in group])
    if not group:
      return False
    rows = bucket(c.prefill_rows, len(group))
    V = c.view_pages(max(len(s.tokens) + C for s in group))
    batch = P.PrefillBatch.zeros(rows, C, V)
    pieces = []
    for i in range(rows):
      s = group[min(i, len(group) - 1)]    # padding rows repeat the last real row exactly
      a = len(s.tokens)
      piece = s.req.context[a:a + C]
      if i < len(group):
        pieces.append(piece)
      batch.pages_PxV[i] = table_row(s.pages, V)
      batch.start_P[i], batch.n_valid_P[i] = a, len(piece)
      batch.tokens_PxC[i, :len(piece)] = piece
    arrays = P.sampling_arrays(rows, [(i, s.req.params, s.req.seed) for i, s in enumerate(group)])
    cache, logits_PxV = self._prefill(self.state.params, self.state.cache, batch)
    self.state = self.state.replace(cache=cache)
    # The first generated token has no earlier output, so the repetition penalties (over
    # generated tokens only) cannot change it; only min_new_tokens' stop-id mask can.
    pen = P.penalties(rows, self.vocab_size,
                      [(i, s.req.params, [], s.req.stop_ids) for i, s in enumerate(group)
                       if s.req.params.min_new_tokens > 0])
    tok_P, logp_P = P.sample(logits_PxV, arrays, batch.start_P + batch.n_valid_P, pen)
    tok_P, logp_P = np.asarray(tok_P), np.asarray(logp_P)
    self.stats["prefill_calls"] += 1
    self.stats["prefill_tokens"] += sum(len(p) for p in pieces)
    self.stats["prefill_padded_tokens"] += rows * C
    self.stats["prefill_s"] += time.perf_counter() - t0
    index = {s.index: i for i, s in enumerate(group)}
    for s in self.table.prefilled(group, pieces):
      if s.req.out:    # back from a preemption: it already has its next input, out[-1]
        continue
      i = index[s.index]
      self.accept(s.req, int(tok_P[i]), float(logp_P[i]))
    return True

  def _decode_step(self, decoding: list[Slot]) -> bool:
    c = self.config
    t0 = time.perf_counter()
    decoding = sorted(decoding, key=lambda s: s.req.seq)
    decoding = self._reserve(decoding, [len(s.tokens) + c.decode_steps for s in decoding])
    if not decoding:
      return False
    R = bucket(c.decode_rows, len(decoding))
    batch = P.DecodeBatch.zeros(R, c.pages_per_row)
    for i, s in enumerate(decoding):
      batch.tokens_R[i], batch.lengths_R[i], batch.active_R[i] = (s.req.out[-1], len(s.tokens),
                                                                  True)
      batch.pages_RxW[i] = table_row(s.pages, c.pages_per_row)
    arrays = P.sampling_arrays(R, [(i, s.req.params, s.req.seed)
                                   for i, s in enumerate(decoding)])
    penalties = P.penalties(R, self.vocab_size,
                            [(i, s.req.params, s.req.out, s.req.stop_ids)
                             for i, s in enumerate(decoding)])
    cache, toks_RxN, logps_RxN = self._decode(self.state.params, self.state.cache, batch,
                                              arrays, penalties)
    self.state = self.state.replace(cache=cache)
    toks_RxN, logps_RxN = np.asarray(toks_RxN), np.asarray(logps_RxN)
    # Tallied before any request finishes: a caller woken by its result reads them complete.
    self.stats["decode_calls"] += 1
    self.stats["decode_tokens"] += len(decoding) * c.decode_steps
    # Occupancy: rows computed against requests that needed them; the per-count tallies let
    # a benchmark price each call at the rate of a batch of its active requests.
    self.stats["decode_rows"] += R
    self.stats["decode_active"] += len(decoding)
    self.stats[f"decode_calls_active_{len(decoding)}"] += 1
    now = time.monotonic()
    for i, s in enumerate(decoding):
      r = s.req
      for n in range(c.decode_steps):
        s.tokens.append(r.out[-1])      # the token just fed now has its KV in the cache
        if self.accept(r, int(toks_RxN[i, n]), float(logps_RxN[i, n])):
          break
      s.last_used = now
    self.stats["decode_s"] += time.perf_counter() - t0
    return True

  def accept(self, r: Req, token: int, logp: float) -> bool:
    """Records one sampled token; finishes the request when a limit is hit."""
    r.record(token, logp)
    hook_stop = False
    if r.on_token is not None:
      try:
        hook_stop = bool(r.on_token(r.out, r.logps))
      except Exception as e:  # noqa: BLE001 - the caller's hook fails its request only
        log.exception("on_token hook of request %s failed", r.rid)
        self._finish(r, FinishReason.ABORT, f"on_token hook failed: {e!r}")
        return True
    end = r.end_after_last(hook_stop)
    if end is not None:
      self._finish(r, *end)
    return r.done

  # ---- compilation ahead of time -------------------------------------------------------------
  def warmup(self, max_cache_len: int | None = None, verbose: bool = False) -> None:
    """Compiles every shape ``step`` can use: decode per row bucket, prefill per (rows, chunk,
    view), on the engine's own pool with tables that name no page (every write is dropped,
    so the pool is unchanged; a second pool could not fit where the first fills the device).

    Args:
      max_cache_len: compile only the prefill views up to this length.
      verbose: log each compilation.
    """
    c = self.config
    params = self.state.params
    lens = [n for n in c.cache_lens if max_cache_len is None or n <= max_cache_len]
    views = sorted({c.view_pages(n) for n in lens})
    try:
      for R in c.decode_rows:
        # Called as the steps call them: penalties passed (None), since jit keys on the
        # arguments' structure and an omitted argument is another program.
        cache, _, _ = self._decode(params, self.state.cache,
                                   P.DecodeBatch.zeros(R, c.pages_per_row), P.sampling_arrays(R),
                                   None)
        self.state = self.state.replace(cache=cache)
        if verbose:
          log.info("warmup decode R=%d", R)
      for rows in c.prefill_rows:
        for V in views:
          for C in c.chunk_sizes:
            if C > V * c.page_size:
              continue   # the view covers the chunk: the scheduler never pairs them
            batch = P.PrefillBatch.zeros(rows, C, V)
            cache, logits = self._prefill(params, self.state.cache, batch)
            self.state = self.state.replace(cache=cache)
            if V == views[0] and C == c.chunk_sizes[0]:
              P.sample(logits, P.sampling_arrays(rows), batch.start_P + batch.n_valid_P, None)
            if verbose:
              log.info("warmup prefill rows=%d C=%d view=%d pages", rows, C, V)
      self.state = self.state.replace(
          cache=self._copy_page(self.state.cache, np.int32(0), np.int32(0)))
      jax.block_until_ready(self.state.cache)
    except BaseException:
      # A failed call may have consumed the donated pool: start the device state over.
      self.rebuild()
      raise
    host_memory.release_free_memory()


__all__ = ["Scheduler"]
