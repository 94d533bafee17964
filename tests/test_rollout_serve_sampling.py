"""The sampling options serve exposes, at the engine level: SGLang's penalty formulas, min-p,
the engine's default stop tokens, and SamplingParams' validation."""
import asyncio

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.model import Transformer
from rao_jax.rollout import GenerateRequest, SamplingParams, sampling
from rao_jax.rollout.embedded import EmbeddedEngine, EngineConfig
from rao_jax.testing import tiny_config


@pytest.mark.slow
def test_penalties_follow_sglang_formulas():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 50)).astype(np.float32) * 3
  counts = rng.integers(0, 3, size=(3, 50)).astype(np.float32)
  freq, pres, rep = (np.array([0.5, 0.0, -1.0], np.float32), np.array([0.0, 1.5, 0.3],
                     np.float32), np.array([1.0, 1.3, 0.7], np.float32))
  want = logits - freq[:, None] * counts - pres[:, None] * (counts > 0)
  r = np.where(counts > 0, rep[:, None], 1.0)
  want = np.where(want > 0, want / r, want * r)
  got = sampling.apply_penalties(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(freq),
                                 jnp.asarray(pres), jnp.asarray(rep))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
  # Tokens never generated are untouched.
  np.testing.assert_array_equal(np.asarray(got)[counts == 0], logits[counts == 0])


@pytest.mark.slow
def test_min_p_keeps_only_tokens_near_the_top():
  B, V = 256, 64
  logits = np.tile(np.linspace(0.0, 4.0, V, dtype=np.float32), (B, 1))
  probs = np.exp(logits[0] - logits[0].max())          # relative to the most likely token
  args = (jnp.asarray(logits), jnp.ones(B, jnp.float32), jnp.ones(B, jnp.float32),
          -jnp.ones(B, jnp.int32), jnp.arange(B, dtype=jnp.uint32), jnp.zeros(B, jnp.int32))
  tok, _ = sampling.sample(*args, jnp.full(B, 0.3, jnp.float32))
  assert (probs[np.asarray(tok)] >= 0.3).all()
  tok0, _ = sampling.sample(*args, jnp.zeros(B, jnp.float32))
  assert (probs[np.asarray(tok0)] < 0.3).any()         # without min-p those tokens do occur


@pytest.fixture(scope="module")
def model():
  return Transformer(tiny_config(), rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_engine_stops_at_its_default_stop_tokens_unless_told_otherwise(model):
  prompt = list(range(7, 27))
  eng_kw = dict(num_slots=2, max_len=64, cache_lens=(64,), chunk_sizes=(16,), prefill_rows=(1,))

  async def go():
    free = EmbeddedEngine(model, **eng_kw)
    ref = await free.generate(GenerateRequest(prompt, SamplingParams(temperature=0,
                                                                     max_new_tokens=8)))
    await free.close()
    stop = ref.token_ids[3]
    eng = EmbeddedEngine(model, default_stop_token_ids=(stop,), **eng_kw)
    by_default = await eng.generate(GenerateRequest(prompt, SamplingParams(
        temperature=0, max_new_tokens=8)))
    never = await eng.generate(GenerateRequest(prompt, SamplingParams(
        temperature=0, max_new_tokens=8, stop_token_ids=())))
    other = await eng.generate(GenerateRequest(prompt, SamplingParams(
        temperature=0, max_new_tokens=8, stop_token_ids=(ref.token_ids[5],))))
    await eng.close()
    return ref, by_default, never, other
  ref, by_default, never, other = asyncio.run(go())
  assert ref.token_ids[3] not in ref.token_ids[:3]
  assert by_default.token_ids == ref.token_ids[:4] and by_default.finish_reason.value == "stop"
  assert never.token_ids == ref.token_ids and never.finish_reason.value == "length"
  assert other.token_ids == ref.token_ids[:6]          # explicit ids replace the defaults


def test_min_new_tokens_masks_the_stop_ids_until_then(model):
  """SGLang's min_new_tokens: token k cannot be a stop id while k < min_new_tokens (the stop ids'
  logits are masked, at the prefill's first token and in every decode step); from then on the
  first stop id ends the request. Greedy, so a masked stop id is replaced by the next most likely
  token, and an engine that decodes 3 steps per call must give what a 1-step engine gives (the
  mask counts down inside a multi-step decode)."""
  prompt = list(range(7, 27))
  eng_kw = dict(num_slots=2, max_len=64, cache_lens=(64,), chunk_sizes=(16,), prefill_rows=(1,))
  greedy = dict(temperature=0, max_new_tokens=12)
  mins = (0, 1, 2, 3, 5, 12)

  async def go(decode_steps, stops):
    eng = EmbeddedEngine(model, decode_steps=decode_steps, **eng_kw)
    ref = await eng.generate(GenerateRequest(prompt, SamplingParams(**greedy)))
    outs = {}
    for stop in stops or dict.fromkeys(ref.token_ids[:6]):
      for min_new in mins:
        outs[stop, min_new] = await eng.generate(GenerateRequest(prompt, SamplingParams(
            **greedy, stop_token_ids=(stop,), min_new_tokens=min_new)))
    await eng.close()
    return ref, outs

  ref, one = asyncio.run(go(1, None))
  _, three = asyncio.run(go(3, [stop for stop, _ in one]))
  first, second = ref.token_ids[0], ref.token_ids[1]
  assert first != second
  assert one[first, 0].token_ids == [first]          # no minimum: greedy's first token stops
  assert one[second, 1].token_ids == ref.token_ids[:2]
  for (stop, min_new), r in one.items():
    ids = r.token_ids
    assert three[stop, min_new].token_ids == ids, (stop, min_new, ids)
    assert stop not in ids[:min_new], (stop, min_new, ids)
    if r.finish_reason.value == "stop":
      assert ids[-1] == stop and ids.count(stop) == 1 and len(ids) > min_new
    else:
      assert r.finish_reason.value == "length" and len(ids) == 12 and stop not in ids
  # Masked at the prefill's first token: greedy's first token is replaced.
  assert one[first, 1].token_ids[0] != first
  # Masked inside the decode steps: the second token is not greedy's second.
  assert one[second, 5].token_ids[0] == first and one[second, 5].token_ids[1] != second
  # Somewhere a stop ends a request right at its minimum (the case a late count-down breaks).
  assert any(r.finish_reason.value == "stop" and len(r.token_ids) == m + 1
             for (_, m), r in one.items() if m > 1), {k: r.token_ids for k, r in one.items()}


def test_sampling_params_validation_names_the_field():
  for kw, field in ((dict(min_p=1.5), "min_p"), (dict(frequency_penalty=3), "frequency_penalty"),
                    (dict(presence_penalty=-2.5), "presence_penalty"),
                    (dict(repetition_penalty=0), "repetition_penalty"),
                    (dict(stop_token_ids=(1, -2)), "stop_token_ids"),
                    (dict(stop_token_ids=("a",)), "stop_token_ids"),
                    (dict(min_new_tokens=9, max_new_tokens=8), "min_new_tokens"),
                    (dict(min_new_tokens=-1), "min_new_tokens")):
    with pytest.raises(ValueError, match=field):
      SamplingParams(**kw)
  assert SamplingParams(stop_token_ids=[np.int64(3), 4]).stop_token_ids == (3, 4)
  assert SamplingParams().stop_token_ids is None and not SamplingParams().penalized
  assert SamplingParams(presence_penalty=0.1).penalized
  with pytest.raises(ValueError, match="default_stop_token_ids"):
    EngineConfig(default_stop_token_ids=(-1,))
