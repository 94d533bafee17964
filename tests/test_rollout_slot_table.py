"""The embedded engine's host side without JAX: the slot table (admission, sessions, eviction,
prefix sharing, batch grouping), the KV page pool (allocation as a context grows, release when it
ends, shared pages and their copies, eviction and preemption when the pool is full) and the
request's stop rules.

Nothing here imports JAX (the engine's device side is tested in test_rollout_embedded.py);
`test_host_side_loads_no_jax` checks it in a fresh interpreter.
"""
import collections
import subprocess
import sys

import pytest

from rao_jax.rollout.base import FinishReason, SamplingParams
from rao_jax.rollout.engine.config import EngineConfig
from rao_jax.rollout.engine.pages import PagePool, PoolExhausted, table_row
from rao_jax.rollout.engine.slot_table import Req, SlotTable, common_prefix


class Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    self.t += 1.0
    return self.t


def table(**kw):
  cfg = EngineConfig(**{**dict(num_slots=3, max_len=64, cache_lens=(32, 64), chunk_sizes=(4, 16),
                               prefill_rows=(1, 2), share_prefix_min=0, page_size=8), **kw})
  return SlotTable(cfg, collections.Counter(), clock=Clock())


def check_pages(t):
  """The pool's counts equal the slots' holds; each slot's pages cover the tokens it holds."""
  t.pool.check(s.pages for s in t.slots)
  for s in t.slots:
    assert len(s.pages) >= t.pool.pages_for(len(s.tokens)), (s.index, s.tokens, s.pages)


def req(prompt, session=None, rid=None, max_new=8, stops=(), limit=48):
  return Req(rid=rid or f"r{id(prompt)}", prompt=list(prompt),
             params=SamplingParams(temperature=0.0, max_new_tokens=max_new), limit=limit,
             stop_ids=frozenset(stops), session_id=session)


def prefill_all(t):
  """Prefills every admitted context completely, reserving pages as the scheduler does."""
  while t.prefilling():
    C, group = t.prefill_group()
    pieces = [s.req.context[len(s.tokens):len(s.tokens) + C] for s in group]
    assert all(t.reserve(s, len(s.tokens) + len(p)) for s, p in zip(group, pieces))
    t.prefilled(group, pieces)
    check_pages(t)


def finish(t, r, generated=()):
  """Ends a request: its generated tokens' KV is in the slot (all but the last), then the
  table takes it out."""
  slot = t.slots[r.slot]
  for tok in generated:
    r.record(tok, -1.0)
  new = list(generated)[:-1]
  assert t.reserve(slot, len(slot.tokens) + len(new))
  slot.tokens.extend(new)
  r.done = True
  t.release(r)
  check_pages(t)


def test_host_side_loads_no_jax():
  code = ("import sys\n"
          "from rao_jax.rollout.engine import slot_table, pages, config\n"
          "from rao_jax.rollout import base\n"
          "t = slot_table.SlotTable(config.EngineConfig(num_slots=4, max_len=64))\n"
          "t.waiting.append(slot_table.Req('a', [1, 2, 3], base.SamplingParams(), 60))\n"
          "t.admit()\n"
          "assert t.slots[0].req is not None\n"
          "assert 'jax' not in sys.modules and 'flax' not in sys.modules, sorted(sys.modules)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr


def test_common_prefix_matches_a_token_by_token_scan():
  import random
  rng = random.Random(0)
  for _ in range(300):
    a = [rng.randrange(3) for _ in range(rng.randrange(40))]
    b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(40))]
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
      n += 1
    assert common_prefix(a, b) == n == common_prefix(b, a)


def test_admission_fills_free_slots_in_order_then_waits():
  t = table()
  reqs = [req(range(1, 6 + i), rid=f"r{i}") for i in range(4)]
  t.waiting.extend(reqs)
  assert t.admit() == reqs[:3]
  assert [s.req for s in t.slots] == reqs[:3]
  assert list(t.waiting) == [reqs[3]]                     # no idle slot: it waits, in order
  assert [r.slot for r in reqs[:3]] == [0, 1, 2] and reqs[3].slot is None
  assert t.stats["prompt_tokens"] == 5 + 6 + 7 and t.stats["cached_tokens"] == 0
  finish(t, reqs[1], [9, 9])                              # no session: its slot is freed
  assert t.slots[1].tokens == [] and t.slots[1].req is None
  t.admit()
  assert t.slots[1].req is reqs[3] and not t.waiting


def test_session_keeps_its_slot_and_reuses_the_common_prefix():
  t = table()
  first = req([1, 2, 3, 4, 5, 6], session="s")
  t.waiting.append(first)
  t.admit()
  prefill_all(t)
  assert first.decoding and t.slots[0].tokens == [1, 2, 3, 4, 5, 6]
  finish(t, first, [7, 8])                     # KV of 7 is in the cache; 8 was never fed
  assert t.sessions == {"s": 0} and t.slots[0].tokens == [1, 2, 3, 4, 5, 6, 7]
  nxt = req([1, 2, 3, 4, 5, 6, 7, 8, 20, 21], session="s")
  t.waiting.append(nxt)
  t.admit()
  assert nxt.slot == 0 and nxt.cached == 7 and t.slots[0].tokens == [1, 2, 3, 4, 5, 6, 7]
  # A repeated prompt still leaves one token to prefill (it yields the first logits).
  finish(t, nxt)
  same = req(list(t.slots[0].tokens), session="s")
  t.waiting.append(same)
  t.admit()
  assert same.cached == len(same.prompt) - 1


def test_a_session_turn_waits_while_its_previous_turn_runs():
  t = table()
  a1 = req([1, 2, 3], session="a")
  t.waiting.append(a1)
  t.admit()
  prefill_all(t)
  finish(t, a1, [4])
  a2, a3, other = req([1, 2, 3, 4, 5], session="a"), req([1, 2, 3, 4, 5, 6], session="a"), \
      req([9, 9, 9])
  t.waiting.extend([a2, a3, other])
  t.admit()
  assert a2.slot == 0 and a3.slot is None and other.slot == 1
  assert list(t.waiting) == [a3]


def test_idle_sessions_are_evicted_least_recently_used_first():
  t = table()
  sessions = {}
  for sid in "abc":
    r = req([ord(sid)] * 4, session=sid)
    t.waiting.append(r)
    t.admit()
    prefill_all(t)
    finish(t, r, [1])
    sessions[sid] = r.slot
  t.slots[sessions["a"]].last_used = 100.0      # a was used last: b is the oldest now
  new = req([5, 5, 5], session="d")
  t.waiting.append(new)
  t.admit()
  assert new.slot == sessions["b"] and t.stats["evictions"] == 1
  assert set(t.sessions) == {"a", "c"}           # d is recorded when its request ends
  finish(t, new, [2])
  assert t.sessions["d"] == sessions["b"]
  # The evicted session comes back: a fresh slot (after another eviction), nothing cached.
  back = req([ord("b")] * 4 + [1, 7], session="b")
  t.waiting.append(back)
  t.admit()
  assert back.cached == 0 and t.stats["evictions"] == 2


def test_end_session_frees_now_or_when_the_running_request_ends():
  t = table()
  r = req([1, 2, 3], session="s")
  t.waiting.append(r)
  t.admit()
  prefill_all(t)
  finish(t, r, [4])
  assert t.sessions == {"s": 0}
  r2 = req([1, 2, 3, 4, 5], session="s")
  t.waiting.append(r2)
  t.admit()
  assert not t.flush()                     # a request runs: nothing dropped
  t.end_session("s")                       # running: freed when it ends, not kept
  assert t.slots[0].drop_after and t.sessions == {"s": 0}
  finish(t, r2, [6])
  assert "s" not in t.sessions and t.slots[0].tokens == []
  r3 = req([1, 2, 3], session="s")
  t.waiting.append(r3)
  t.admit()
  prefill_all(t)
  finish(t, r3, [4])
  assert t.sessions == {"s": 0}
  t.end_session("s")                       # idle: freed at once
  assert t.sessions == {} and t.slots[0].tokens == []
  assert t.flush()


def test_prefix_sharing_shares_pages_above_the_threshold():
  head = list(range(100, 120))               # a 20-token "system prompt": pages 0, 1 and half of 2
  t = table(share_prefix_min=8)
  src = req(head + [1, 2], session="x")
  t.waiting.append(src)
  t.admit()
  prefill_all(t)
  finish(t, src, [3])                        # idle session: still a source
  a, b = req(head + [7]), req(head[:5] + [9, 9])
  t.waiting.extend([a, b])
  assert t.admit() == [a, b]                 # b shares only 5 tokens (< 8): its own pages
  src_slot, a_slot = t.slots[src.slot], t.slots[a.slot]
  assert a.cached == len(head) and b.cached == 0
  assert a_slot.tokens == head and a_slot.pages == src_slot.pages[:3] and not t.slots[b.slot].pages
  assert list(t.pool.refs[src_slot.pages[:3]]) == [2, 2, 2]
  assert t.stats["prefix_shares"] == 1 and t.stats["prefix_shared_tokens"] == len(head)
  check_pages(t)
  # a writes from slot 20 on, inside the half-full shared page 2: it gets its own copy first.
  assert t.reserve(a_slot, 21) and t.take_copies() == [(src_slot.pages[2], a_slot.pages[2])]
  assert a_slot.pages[:2] == src_slot.pages[:2] and t.stats["page_copies"] == 1
  assert t.take_copies() == []
  check_pages(t)


def test_a_request_waits_for_a_peer_still_prefilling_its_prefix():
  head = list(range(200, 230))
  t = table(share_prefix_min=8)
  first, second = req(head + [1]), req(head + [2])
  t.waiting.extend([first, second])
  assert t.admit() == [first]                # second waits for first's prefix
  assert first.slot is not None and second.slot is None and t.stats["prefix_waits"] == 1
  prefill_all(t)
  assert t.admit() == [second] and second.cached == len(head)
  assert t.slots[second.slot].pages == t.slots[first.slot].pages[:4]   # 30 tokens: 4 pages


def test_new_weights_free_idle_slots_and_stop_sharing_running_ones():
  head = list(range(300, 320))
  t = table(share_prefix_min=8)
  idle, running = req(head + [1], session="i"), req(head + [2])
  t.waiting.extend([idle])
  t.admit()
  prefill_all(t)
  finish(t, idle, [5])
  t.waiting.append(running)
  t.admit()
  assert t.stats["prefix_shares"] == 1
  prefill_all(t)
  assert running.decoding
  t.new_weights()
  assert "i" not in t.sessions and not t.slots[running.slot].shareable
  check_pages(t)                                 # the shared pages are the running one's now
  late = req(head + [3])
  t.waiting.append(late)
  assert t.admit() == [late] and late.cached == 0    # stale KV is never shared
  assert t.stats["prefix_shares"] == 1
  finish(t, running, [4])
  assert t.slots[running.slot].shareable         # a freed slot starts clean


def test_prefill_groups_share_one_chunk_and_the_oldest_goes_first():
  t = table(num_slots=4, prefill_rows=(1, 2))
  long1, short, long2, long3 = req(range(1, 40)), req([1, 2, 3]), req(range(2, 41)), \
      req(range(3, 42))
  t.waiting.extend([long1, short, long2, long3])
  t.admit()
  t.slots[short.slot].last_used = -1.0         # served least recently: its chunk goes first
  C, group = t.prefill_group()
  assert C == 4 and [s.req for s in group] == [short]
  done = t.prefilled(group, [short.prompt[:4]])
  assert [s.req for s in done] == [short] and short.decoding
  C, group = t.prefill_group()
  assert C == 16 and len(group) == 2           # the largest row bucket caps the group
  # 39 tokens in chunks of 16: full chunks, then the small bucket for the 7 left.
  t.prefilled(group, [s.req.prompt[:16] for s in group])
  slot = t.slots[long1.slot]
  slot.tokens = long1.prompt[:32]
  assert t.chunk_for(slot) == 4


def test_request_stop_rules():
  r = req([1, 2], max_new=3, stops=(9,), limit=5)
  r.record(4, -0.1)
  assert r.end_after_last() is None
  assert r.end_after_last(hook_stop=True) == (FinishReason.STOP, "")
  r.record(9, -0.2)
  assert r.end_after_last()[0] == FinishReason.STOP
  r = req([1, 2], max_new=2, limit=50)
  r.record(4, 0.0)
  r.record(5, 0.0)
  assert r.end_after_last()[0] == FinishReason.LENGTH
  r = req([1, 2, 3], max_new=10, limit=5)
  r.record(4, 0.0)
  r.record(5, 0.0)
  reason, message = r.end_after_last()
  assert reason == FinishReason.CONTEXT and "5 tokens" in message


def test_page_pool_allocates_shares_and_frees():
  pool = PagePool(num_pages=4, page_size=16)
  assert pool.pages_for(0) == 0 and pool.pages_for(16) == 1 and pool.pages_for(17) == 2
  a, b = pool.alloc(), pool.alloc()
  assert (a, b) == (0, 1) and pool.num_free == 2 and pool.exclusive(a)
  assert pool.share([a]) == [a] and not pool.exclusive(a) and pool.refs[a] == 2
  pool.release([a])                       # one holder left: still held
  assert pool.exclusive(a) and pool.num_free == 2
  pool.release([a, b])
  assert pool.num_free == 4 and pool.alloc() == b    # the page freed last is reused first
  pool.check([[b]])
  with pytest.raises(ValueError, match="released twice"):
    pool.release([a])
  with pytest.raises(ValueError, match="free ones"):
    pool.share([a])
  for _ in range(3):
    pool.alloc()
  with pytest.raises(PoolExhausted, match="EngineConfig.num_pages"):
    pool.alloc()
  assert list(table_row([5, 2], 4)) == [5, 2, -1, -1] and list(table_row([1, 2, 3], 2)) == [1, 2]


def test_pages_follow_a_context_as_it_grows_and_return_when_it_ends():
  t = table()                                             # pages of 8 slots
  r = req(range(1, 12))                                   # 11 tokens: 2 pages
  t.waiting.append(r)
  t.admit()
  slot = t.slots[r.slot]
  assert slot.pages == []                                 # nothing until it writes
  prefill_all(t)
  assert slot.pages == [0, 1] and t.pool.num_free == t.pool.num_pages - 2
  assert t.reserve(slot, len(slot.tokens) + 1) and slot.pages == [0, 1]    # slot 11: page 1
  slot.tokens += [7] * 5                                  # 16 tokens: page 1 full
  assert t.reserve(slot, 17) and slot.pages == [0, 1, 2]  # slot 16 opens a page
  assert t.take_copies() == []                            # nothing shared: nothing to copy
  r.done = True
  t.release(r)                                            # no session: every page back
  assert slot.pages == [] and t.pool.num_free == t.pool.num_pages
  check_pages(t)


def test_a_kept_session_keeps_its_pages_and_a_shorter_next_turn_returns_the_rest():
  t = table()
  first = req(list(range(1, 20)), session="s")            # 19 tokens: 3 pages
  t.waiting.append(first)
  t.admit()
  prefill_all(t)
  assert t.reserve(t.slots[first.slot], 19 + 8)           # a fused decode call's extent: 4 pages
  finish(t, first, [50])
  slot = t.slots[first.slot]
  assert len(slot.pages) == 3                             # the page past its tokens went back
  nxt = req(list(range(1, 6)) + [99, 98], session="s")    # shares 5 tokens with the session
  t.waiting.append(nxt)
  t.admit()
  assert nxt.cached == 5 and len(slot.pages) == 1 and t.pool.num_free == t.pool.num_pages - 1
  check_pages(t)


def test_a_full_pool_evicts_idle_sessions_then_preempts_the_youngest_request():
  t = table(num_slots=3, num_pages=8)                     # 8 pages of 8 slots: 64 in all
  idle = req(list(range(1, 17)), session="idle")          # 2 pages, then idle
  t.waiting.append(idle)
  t.admit()
  prefill_all(t)
  finish(t, idle, [5])
  old, young = req(list(range(100, 124))), req(list(range(200, 224)))   # 3 pages each
  t.waiting.extend([old, young])
  assert t.admit() == [old, young]
  prefill_all(t)
  assert t.pool.num_free == 0                             # 2 + 3 + 3 pages
  o, y = t.slots[old.slot], t.slots[young.slot]
  for r in (old, young):
    r.record(9, -1.0)
  # old grows into a new page: the idle session goes first (it frees 2 pages).
  assert t.reserve(o, 25) and len(o.pages) == 4 and t.stats["evictions"] == 1
  assert "idle" not in t.sessions and t.pool.num_free == 1
  assert t.reserve(y, 25) and t.pool.num_free == 0
  o.tokens += [9] * 8                                     # 32 tokens: page 3 full
  # old needs another page, nothing is idle: the youngest request gives its pages back and
  # waits at the front of the queue, its output kept; its context is what it held.
  assert t.reserve(o, 33) and len(o.pages) == 5
  assert young.slot is None and not young.decoding and list(t.waiting) == [young]
  assert young.context == young.prompt and young.out == [9]
  assert t.stats["preemptions"] == 1 and t.stats["preempted_tokens"] == 24
  check_pages(t)
  # Admission waits while the pool cannot hold its context (4 pages, 3 free)...
  assert t.admit() == [] and young.slot is None and t.stats["page_waits"] == 1
  # ... and takes it when the running request ends: back, it re-prefills prompt + out[:-1]
  # (here the prompt), and keeps its place (seq) and its first admission's counts.
  seq = young.seq
  old.done = True
  t.release(old)
  assert t.admit() == [young] and young.seq == seq and young.cached == 0
  assert t.stats["prompt_tokens"] == 16 + 24 + 24
  check_pages(t)


def test_a_preempted_decoding_request_resumes_from_its_output():
  t = table(num_slots=2, num_pages=8, max_len=64)
  a, b = req(list(range(1, 25))), req(list(range(30, 54)))   # 3 pages each
  t.waiting.extend([a, b])
  t.admit()
  prefill_all(t)
  for tok in (7, 8, 9):                 # b decodes three tokens: two fed, one pending
    b.record(tok, -1.0)
  b_slot, a_slot = t.slots[b.slot], t.slots[a.slot]
  assert t.reserve(b_slot, 26)          # 4 pages, one left free
  b_slot.tokens += [7, 8]
  assert t.reserve(a_slot, 40)          # a (older) grows by 2 pages: b is preempted for one
  a_slot.tokens += [5] * 16
  assert t.reserve(a_slot, 48) and len(a_slot.pages) == 6
  assert b.slot is None and b.context == b.prompt + [7, 8] and b.out == [7, 8, 9]
  check_pages(t)
  # Back in a slot it prefills its context (26 tokens), then decodes from out[-1] on.
  t.waiting.clear()
  a.done = True
  t.release(a)
  t.waiting.append(b)
  t.admit()
  prefill_all(t)
  assert b.decoding and t.slots[b.slot].tokens == b.prompt + [7, 8]


def test_the_youngest_request_asking_for_a_page_is_preempted_itself():
  t = table(num_slots=2, num_pages=8)
  a, b = req(list(range(1, 29))), req(list(range(40, 68)))     # 4 pages each: the pool
  t.waiting.extend([a, b])
  assert t.admit() == [a, b]
  prefill_all(t)
  assert t.pool.num_free == 0
  b_slot = t.slots[b.slot]
  assert not t.reserve(b_slot, 33)          # b is the youngest: it gives way, a keeps running
  assert b.slot is None and list(t.waiting) == [b] and b_slot.pages == []
  assert t.slots[a.slot].req is a and t.pool.num_free == 4
  check_pages(t)


def test_num_pages_must_hold_one_context():
  assert EngineConfig(num_slots=4, max_len=100, page_size=16).num_pages == 4 * 7
  # By default a slot holds 1,024 positions on average beyond that, and one context fits.
  assert EngineConfig(num_slots=32, max_len=8192, page_size=64).num_pages == 32 * 16
  assert EngineConfig(num_slots=4, max_len=8192, page_size=64).num_pages == 128
  assert EngineConfig(num_slots=4, max_len=100, page_size=16, num_pages=7).pages_per_row == 7
  with pytest.raises(ValueError, match="num_pages"):
    EngineConfig(num_slots=4, max_len=100, page_size=16, num_pages=6)
  with pytest.raises(ValueError, match="page_size"):
    EngineConfig(page_size=0)


def test_random_workloads_keep_every_context_readable_through_its_pages():
  stats = collections.Counter()
  for seed in range(6):
    stats.update(_random_workload(seed))
  # The workloads did meet what they are here for.
  assert min(stats[k] for k in ("preemptions", "evictions", "prefix_shares", "page_copies",
                                "page_waits")) > 0, stats


def _random_workload(seed):
  """The table driven as the scheduler drives it, over a small pool, with sessions, shared
  prefixes, preemptions and evictions, against a model of the device pool: each write goes
  through the writer's pages (which it must hold alone), each copy the table asks for is made
  before the writes, and after every step every slot reads its tokens back through its pages."""
  import random
  rng = random.Random(seed)
  t = table(num_slots=4, max_len=64, page_size=8, num_pages=12, share_prefix_min=4,
            chunk_sizes=(4, 16), prefill_rows=(1, 2))
  P = t.pool.page_size
  device = {p: [None] * P for p in range(t.pool.num_pages)}
  heads = [[rng.randrange(1000, 2000) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
  histories = {}

  def write(slot, start, toks):
    for i, tok in enumerate(toks):
      page = slot.pages[(start + i) // P]
      assert t.pool.exclusive(page), (slot.index, start + i, page)
      device[page][(start + i) % P] = tok

  def reserve(slots, ends):
    kept = [s for s, e in zip(slots, ends) if s.req is not None and t.reserve(s, e)]
    for src, dst in t.take_copies():
      device[dst] = list(device[src])
    return kept

  def end(r):
    r.done = True
    if r.session_id is not None:
      histories[r.session_id] = r.prompt + r.out
    t.release(r)

  for step in range(150):
    if rng.random() < 0.5 and len(t.waiting) < 6:
      sid = rng.choice([None, "a", "b", "c", "d"])
      busy = {s.req.session_id for s in t.slots if s.req is not None} | {
          r.session_id for r in t.waiting}
      if sid in busy:
        sid = None
      base = histories.get(sid) if sid is not None and rng.random() < 0.7 else None
      prompt = (base or rng.choice(heads)) + [rng.randrange(3, 900)
                                              for _ in range(rng.randrange(1, 12))]
      if len(prompt) < 40:
        t.waiting.append(req(prompt, session=sid, rid=f"q{step}", max_new=rng.randrange(1, 10),
                             limit=56))
    t.admit()
    if t.prefilling():
      C, group = t.prefill_group()
      group = reserve(group, [len(s.tokens) + min(C, len(s.req.context) - len(s.tokens))
                              for s in group])
      pieces = [s.req.context[len(s.tokens):len(s.tokens) + C] for s in group]
      for s, piece in zip(group, pieces):
        write(s, len(s.tokens), piece)
      for s in t.prefilled(group, pieces):
        if not s.req.out:
          s.req.record(rng.randrange(3, 900), -1.0)
    decoding = sorted(t.decoding(), key=lambda s: s.req.seq)
    for s in reserve(decoding, [len(s.tokens) + 1 for s in decoding]):
      r = s.req
      write(s, len(s.tokens), [r.out[-1]])
      s.tokens.append(r.out[-1])
      r.record(rng.randrange(3, 900), -1.0)
      if r.end_after_last() is not None:
        end(r)
    if rng.random() < 0.05:
      t.new_weights()
    check_pages(t)
    for s in t.slots:
      assert [device[s.pages[j // P]][j % P] for j in range(len(s.tokens))] == s.tokens
  return t.stats
