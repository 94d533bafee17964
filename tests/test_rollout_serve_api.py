"""rao_jax.rollout.serve speaking SGLang 0.5.6's /generate shapes and the OpenAI API (driven by
the `openai` client and raw HTTP), in-process over the real embedded engine on a tiny random
model with the real SmolLM2 tokenizer."""
import json
import time

import numpy as np
import openai
import pytest
import requests
from flax import nnx

from rao_jax.model import Transformer
from rao_jax.rollout import serve
from rao_jax.rollout.embedded import EmbeddedEngine
from rao_jax.testing import BackgroundServer, tiny_config

ENGINE = dict(num_slots=4, max_len=128, cache_lens=(64, 128), chunk_sizes=(16,),
              prefill_rows=(2,))


class _Running:
  """A Server on a background event loop (one per module: compilations are shared)."""

  def __init__(self):
    from rao_jax.model.tokenizer import Tokenizer
    from rao_jax.model.weights import resolve_model_path
    self.tokenizer = Tokenizer.from_gguf(resolve_model_path("smollm2-135m"))
    model = Transformer(tiny_config(), rngs=nnx.Rngs(0))
    self.engine = EmbeddedEngine(model, weight_version="default",
                                 default_stop_token_ids=tuple(self.tokenizer.stop_token_ids),
                                 **ENGINE)
    self.server = serve.Server(self.engine, self.tokenizer, model_path="tiny-smollm2",
                               served_model_name="tiny")
    self._bg = BackgroundServer(self.server)
    self.url = self._bg.url

  def close(self):
    self._bg.close()


@pytest.fixture(scope="module")
def srv():
  s = _Running()
  yield s
  s.close()


def gen(srv, body, status=200):
  r = requests.post(srv.url + "/generate", json=body, timeout=120)
  assert r.status_code == status, r.text
  return r.json()


def sse(resp):
  """The JSON payloads of an SSE response; asserts it ends with data: [DONE]."""
  lines = [ln for ln in resp.iter_lines(decode_unicode=True) if ln]
  assert all(ln.startswith("data: ") for ln in lines), lines[:3]
  assert lines[-1] == "data: [DONE]"
  return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]


PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.mark.slow
def test_sglang_generate_shapes(srv):
  base = gen(srv, {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True})
  ids, meta = base["output_ids"], base["meta_info"]
  assert len(ids) == 12 and meta["completion_tokens"] == 12
  assert meta["finish_reason"] == {"type": "length", "length": 12}
  assert meta["weight_version"] == "default" and meta["id"] and "e2e_latency" in meta
  assert [e[1] for e in meta["output_token_logprobs"]] == ids
  assert meta["input_token_logprobs"] == []

  # Streaming: cumulative chunks, the last one equal to the non-streamed answer, then [DONE].
  with requests.post(srv.url + "/generate", stream=True, timeout=120, json={
      "text": PROMPT, "sampling_params": GREEDY, "stream": True, "return_logprob": True}) as r:
    assert r.headers["Content-Type"].startswith("text/event-stream")
    chunks = sse(r)
  assert len(chunks) >= 2 and chunks[-1]["output_ids"] == ids
  assert chunks[-1]["text"] == base["text"]
  assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
  assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
  assert all(ids[:len(c["output_ids"])] == c["output_ids"] for c in chunks)

  # Stop strings (scalar and list): text trimmed before the match, ids kept up to it.
  stop = base["text"][len(base["text"]) // 2:][:3]
  assert stop.strip() and stop in base["text"]
  for s in (stop, [stop, "never-appears-xyz"]):
    out = gen(srv, {"text": PROMPT, "sampling_params": {**GREEDY, "stop": s}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == base["text"][:base["text"].find(stop)]
    assert out["output_ids"] == ids[:len(out["output_ids"])] and len(out["output_ids"]) < 12
  kept = gen(srv, {"text": PROMPT, "sampling_params": {**GREEDY, "stop": stop,
                                                       "no_stop_trim": True}})
  assert kept["output_ids"] == out["output_ids"] and stop in kept["text"]
  assert kept["text"] == srv.tokenizer.decode(kept["output_ids"], skip_special_tokens=True)
  # Streamed text with a stop string equals the answer's (no partial stop string shown).
  with requests.post(srv.url + "/generate", stream=True, timeout=120, json={
      "text": PROMPT, "sampling_params": {**GREEDY, "stop": stop}, "stream": True}) as r:
    chunks = sse(r)
  assert chunks[-1]["text"] == out["text"]
  assert all(out["text"].startswith(c["text"]) for c in chunks)

  # A stop token: output_ids and output_token_logprobs keep it, only the text drops it.
  stop_id = ids[4]
  out = gen(srv, {"input_ids": srv.tokenizer.encode(PROMPT), "return_logprob": True,
                  "sampling_params": {**GREEDY, "stop_token_ids": [stop_id]}})
  assert out["output_ids"] == ids[:5] and out["meta_info"]["completion_tokens"] == 5
  assert len(out["meta_info"]["output_token_logprobs"]) == 5
  assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
  assert out["text"] == srv.tokenizer.decode(ids[:4], skip_special_tokens=True)


@pytest.mark.slow
def test_sglang_logprobs_scoring_n_and_rids(srv):
  prompt = srv.tokenizer.encode(PROMPT)
  out = gen(srv, {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True,
                  "logprob_start_len": 0, "top_logprobs_num": 3,
                  "return_text_in_logprobs": True})
  m = out["meta_info"]
  assert [e[1] for e in m["input_token_logprobs"]] == prompt
  assert m["input_token_logprobs"][0][0] is None and m["input_token_logprobs"][1][0] < 0
  assert m["input_top_logprobs"][0] is None and len(m["input_top_logprobs"][1]) == 3
  assert len(m["output_top_logprobs"]) == 12
  for (lp, tok, text), top in zip(m["output_token_logprobs"], m["output_top_logprobs"]):
    # Greedy: the chosen token is the most likely one, with the same log-prob.
    assert top[0][1] == tok and abs(top[0][0] - lp) < 1e-4
    assert text == srv.tokenizer.decode([tok]) and isinstance(top[0][2], str)

  # max_new_tokens 0 scores the prompt: the same prompt log-probs, no output.
  score = gen(srv, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 2,
                    "sampling_params": {"max_new_tokens": 0}})
  assert score["output_ids"] == [] and score["meta_info"]["completion_tokens"] == 0
  assert score["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
  np.testing.assert_allclose([e[0] for e in score["meta_info"]["input_token_logprobs"]],
                             [e[0] for e in m["input_token_logprobs"][2:]], atol=1e-5)

  # n > 1: a list of n; a string rid of a batch expands to rid_0, rid_1, ...
  sampled = {"temperature": 1.0, "max_new_tokens": 6, "n": 3, "sampling_seed": 7}
  outs = gen(srv, {"text": PROMPT, "sampling_params": sampled})
  assert isinstance(outs, list) and len(outs) == 3
  assert len({tuple(o["output_ids"]) for o in outs}) == 3     # seeds + j: the samples differ
  again = gen(srv, {"text": PROMPT, "sampling_params": sampled})
  assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
  outs = gen(srv, {"text": [PROMPT, "Hello"], "rid": "job", "sampling_params": {**GREEDY,
                                                                                   "n": 2}})
  assert [o["meta_info"]["id"] for o in outs] == ["job_0", "job_1", "job_2", "job_3"]
  assert outs[0]["output_ids"] == outs[1]["output_ids"] == out["output_ids"]   # greedy copies
  with requests.post(srv.url + "/generate", stream=True, timeout=120, json={
      "text": [PROMPT, "Hello"], "stream": True, "sampling_params": GREEDY}) as r:
    chunks = sse(r)
  finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"]}
  assert sorted(finals) == [0, 1] and finals[0]["output_ids"] == out["output_ids"]

  # A client that leaves a stream early: its request is aborted, not left running.
  with requests.post(srv.url + "/generate", stream=True, timeout=120, json={
      "input_ids": prompt, "stream": True, "rid": "gone",
      "sampling_params": {"temperature": 0, "max_new_tokens": 100, "ignore_eos": True}}) as r:
    next(r.iter_lines())
    srv.engine.pause()         # so the request cannot finish before the server notices
  time.sleep(0.5)
  srv.engine.resume()
  for _ in range(100):
    if not srv.engine.num_running:
      break
    time.sleep(0.1)
  assert srv.engine.num_running == 0 and srv.engine.stats["finish_abort"] >= 1


@pytest.mark.slow
def test_sglang_sampling_options_and_refusals(srv):
  prompt = srv.tokenizer.encode(PROMPT)
  greedy = gen(srv, {"input_ids": prompt, "sampling_params": GREEDY})["output_ids"]
  # min_p = 1 keeps only the most likely token: sampling then equals greedy.
  out = gen(srv, {"input_ids": prompt, "sampling_params": {
      "temperature": 1.0, "min_p": 1.0, "max_new_tokens": 12, "sampling_seed": 3}})
  assert out["output_ids"] == greedy
  # A negative frequency (presence) penalty rewards repeats: on this near-uniform model the
  # first token then repeats; custom_params (slime sends them) are accepted.
  for key in ("frequency_penalty", "presence_penalty"):
    out = gen(srv, {"input_ids": prompt, "sampling_params": {
        **GREEDY, key: -2.0, "custom_params": {"x": 1}}})
    assert out["output_ids"] == [greedy[0]] * 12, key
  rep = gen(srv, {"input_ids": prompt, "sampling_params": {**GREEDY, "repetition_penalty": 1.5}})
  assert len(rep["output_ids"]) == 12
  # Fields this server does not implement: 400 naming the field.
  for body, field in (({"sampling_params": {"json_schema": "{}"}}, "json_schema"),
                      ({"sampling_params": {"min_new_tokens": 20, "max_new_tokens": 12}},
                       "min_new_tokens"),
                      ({"custom_logit_processor": "x"}, "custom_logit_processor"),
                      ({"lora_path": "a"}, "lora_path"),
                      ({"sampling_params": {"bogus": 1}}, "bogus"),
                      ({"sampling_params": {"top_k": 0}}, "top_k"),
                      ({"top_logprobs_num": 50, "return_logprob": True}, "top_logprobs_num")):
    err = gen(srv, {"input_ids": prompt, **body}, status=400)
    assert field in err["error"]["message"], (field, err)

  # Model / server info and weight versions in SGLang's shapes.
  info = requests.get(srv.url + "/get_model_info").json()
  assert info["model_path"] == "tiny-smollm2" and "preferred_sampling_params" in info
  assert info["is_generation"] is True
  assert requests.get(srv.url + "/get_server_info").json()["model_path"] == "tiny-smollm2"
  r = requests.post(srv.url + "/update_weight_version",
                    json={"new_version": "v2", "abort_all_requests": False}).json()
  assert r["success"] and r["new_version"] == "v2"
  # All three routes carry it: /model_info (current SGLang, whose /get_weight_version is
  # gone), /get_model_info, and /get_weight_version (0.5.x).
  for path in ("/model_info", "/get_model_info", "/get_weight_version"):
    assert requests.get(srv.url + path).json()["weight_version"] == "v2", path
  assert requests.get(srv.url + "/model_info").json()["model_path"] == "tiny-smollm2"
  assert gen(srv, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
             )["meta_info"]["weight_version"] == "v2"
  requests.post(srv.url + "/update_weight_version", json={"new_version": "default"})


@pytest.mark.slow
def test_sglang_min_new_tokens(srv):
  # A stop id that greedy decoding meets at its second token: without min_new_tokens the
  # request ends there; with it, the stop id cannot be drawn before min_new_tokens tokens (its
  # logit is masked, as SGLang's min-new-tokens penalizer does), and the first one from then on
  # ends the request.
  prompt = srv.tokenizer.encode(PROMPT)
  free = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
  ids = gen(srv, {"input_ids": prompt, "sampling_params": free})["output_ids"]
  stop_id = ids[1]
  early = gen(srv, {"input_ids": prompt, "sampling_params": {**free, "stop_token_ids": [stop_id]}})
  assert len(early["output_ids"]) <= 2
  assert early["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
  for min_new in (6, 12):
    out = gen(srv, {"input_ids": prompt, "sampling_params": {
        **free, "stop_token_ids": [stop_id], "min_new_tokens": min_new}})["output_ids"]
    assert out[0] == ids[0] and stop_id not in out[:min_new], (min_new, out, ids)
    assert len(out) >= min_new
    if len(out) < 12:
      assert out[-1] == stop_id and out.count(stop_id) == 1
  # Stop strings wait for min_new_tokens too; streamed, the same answer.
  text = srv.tokenizer.decode(ids, skip_special_tokens=True)
  stop = srv.tokenizer.decode(ids[:2], skip_special_tokens=True)[-2:]
  assert stop.strip() and text.find(stop) < len(srv.tokenizer.decode(ids[:3]))
  body = {"input_ids": prompt, "sampling_params": {**free, "stop": stop}}
  assert len(gen(srv, body)["output_ids"]) <= 3
  body["sampling_params"]["min_new_tokens"] = 8
  out = gen(srv, body)
  assert len(out["output_ids"]) >= 8 and out["output_ids"] == ids[:len(out["output_ids"])]
  with requests.post(srv.url + "/generate", stream=True, timeout=120,
                     json={**body, "stream": True}) as r:
    assert sse(r)[-1]["output_ids"] == out["output_ids"]


@pytest.mark.slow
def test_server_info_internal_states(srv):
  def state():
    info = requests.get(srv.url + "/get_server_info").json()
    assert isinstance(info["internal_states"], list) and len(info["internal_states"]) == 1
    return info["internal_states"][0]
  from rao_jax.rollout.serve.protocol import ServedEngine
  assert isinstance(srv.engine, ServedEngine)  # the embedded engine has every member
  state()                                      # starts a measuring interval
  before = srv.engine.stats["decode_tokens"]
  gen(srv, {"input_ids": srv.tokenizer.encode(PROMPT),
            "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}})
  s = state()
  # 10 tokens: the first from prefill, 9 decode steps; the last step's count may land just
  # after the answer (the engine counts once the step's tokens are delivered).
  assert s["engine_stats"]["decode_tokens"] >= before + 8
  assert s["last_gen_throughput"] > 0
  assert s["memory_usage"]["token_capacity"] == 4 * 128
  assert s["memory_usage"]["weight"] > 0
  assert s["prefill_decode_size"] == 0 and s["engine_paused"] is False
  assert s["weight_version"] == str(srv.engine.weight_version)
  assert state()["last_gen_throughput"] == 0.0          # nothing generated since
  requests.post(srv.url + "/pause_generation", json={"mode": "in_place"})
  try:
    assert state()["engine_paused"] is True
  finally:
    requests.post(srv.url + "/continue_generation")
  assert state()["engine_paused"] is False


@pytest.mark.slow
def test_typed_bodies_refused_over_http(srv):
  # Every body is a typed model: a value of the wrong type or range is a 400 whose message
  # names the field and the value (OpenAI's error also in `param`); nothing reaches the engine.
  running = srv.engine.stats["prompt_tokens"]
  for path, body, field, value in (
      ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
       "temperature", "'hot'"),
      ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2.5}},
       "max_new_tokens", "2.5"),
      ("/generate", {"input_ids": [1, 2], "stream": "yes"}, "stream", "'yes'"),
      ("/generate", {"input_ids": [1, 2], "rid": 7}, "rid", "7"),
      ("/pause_generation", {"mode": "later"}, "mode", "'later'"),
      ("/abort_request", {"rid": 3}, "rid", "3"),
      ("/update_weight_version", {"new_version": "v", "abort_all_requests": "no"},
       "abort_all_requests", "'no'"),
      ("/update_weights_from_disk", {"weight_version": "3"}, "model_path", "required")):
    r = requests.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, (path, body, r.text)
    msg = r.json()["error"]["message"]
    assert field in msg and value in msg, (path, msg)
  for path, body, field in (
      ("/v1/completions", {"prompt": "a", "max_tokens": "9"}, "max_tokens"),
      ("/v1/completions", {"prompt": "a", "temperature": [1]}, "temperature"),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 0}, "n")):
    r = requests.post(srv.url + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
  assert srv.engine.stats["prompt_tokens"] == running


@pytest.mark.slow
def test_openai_client_models_completions_and_chat(srv):
  client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
  assert [m.id for m in client.models.list().data] == ["tiny"]

  ref = gen(srv, {"text": PROMPT, "sampling_params": GREEDY})
  c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                logprobs=2)
  ch = c.choices[0]
  assert ch.text == ref["text"] and ch.finish_reason == "length"
  assert c.usage.completion_tokens == 12 and c.usage.prompt_tokens == len(
      srv.tokenizer.encode(PROMPT))
  assert len(ch.logprobs.tokens) == 12 and len(ch.logprobs.top_logprobs[0]) == 2
  # Streaming: the deltas add up to the same text.
  parts = [e.choices[0].text for e in client.completions.create(
      model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if e.choices]
  assert "".join(parts) == ref["text"] and len(parts) >= 2
  # n, stop, several prompts: choices indexed prompt-major.
  stop = ref["text"][len(ref["text"]) // 2:][:3]
  c = client.completions.create(model="tiny", prompt=[PROMPT, "Hello"], max_tokens=12,
                                temperature=0, n=2, stop=[stop])
  assert [x.index for x in c.choices] == [0, 1, 2, 3]
  assert c.choices[0].text == ref["text"][:ref["text"].find(stop)]
  assert c.choices[0].finish_reason == "stop"

  messages = [{"role": "user", "content": "Say hi"}]
  prompt_ids = srv.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
  ref = gen(srv, {"input_ids": prompt_ids, "sampling_params": GREEDY})
  r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                     temperature=0, logprobs=True, top_logprobs=2)
  assert r.choices[0].message.role == "assistant"
  assert r.choices[0].message.content == ref["text"]
  assert r.usage.prompt_tokens == len(prompt_ids)
  lp = r.choices[0].logprobs.content
  assert len(lp) == 12 and len(lp[0].top_logprobs) == 2 and lp[0].logprob <= 0
  stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True})
  events = list(stream)
  text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
  assert text == ref["text"]
  assert events[0].choices[0].delta.role == "assistant"
  assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
  assert events[-1].usage.completion_tokens == 12
  # Unsupported fields: 400 whose error names the field (OpenAI's error shape).
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                              logit_bias={"1": 5})
  assert e.value.body["param"] == "logit_bias" and "logit_bias" in e.value.message
  with pytest.raises(openai.BadRequestError):
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                   tools=[{"type": "function",
                                           "function": {"name": "f", "parameters": {}}}])


@pytest.mark.slow
def test_openai_raw_echo_scoring_and_errors(srv):
  # echo + max_tokens 0: OpenAI's prompt-scoring idiom.
  r = requests.post(srv.url + "/v1/completions", json={
      "model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
  ch = r["choices"][0]
  n = len(srv.tokenizer.encode(PROMPT))
  assert ch["text"] == PROMPT and len(ch["logprobs"]["token_logprobs"]) == n
  assert ch["logprobs"]["token_logprobs"][0] is None and r["usage"]["completion_tokens"] == 0
  assert r["metadata"]["weight_version"]
  # Token-id prompts work without text.
  r = requests.post(srv.url + "/v1/completions", json={
      "model": "tiny", "prompt": srv.tokenizer.encode(PROMPT), "max_tokens": 3,
      "temperature": 0}).json()
  assert r["object"] == "text_completion" and r["usage"]["completion_tokens"] == 3
  for path, body, field in (
      ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix"),
      ("/v1/completions", {"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                "response_format": {"type": "json_object"}}, "response_format"),
      ("/v1/chat/completions", {"messages": []}, "messages"),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                "top_logprobs": 2}, "top_logprobs")):
    resp = requests.post(srv.url + path, json={"model": "tiny", **body})
    assert resp.status_code == 400, (path, body)
    err = resp.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err
