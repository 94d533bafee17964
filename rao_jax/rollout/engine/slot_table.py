"""The slot table: which context lives in which slot and KV pages, in plain Python (no JAX).

A slot holds one context; its KV lives in pages of the engine's pool (``pages.PagePool``), a
list per slot. The table decides everything about slots and pages: admission of waiting
requests, sessions (a finished request with a ``session_id`` keeps its slot and pages, and the
next turn reuses the longest common prefix so only the new suffix is prefilled), eviction of
idle sessions (least recently used first, when slots or pages run out; an evicted session is
recomputed transparently), prefix sharing across slots (a new context whose prompt starts like
another slot's cached tokens shares that slot's pages instead of recomputing them; a request
whose shared prefix another slot is still prefilling waits for it), the pages a write needs
(``reserve``: new pages as a context grows, a private copy of a shared page before writing
into it, preemption when the pool is full), the prompt chunk each slot prefills next, and
which slots prefill or decode together.

The device side only ever hears the outcome: ``take_copies`` gives the page copies to make
before the next call, the scheduler builds its batches (and their page tables) from
``prefill_group`` and ``decoding``.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Iterable

from rao_jax.rollout.base import FinishReason, SamplingParams
from rao_jax.rollout.engine.config import EngineConfig, bucket
from rao_jax.rollout.engine.pages import PagePool


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
    context: the tokens whose KV must be in the cache before it decodes: the prompt, or after
      a preemption the prompt and its output but the last token (which decoding feeds next).
    slot: the slot index once admitted.
    seq: its admission order (first admission; the most recent is preempted first).
    cached: prompt tokens whose KV was reused at its first admission (session or prefix).
    decoding: the context is fully prefilled.
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
  context: list[int] | None = None
  slot: int | None = None
  seq: int = -1
  cached: int = 0
  decoding: bool = False
  done: bool = False

  def __post_init__(self):
    if self.context is None:
      self.context = self.prompt

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
    index: the slot's number.
    tokens: the tokens whose KV the slot holds (valid for the current weights).
    pages: the pool pages holding them (slot j in pages[j // page_size]); possibly more,
      reserved for the next writes.
    session: the session kept here, or None.
    req: the request running here, or None.
    last_used: clock time of its last step (eviction and prefill order).
    drop_after: end_session() arrived while a request was running: free it when it ends.
    shareable: False while its KV holds tokens of replaced weights (never a copy source).
  """
  index: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  pages: list[int] = dataclasses.field(default_factory=list)
  session: str | None = None
  req: Req | None = None
  last_used: float = 0.0
  drop_after: bool = False
  shareable: bool = True


class SlotTable:
  """Slots, sessions, KV pages and the waiting queue of one engine.

  Not thread-safe: the engine touches it from its scheduler thread only.

  Args:
    config: the engine's config (num_slots, pages, share_prefix_min, chunk and row buckets).
    stats: counters to add to (evictions, preemptions, prefix shares and waits, page copies,
      prompt/cached tokens).
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
    self.pool = PagePool(config.num_pages, config.page_size)
    self.copies: list[tuple[int, int]] = []   # (src, dst) pages to copy before the next call
    self._admitted = 0

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

  # ---- slot lifetime -------------------------------------------------------------------------
  def free(self, slot: Slot) -> None:
    """Forgets a slot's tokens, pages and session (the request running there, if any, is the
    caller's business)."""
    if slot.session is not None and self.sessions.get(slot.session) == slot.index:
      del self.sessions[slot.session]
    self._keep_pages(slot, 0)
    slot.tokens, slot.session, slot.drop_after, slot.shareable = [], None, False, True

  def _keep_pages(self, slot: Slot, n: int) -> None:
    """Releases the slot's pages past the first n (a copy still to make into one goes too)."""
    dropped = slot.pages[n:]
    if dropped:
      gone = set(dropped)
      self.copies = [(s, d) for s, d in self.copies if d not in gone]
      slot.pages = slot.pages[:n]
      self.pool.release(dropped)

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
      # Pages reserved past its tokens (a fused decode call's last steps) go back now.
      self._keep_pages(slot, self.pool.pages_for(len(slot.tokens)))
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
    """The slot whose cached tokens share the longest prefix with req's context, and its
    length (capped so that one context token is left to prefill: it yields the first logits)."""
    best, best_n = None, 0
    cap = len(req.context) - 1
    for s in self.slots:
      if s is not exclude and s.shareable and len(s.tokens) > best_n:
        n = min(common_prefix(s.tokens, req.context), cap)
        if n > best_n:
          best, best_n = s, n
    return best, best_n

  def wait_for_peer(self, req: Req) -> bool:
    """Whether a slot still prefilling the same prefix will soon have it to share."""
    m = self.config.share_prefix_min
    if not m:
      return False
    cap = len(req.context) - 1
    promised = 0    # the longest prefix a prefilling peer has yet to compute
    for s in self.slots:
      r = s.req
      if r is not None and not r.decoding and s.shareable:
        n = min(common_prefix(r.context, req.context), cap)
        if len(s.tokens) < n:
          promised = max(promised, n)
    # Only then the cached prefixes (most scheduler steps have no prefilling peer at all).
    return promised >= m and promised - self.shared_prefix(req, None)[1] >= m

  def _slot_for(self, req: Req) -> tuple[Slot | None, bool]:
    """(the slot req would take, whether taking it evicts an idle session); (None, False) when
    it must wait (its session's previous turn runs, or no slot is idle). Changes nothing."""
    sid = req.session_id
    if sid is not None and sid in self.sessions:
      cand = self.slots[self.sessions[sid]]
      return (None, False) if cand.req is not None else (cand, False)
    free = [s for s in self.slots if s.req is None and s.session is None]
    if free:
      return free[0], False
    idle = [s for s in self.slots if s.req is None]
    if not idle:
      return None, False
    return min(idle, key=lambda s: s.last_used), True

  def _pages_within_reach(self, exclude: Slot | None) -> int:
    """Free pages, and those only an idle slot other than ``exclude`` holds (evictable), less
    those the contexts admitted before and still prefilling will take."""
    idle = sum(1 for s in self.slots if s.req is None and s is not exclude
               for p in s.pages if self.pool.exclusive(p))
    promised = sum(max(self.pool.pages_for(len(s.req.context) + self.config.margin)
                       - len(s.pages), 0) for s in self.prefilling())
    return self.pool.num_free + idle - promised

  def admit(self) -> list[Req]:
    """Places waiting requests in slots, in arrival order, as far as slots and pages allow.

    A request is admitted when the pool's free pages, and those of idle sessions, cover the
    context it has still to prefill (or when nothing runs: it then has the pool to itself);
    otherwise it and the ones behind it wait. Shared prefixes are taken page by page (no
    device work here); the first write into a partly shared page copies it (``reserve``).

    Returns:
      The requests admitted.
    """
    admitted, blocked = [], []
    m = self.config.share_prefix_min
    P = self.pool.page_size
    while self.waiting:
      req = self.waiting.popleft()
      sid, ctx = req.session_id, req.context
      if self.wait_for_peer(req):
        blocked.append(req)
        self.stats["prefix_waits"] += 1
        continue
      slot, evict = self._slot_for(req)
      if slot is None:
        blocked.append(req)
        if sid is not None and sid in self.sessions:
          continue          # only its own session's turn holds it back
        break
      reuse = 0 if evict else min(common_prefix(slot.tokens, ctx), len(ctx) - 1)
      src, n = self.shared_prefix(req, slot) if m else (None, 0)
      share = src is not None and n - reuse >= m
      held = n if share else reuse
      need = (self.pool.pages_for(len(ctx) + self.config.margin) - self.pool.pages_for(held)
              + (held % P > 0))
      # The slot's own pages count when taking it evicts them (else it keeps what it reuses).
      if self.any_running() and need > self._pages_within_reach(None if evict else slot):
        blocked.append(req)
        self.stats["page_waits"] += 1
        break
      if evict:
        self.stats["evictions"] += 1
        self.free(slot)
      if sid is not None and slot.session != sid:
        # A new session takes the slot (also: a session re-admitted after eviction).
        old = self.sessions.get(sid)
        if old is not None and old != slot.index:
          self.free(self.slots[old])
      if share:
        pages = self.pool.share(src.pages[:self.pool.pages_for(n)])
        self._keep_pages(slot, 0)
        slot.pages = pages
        self.stats["prefix_shares"] += 1
        self.stats["prefix_shared_tokens"] += n - reuse
        reuse = n
        slot.shareable = True
      else:
        self._keep_pages(slot, self.pool.pages_for(reuse))
      slot.tokens = ctx[:reuse]
      slot.req, slot.drop_after = req, False
      req.slot = slot.index
      if req.seq < 0:     # a first admission (a preempted request keeps its place and counts)
        req.seq, self._admitted = self._admitted, self._admitted + 1
        req.cached = reuse
        self.stats["prompt_tokens"] += len(req.prompt)
        self.stats["cached_tokens"] += reuse
      admitted.append(req)
    self.waiting.extendleft(reversed(blocked))
    return admitted

  # ---- pages -----------------------------------------------------------------------------------
  def reserve(self, slot: Slot, end: int) -> bool:
    """Makes the slot's pages writable over slots [len(tokens), end): new pages where it has
    none, a private copy of a page it shares (recorded for ``take_copies``). With the pool
    full, idle sessions are evicted (least recently used first), then running requests are
    preempted (the most recently admitted first, possibly this slot's own).

    Returns:
      False when this slot's own request was preempted (it waits again), else True.
    """
    if slot.req is None:
      raise ValueError(f"SlotTable.reserve: slot {slot.index} runs no request.")
    P = self.pool.page_size
    end = min(end, self.config.pages_per_row * P)
    for w in range(len(slot.tokens) // P, self.pool.pages_for(end)):
      if w < len(slot.pages) and self.pool.exclusive(slot.pages[w]):
        continue
      page = self._take_page(slot)
      if page is None:
        return False
      if w == len(slot.pages):
        slot.pages.append(page)
      elif self.pool.exclusive(slot.pages[w]):   # its other holders were evicted meanwhile
        self.pool.release([page])
      else:
        self.copies.append((slot.pages[w], page))
        self.pool.release([slot.pages[w]])
        slot.pages[w] = page
        self.stats["page_copies"] += 1
    return True

  def _take_page(self, requester: Slot) -> int | None:
    """A free page, freeing one first if none is; None when the requester was preempted."""
    while not self.pool.num_free:
      # An idle session whose eviction frees a page; else the youngest request; else any idle
      # holder (pages shared only among idle sessions).
      idle = [s for s in self.slots if s.req is None and s.pages]
      freeing = [s for s in idle if any(self.pool.exclusive(p) for p in s.pages)]
      running = [s for s in self.slots if s.req is not None and s.pages]
      if freeing or (idle and not running):
        self.stats["evictions"] += 1
        self.free(min(freeing or idle, key=lambda s: s.last_used))
        continue
      if not running:   # every page is held by a slot: one of them must be
        raise RuntimeError("SlotTable: the page pool is full but no slot holds a page")
      victim = max(running, key=lambda s: s.req.seq)
      self.preempt(victim)
      if victim is requester:
        return None
    return self.pool.alloc()

  def preempt(self, slot: Slot) -> None:
    """Takes the request out of its slot to free its pages: it goes back to the front of the
    queue with its output so far, and its context is prefilled again when it returns."""
    req = slot.req
    self.stats["preemptions"] += 1
    self.stats["preempted_tokens"] += len(slot.tokens)
    self.free(slot)
    slot.req = None
    req.slot, req.decoding = None, False
    req.context = req.prompt + req.out[:-1] if req.out else req.prompt
    self.waiting.appendleft(req)

  def take_copies(self) -> list[tuple[int, int]]:
    """The page copies ``(src, dst)`` to make on the device, in order, before the next call."""
    copies, self.copies = self.copies, []
    return copies

  # ---- batches -------------------------------------------------------------------------------
  def chunk_for(self, slot: Slot) -> int:
    """The prompt chunk bucket slot prefills next."""
    c = self.config
    start = len(slot.tokens)
    remaining = len(slot.req.context) - start
    C = bucket(c.chunk_sizes, remaining)
    if C > 2 * remaining:
      # Mostly padding (e.g. 65 tokens in a 256 chunk): take the largest chunk that is full.
      full = [b for b in c.chunk_sizes if b <= remaining]
      C = full[-1] if full else C
    fitting = [b for b in c.chunk_sizes if b <= C and start + b <= c.max_len]
    return fitting[-1]    # never empty: capacity leaves room for the smallest chunk

  def prefill_group(self) -> tuple[int, list[Slot]]:
    """(chunk, slots) of the next prefill call: the least recently served prefilling slot's
    chunk, with every other slot of that chunk up to the largest row bucket (oldest request
    first, the order ``reserve`` must see them in)."""
    prefilling = sorted(self.prefilling(), key=lambda s: s.last_used)
    C = self.chunk_for(prefilling[0])
    group = [s for s in prefilling if self.chunk_for(s) == C][:self.config.prefill_rows[-1]]
    return C, sorted(group, key=lambda s: s.req.seq)

  def prefilled(self, group: Iterable[Slot], pieces: list[list[int]]) -> list[Slot]:
    """Records that each slot of group now holds its piece of context; returns those whose
    context is complete (their request decodes from now on)."""
    now = self.clock()
    complete = []
    for s, piece in zip(group, pieces):
      s.tokens.extend(piece)
      s.last_used = now
      if len(s.tokens) == len(s.req.context):
        s.req.decoding = True
        complete.append(s)
    return complete


__all__ = ["Req", "Slot", "SlotTable", "common_prefix"]
