"""SGLangEngine (the client) against answers in real SGLang 0.5.6's shapes: both error shapes,
weight_version "default", servers that ignore sampling_seed, and what the payload asks for; and
the weight version read where each SGLang era keeps it (current servers: /model_info, with
/get_weight_version answering 404), also when a returning server is re-synced.

The server here is a small aiohttp app replaying SGLang's documented answers (no SGLang on a
CPU test machine); the client is the code under test."""
import asyncio
import logging
import socket

import pytest
from aiohttp import web

from rao_jax.rollout import FinishReason, GenerateRequest, SamplingParams
from rao_jax.rollout.sglang_client import SGLangEngine, error_message, honours_seed


def _port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class FakeSGLang:
  """Answers /generate and /get_server_info like an SGLang 0.5.6 server would.

  ``era`` says where the weight version is read: "0.5" (/get_weight_version only), "current"
  (SGLang main, 2026-08: /model_info and /get_model_info carry it, /get_weight_version answers
  404 "deprecated"), or "broken" (/model_info fails with 500)."""

  def __init__(self, *, version="default", deterministic=False, refuse=None, era="0.5"):
    self.version, self.deterministic, self.refuse = version, deterministic, refuse
    self.era = era
    self.gets = []               # paths of every GET, in order
    self.bodies, self.info_calls = [], 0
    self.controls = []           # (path, body) of every weight-sync call, in order
    self.draining = 1            # /flush_cache answers 400 this many times (requests draining)

  async def control(self, request):
    path = request.path
    body = await request.json() if request.can_read_body else None
    self.controls.append((path, body))
    if path == "/flush_cache" and self.draining:
      self.draining -= 1
      return web.Response(status=400, text="requests still running")
    if path == "/update_weights_from_disk":
      import os
      folder = body["model_path"]
      files = set(os.listdir(folder)) if os.path.isdir(folder) else set()
      if not {"config.json", "model.safetensors"} <= files:
        return web.json_response({"success": False, "message": f"no checkpoint in {folder}"},
                                 status=400)
      self.version = body["weight_version"]
      return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
    return web.json_response({"status": "ok"})

  async def generate(self, request):
    body = await request.json()
    self.bodies.append(body)
    if self.refuse == "flat":        # FastAPI request validation, OpenAI-style ErrorResponse
      return web.json_response({"object": "error", "message": "bad field: temperature",
                                "type": "BadRequestError", "param": None, "code": 400},
                               status=400)
    if self.refuse == "nested":      # /generate's ValueError path
      return web.json_response({"error": {"message": "nested refusal"}}, status=400)
    n = body["sampling_params"]["max_new_tokens"]
    ids = list(range(100, 100 + n))
    return web.json_response({"text": "x", "output_ids": ids, "meta_info": {
        "id": body["rid"], "finish_reason": {"type": "length", "length": n},
        "prompt_tokens": len(body["input_ids"]), "completion_tokens": n, "cached_tokens": 0,
        "weight_version": self.version,
        "output_token_logprobs": [[-1.0, t, None] for t in ids]}})

  async def info(self, request):
    self.gets.append(request.path)
    if self.era == "broken":
      return web.Response(status=500, text="Internal Server Error")
    if request.path == "/get_weight_version" and self.era == "current":
      return web.json_response({"error": {"message": "Endpoint '/get_weight_version' or "
                                          "'/weight_version' is deprecated. Please use "
                                          "'/model_info' instead."}}, status=404)
    if request.path == "/get_weight_version":
      return web.json_response({"weight_version": self.version})
    return web.json_response({"model_path": "m", "tokenizer_path": "m", "is_generation": True,
                              "weight_version": self.version, "model_type": "llama"})

  async def health(self, request):
    return web.Response(status=200)

  async def server_info(self, request):
    self.info_calls += 1
    info = {"model_path": "m", "version": "0.5.6"}
    if self.deterministic:
      info["enable_deterministic_inference"] = True
    return web.json_response(info)

  async def __aenter__(self):
    app = web.Application()
    app.router.add_post("/generate", self.generate)
    app.router.add_get("/get_server_info", self.server_info)
    app.router.add_get("/health", self.health)
    # An 0.5.x server has only /get_weight_version (aiohttp answers 404 for the others).
    for path in (("/get_weight_version",) if self.era == "0.5" else
                 ("/model_info", "/get_model_info", "/get_weight_version")):
      app.router.add_get(path, self.info)
    for path in ("/pause_generation", "/flush_cache", "/update_weights_from_disk",
                 "/continue_generation"):
      app.router.add_post(path, self.control)
    self.runner = web.AppRunner(app)
    await self.runner.setup()
    port = _port()
    await web.TCPSite(self.runner, "127.0.0.1", port).start()
    self.url = f"http://127.0.0.1:{port}"
    return self

  async def __aexit__(self, *exc):
    await self.runner.cleanup()


def test_error_message_shapes():
  assert error_message({"error": {"message": "a"}}) == "a"
  assert error_message({"object": "error", "message": "b", "code": 400}) == "b"
  assert error_message({"detail": [{"msg": "c"}]}) == "[{'msg': 'c'}]"
  assert error_message("plain") == "plain"
  assert honours_seed({"enable_deterministic_inference": True})
  assert honours_seed({"sampling_seed_honoured": True}) and not honours_seed({"x": 1})


def test_client_surfaces_both_error_shapes():
  async def go():
    for shape, text in (("flat", "bad field: temperature"), ("nested", "nested refusal")):
      async with FakeSGLang(refuse=shape) as srv:
        client = SGLangEngine(srv.url, retry_timeout=5)
        with pytest.raises(ValueError, match=text):
          await client.generate(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2)))
        await client.close()
  asyncio.run(go())


def test_weight_version_default_and_payload():
  async def go():
    async with FakeSGLang(version="default", deterministic=True) as srv:
      client = SGLangEngine(srv.url, weight_version=5)
      r = await client.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=3)))
      # "default" is SGLang's label for never-updated weights: the client's version stands.
      assert r.weight_version == 5 and r.finish_reason == FinishReason.LENGTH
      assert r.token_ids == [100, 101, 102]
      srv.version = "7"
      r = await client.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=1)))
      assert r.weight_version == "7" and client.weight_version == "7"
      srv.version = "default"
      r = await client.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=1)))
      assert r.weight_version == "7"
      # Payload: None stop ids leave the server's EOS default; explicit ids mean exactly those.
      sp0 = srv.bodies[0]["sampling_params"]
      assert "stop_token_ids" not in sp0 and "ignore_eos" not in sp0
      await client.generate(GenerateRequest([1], SamplingParams(
          max_new_tokens=3, stop_token_ids=(9,), min_p=0.1, repetition_penalty=1.2,
          min_new_tokens=2)))
      sp = srv.bodies[-1]["sampling_params"]
      assert sp["stop_token_ids"] == [9] and sp["ignore_eos"] is True
      assert sp["min_new_tokens"] == 2 and "min_new_tokens" not in sp0
      assert sp["min_p"] == pytest.approx(0.1) and sp["repetition_penalty"] == 1.2
      assert "frequency_penalty" not in sp
      await client.close()
  asyncio.run(go())


def test_update_weights_exports_then_loads_from_disk(tmp_path):
  """Engine.update_weights on the client: the model is exported as an HF folder under
  export_root, then every server is paused, flushed (retried while it drains), loaded from
  that folder and continued; results carry the new version."""
  import json
  import os
  from rao_jax.testing import tiny_model
  model = tiny_model(0)

  async def go():
    async with FakeSGLang() as a, FakeSGLang() as b:
      client = SGLangEngine([a.url, b.url], export_root=str(tmp_path), backoff=0.05)
      await client.update_weights(model, 4)
      folder = str(tmp_path / "v000004")
      for srv in (a, b):
        assert [p for p, _ in srv.controls] == [
            "/pause_generation", "/flush_cache", "/flush_cache", "/update_weights_from_disk",
            "/continue_generation"]
        assert srv.controls[3][1]["model_path"] == folder
        assert srv.controls[3][1]["weight_version"] == "4"
      with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == model.cfg.n_layers
      assert client.weight_version == "4"
      r = await client.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=1)))
      assert r.weight_version == "4"
      # A client without an export folder refuses before touching any server.
      bare = SGLangEngine(a.url)
      with pytest.raises(ValueError, match="export_root"):
        await bare.update_weights(model, 5)
      assert len(a.controls) == 5
      for c in (client, bare):
        await c.close()
  asyncio.run(go())


def test_weight_version_is_read_where_each_sglang_era_keeps_it(tmp_path):
  """Current SGLang answers /get_weight_version with 404: the client reads /model_info there
  (and /get_weight_version on an 0.5.x server), so a current server that returns after a
  failure is re-synced to the run's weights before it serves again."""
  folder = tmp_path / "v3"
  folder.mkdir()
  for name in ("config.json", "model.safetensors"):
    (folder / name).write_text("{}")

  async def until(cond, timeout):
    t0 = asyncio.get_running_loop().time()
    while not cond():
      assert asyncio.get_running_loop().time() - t0 < timeout, "timed out"
      await asyncio.sleep(0.02)

  async def go():
    async with FakeSGLang(era="current", version="1") as new, \
        FakeSGLang(era="0.5", version="2") as old, FakeSGLang(era="broken") as bad:
      client = SGLangEngine([new.url, old.url, bad.url], health_interval=0.05, backoff=0.01)
      assert await client.get_weight_versions() == {new.url: "1", old.url: "2", bad.url: None}
      assert new.gets == ["/model_info"]
      assert old.gets == ["/get_weight_version"]     # after two 404s from aiohttp's router
      # A server that has the route and fails is not asked the older spellings.
      assert bad.gets == ["/model_info"]
      with pytest.raises(ValueError, match=r"reported no weight version \(/model_info: HTTP 500"):
        await client._server_version(bad.url)

      new.draining = old.draining = 0
      await client.update_weights_from_disk(str(folder), 3)
      assert await client.get_weight_versions() == {new.url: "3", old.url: "3", bad.url: None}
      # The current server restarts with its start-up weights ("default") after a failure: it
      # comes back re-synced to version 3 before any new request.
      new.version, new.controls = "default", []
      client.pool.mark_down(new.url, "connection reset (test)")
      await until(lambda: client.pool.up[new.url], 10)
      assert [p for p, _ in new.controls] == ["/pause_generation", "/flush_cache",
                                             "/update_weights_from_disk", "/continue_generation"]
      assert new.version == "3" and client.pool.stats[new.url].resyncs == 1
      kinds = [(kind, detail) for url, kind, detail, _ in client.pool.events if url == new.url]
      assert kinds == [("down", "connection reset (test)"), ("resynced", "3"), ("up", "")]
      await client.close()
  asyncio.run(go())


def test_trainer_sync_goes_through_update_weights_of_the_configured_engine(tmp_path):
  """The trainer's one sync path on an SGLang run: make_engine builds the client with the
  run's export folder, Trainer.sync_weights hands it the learner's model, and the servers load
  the exported folder (no engine-specific branch in the trainer)."""
  import types
  from ml_collections import config_dict
  from rao_jax import experiment as X
  from rao_jax.testing import tiny_model
  from rao_jax.trainer import Trainer
  model = tiny_model(1)

  async def go():
    async with FakeSGLang() as srv:
      config = config_dict.ConfigDict({"rollout": {"engine": "sglang", "urls": (srv.url,)}})
      engine = X.make_engine(config, model, None, export_dir=str(tmp_path / "weights"))
      trainer = types.SimpleNamespace(engine=engine, _local_model=lambda: model,
                                      learner=types.SimpleNamespace(lora=False))
      seconds = await Trainer.sync_weights(trainer, 2)
      loads = [b for p, b in srv.controls if p == "/update_weights_from_disk"]
      assert loads == [{"model_path": str(tmp_path / "weights" / "v000002"),
                        "weight_version": "2", "flush_cache": True}]
      assert seconds > 0 and engine.weight_version == "2"
      await engine.close()
  asyncio.run(go())


def test_seed_warning_once_per_server(caplog):
  async def go(deterministic):
    async with FakeSGLang(deterministic=deterministic) as srv:
      client = SGLangEngine(srv.url)
      for seed in (1, 2, 3):
        await client.generate(GenerateRequest([1], SamplingParams(max_new_tokens=1, seed=seed)))
      await client.generate(GenerateRequest([1], SamplingParams(max_new_tokens=1)))
      await client.close()
      assert srv.bodies[0]["sampling_params"]["sampling_seed"] == 1
      return client.seed_warnings, srv.info_calls
  with caplog.at_level(logging.WARNING, logger="rao_jax.rollout.sglang_client"):
    assert asyncio.run(go(False)) == (1, 1)
  assert sum("NOT be reproducible" in r.getMessage() for r in caplog.records) == 1
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="rao_jax.rollout.sglang_client"):
    assert asyncio.run(go(True)) == (0, 1)
  assert not any("reproducible" in r.getMessage() for r in caplog.records)


class FakeOpenAI:
  """A strict OpenAI-compatible /v1/completions server: unknown fields are refused, and the
  answer carries text only (no token ids)."""

  def __init__(self):
    self.bodies = []

  async def completions(self, request):
    body = await request.json()
    self.bodies.append(body)
    if "return_token_ids" in body:
      return web.json_response({"object": "error", "message": "Unrecognized request argument "
                                "supplied: return_token_ids", "code": 400}, status=400)
    return web.json_response({"object": "text_completion", "model": body["model"], "choices": [
        {"index": 0, "text": "hi!", "finish_reason": "stop", "logprobs": None}]})

  async def models(self, request):
    return web.json_response({"object": "list", "data": [{"id": "m1", "object": "model"}]})

  async def __aenter__(self):
    app = web.Application()
    app.router.add_post("/v1/completions", self.completions)
    app.router.add_get("/v1/models", self.models)
    self.runner = web.AppRunner(app)
    await self.runner.setup()
    port = _port()
    await web.TCPSite(self.runner, "127.0.0.1", port).start()
    self.url = f"http://127.0.0.1:{port}"
    return self

  async def __aexit__(self, *exc):
    await self.runner.cleanup()


def test_openai_engine_falls_back_to_reencoding_text():
  from rao_jax.rollout.openai_client import OpenAIEngine

  class CharTokenizer:       # stands in for the model's tokenizer (not under test)
    stop_token_ids = [2]

    @staticmethod
    def encode(text):
      return [ord(c) for c in text]

  async def go():
    async with FakeOpenAI() as srv:
      eng = OpenAIEngine(srv.url + "/v1", CharTokenizer(), retry_timeout=5)
      r = await eng.generate(GenerateRequest([5, 6], SamplingParams(max_new_tokens=4, seed=3)))
      r2 = await eng.generate(GenerateRequest([5], SamplingParams(
          max_new_tokens=4, stop_token_ids=(7,))))
      await eng.close()
      return srv.bodies, r, r2
  bodies, r, r2 = asyncio.run(go())
  # First call refused for return_token_ids, then retried without it; later calls skip it.
  assert "return_token_ids" in bodies[0] and "return_token_ids" not in bodies[1]
  assert len(bodies) == 3 and bodies[1]["model"] == "m1" and bodies[1]["prompt"] == [5, 6]
  assert bodies[1]["seed"] == 3 and bodies[1]["max_tokens"] == 4
  # Text re-encoded, the stop token that ended the turn appended.
  assert r.token_ids == [ord("h"), ord("i"), ord("!"), 2] and r.finish_reason == FinishReason.STOP
  assert r.logprobs == [0.0] * 4
  assert bodies[2]["stop_token_ids"] == [7] and bodies[2]["ignore_eos"] is True
  assert r2.token_ids[-1] == 7
