"""Opt-in: SGLangEngine against a live SGLang server, through every route the client calls.

Run with ``RAO_JAX_SGLANG_URL=http://host:port pytest -m sglang_real`` (docs/sglang.md says how
to start a server); without that variable every test here is skipped, so CI stays green with no
server. The suite drives the server with the client's own bodies (``SGLangEngine`` itself, or
its ``_payload`` posted raw where a field of the answer is checked) and checks the fields the
client reads. Nothing here imitates SGLang: the server under test is whatever the URL names (a
real SGLang server, or ``python -m rao_jax.rollout.serve``, which speaks the same contract).

Environment:
  RAO_JAX_SGLANG_URL     the server's base URL (required).
  RAO_JAX_SGLANG_MODEL   the HF folder it serves, readable here (default: /model_info's
                         model_path when that is a local folder). Without one, the tests that
                         need the learner's log-probs, a folder to load or an adapter skip.
  RAO_JAX_SGLANG_LAUNCH  a shell command that starts the server at that URL. With it the suite
                         owns the server: it starts it, kills its process group and starts it
                         again mid-run (the restart test, skipped without it), and stops it.
  RAO_JAX_SGLANG_EXPORT  a folder the server can read, for the adapters the LoRA test writes
                         (default: a pytest temporary folder; same host).
  RAO_JAX_API_KEY        the server's --api-key, if it has one.

Tolerances for a bf16 server against the float32 learner: log-probs of the same tokens agree
to LOGP_TOL (0.15; measured <= 0.13 on SGLang's CPU engine), and greedy tokens may differ
between two runs only at a near-tie (the token taken had probability below NEAR_TIE), after
which the two continuations are not compared.
"""
import asyncio
import math
import os
import signal
import subprocess
import time
import uuid

import numpy as np
import pytest
import requests

from rao_jax.rollout import FinishReason, GenerateRequest, SamplingParams
from rao_jax.rollout.sglang_client import SGLangEngine, api_key_from_env, honours_seed

URL = os.environ.get("RAO_JAX_SGLANG_URL", "").rstrip("/")
LAUNCH = os.environ.get("RAO_JAX_SGLANG_LAUNCH", "")
LOGP_TOL = 0.15
# A greedy token of probability below this may lose to its runner-up under bf16 noise.
NEAR_TIE = 0.6
# Seconds a launched server may take to answer /health (SGLang's CPU engine: 19-30 s).
START_TIMEOUT = 600.0

pytestmark = [
    pytest.mark.sglang_real,
    pytest.mark.skipif(not URL, reason="RAO_JAX_SGLANG_URL is unset: no live SGLang server to "
                                       "test against (see docs/sglang.md)"),
]


def _headers():
  key = api_key_from_env()
  return {"Authorization": f"Bearer {key}"} if key else {}


def _healthy(timeout=2.0) -> bool:
  try:
    return requests.get(URL + "/health", timeout=timeout).status_code == 200
  except requests.RequestException:
    return False


class Served:
  """The server under test; with RAO_JAX_SGLANG_LAUNCH, a process group this suite owns."""

  def __init__(self):
    self.proc = None
    self.log = None

  def launch(self):
    self.log = open(os.environ.get("RAO_JAX_SGLANG_LOG", os.devnull), "ab")
    # Its own session: SGLang's server does not stop on SIGTERM within 20 s and spawns
    # scheduler processes; the whole group is killed at once.
    self.proc = subprocess.Popen(LAUNCH, shell=True, start_new_session=True,
                                 stdout=self.log, stderr=self.log)
    self.wait_healthy()

  def wait_healthy(self):
    t0 = time.monotonic()
    while not _healthy():
      if self.proc is not None and self.proc.poll() is not None:
        raise RuntimeError(f"RAO_JAX_SGLANG_LAUNCH exited with {self.proc.returncode} before "
                           f"{URL}/health answered (set RAO_JAX_SGLANG_LOG=<file> to see why)")
      if time.monotonic() - t0 > START_TIMEOUT:
        raise TimeoutError(f"{URL}/health did not answer 200 within {START_TIMEOUT:g} s")
      time.sleep(0.5)

  def kill(self):
    if self.proc is not None and self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait(60)
    t0 = time.monotonic()
    while _healthy(0.5):          # the port is free once nothing answers there
      assert time.monotonic() - t0 < 60, f"{URL} still answers after its process was killed"
      time.sleep(0.2)


@pytest.fixture(scope="module")
def server():
  served = Served()
  if LAUNCH:
    served.launch()
  elif not _healthy(10):
    pytest.fail(f"RAO_JAX_SGLANG_URL={URL}: /health does not answer 200; start the server "
                "first (or set RAO_JAX_SGLANG_LAUNCH)")
  yield served
  if LAUNCH:
    served.kill()
    served.log.close()


@pytest.fixture(scope="module")
def info(server):
  """(/model_info, /get_server_info) of the server: the routes current SGLang keeps them on."""
  model = requests.get(URL + "/model_info", headers=_headers(), timeout=30)
  assert model.status_code == 200, (model.status_code, model.text[:300])
  srv = requests.get(URL + "/get_server_info", headers=_headers(), timeout=30)
  assert srv.status_code == 200, (srv.status_code, srv.text[:300])
  return model.json(), srv.json()


@pytest.fixture(scope="module")
def model_dir(info):
  path = os.environ.get("RAO_JAX_SGLANG_MODEL") or info[0].get("model_path") or ""
  if not os.path.isdir(path):
    pytest.skip(f"no local HF folder of the served model (model_path={path!r}); set "
                "RAO_JAX_SGLANG_MODEL to it")
  return os.path.abspath(path)


@pytest.fixture(scope="module")
def learner(model_dir):
  """The served model in float32 (the learner's precision) and its tokenizer."""
  from rao_jax.model import load_pretrained
  return load_pretrained(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def prompt(info):
  """A short prompt's ids: the model's own tokenization when its folder is here."""
  path = os.environ.get("RAO_JAX_SGLANG_MODEL") or info[0].get("model_path") or ""
  if os.path.isdir(path):
    from rao_jax.model.tokenizer import Tokenizer
    return Tokenizer.from_hf_folder(path).encode("The capital of France is")
  # Ids below 1000 exist in every real vocabulary.
  return [504, 3575, 282, 4649, 314]


def client(**kw) -> SGLangEngine:
  kw.setdefault("retry_timeout", 300.0)
  return SGLangEngine(URL, api_key=api_key_from_env(), **kw)


def greedy(n, **kw):
  # stop_token_ids=(): exactly n tokens (the client then sends ignore_eos).
  kw.setdefault("stop_token_ids", ())
  return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def compare(a, b):
  """Index of the first token where two greedy runs differ (len when none), asserting they
  agree before it (log-probs within LOGP_TOL) and that it is a near-tie in both."""
  n = min(len(a.token_ids), len(b.token_ids))
  for i in range(n):
    if a.token_ids[i] != b.token_ids[i]:
      assert max(a.logprobs[i], b.logprobs[i]) < math.log(NEAR_TIE), (
          f"greedy runs differ at token {i} with no near-tie: {a.logprobs[i]:.3f} vs "
          f"{b.logprobs[i]:.3f}")
      return i
    assert abs(a.logprobs[i] - b.logprobs[i]) <= LOGP_TOL, (i, a.logprobs[i], b.logprobs[i])
  return n


def learner_logprobs(model, prompt_ids, out_ids):
  """log softmax(logits)[token] of each of ``out_ids`` after ``prompt_ids`` (float32)."""
  import jax.numpy as jnp
  from rao_jax.model import token_logprobs
  ids = list(prompt_ids) + list(out_ids)
  T = len(ids) - 1
  tokens = jnp.asarray([ids[:-1]], jnp.int32)
  hidden = model(tokens, jnp.arange(T, dtype=jnp.int32)[None], jnp.ones((1, T), jnp.int32))
  lp = token_logprobs(model, hidden, jnp.asarray([ids[1:]], jnp.int32))
  return np.asarray(lp[0, len(prompt_ids) - 1:])


async def long_request(c, server_info, prompt) -> tuple[int, float]:
  """(tokens, seconds to wait): a request of that many tokens generates for about 8 s (from the
  rate of a short one; at most what the context holds), and still runs after the wait, when an
  abort or a weight update is sent."""
  t0 = time.monotonic()
  r = await c.generate(GenerateRequest(prompt, greedy(16)))
  per_s = len(r.token_ids) / (time.monotonic() - t0)
  room = int(server_info.get("context_length") or 2048) - len(prompt) - 1
  n = int(min(room, max(64, per_s * 8)))
  return n, min(2.0, n / per_s / 4)


def test_generate_fields_tokens_stops_seeds_and_sessions(server, info, prompt):
  """/generate with input_ids, return_logprob, stop ids, sampling_seed and a session's turns:
  the fields the client reads are there and consistent."""
  async def go():
    c = client()
    try:
      # The client's own body, posted raw: the answer's fields, one by one.
      req = GenerateRequest(prompt, greedy(12))
      status, data = await c._post(URL, "/generate", c._payload(req, prompt, 12, "rao-real-1"))
      assert status == 200, data
      meta = data["meta_info"]
      lps = meta["output_token_logprobs"]
      assert len(lps) == meta["completion_tokens"] == 12 == len(data["output_ids"])
      assert [int(x[1]) for x in lps] == data["output_ids"]
      assert all(isinstance(x[0], float) and x[0] <= 0 for x in lps)
      assert meta["finish_reason"]["type"] == "length"
      assert meta["prompt_tokens"] == len(prompt) and "cached_tokens" in meta
      assert meta["weight_version"] is not None

      # Through the client: greedy twice agrees (up to a near-tie flip).
      a = await c.generate(GenerateRequest(prompt, greedy(16)))
      b = await c.generate(GenerateRequest(prompt, greedy(16)))
      for r in (a, b):
        assert r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == 16
        assert len(r.logprobs) == 16 and r.prompt_len == len(prompt)
      same = compare(a, b)

      # Stop ids: generation ends at the first one, which is kept.
      stop = a.token_ids[5]
      s = await c.generate(GenerateRequest(prompt, greedy(16, stop_token_ids=(stop,))))
      k = a.token_ids.index(stop)
      if stop in s.token_ids:
        assert s.finish_reason == FinishReason.STOP and s.token_ids[-1] == stop
        assert stop not in s.token_ids[:-1]
      else:          # a near-tie flipped a token before the stop id came
        assert s.finish_reason == FinishReason.LENGTH and compare(a, s) <= k
      if same > k and stop in s.token_ids:
        assert s.token_ids == a.token_ids[:k + 1]

      # sampling_seed: reproduced where the server says it honours seeds; otherwise the
      # client warned once (SGLang needs --enable-deterministic-inference).
      seeded = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1234, stop_token_ids=())
      x = await c.generate(GenerateRequest(prompt, seeded))
      y = await c.generate(GenerateRequest(prompt, seeded))
      assert len(x.token_ids) == len(y.token_ids) == 12
      if honours_seed(info[1]):
        assert x.token_ids == y.token_ids and c.seed_warnings == 0
      else:
        assert c.seed_warnings == 1

      # A session's second turn (prompt + first output + new ids) gives what the same ids
      # give without a session: SGLang reuses the prefix from its radix cache.
      sid = f"rao-real-{uuid.uuid4().hex[:6]}"
      t1 = await c.generate(GenerateRequest(prompt, greedy(8), session_id=sid))
      turn2 = prompt + t1.token_ids + prompt[-2:]
      t2 = await c.generate(GenerateRequest(turn2, greedy(8), session_id=sid))
      fresh = await c.generate(GenerateRequest(turn2, greedy(8)))
      assert t2.prompt_len == len(turn2) and t2.cached_tokens >= 0
      compare(t2, fresh)
      await c.end_session(sid)
    finally:
      await c.close()
  asyncio.run(go())


def test_logprobs_match_the_learner(server, learner, prompt):
  """The server's log-probs of its own tokens against the float32 learner's, greedy and
  sampled at temperature 1 (what RL trains on)."""
  model, _ = learner

  async def go():
    c = client()
    try:
      return [await c.generate(GenerateRequest(prompt, p)) for p in (
          greedy(24), SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=()))]
    finally:
      await c.close()
  for r in asyncio.run(go()):
    mine = learner_logprobs(model, prompt, r.token_ids)
    gap = np.abs(mine - np.asarray(r.logprobs))
    assert gap.max() <= LOGP_TOL, (gap.max(), gap.mean())


def test_abort_returns_the_partial_tokens(server, info, prompt):
  """/abort_request on a running request: it returns early, aborted, with its tokens so far;
  the server goes on serving."""
  async def go():
    c = client()
    try:
      n, wait = await long_request(c, info[1], prompt)
      task = asyncio.create_task(c.generate(GenerateRequest(prompt, greedy(n), rid="abort-me")))
      await asyncio.sleep(wait)
      assert not task.done(), "the request finished before the abort: the server is faster "\
                              "than its first request said"
      await c.abort("abort-me")
      r = await asyncio.wait_for(task, 120)
      assert r.finish_reason == FinishReason.ABORT, (r.finish_reason, r.message)
      assert 0 < len(r.token_ids) < n and len(r.logprobs) == len(r.token_ids)
      after = await c.generate(GenerateRequest(prompt, greedy(4)))
      assert after.finish_reason == FinishReason.LENGTH and len(after.token_ids) == 4
    finally:
      await c.close()
  asyncio.run(go())


def test_weight_update_recipe_and_the_version_on_samples(server, info, model_dir, prompt):
  """pause -> flush -> update_weights_from_disk -> continue with a request running: it is
  continued on the new weights and carries the new version, which /model_info reports; a
  folder the server cannot load fails the update and leaves the version as it was."""
  version = f"rao-real-{uuid.uuid4().hex[:6]}"

  async def go():
    bad = client()
    try:
      before = (await bad.get_weight_versions())[URL]
      with pytest.raises(RuntimeError, match="update_weights_from_disk failed"):
        await bad.update_weights_from_disk("/nonexistent/rao-real-weights", version + "-bad")
      assert (await bad.get_weight_versions())[URL] == before
    finally:
      await bad.close()

    c = client()
    try:
      n, wait = await long_request(c, info[1], prompt)
      task = asyncio.create_task(c.generate(GenerateRequest(prompt, greedy(n))))
      await asyncio.sleep(wait)
      assert not task.done()
      t0 = time.monotonic()
      await c.update_weights_from_disk(model_dir, version)
      seconds = time.monotonic() - t0
      r = await asyncio.wait_for(task, 600)
      # Aborted by the pause, continued by the client after it: all n tokens, new version.
      assert r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == n
      assert r.weight_version == version, r.weight_version
      assert await c.get_weight_versions() == {URL: version}
      got = requests.get(URL + "/model_info", headers=_headers(), timeout=30).json()
      assert got["weight_version"] == version
      after = await c.generate(GenerateRequest(prompt, greedy(4)))
      assert after.weight_version == version
      print(f"weight sync {seconds:.2f} s")
    finally:
      await c.close()
  asyncio.run(go())


@pytest.mark.skipif(not LAUNCH, reason="RAO_JAX_SGLANG_LAUNCH is unset: the suite can kill and "
                                       "restart only a server it started")
def test_killed_server_is_resynced_before_it_serves_again(server, info, model_dir,
                                                           prompt):
  """The server dies under a running request and is started again (with its start-up
  weights): the client marks it down, re-syncs it to the run's version once /health answers,
  and only then sends it the request again, which finishes on the synced weights."""
  version = f"rao-real-restart-{uuid.uuid4().hex[:6]}"

  async def go():
    c = client(retry_timeout=START_TIMEOUT, health_interval=0.5)
    try:
      await c.update_weights_from_disk(model_dir, version)
      n, wait = await long_request(c, info[1], prompt)
      task = asyncio.create_task(c.generate(GenerateRequest(prompt, greedy(n))))
      await asyncio.sleep(wait)
      assert not task.done()
      await asyncio.to_thread(server.kill)
      await asyncio.to_thread(server.launch)
      r = await asyncio.wait_for(task, START_TIMEOUT)
      assert r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == n, r.message
      assert r.weight_version == version
      events = [(kind, sent) for url, kind, _, sent in c.pool.events if url == URL]
      assert [k for k, _ in events] == ["down", "resynced", "up"], events
      # Nothing was sent to it between going down and coming back re-synced.
      assert events[0][1] == events[1][1] == events[2][1]
      assert c.pool.stats[URL].resyncs == 1
      assert await c.get_weight_versions() == {URL: version}
    finally:
      await c.close()
  asyncio.run(go())


def _lora_slot(server_info):
  """(max rank, target projections) the server's LoRA takes, or None without LoRA."""
  slot = server_info.get("lora")             # rao_jax.rollout.serve's own description
  if isinstance(slot, dict):
    return int(slot["max_lora_rank"]), slot["lora_target_modules"]
  if not server_info.get("enable_lora"):
    return None
  targets = server_info.get("lora_target_modules") or "all"
  return int(server_info.get("max_lora_rank") or 8), targets


def test_lora_adapter_load_and_unload(server, info, learner, model_dir, prompt, tmp_path):
  """/load_lora_adapter of a PEFT adapter the project writes, requests naming it with
  lora_path, a second adapter replacing the first, and /unload_lora_adapter."""
  import jax
  from rao_jax.model import load_pretrained
  from rao_jax.model import lora as lora_lib
  from rao_jax.model import peft
  from rao_jax.model.peft import save_adapter
  slot = _lora_slot(info[1])
  if slot is None:
    pytest.skip("the server has no LoRA (SGLang: --enable-lora --max-lora-rank R "
                "--lora-target-modules ...; it needs CUDA)")
  rank, targets = slot
  by_hf = {peft.HF_MODULES[t].split(".")[1]: t for t in lora_lib.TARGETS}
  if targets == "all" or targets == ["all"]:
    chosen = lora_lib.TARGETS
  else:
    chosen = tuple(by_hf[m] for m in targets if m in by_hf)
  export = os.environ.get("RAO_JAX_SGLANG_EXPORT") or str(tmp_path)

  def adapted(seed):
    model, _ = load_pretrained(model_dir, dtype="float32")
    model = lora_lib.add_adapters(model, lora_lib.LoraConfig(rank=min(rank, 8), targets=chosen))
    rng = np.random.default_rng(seed)
    for t in chosen:
      var = getattr(model.lora, f"{t}_b")
      var.set_value(jax.numpy.asarray(rng.normal(0, 0.05, var.shape), var[...].dtype))
    folder = os.path.join(export, f"rao-real-adapter-{uuid.uuid4().hex[:6]}")
    save_adapter(model, folder, base_model=model_dir)
    return model, folder

  first, second = adapted(1), adapted(2)

  async def go():
    c = client()
    try:
      base = await c.generate(GenerateRequest(prompt, greedy(12)))
      await c.load_adapter_from_disk(first[1], "lora-a")
      a = await c.generate(GenerateRequest(prompt, greedy(12)))
      assert a.weight_version == "lora-a"
      await c.load_adapter_from_disk(second[1], "lora-b")
      b = await c.generate(GenerateRequest(prompt, greedy(12)))
      assert b.weight_version == "lora-b"
      # The first adapter was unloaded when the second loaded: naming it is refused.
      payload = c._payload(GenerateRequest(prompt, greedy(2)), prompt, 2, "rao-real-old")
      payload["lora_path"] = c.adapter_name("lora-a")
      status, _ = await c._post(URL, "/generate", payload)
      assert status == 400
      status, out = await c._post(URL, "/unload_lora_adapter",
                                  {"lora_name": c.adapter_name("lora-b")})
      assert status == 200 and out.get("success"), out
      return base, a, b
    finally:
      await c.close()
  base, a, b = asyncio.run(go())
  # Each adapter is applied as the learner applies it (its log-probs, not the base's).
  for (model, _), r in ((first, a), (second, b)):
    gap = np.abs(learner_logprobs(model, prompt, r.token_ids) - np.asarray(r.logprobs))
    assert gap.max() <= LOGP_TOL, gap.max()
  plain = learner_logprobs(learner[0], prompt, a.token_ids)
  assert np.abs(plain - np.asarray(a.logprobs)).max() > LOGP_TOL or a.token_ids != base.token_ids
