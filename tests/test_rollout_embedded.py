"""The embedded engine against the plain model: greedy parity, logprobs, batching, sessions,
prefix sharing by pages, a pool small enough to preempt, compilation count, limits, aborts and
weight swaps. A tiny random model; one slow real test."""
import asyncio
import collections
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.model import Transformer, token_logprobs
from rao_jax.rollout import FinishReason, GenerateRequest, SamplingParams
from rao_jax.rollout import sampling
from rao_jax.rollout.embedded import EmbeddedEngine, EngineConfig
from rao_jax.testing import tiny_config

# Small shapes so every program compiles once for the whole module (the jitted functions are
# shared by every engine over the same architecture): 2 prefill views x 1 chunk x 1 row bucket.
# Pages of 16 slots: a context spans up to 4, and the prefixes below end inside one.
CFG = dict(num_slots=4, max_len=64, cache_lens=(32, 64), chunk_sizes=(16,), prefill_rows=(2,),
           page_size=16)
REF_T = 64
_GRAPHDEF = []

_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *a, **k: _COMPILES.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)


@pytest.fixture(scope="module")
def model():
  return Transformer(tiny_config(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def warm(model):
  EmbeddedEngine(model, **CFG).warmup()
  return True


@jax.jit
def _ref_logits(state, tokens_1xT, n):
  m = nnx.merge(_GRAPHDEF[0], state)
  seg = (jnp.arange(REF_T) < n).astype(jnp.int32)[None]
  hidden = m(tokens_1xT, jnp.arange(REF_T)[None], seg)
  return m.logits(jnp.take(hidden, n - 1, axis=1))[0]


def reference_greedy(model, prompt, n_new):
  """Step-by-step greedy decoding with the plain model's full forward (no cache)."""
  graphdef, state = nnx.split(model)
  _GRAPHDEF[:] = [graphdef]     # same architecture for every model here: one compilation
  toks = list(prompt)
  for _ in range(n_new):
    padded = np.zeros((1, REF_T), np.int32)
    padded[0, :len(toks)] = toks
    toks.append(int(jnp.argmax(_ref_logits(state, padded, len(toks)))))
  return toks[len(prompt):]


@jax.jit
def _ref_logprobs(state, inputs_1xT, targets_1xT, n, temperature):
  m = nnx.merge(_GRAPHDEF[0], state)
  seg = (jnp.arange(REF_T) < n).astype(jnp.int32)[None]
  hidden = m(inputs_1xT, jnp.arange(REF_T)[None], seg)
  return token_logprobs(m, hidden, targets_1xT, temperature=temperature)[0]


def recomputed_logprobs(model, prompt, out, temperature=1.0):
  """The learner's quantity: token_logprobs over the full forward of prompt + output."""
  graphdef, state = nnx.split(model)
  _GRAPHDEF[:] = [graphdef]
  seq = list(prompt) + list(out)
  inputs, targets = np.zeros((1, REF_T), np.int32), np.zeros((1, REF_T), np.int32)
  inputs[0, :len(seq) - 1], targets[0, :len(seq) - 1] = seq[:-1], seq[1:]
  lp = _ref_logprobs(state, inputs, targets, len(seq) - 1, jnp.float32(temperature))
  return np.asarray(lp)[len(prompt) - 1:len(seq) - 1]


def prompts(n, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [list(map(int, rng.integers(3, 49152, size=lengths[i % len(lengths)])))
          for i in range(n)]


def run(coro):
  return asyncio.run(coro)


def greedy(n, **kw):
  return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def test_greedy_equals_plain_model_and_logprobs_match(model, warm):
  ps = prompts(4, [5, 19, 30, 1])
  async def go():
    eng = EmbeddedEngine(model, **CFG)
    res = await asyncio.gather(*[eng.generate(GenerateRequest(p, greedy(12))) for p in ps])
    await eng.close()
    return res
  for p, r in zip(ps, run(go())):
    assert r.finish_reason == FinishReason.LENGTH
    assert r.token_ids == reference_greedy(model, p, 12)
    np.testing.assert_allclose(r.logprobs, recomputed_logprobs(model, p, r.token_ids),
                               atol=1e-4, rtol=0)
    assert all(isinstance(x, float) for x in r.logprobs)


def test_sampled_logprobs_are_tempered_unfiltered_log_softmax(model, warm):
  p = prompts(1, [9])[0]
  params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=10, seed=5)
  async def go():
    eng = EmbeddedEngine(model, **CFG)
    r = await eng.generate(GenerateRequest(p, params))
    await eng.close()
    return r
  r = run(go())
  np.testing.assert_allclose(r.logprobs,
                             recomputed_logprobs(model, p, r.token_ids, temperature=0.7),
                             atol=1e-4, rtol=0)


def test_continuous_batching_equals_one_at_a_time(model, warm):
  ps = prompts(7, [3, 30, 12, 35, 7])      # more requests than slots: they queue and join
  sampled = SamplingParams(temperature=1.0, top_k=40, max_new_tokens=9, seed=11)
  async def together():
    eng = EmbeddedEngine(model, **CFG)
    reqs = [GenerateRequest(p, greedy(9 + i) if i % 2 else sampled) for i, p in enumerate(ps)]
    res = await asyncio.gather(*[eng.generate(r) for r in reqs])
    await eng.close()
    return res
  async def alone():
    out = []
    for i, p in enumerate(ps):
      eng = EmbeddedEngine(model, **CFG)
      out.append(await eng.generate(GenerateRequest(p, greedy(9 + i) if i % 2 else sampled)))
      await eng.close()
    return out
  a, b = run(together()), run(alone())
  assert [r.token_ids for r in a] == [r.token_ids for r in b]
  for x, y in zip(a, b):
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4, rtol=0)


def test_time_split_counts_the_engines_calls_tokens_and_occupancy(model, warm):
  from rao_jax.rollout.engine import scheduler
  ps = prompts(3, [5, 19, 30])
  async def go():
    eng = EmbeddedEngine(model, **CFG)
    before = dict(eng.stats)
    t0 = time.perf_counter()
    res = await asyncio.gather(*[eng.generate(GenerateRequest(p, greedy(8))) for p in ps])
    wall = time.perf_counter() - t0
    delta = collections.Counter(eng.stats)
    delta.subtract(before)
    await eng.close()
    return res, scheduler.time_split(delta, wall), wall
  res, split, wall = run(go())
  # Every generated token after a request's first (which its prefill samples) is decoded.
  assert split["decode_tokens"] >= sum(len(r.token_ids) for r in res) - len(ps)
  assert split["prompt_tokens"] == sum(map(len, ps))
  assert 0 < split["occupancy"] <= 1 and split["active_requests_per_call"] <= 3
  assert split["decode_rows_per_call"] >= split["active_requests_per_call"]
  assert split["engine_busy_s"] == pytest.approx(split["decode_s"] + split["prefill_s"])
  assert split["engine_busy_s"] + split["engine_idle_s"] >= wall - 1e-6
  # Three requests in a 4-slot engine: no decode call computes more active rows than exist.
  assert split["occupancy"] == pytest.approx(
      split["active_requests_per_call"] / split["decode_rows_per_call"])
  empty = scheduler.time_split({}, 2.0)
  assert empty["engine_idle_s"] == 2.0 and empty["occupancy"] == 0.0


def test_sessions_resume_and_eviction_equal_recompute(model, warm):
  async def go():
    eng = EmbeddedEngine(model, **CFG)
    histories = {f"s{i}": p for i, p in enumerate(prompts(5, [6, 11, 4, 9, 7], seed=3))}
    cached = []
    for turn in range(3):
      # 5 sessions, 4 slots: evictions every turn; the order alternates so that LRU keeps
      # the sessions asked for next (the first four of each turn hit their cache).
      order = list(histories) if turn % 2 == 0 else list(histories)[::-1]
      for sid in order:
        h = histories[sid]
        r = await eng.generate(GenerateRequest(h, greedy(5), session_id=sid))
        assert r.token_ids == reference_greedy(model, h, 5)
        cached.append(r.cached_tokens)
        histories[sid] = h + r.token_ids + [17 + turn, 23]    # the "observation"
    stats = dict(eng.stats)
    await eng.close()
    return cached, stats
  cached, stats = run(go())
  assert stats["evictions"] > 0
  # Kept sessions prefill only the new suffix: everything but the observation is cached.
  assert all(c > 0 for c in cached[5:9]) and all(c > 0 for c in cached[10:14])


def test_session_turn_prefills_only_new_suffix(model, warm):
  p = prompts(1, [20], seed=4)[0]
  async def go():
    eng = EmbeddedEngine(model, **CFG)
    r1 = await eng.generate(GenerateRequest(p, greedy(6), session_id="a"))
    before = eng.stats["prefill_tokens"]
    p2 = p + r1.token_ids + [5, 6, 7]
    r2 = await eng.generate(GenerateRequest(p2, greedy(6), session_id="a"))
    after = eng.stats["prefill_tokens"]
    await eng.end_session("a")
    r3 = await eng.generate(GenerateRequest(p2, greedy(6), session_id="a"))
    await eng.close()
    return r1, r2, r3, after - before, p2
  r1, r2, r3, prefilled, p2 = run(go())
  assert r2.cached_tokens == len(p2) - 4    # prompt + output minus the unfed last token
  assert prefilled == 4
  assert r3.cached_tokens == 0 and r3.token_ids == r2.token_ids
  assert r2.token_ids == reference_greedy(model, p2, 6)


def test_no_compilation_after_warmup(model, warm):
  before_compiles = len(_COMPILES)
  async def go():
    eng = EmbeddedEngine(model, **CFG)
    params = [greedy(20), SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=14),
              SamplingParams(temperature=1.3, top_k=7, max_new_tokens=3, seed=2)]
    reqs = [GenerateRequest(p, params[i % 3], session_id=f"s{i % 2}" if i < 2 else None)
            for i, p in enumerate(prompts(9, [2, 33, 8, 40, 17, 1]))]
    await asyncio.gather(*[eng.generate(r) for r in reqs])
    stats = dict(eng.stats)
    await eng.close()
    return stats, eng.trace_counts
  stats, traces = run(go())
  # The workload crossed prefill views (contexts past 32) and decoded rows of several pages.
  assert stats["prefill_calls"] >= 2 and stats["decode_calls"] >= 20
  assert traces == {}                 # this engine traced nothing: warmup's programs served
  assert len(_COMPILES) == before_compiles


def test_trace_counts_are_per_engine(model, warm):
  """Traces count into the engine whose call caused them, not into a shared global."""
  bystander = EmbeddedEngine(model, **CFG)
  async def go():
    eng = EmbeddedEngine(model, **CFG, decode_steps=2)   # one new program: a 2-step decode
    r = await eng.generate(GenerateRequest([1, 2, 3], greedy(4)))
    await eng.close()
    return eng.trace_counts, r
  traces, r = run(go())
  assert traces == {"decode": 1} and len(r.token_ids) == 4
  assert bystander.trace_counts == {}


def test_context_limit_stop_ids_and_max_new_tokens(model, warm):
  p = prompts(1, [10], seed=5)[0]
  ref = reference_greedy(model, p, 8)
  async def go():
    eng = EmbeddedEngine(model, **CFG)
    limited = await eng.generate(GenerateRequest(p, greedy(30), context_limit=14))
    full = await eng.generate(GenerateRequest(p, greedy(30), context_limit=10))
    stop = await eng.generate(GenerateRequest(p, greedy(30, stop_token_ids=(ref[3],))))
    capped = await eng.generate(GenerateRequest(p, greedy(60)))     # engine capacity 48
    await eng.close()
    return limited, full, stop, capped
  limited, full, stop, capped = run(go())
  assert limited.finish_reason == FinishReason.CONTEXT and limited.token_ids == ref[:4]
  assert full.finish_reason == FinishReason.CONTEXT and full.token_ids == []
  assert "context" in full.message
  first = ref.index(ref[3])
  assert stop.finish_reason == FinishReason.STOP and stop.token_ids == ref[:first + 1]
  assert capped.finish_reason == FinishReason.CONTEXT
  assert len(p) + len(capped.token_ids) == EngineConfig(**CFG).capacity


def test_abort_returns_partial_and_weight_swap_between_steps(model, warm):
  graphdef, state = nnx.split(model)   # "new weights": every matrix scaled (cheap to build)
  other = nnx.merge(graphdef, jax.jit(
      lambda st: jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, st))(state))
  p = prompts(1, [6], seed=6)[0]
  async def go():
    eng = EmbeddedEngine(model, **CFG, weight_version=0)
    task = asyncio.create_task(eng.generate(GenerateRequest(p, greedy(40), rid="long")))
    while not eng.stats["decode_calls"]:
      await asyncio.sleep(0.005)
    await eng.abort("long")
    aborted = await task
    await eng.update_weights(other, 7)
    swapped = await eng.generate(GenerateRequest(p, greedy(6)))
    await eng.close()
    return aborted, swapped
  aborted, swapped = run(go())
  assert aborted.finish_reason == FinishReason.ABORT and aborted.weight_version == 0
  assert 0 < len(aborted.token_ids) < 40
  assert aborted.token_ids == reference_greedy(model, p, len(aborted.token_ids))
  assert swapped.weight_version == 7
  assert swapped.token_ids == reference_greedy(other, p, 6)


def test_engine_copies_weights_at_the_sync_boundary(model, warm):
  """The engine never serves a view of the arrays it is given. Deleting them (what a learner
  step's donation does to its state) leaves it working, after construction and after
  update_weights; without the copy the embedding and final norm would be the caller's."""
  graphdef, state = nnx.split(model)
  def fresh(scale):   # a model of arrays of its own, which the test then deletes
    return nnx.merge(graphdef, jax.tree.map(
        lambda x: jnp.array(x * scale if x.ndim >= 2 else x, copy=True), state))

  def delete_all(m):
    for x in jax.tree.leaves(nnx.state(m)):
      x.delete()
  p = prompts(1, [7], seed=12)[0]
  other = fresh(1.5)
  ref_a, ref_b = reference_greedy(model, p, 5), reference_greedy(other, p, 5)
  async def go():
    src = fresh(1.0)
    eng = EmbeddedEngine(src, **CFG)
    delete_all(src)
    a = await eng.generate(GenerateRequest(p, greedy(5)))
    await eng.update_weights(other, 2)
    delete_all(other)
    b = await eng.generate(GenerateRequest(p, greedy(5)))
    await eng.close()
    return a, b
  a, b = run(go())
  assert a.finish_reason == b.finish_reason == FinishReason.LENGTH, (a.message, b.message)
  assert a.token_ids == ref_a and b.token_ids == ref_b and b.weight_version == 2


def test_bad_requests_and_configs_are_refused(model):
  eng = EmbeddedEngine(model, **CFG)
  async def go(req):
    return await eng.generate(req)
  with pytest.raises(ValueError, match="empty"):
    run(go(GenerateRequest([])))
  with pytest.raises(ValueError, match="outside"):
    run(go(GenerateRequest([1, 10 ** 6])))
  with pytest.raises(ValueError, match="cache_lens"):
    EngineConfig(max_len=64, cache_lens=(32, 48))
  with pytest.raises(ValueError, match="num_pages"):
    EngineConfig(max_len=64, page_size=16, num_pages=3)
  with pytest.raises(ValueError, match="decode_rows"):
    EngineConfig(num_slots=4, decode_rows=(2, 3))
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)


def test_sampler_distribution_and_filters():
  logits = jnp.asarray(np.log(np.array([0.5, 0.25, 0.15, 0.1], np.float32)))
  n = 4000
  L = jnp.broadcast_to(logits, (n, 4))
  ones = jnp.ones(n, jnp.float32)
  seeds = jnp.arange(n, dtype=jnp.uint32)
  pos = jnp.full(n, 3, jnp.int32)
  sample = jax.jit(sampling.sample)
  tok, logp = sample(L, ones, ones, -jnp.ones(n, jnp.int32), seeds, pos)
  freq = np.bincount(np.asarray(tok), minlength=4) / n
  np.testing.assert_allclose(freq, [0.5, 0.25, 0.15, 0.1], atol=0.03)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(logits)[np.asarray(tok)], atol=1e-6)
  # top-k 2 keeps the two best; top-p 0.7 keeps {0, 1} (0.5 < 0.7 <= 0.75).
  tk, _ = sample(L, ones, ones, jnp.full(n, 2, jnp.int32), seeds, pos)
  tp, lp = sample(L, ones, jnp.full(n, 0.7), -jnp.ones(n, jnp.int32), seeds, pos)
  assert set(np.unique(np.asarray(tk))) == {0, 1}
  assert set(np.unique(np.asarray(tp))) == {0, 1}
  np.testing.assert_allclose(np.asarray(lp), np.asarray(logits)[np.asarray(tp)], atol=1e-6)
  # Same seed and position -> same token, whatever the batch around it.
  t1, _ = sample(L, ones, ones, -jnp.ones(n, jnp.int32), jnp.roll(seeds, -5), pos)
  assert np.array_equal(np.asarray(t1), np.roll(np.asarray(tok), -5))


def test_a_sampled_token_is_never_one_the_distribution_rules_out():
  # One token holds all the mass; the others sit 60 nats below (at temperature 0.2 that is
  # 300 nats: e^-300). 4096 rows x a SmolLM2-sized vocabulary is 2e8 noise draws: when the
  # uniform behind the Gumbel noise could round to exactly 1.0 (1 draw in 2^24), about 12 of
  # them were +inf and drew a token at random, which put garbage words into sampled programs.
  V, n = 49152, 512
  sample = jax.jit(sampling.sample)
  logits = jnp.full((n, V), -60.0).at[:, 7].set(0.0)
  temp = jnp.full(n, 0.2, jnp.float32)
  ones = jnp.ones(n, jnp.float32)
  wrong = 0
  for chunk in range(8):
    seeds = jnp.arange(chunk * n, (chunk + 1) * n, dtype=jnp.uint32)
    tok, _ = sample(logits, temp, ones, -jnp.ones(n, jnp.int32), seeds,
                    jnp.full(n, 11, jnp.int32))
    wrong += int(np.sum(np.asarray(tok) != 7))
  assert wrong == 0, f"{wrong} of {8 * n} draws took a token of probability e^-300"
  noise = sampling.gumbel_noise(jnp.arange(64, dtype=jnp.uint32), jnp.zeros(64, jnp.int32), V)
  assert bool(jnp.all(jnp.isfinite(noise)))


@pytest.mark.slow
def test_real_smollm2_greedy_matches_plain_model():
  from rao_jax.model import load_pretrained
  model, tok = load_pretrained("smollm2-135m", dtype="float32")
  p = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                              add_generation_prompt=True)
  async def go():
    eng = EmbeddedEngine(model, num_slots=1, max_len=64, cache_lens=(64,), chunk_sizes=(16,),
                         prefill_rows=(1,))
    r = await eng.generate(GenerateRequest(p, greedy(8, stop_token_ids=tuple(
        tok.stop_token_ids))))
    await eng.close()
    return r
  r = run(go())
  assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and r.token_ids
  assert r.token_ids == reference_greedy(model, p, len(r.token_ids))
  np.testing.assert_allclose(r.logprobs, recomputed_logprobs(model, p, r.token_ids),
                             atol=1e-4, rtol=0)
  assert tok.decode(r.token_ids).strip()


def test_prefix_shared_across_slots_equals_recompute(model, warm):
  """Contexts that start alike share the KV pages of the first (cross-slot prefix sharing): the
  same tokens and logprobs as prefilling everything, fewer tokens prefilled, nothing compiled.
  The 26-token head ends inside its second page, which each sharer copies before writing."""
  rng = np.random.default_rng(8)
  head = list(map(int, rng.integers(3, 49152, size=26)))     # the "system prompt"
  ps = [head + list(map(int, rng.integers(3, 49152, size=n))) for n in (3, 7, 1, 9)]

  async def go(share):
    eng = EmbeddedEngine(model, **CFG, share_prefix_min=share)
    # Four at once: the first prefills the head, the others share its pages (waiting for its
    # prefill if they arrive while it runs).
    res = await asyncio.gather(*[eng.generate(GenerateRequest(p, greedy(8))) for p in ps])
    stats = dict(eng.stats, traces=eng.trace_counts)
    await eng.close()
    return res, stats
  (shared, s1), (plain, s0) = run(go(8)), run(go(0))
  for p, a, b in zip(ps, shared, plain):
    assert a.token_ids == b.token_ids == reference_greedy(model, p, 8)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
  assert s1["prefix_shares"] == 3 and s1["prefix_shared_tokens"] == 3 * len(head)
  assert s1["page_copies"] == 3 and not s0.get("page_copies")   # page 1, once per sharer
  assert s0["prefill_tokens"] - s1["prefill_tokens"] == 3 * len(head)
  assert sorted(r.cached_tokens for r in shared) == [0] + [len(head)] * 3
  # Whether the later requests waited for the head's prefill or arrived after it depends on
  # thread timing (a loaded machine admits them late); the sharing above does not.
  # test_rollout_slot_table checks the wait itself, deterministically.
  assert not s0.get("prefix_shares")
  assert s1["traces"] == s0["traces"] == {}


def test_prefix_of_replaced_weights_is_never_shared(model, warm):
  """A context still running on the old weights when new ones arrive is not a source: a new
  context with its prefix must see the new weights' KV."""
  graphdef, state = nnx.split(model)
  other = nnx.merge(graphdef, jax.jit(
      lambda st: jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, st))(state))
  rng = np.random.default_rng(9)
  head = list(map(int, rng.integers(3, 49152, size=20)))
  p_long, p_new = head + [11, 12], head + [13]

  async def go():
    eng = EmbeddedEngine(model, **CFG, share_prefix_min=8)

    def swap_mid_request(out, _):
      # On the scheduler thread, two tokens in: new weights arrive and scheduling pauses, so
      # the long request is certainly running on the old weights' KV when `new` is admitted.
      if len(out) == 2:
        eng.load_weights(other, 1, wait=False)
        eng.pause()
    task = asyncio.create_task(eng.generate(GenerateRequest(p_long, greedy(24)),
                                            on_token=swap_mid_request))
    while eng.weight_version != 1:
      await asyncio.sleep(0.005)
    new_task = asyncio.create_task(eng.generate(GenerateRequest(p_new, greedy(6))))
    await asyncio.sleep(0.05)
    eng.resume()
    new, long = await new_task, await task
    stats = dict(eng.stats)
    await eng.close()
    return new, long, stats
  new, long, stats = run(go())
  assert long.finish_reason == FinishReason.LENGTH and len(long.token_ids) == 24
  assert new.cached_tokens == 0 and not stats.get("prefix_shares")
  assert new.token_ids == reference_greedy(other, p_new, 6)


@pytest.mark.slow
def test_a_small_pool_preempts_and_recomputes_to_the_same_tokens(model, warm):
  """A pool of 6 pages (96 slots) for 4 contexts of up to 48: contexts are preempted and
  recomputed, queued ones wait for pages, and every greedy output is still the plain model's;
  the pool returns whole afterwards. Sessions kept meanwhile are evicted to make room. (Slow:
  a pool of another size is another shape, so its programs compile here.)"""
  ps = prompts(6, [30, 12, 25, 9, 33, 17], seed=13)

  async def go():
    eng = EmbeddedEngine(model, **CFG, num_pages=6)
    kept = await eng.generate(GenerateRequest(ps[5], greedy(4), session_id="kept"))
    res = await asyncio.gather(*[eng.generate(GenerateRequest(p, greedy(14))) for p in ps[:5]])
    table = eng._sched.table    # pylint: disable=protected-access
    table.pool.check(s.pages for s in table.slots)    # every page held is a slot's, once
    held = [len(s.pages) for s in table.slots if s.session is None]
    stats, traces = dict(eng.stats), eng.trace_counts
    await eng.close()
    return kept, res, held, stats, traces
  kept, res, held, stats, traces = run(go())
  assert kept.token_ids == reference_greedy(model, ps[5], 4)
  for p, r in zip(ps, res):
    assert r.finish_reason == FinishReason.LENGTH
    assert r.token_ids == reference_greedy(model, p, 14)
    np.testing.assert_allclose(r.logprobs, recomputed_logprobs(model, p, r.token_ids),
                               atol=1e-4, rtol=0)
  assert stats["preemptions"] >= 1 and stats["evictions"] >= 1
  assert not any(held)      # contexts that ended gave back all their pages
  assert traces.get("prefill", 0) <= 2 and traces.get("decode", 0) <= 3   # each shape once
