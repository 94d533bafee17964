"""One scheduler step of the embedded engine: admission, prefill, decode.

The ``Scheduler`` owns the engine's state: the slot table (host), the cache-length policy
(host) and the ``DeviceState`` (weights and KV cache). It runs on the engine's scheduler
thread only; each ``step`` admits waiting requests (making the row copies the table asks for),
prefills one chunk for a group of slots and decodes every decoding slot, building each batch
as a struct dataclass for the jitted programs.
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
from rao_jax.rollout.engine.cache_policy import CacheLenPolicy
from rao_jax.rollout.engine.config import EngineConfig, bucket
from rao_jax.rollout.engine.slot_table import Req, Slot, SlotTable

log = logging.getLogger(__name__)


class Scheduler:
  """Slot table, cache policy and device state of one engine, and its step.

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
    self.policy = CacheLenPolicy(c.cache_lens, c.shrink_patience)
    self._finish = finish
    self._init_cache = model.init_cache
    fns = model.inference_fns()
    batch_axes, len_axes = P.cache_axes(model)   # also checks every leaf has a batch axis
    self._prefill = functools.partial(P.prefill, fns)
    self._decode = functools.partial(P.decode, fns, c.decode_steps)
    self._resize = {n: functools.partial(P.resize, len_axes, n) for n in c.cache_lens}
    self._copy_row = functools.partial(P.copy_row, batch_axes)
    self._swap_rows = functools.partial(P.swap_rows, batch_axes)
    self.score_fn = functools.partial(P.score, fns)
    self.state = P.DeviceState(params=params, cache=self._fresh_cache())

  def _fresh_cache(self):
    return self._init_cache(batch_size=self.config.num_slots, max_len=self.policy.length)

  # ---- recovery ------------------------------------------------------------------------------
  def rebuild(self) -> None:
    """Starts the device state over after a failed device call: an empty slot table (no
    requests, no kept sessions), the smallest cache length and a zeroed KV cache; the weights
    are kept (no program donates them).

    A failed call may have consumed its donated cache, or left rows half written that the
    table believes hold a context; nothing of the old cache can be trusted. Its buffers are
    released first, so a failure from memory pressure does not hold two caches at once. The
    caller has already ended every request the old table held.
    """
    for x in jax.tree.leaves(self.state.cache):
      if not x.is_deleted():
        x.delete()
    self.table = SlotTable(self.config, self.stats)
    self.policy = CacheLenPolicy(self.config.cache_lens, self.config.shrink_patience)
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
    for src, dst in self.table.admit():
      self.state = self.state.replace(
          cache=self._copy_row(self.state.cache, np.int32(src), np.int32(dst)))
    ran = False
    if self.table.prefilling():
      self._prefill_step()
      ran = True
    decoding = self.table.decoding()
    if decoding:
      self._decode_step(decoding)
      ran = True
    return ran

  def _ensure_cache_len(self, needed: int, allow_shrink: bool) -> None:
    old = self.policy.length
    new = self.policy.plan(needed, allow_shrink)
    if new is not None:
      self.state = self.state.replace(cache=self._resize[new](self.state.cache))
      self.stats["cache_grow" if new > old else "cache_shrink"] += 1
      # The old cache is free once the resize ran: give its pages back (host_memory says why).
      # Only where freed memory is kept (CPU): elsewhere this would be a needless device sync.
      if host_memory.in_effect():
        jax.block_until_ready(self.state.cache)
        host_memory.release_free_memory()

  def _prefill_step(self) -> None:
    c = self.config
    t0 = time.perf_counter()
    C, group = self.table.prefill_group()
    rows = bucket(c.prefill_rows, len(group))
    self._ensure_cache_len(max(max(len(s.tokens) + C for s in group), self.table.held_need()),
                           allow_shrink=False)
    batch = P.PrefillBatch.zeros(rows, C)
    pieces = []
    for i in range(rows):
      s = group[min(i, len(group) - 1)]    # padding rows repeat the last real row exactly
      a = len(s.tokens)
      piece = s.req.prompt[a:a + C]
      if i < len(group):
        pieces.append(piece)
      batch.rows_P[i], batch.start_P[i], batch.n_valid_P[i] = s.index, a, len(piece)
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
      i = index[s.index]
      self.accept(s.req, int(tok_P[i]), float(logp_P[i]))

  def _decode_step(self, decoding: list[Slot]) -> None:
    c = self.config
    t0 = time.perf_counter()
    for a, b in self.table.compaction():   # rows follow the active requests, not the highest
      self.state = self.state.replace(
          cache=self._swap_rows(self.state.cache, np.int32(a), np.int32(b)))
    R = bucket(c.decode_rows, max(s.index for s in decoding) + 1)
    self._ensure_cache_len(self.table.held_need(), allow_shrink=True)
    batch = P.DecodeBatch.zeros(R)
    for s in self.table.slots[:R]:
      batch.lengths_R[s.index] = len(s.tokens)
    for s in decoding:
      batch.tokens_R[s.index], batch.active_R[s.index] = s.req.out[-1], True
    arrays = P.sampling_arrays(R, [(s.index, s.req.params, s.req.seed) for s in decoding])
    penalties = P.penalties(R, self.vocab_size,
                            [(s.index, s.req.params, s.req.out, s.req.stop_ids)
                             for s in decoding])
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
    for s in decoding:
      r = s.req
      for n in range(c.decode_steps):
        s.tokens.append(r.out[-1])      # the token just fed now has its KV in the cache
        if self.accept(r, int(toks_RxN[s.index, n]), float(logps_RxN[s.index, n])):
          break
      s.last_used = now
    self.stats["decode_s"] += time.perf_counter() - t0

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
    """Compiles every shape ``step`` can use (on scratch caches; the engine's is untouched)."""
    c = self.config
    params = self.state.params
    lens = [n for n in c.cache_lens if max_cache_len is None or n <= max_cache_len]
    for S in lens:
      cache = self._init_cache(batch_size=c.num_slots, max_len=S)
      for R in c.decode_rows:
        # Called as the steps call them: penalties passed (None), since jit keys on the
        # arguments' structure and an omitted argument is another program.
        cache, _, _ = self._decode(params, cache, P.DecodeBatch.zeros(R), P.sampling_arrays(R),
                                   None)
        if verbose:
          log.info("warmup decode S=%d R=%d", S, R)
      for rows in c.prefill_rows:
        for C in c.chunk_sizes:
          if C > S and C != c.chunk_sizes[0]:
            continue   # the scheduler grows the cache before pairing it with a larger chunk
          batch = P.PrefillBatch.zeros(rows, C)
          cache, logits = self._prefill(params, cache, batch)
          if S == lens[0] and C == c.chunk_sizes[0]:
            P.sample(logits, P.sampling_arrays(rows), batch.start_P + batch.n_valid_P, None)
      for S2 in lens:
        if S2 != S:
          jax.block_until_ready(
              self._resize[S2](self._init_cache(batch_size=c.num_slots, max_len=S)))
          host_memory.release_free_memory()
      if c.share_prefix_min:
        cache = self._copy_row(cache, np.int32(0), np.int32(0))
      cache = self._swap_rows(cache, np.int32(0), np.int32(0))
      jax.block_until_ready(cache)
      del cache
      host_memory.release_free_memory()


__all__ = ["Scheduler"]
