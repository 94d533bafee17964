"""The slot table: which context lives in which cache row, in plain Python (no JAX).

A slot is one row of the KV cache and holds one context. The table decides everything about
slots: admission of waiting requests, sessions (a finished request with a ``session_id`` keeps
its slot, and the next turn reuses the longest common prefix so only the new suffix is
prefilled), eviction of idle sessions (least recently used first; an evicted session is
recomputed transparently), prefix sharing across slots (a new context whose prompt starts like
another slot's cached tokens gets that slot's KV rows copied instead of recomputing them; a
request whose shared prefix another slot is still prefilling waits for it), the prompt chunk
each slot prefills next, and which rows prefill or decode together.

The device side only ever hears the outcome: ``admit`` returns the row copies to make, the
scheduler then builds its batches from ``prefill_group`` and ``decoding``.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Iterable

from rao_jax.rollout.base import FinishReason, SamplingParams
from rao_jax.rollout.engine.config import EngineConfig, bucket


def common_prefix(a: list[int], b: list[int]) -> int:
  """Length of the longest common prefix of two token lists."""
  # Slice comparisons run in C: admission compares every waiting prompt with every slot (tens
  # of ~500-token prefixes per scheduler step), too slow token by token in Python.
  n = min(len(a), len(b))
  if a[:n] == b[:n]:
    return n
  lo, hi = 0, n      # a[:lo] == b[:lo] and a[:hi] != b[:hi]
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if a[lo:mid] == b[lo:mid]:
      lo = mid
    else:
      hi = mid
  return lo


@dataclasses.dataclass(eq=False)
class Req:
  """One request's host-side state, from admission to its result.

  Attributes:
    rid: the request id (unique among running requests).
    prompt: the prompt's token ids.
    params: its sampling parameters.
    limit: the most tokens prompt + output may reach (context limit and engine capacity).
    seed: its sampling seed (uint32).
    stop_ids: ids that end it (kept in the output).
    session_id: the session whose slot it uses and keeps, or None.
    request / loop / future / on_token: the front end's handles (the caller's request, its
      event loop and result future, its per-token hook); the table never reads them.
    out / logps: generated ids and their logprobs so far.
    slot: the slot index once admitted.
    cached: prompt tokens whose KV was reused (session or shared prefix).
    decoding: the prompt is fully prefilled.
    done: the result has been decided.
  """
  rid: str
  prompt: list[int]
  params: SamplingParams
  limit: int
  seed: int = 0
  stop_ids: frozenset = frozenset()
  session_id: str | None = None
  request: Any = None
  loop: Any = None
  future: Any = None
  on_token: Any = None
  out: list[int] = dataclasses.field(default_factory=list)
  logps: list[float] = dataclasses.field(default_factory=list)
  slot: int | None = None
  cached: int = 0
  decoding: bool = False
  done: bool = False

  def record(self, token: int, logp: float) -> None:
    """Appends one generated token and its logprob."""
    self.out.append(token)
    self.logps.append(logp)

  def end_after_last(self, hook_stop: bool = False) -> tuple[FinishReason, str] | None:
    """(reason, message) when the last recorded token ends the request, else None.

    Args:
      hook_stop: the caller's per-token hook asked to stop (stop strings, streaming).
    """
    if self.out[-1] in self.stop_ids or hook_stop:
      return FinishReason.STOP, ""
    if len(self.out) >= self.params.max_new_tokens:
      return FinishReason.LENGTH, ""
    if len(self.prompt) + len(self.out) >= self.limit:
      return FinishReason.CONTEXT, f"context limit of {self.limit} tokens reached"
    return None


@dataclasses.dataclass(eq=False)
class Slot:
  """One cache row.

  Attributes:
    index: the row.
    tokens: the tokens whose KV the row holds (valid for the current weights).
    session: the session kept here, or None.
    req: the request running here, or None.
    last_used: clock time of its last step (eviction and prefill order).
    drop_after: end_session() arrived while a request was running: free it when it ends.
    shareable: False while its KV holds tokens of replaced weights (never a copy source).
  """
  index: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  session: str | None = None
  req: Req | None = None
  last_used: float = 0.0
  drop_after: bool = False
  shareable: bool = True


class SlotTable:
  """Slots, sessions and the waiting queue of one engine.

  Not thread-safe: the engine touches it from its scheduler thread only.

  Args:
    config: the engine's config (num_slots, share_prefix_min, chunk and row buckets).
    stats: counters to add to (evictions, prefix copies and waits, prompt/cached tokens).
    clock: a monotonic clock (tests pass their own).
  """

  def __init__(self, config: EngineConfig, stats: collections.Counter | None = None,
               clock: Callable[[], float] = time.monotonic):
    self.config = config
    self.stats = stats if stats is not None else collections.Counter()
    self.clock = clock
    self.slots = [Slot(i) for i in range(config.num_slots)]
    self.sessions: dict[str, int] = {}
    self.waiting: collections.deque[Req] = collections.deque()

  # ---- queries -------------------------------------------------------------------------------
  def any_running(self) -> bool:
    """Whether any slot has a request admitted (prefilling or decoding)."""
    return any(s.req is not None for s in self.slots)

  def requests(self) -> list[Req]:
    """Every request the table holds: waiting, then running."""
    return list(self.waiting) + [s.req for s in self.slots if s.req is not None]

  def prefilling(self) -> list[Slot]:
    """Slots whose request still has prompt tokens to prefill."""
    return [s for s in self.slots if s.req is not None and not s.req.decoding]

  def decoding(self) -> list[Slot]:
    """Slots whose request generates (its prompt is in the cache)."""
    return [s for s in self.slots if s.req is not None and s.req.decoding]

  def held_need(self) -> int:
    """The cache length every slot's held tokens need through the next decode call."""
    return max([len(s.tokens) + self.config.decode_steps for s in self.slots] + [1])

  # ---- slot lifetime -------------------------------------------------------------------------
  def free(self, slot: Slot) -> None:
    """Forgets a slot's tokens and session (the request running there, if any, is the
    caller's business)."""
    if slot.session is not None and self.sessions.get(slot.session) == slot.index:
      del self.sessions[slot.session]
    slot.tokens, slot.session, slot.drop_after, slot.shareable = [], None, False, True

  def flush(self) -> bool:
    """Drops every kept session; False (and nothing dropped) while requests wait or run."""
    if self.waiting or self.any_running():
      return False
    for s in self.slots:
      self.free(s)
    return True

  def end_session(self, session_id: str) -> None:
    """Frees a session's slot now, or when its running request ends."""
    idx = self.sessions.get(session_id)
    if idx is not None:
      slot = self.slots[idx]
      if slot.req is None:
        self.free(slot)
      else:
        slot.drop_after = True

  def release(self, req: Req) -> None:
    """Takes a finished request out of its slot: the slot keeps its session (and KV) when the
    request had one, else it is freed."""
    if req.slot is None:
      return
    slot = self.slots[req.slot]
    slot.req = None
    slot.last_used = self.clock()
    if req.session_id is not None and not slot.drop_after:
      slot.session = req.session_id
      self.sessions[slot.session] = slot.index
    else:
      self.free(slot)

  def new_weights(self) -> None:
    """KV computed by old weights is stale for later turns: idle slots are freed, running ones
    finish on their old KV but are never a prefix source again."""
    for s in self.slots:
      if s.req is None:
        self.free(s)
      else:
        s.shareable = False

  # ---- admission -----------------------------------------------------------------------------
  def shared_prefix(self, req: Req, exclude: Slot | None) -> tuple[Slot | None, int]:
    """The slot whose cached tokens share the longest prefix with req's prompt, and its length
    (capped so that one prompt token is left to prefill: it yields the first logits)."""
    best, best_n = None, 0
    cap = len(req.prompt) - 1
    for s in self.slots:
      if s is not exclude and s.shareable and len(s.tokens) > best_n:
        n = min(common_prefix(s.tokens, req.prompt), cap)
        if n > best_n:
          best, best_n = s, n
    return best, best_n

  def wait_for_peer(self, req: Req) -> bool:
    """Whether a slot still prefilling the same prompt prefix will soon have it to share."""
    m = self.config.share_prefix_min
    if not m:
      return False
    cap = len(req.prompt) - 1
    promised = 0    # the longest prefix a prefilling peer has yet to compute
    for s in self.slots:
      r = s.req
      if r is not None and not r.decoding and s.shareable:
        n = min(common_prefix(r.prompt, req.prompt), cap)
        if len(s.tokens) < n:
          promised = max(promised, n)
    # Only then the cached prefixes (most scheduler steps have no prefilling peer at all).
    return promised >= m and promised - self.shared_prefix(req, None)[1] >= m

  def admit(self) -> list[tuple[int, int]]:
    """Places waiting requests in slots, in arrival order, as far as slots allow.

    Returns:
      The row copies ``(src, dst)`` to make on the device, in this order, before the next
      prefill: each gives slot dst the KV rows of slot src for a shared prompt prefix.
    """
    copies = []
    blocked = []
    m = self.config.share_prefix_min
    while self.waiting:
      req = self.waiting.popleft()
      sid = req.session_id
      if self.wait_for_peer(req):
        blocked.append(req)
        self.stats["prefix_waits"] += 1
        continue
      slot = None
      if sid is not None and sid in self.sessions:
        cand = self.slots[self.sessions[sid]]
        if cand.req is not None:      # the session's previous turn is still running
          blocked.append(req)
          continue
        slot = cand
      if slot is None:
        free = [s for s in self.slots if s.req is None and s.session is None]
        if free:
          slot = free[0]
        else:
          idle = [s for s in self.slots if s.req is None]
          if not idle:
            blocked.append(req)
            break
          slot = min(idle, key=lambda s: s.last_used)
          self.stats["evictions"] += 1
          self.free(slot)
      if sid is not None and slot.session != sid:
        # A new session takes the slot (also: a session re-admitted after eviction).
        old = self.sessions.get(sid)
        if old is not None and old != slot.index:
          self.free(self.slots[old])
      reuse = min(common_prefix(slot.tokens, req.prompt), len(req.prompt) - 1)
      if m:
        src, n = self.shared_prefix(req, slot)
        if src is not None and n - reuse >= m:
          copies.append((src.index, slot.index))
          self.stats["prefix_copies"] += 1
          self.stats["prefix_copied_tokens"] += n - reuse
          reuse = n
          slot.shareable = True
      slot.tokens = req.prompt[:reuse]
      slot.req, slot.drop_after = req, False
      req.slot, req.cached = slot.index, reuse
      self.stats["prompt_tokens"] += len(req.prompt)
      self.stats["cached_tokens"] += reuse
    self.waiting.extendleft(reversed(blocked))
    return copies

  # ---- compaction ----------------------------------------------------------------------------
  def compaction(self) -> list[tuple[int, int]]:
    """Swaps rows so that the decoding slots fill the lowest rows; returns the swaps to make.

    Decoding runs over the first R rows, R the bucket covering the highest decoding slot. A
    parent keeps its slot (its session) while its children generate, so children sit in high
    rows and R would count the idle rows below them. When the decoding slots would fit a
    smaller bucket, each one above it trades rows (KV and all) with a non-decoding slot
    below it: R then follows the active requests. The table is updated here; the caller
    swaps the device rows in the same order before the next device call.
    """
    decoding = self.decoding()
    if not decoding:
      return []
    rows = self.config.decode_rows
    want = bucket(rows, len(decoding))
    if want >= bucket(rows, max(s.index for s in decoding) + 1):
      return []
    high = sorted((s for s in decoding if s.index >= want), key=lambda s: -s.index)
    low = [s for s in self.slots[:want] if s.req is None or not s.req.decoding]
    swaps = []
    for h, l in zip(high, low):   # low has room for all of high (see the count in the doc)
      swaps.append((h.index, l.index))
      self._swap(h.index, l.index)
    self.stats["row_swaps"] += len(swaps)
    return swaps

  def _swap(self, a: int, b: int) -> None:
    sa, sb = self.slots[a], self.slots[b]
    self.slots[a], self.slots[b] = sb, sa
    sa.index, sb.index = b, a
    for s in (sa, sb):
      if s.req is not None:
        s.req.slot = s.index
    for sid, idx in list(self.sessions.items()):
      if idx in (a, b):
        self.sessions[sid] = b if idx == a else a

  # ---- batches -------------------------------------------------------------------------------
  def chunk_for(self, slot: Slot) -> int:
    """The prompt chunk bucket slot prefills next."""
    c = self.config
    start = len(slot.tokens)
    remaining = len(slot.req.prompt) - start
    C = bucket(c.chunk_sizes, remaining)
    if C > 2 * remaining:
      # Mostly padding (e.g. 65 tokens in a 256 chunk): take the largest chunk that is full.
      full = [b for b in c.chunk_sizes if b <= remaining]
      C = full[-1] if full else C
    fitting = [b for b in c.chunk_sizes if b <= C and start + b <= c.max_len]
    return fitting[-1]    # never empty: capacity leaves room for the smallest chunk

  def prefill_group(self) -> tuple[int, list[Slot]]:
    """(chunk, slots) of the next prefill call: the least recently served prefilling slot's
    chunk, with every other slot of that chunk up to the largest row bucket."""
    prefilling = sorted(self.prefilling(), key=lambda s: s.last_used)
    C = self.chunk_for(prefilling[0])
    group = [s for s in prefilling if self.chunk_for(s) == C][:self.config.prefill_rows[-1]]
    return C, group

  def prefilled(self, group: Iterable[Slot], pieces: list[list[int]]) -> list[Slot]:
    """Records that each slot of group now holds its piece of prompt; returns those whose
    prompt is complete (their request decodes from now on)."""
    now = self.clock()
    complete = []
    for s, piece in zip(group, pieces):
      s.tokens.extend(piece)
      s.last_used = now
      if len(s.tokens) == len(s.req.prompt):
        s.req.decoding = True
        complete.append(s)
    return complete


__all__ = ["Req", "Slot", "SlotTable", "common_prefix"]
