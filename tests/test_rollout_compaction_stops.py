"""Decode rows that follow the active requests and stop strings, in the embedded engine: a lone
request decodes one row whatever slot it holds, outputs equal the plain model's, and kept
sessions keep their pages across the requests decoded beside them."""
import asyncio

import numpy as np
import pytest
from flax import nnx

from rao_jax.agent import code as code_lib
from rao_jax.model import Transformer
from rao_jax.rollout import FinishReason, GenerateRequest, SamplingParams
from rao_jax.rollout.embedded import EmbeddedEngine
from rao_jax.testing import tiny_config

from tests.test_rollout_embedded import CFG, prompts, reference_greedy


class TagTokenizer:
  """Each id decodes to "<id>": a stop string can span tokens and match mid-token."""

  def decode(self, ids, skip_special_tokens=True):
    del skip_special_tokens
    return "".join(f"<{int(i)}>" for i in ids)


@pytest.fixture(scope="module")
def model():
  return Transformer(tiny_config(), rngs=nnx.Rngs(0))


def greedy(n, **kw):
  return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def test_decode_rows_follow_active_requests_and_sessions_survive(model):
  cfg = dict(CFG)                      # 4 slots, decode rows (1, 4)
  ps = prompts(4, [9, 12, 7, 10], seed=5)

  async def go():
    eng = EmbeddedEngine(model, **cfg)
    first = [await eng.generate(GenerateRequest(p, greedy(4), session_id=f"s{i}"))
             for i, p in enumerate(ps[:3])]       # three kept sessions in rows 0-2
    rows0, calls0 = eng.stats["decode_rows"], eng.stats["decode_calls"]
    lone = await eng.generate(GenerateRequest(ps[3], greedy(6)))      # row 3, alone
    lone_rows = (eng.stats["decode_rows"] - rows0) / (eng.stats["decode_calls"] - calls0)
    nxt = []
    for i, (p, r) in enumerate(zip(ps[:3], first)):    # each session's next turn
      h = p + r.token_ids + [31, 32]
      nxt.append((h, await eng.generate(GenerateRequest(h, greedy(4), session_id=f"s{i}"))))
    await eng.close()
    return lone, lone_rows, nxt

  lone, lone_rows, nxt = asyncio.run(go())
  assert lone_rows == 1.0                   # one active request decodes one row, in slot 3
  assert lone.token_ids == reference_greedy(model, ps[3], 6)
  for h, r in nxt:
    assert r.cached_tokens == len(h) - 3     # its pages kept, still reused
    assert r.token_ids == reference_greedy(model, h, 4)


def test_decode_tallies_are_complete_when_a_token_is_handed_out(model):
  """The engine counts a decode call before it hands that call's tokens to their requests, so
  whoever a token (or a finished result) wakes reads tallies that include the call. The
  k-th decoded token's hook sees k calls, rows and tokens (the first token comes from the prefill)."""
  p = prompts(1, [9], seed=3)[0]
  seen = []

  async def go():
    eng = EmbeddedEngine(model, **CFG)
    try:
      def hook(out, logps):
        st = eng.stats
        seen.append((len(out), st["decode_calls"], st["decode_rows"], st["decode_tokens"]))
        return False
      await eng.generate(GenerateRequest(p, greedy(5)), on_token=hook)
      return eng.stats["decode_calls"]
    finally:
      await eng.close()

  calls = asyncio.run(go())
  # One request decodes one row a call: calls, rows and tokens counted alike.
  assert seen == [(n, n - 1, n - 1, n - 1) for n in range(1, 6)] and calls == 4, (seen, calls)


def test_stop_strings_end_at_the_completing_token(model):
  p = prompts(1, [11], seed=7)[0]
  tok = TagTokenizer()

  async def go(params, tokenizer=tok):
    eng = EmbeddedEngine(model, **CFG, tokenizer=tokenizer)
    try:
      return await eng.generate(GenerateRequest(p, params))
    finally:
      await eng.close()

  full = asyncio.run(go(greedy(16, stop_token_ids=())))
  ids = full.token_ids
  # A stop string spanning tokens 5 and 6 and ending inside token 6's text.
  stop = f"{ids[5]}><{str(ids[6])[:1]}"
  n = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
  cut = asyncio.run(go(greedy(16, stop_token_ids=(), stop=(stop, "never-there"))))
  assert cut.token_ids == ids[:n] and cut.finish_reason == FinishReason.STOP and n <= 7
  missed = asyncio.run(go(greedy(16, stop_token_ids=(), stop=("never-there",))))
  assert missed.token_ids == ids and missed.finish_reason == FinishReason.LENGTH
  with pytest.raises(ValueError, match="tokenizer"):
    asyncio.run(go(greedy(4, stop=("x",)), tokenizer=None))
  with pytest.raises(ValueError, match="stop"):
    SamplingParams(stop=("",))


def test_a_cell_stops_where_it_closes():
  # The agent's stop string on real cell text: a turn that runs on after its closing fence
  # ends at the newline after it, with the whole cell kept.
  text = "Plan.\n```python\nprint(craft('x'))\nfinish('done')\n```\nNow I will also"
  (stop,) = code_lib.CELL_CLOSE_STOP
  end = text.index(stop) + len(stop)
  assert code_lib.extract_code(text[:end]) == "print(craft('x'))\nfinish('done')"
  assert stop not in text[:end - 1]         # nothing earlier (the opening fence) matches
  ok = np.array([stop in text[:k] for k in range(len(text) + 1)])
  assert ok.argmax() == end
