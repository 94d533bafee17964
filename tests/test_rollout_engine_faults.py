"""The embedded engine survives a failure of its own device call.

The fault is injected at the jitted program the scheduler calls (``programs.decode`` or
``programs.prefill``): the call runs, consumes the KV cache donated to it, then raises what XLA
raises when the device runs out of memory. Requests in flight must end with ``FinishReason.ERROR`` (an infrastructure failure),
the engine must rebuild its device state and serve the next request exactly as a fresh engine
would; failing ``max_consecutive_faults`` steps in a row stops it for good, and every later
call raises ``EngineFailedError`` instead of hanging.
"""
import asyncio

import jax
import numpy as np
import pytest
from flax import nnx

from rao_jax.model import Transformer
from rao_jax.rollout import EngineFailedError, FinishReason, GenerateRequest, SamplingParams
from rao_jax.rollout.embedded import EmbeddedEngine, EngineConfig
from rao_jax.rollout.engine import programs
from rao_jax.testing import tiny_config

# The shapes of tests/test_rollout_embedded.py: the programs compile once for both modules.
CFG = dict(num_slots=4, max_len=64, cache_lens=(32, 64), chunk_sizes=(16,), prefill_rows=(2,))
OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB (injected)"


@pytest.fixture(scope="module")
def model():
  return Transformer(tiny_config(), rngs=nnx.Rngs(0))


class DeviceFault:
  """Stands in for the jitted ``programs.<name>`` ("decode" or "prefill") in the engines built
  while it is installed (``install``): calls the real program, then, where ``fail(call number
  from 1)`` is true, deletes the cache the call was given (as a failed donated call leaves it)
  and raises XLA's out-of-memory error."""
  CACHE_ARG = {"decode": 3, "prefill": 2}   # (fns, [n_steps,] params, cache, ...)

  def __init__(self, name, fail):
    self.name, self.fail = name, fail
    self.real, self.calls, self.raised = getattr(programs, name), 0, 0

  def install(self, monkeypatch):
    monkeypatch.setattr(programs, self.name, self)

  def __call__(self, *args, **kwargs):
    self.calls += 1
    out = self.real(*args, **kwargs)
    if self.fail(self.calls):
      jax.block_until_ready(out)
      for x in jax.tree.leaves(args[self.CACHE_ARG[self.name]]):
        if not x.is_deleted():
          x.delete()
      self.raised += 1
      raise RuntimeError(OOM)
    return out


def _req(prompt, n=8, session=None, rid=None):
  return GenerateRequest(prompt_ids=list(prompt), session_id=session, rid=rid,
                         params=SamplingParams(temperature=0.0, max_new_tokens=n,
                                               stop_token_ids=()))


PROMPTS = [list(range(3 + i, 20 + 2 * i)) for i in range(3)]


async def _all(engine, reqs):
  return await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in reqs)), 120)


def test_a_failed_decode_ends_the_requests_in_flight_and_the_engine_serves_on(model, monkeypatch):
  fresh = EmbeddedEngine(model, **CFG)                  # built before the fault is installed
  fault = DeviceFault("decode", lambda call: call == 2)
  fault.install(monkeypatch)
  engine = EmbeddedEngine(model, **CFG)
  monkeypatch.undo()
  try:
    # Three requests at once: the first decode call serves two of them, the second (which
    # fails) all three, so every one of them is in flight when the device call fails.
    reqs = [_req(p, session=f"s{i}") for i, p in enumerate(PROMPTS)]
    results = asyncio.run(_all(engine, reqs))
    assert fault.raised == 1
    for r in results:
      assert r.finish_reason == FinishReason.ERROR, (r.finish_reason, r.message)
      assert "RESOURCE_EXHAUSTED" in r.message and "infrastructure" in r.message
    assert engine.stats["faults"] == 1 and engine.stats["rebuilds"] == 1
    assert engine.failure is None and engine.num_running == 0

    # The engine serves on: greedy tokens and logprobs equal a fresh engine's, for a new
    # request and for a session whose KV the fault threw away (re-prefilled in full).
    want = asyncio.run(_all(fresh, [_req(PROMPTS[0]), _req(PROMPTS[1] + [7, 8])]))
    got = asyncio.run(_all(engine, [_req(PROMPTS[0]),
                                    _req(PROMPTS[1] + [7, 8], session="s1")]))
    for g, w in zip(got, want):
      assert g.finish_reason == w.finish_reason == FinishReason.LENGTH, g.message
      assert g.token_ids == w.token_ids
      np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    assert got[1].cached_tokens == 0
    # A success resets the count: one more fault later is again only one in a row.
    assert engine._faults_in_row == 0
  finally:
    asyncio.run(engine.close())
    asyncio.run(fresh.close())


def test_repeated_faults_stop_the_engine_for_good(model, monkeypatch):
  fault = DeviceFault("prefill", lambda call: True)
  fault.install(monkeypatch)
  engine = EmbeddedEngine(model, EngineConfig(**CFG, max_consecutive_faults=2))
  monkeypatch.undo()
  try:
    first = asyncio.run(_all(engine, [_req(PROMPTS[0])]))[0]
    assert first.finish_reason == FinishReason.ERROR and engine.failure is None
    # The second failure in a row stops the engine: the request it held raises, as every
    # later call does (none hangs waiting for a scheduler that is gone).
    with pytest.raises(EngineFailedError, match="max_consecutive_faults=2"):
      asyncio.run(_all(engine, [_req(PROMPTS[1])]))
    assert fault.raised == 2 and engine.stats["rebuilds"] == 1
    assert "2 device steps failed in a row" in engine.failure
    assert "RESOURCE_EXHAUSTED" in engine.failure
    with pytest.raises(EngineFailedError, match="max_consecutive_faults=2"):
      asyncio.run(_all(engine, [_req(PROMPTS[2])]))
    with pytest.raises(EngineFailedError):
      asyncio.run(asyncio.wait_for(engine.update_weights(model, 1), 30))
    with pytest.raises(EngineFailedError):
      asyncio.run(asyncio.wait_for(engine.end_session("s0"), 30))
    assert fault.raised == 2
  finally:
    asyncio.run(asyncio.wait_for(engine.close(), 30))


def test_max_consecutive_faults_is_validated():
  for bad in (0, -1, 1.5, True, "3"):
    with pytest.raises(ValueError, match=r"EngineConfig.max_consecutive_faults=.*int >= 1"):
      EngineConfig(max_consecutive_faults=bad)
  assert EngineConfig(max_consecutive_faults=1).max_consecutive_faults == 1


def test_a_control_whose_caller_gave_up_still_runs_and_is_no_fault(model):
  """A control or weight update whose caller cancelled its future (a cancelled task, a
  timeout) runs all the same; answering the cancelled future must not count as a failed step
  (which would fail every running request and rebuild the engine)."""
  import concurrent.futures
  engine = EmbeddedEngine(model, **CFG)
  ran = []
  with engine._cv:   # the scheduler thread reads neither until both are cancelled
    control = engine._control(lambda: ran.append("control"))
    swap = engine._swap(engine._as_params(model), "v2")
    assert control.cancel() and swap.cancel()
  res = asyncio.run(_all(engine, [_req(p) for p in PROMPTS]))
  assert [r.finish_reason for r in res] == [FinishReason.LENGTH] * len(PROMPTS)
  assert ran == ["control"] and engine.weight_version == "v2"
  assert engine.stats["faults"] == 0 and engine.failure is None
  with pytest.raises(concurrent.futures.CancelledError):
    control.result(0)
