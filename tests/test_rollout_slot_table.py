"""The embedded engine's host side without JAX: the slot table (admission, sessions, eviction,
prefix sharing, batch grouping), the cache-length policy and the request's stop rules.

Nothing here imports JAX (the engine's device side is tested in test_rollout_embedded.py);
`test_host_side_loads_no_jax` checks it in a fresh interpreter.
"""
import collections
import subprocess
import sys

import pytest

from rao_jax.rollout.base import FinishReason, SamplingParams
from rao_jax.rollout.engine.cache_policy import CacheLenPolicy
from rao_jax.rollout.engine.config import EngineConfig
from rao_jax.rollout.engine.slot_table import Req, SlotTable, common_prefix


class Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    self.t += 1.0
    return self.t


def table(**kw):
  cfg = EngineConfig(**{**dict(num_slots=3, max_len=64, cache_lens=(32, 64), chunk_sizes=(4, 16),
                               prefill_rows=(1, 2), share_prefix_min=0), **kw})
  return SlotTable(cfg, collections.Counter(), clock=Clock())


def req(prompt, session=None, rid=None, max_new=8, stops=(), limit=48):
  return Req(rid=rid or f"r{id(prompt)}", prompt=list(prompt),
             params=SamplingParams(temperature=0.0, max_new_tokens=max_new), limit=limit,
             stop_ids=frozenset(stops), session_id=session)


def prefill_all(t):
  """Prefills every admitted prompt completely (as the scheduler's prefill steps would)."""
  while t.prefilling():
    C, group = t.prefill_group()
    t.prefilled(group, [s.req.prompt[len(s.tokens):len(s.tokens) + C] for s in group])


def finish(t, r, generated=()):
  """Ends a request: its generated tokens' KV is in the slot (all but the last), then the
  table takes it out."""
  slot = t.slots[r.slot]
  for tok in generated:
    r.record(tok, -1.0)
  slot.tokens.extend(list(generated)[:-1])
  r.done = True
  t.release(r)


def test_host_side_loads_no_jax():
  code = ("import sys\n"
          "from rao_jax.rollout.engine import slot_table, cache_policy, config\n"
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
  assert t.admit() == []
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


def test_prefix_sharing_copies_rows_above_the_threshold():
  head = list(range(100, 120))               # a 20-token "system prompt"
  t = table(share_prefix_min=8)
  src = req(head + [1, 2], session="x")
  t.waiting.append(src)
  t.admit()
  prefill_all(t)
  finish(t, src, [3])                        # idle session: still a source
  a, b = req(head + [7]), req(head[:5] + [9, 9])
  t.waiting.extend([a, b])
  copies = t.admit()
  assert copies == [(src.slot, a.slot)]      # b shares only 5 tokens (< 8): no copy
  assert a.cached == len(head) and b.cached == 0
  assert t.slots[a.slot].tokens == head
  assert t.stats["prefix_copies"] == 1 and t.stats["prefix_copied_tokens"] == len(head)


def test_a_request_waits_for_a_peer_still_prefilling_its_prefix():
  head = list(range(200, 230))
  t = table(share_prefix_min=8)
  first, second = req(head + [1]), req(head + [2])
  t.waiting.extend([first, second])
  assert t.admit() == []                     # second waits for first's prefix
  assert first.slot is not None and second.slot is None and t.stats["prefix_waits"] == 1
  prefill_all(t)
  copies = t.admit()
  assert copies == [(first.slot, second.slot)] and second.cached == len(head)


def test_new_weights_free_idle_slots_and_stop_sharing_running_ones():
  head = list(range(300, 320))
  t = table(share_prefix_min=8)
  idle, running = req(head + [1], session="i"), req(head + [2])
  t.waiting.extend([idle])
  t.admit()
  prefill_all(t)
  finish(t, idle, [5])
  t.waiting.append(running)
  copies = t.admit()
  prefill_all(t)
  assert copies and running.decoding
  t.new_weights()
  assert "i" not in t.sessions and not t.slots[running.slot].shareable
  late = req(head + [3])
  t.waiting.append(late)
  assert t.admit() == [] and late.cached == 0    # stale KV is never copied
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
  assert t.held_need() == 32 + t.config.decode_steps


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


def test_cache_length_grows_at_once_and_shrinks_after_patience():
  p = CacheLenPolicy((32, 64, 128), shrink_patience=3)
  assert p.length == 32 and p.plan(10, allow_shrink=True) is None
  assert p.plan(100, allow_shrink=False) == 128 and p.length == 128
  assert p.plan(20, allow_shrink=True) is None
  assert p.plan(20, allow_shrink=True) is None
  assert p.plan(20, allow_shrink=False) is None     # a prefill step restarts the count
  assert p.plan(20, allow_shrink=True) is None
  assert p.plan(20, allow_shrink=True) is None
  assert p.plan(20, allow_shrink=True) == 32 and p.length == 32
  assert p.plan(60, allow_shrink=True) == 64
  assert p.plan(40, allow_shrink=True) is None       # 64 is the bucket for 40: no shrink
  with pytest.raises(ValueError, match="shrink_patience"):
    CacheLenPolicy((32,), 0)
