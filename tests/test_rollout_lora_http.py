"""LoRA over HTTP: a real `python -m rao_jax.rollout.serve --max-lora-rank` process, the real
SGLang client. SGLangEngine.update_adapter (PEFT folder -> /load_lora_adapter -> lora_path on
every /generate) gives the tokens an EmbeddedEngine given the same adapter gives; adapter names
that are not served, folders outside the weight roots and requests without the API key are
refused; a session's KV from before a load is never reused after it; a server that lost its
adapter gets it back from the client's re-sync."""
import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import requests
from flax import nnx

from rao_jax.model import lora as lora_lib
from rao_jax.model.peft import save_adapter
from rao_jax.rollout import FinishReason, GenerateRequest, SamplingParams
from rao_jax.rollout.embedded import EmbeddedEngine
from rao_jax.rollout.sglang_client import SGLangEngine
from rao_jax.testing import tiny_model
from test_rollout_http import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "rk-" + secrets.token_hex(16)
RANK, ALPHA = 4, 32.0
ENGINE = dict(num_slots=2, max_len=64, cache_lens=(64,), chunk_sizes=(16,), prefill_rows=(1,),
              decode_rows=(2,))
ARGS = ["--tiny", "--num-slots", "2", "--max-len", "64", "--min-cache-len", "64",
        "--chunk-sizes", "16", "--prefill-rows", "1", "--decode-rows", "2",
        "--max-lora-rank", str(RANK)]
PROMPTS = [[5, 900, 17, 4000, 23], [77, 12, 3000, 41, 8, 19, 600, 2], [1000, 2000]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """A real server with a rank-4 adapter slot on every projection, its key from
  RAO_JAX_API_KEY, loading only under its `weights` folder."""
  base = tmp_path_factory.mktemp("lora")
  roots = base / "weights"
  roots.mkdir()
  port = free_port()
  env = dict(os.environ, RAO_JAX_API_KEY=KEY,
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.Popen([sys.executable, "-m", "rao_jax.rollout.serve", "--port", str(port),
                           "--weight-roots", str(roots), *ARGS], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  url = f"http://127.0.0.1:{port}"
  t0 = time.time()
  while True:
    if proc.poll() is not None:
      raise RuntimeError("server died: " + proc.stderr.read().decode()[-3000:])
    try:
      if requests.get(url + "/health", timeout=1).status_code == 200:
        break
    except requests.ConnectionError:
      pass
    if time.time() - t0 > 180:
      proc.kill()
      raise TimeoutError("the server did not become healthy")
    time.sleep(0.2)
  yield url, base, roots
  proc.send_signal(signal.SIGKILL)
  proc.wait(30)


def _adapted(seed):
  """The server's tiny base with a rank-4 adapter whose B is random (so it changes outputs)."""
  model = lora_lib.add_adapters(tiny_model(), lora_lib.LoraConfig(rank=RANK, alpha=ALPHA))
  rng = np.random.default_rng(seed)
  for t in model.cfg.lora.targets:
    var = getattr(model.lora, f"{t}_b")
    var.set_value(jax.numpy.asarray(rng.normal(0, 0.2, var.shape), var[...].dtype))
  return model


def _greedy(n):
  return SamplingParams(temperature=0.0, max_new_tokens=n)


def _post(url, path, body, key=KEY):
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  r = requests.post(url + path, json=body, headers=headers, timeout=120)
  return r.status_code, r.json()


def _gen(url, ids, n=6, **extra):
  return _post(url, "/generate", {"input_ids": ids, "sampling_params": {
      "temperature": 0, "max_new_tokens": n, "ignore_eos": True}, **extra})


@pytest.mark.slow
def test_update_adapter_matches_the_embedded_engine_and_refuses_what_is_not_served(served):
  url, base, roots = served
  first, second = _adapted(1), _adapted(2)

  async def go():
    client = SGLangEngine(url, retry_timeout=30, export_root=str(roots), api_key=KEY)
    local = EmbeddedEngine(lora_lib.add_adapters(tiny_model(), first.cfg.lora), **ENGINE)
    before = [await client.generate(GenerateRequest(p, _greedy(6))) for p in PROMPTS]

    # A session keeps its KV while the weights stay: its second turn reuses the first's.
    status, t1 = _gen(url, PROMPTS[1], session_params={"id": "s"})
    assert status == 200, t1
    turn2 = PROMPTS[1] + t1["output_ids"] + [31, 32]
    status, t2 = _gen(url, turn2, session_params={"id": "s"})
    assert status == 200 and t2["meta_info"]["cached_tokens"] > 0, t2

    await client.update_adapter(first, 1)
    folder = os.path.join(str(roots), "v000001")
    assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (await client.get_weight_versions())[url] == "1"
    await local.update_adapter(first, 1)
    changed = 0
    for p, b in zip(PROMPTS, before):
      r = await client.generate(GenerateRequest(p, _greedy(6)))
      ref = await local.generate(GenerateRequest(p, _greedy(6)))
      assert r.token_ids == ref.token_ids and r.weight_version == "1"
      np.testing.assert_allclose(r.logprobs, ref.logprobs, atol=1e-4)
      assert r.finish_reason == FinishReason.LENGTH
      changed += r.token_ids != b.token_ids
    assert changed, "the adapter should change some output"

    # The session's KV from the base is not reused under the adapter: nothing cached, and the
    # answer is the adapted model's for the whole prompt.
    turn3 = turn2 + t2["output_ids"] + [33]
    status, t3 = _gen(url, turn3, lora_path="rao-v1", session_params={"id": "s"})
    assert status == 200 and t3["meta_info"]["cached_tokens"] == 0, t3
    assert t3["output_ids"] == (await local.generate(GenerateRequest(turn3, _greedy(6)))
                                ).token_ids
    # Under the same adapter the session's KV is kept again.
    turn4 = turn3 + t3["output_ids"] + [34]
    status, t4 = _gen(url, turn4, lora_path="rao-v1", session_params={"id": "s"})
    assert status == 200 and t4["meta_info"]["cached_tokens"] > 0, t4

    # What the server does not serve: a clear 400 naming the active adapter.
    status, out = _gen(url, PROMPTS[0], lora_path="nope")
    assert status == 400 and "one LoRA adapter at a time" in out["error"]["message"] \
        and "'rao-v1'" in out["error"]["message"], out
    status, out = _gen(url, PROMPTS[0])
    assert status == 400 and "adapter 'rao-v1' is active" in out["error"]["message"], out
    status, out = _post(url, "/v1/completions", {"model": "m", "prompt": PROMPTS[0],
                                                 "max_tokens": 2, "lora_path": "nope"})
    assert status == 400 and out["error"]["param"] == "lora_path", out
    status, out = _post(url, "/v1/completions", {"model": "m", "prompt": PROMPTS[0],
                                                 "max_tokens": 2, "temperature": 0,
                                                 "lora_path": "rao-v1"})
    assert status == 200, out

    # The next sync replaces the adapter: a request running then is aborted by the load and
    # continued by the client under the new name (never lost, never refused); the old name is
    # refused saying by what.
    running = asyncio.create_task(client.generate(GenerateRequest(PROMPTS[0], _greedy(40))))
    await asyncio.sleep(0.3)
    await client.update_adapter(second, 2)
    mid = await running
    assert mid.finish_reason == FinishReason.LENGTH and len(mid.token_ids) == 40
    status, out = _gen(url, PROMPTS[0], lora_path="rao-v1")
    assert status == 400 and "replaced it with 'rao-v2'" in out["error"]["message"], out
    info = requests.get(url + "/get_server_info", headers={"Authorization": f"Bearer {KEY}"}
                        ).json()["lora"]
    assert info["loaded_adapters"] == {"rao-v2": os.path.join(str(roots), "v000002")}
    await local.update_adapter(second, 2)
    # KV kept under one adapter is not reused under the next.
    turn5 = turn4 + t4["output_ids"] + [35]
    status, t5 = _gen(url, turn5, lora_path="rao-v2", session_params={"id": "s"})
    assert status == 200 and t5["meta_info"]["cached_tokens"] == 0, t5
    assert t5["output_ids"] == (await local.generate(GenerateRequest(turn5, _greedy(6)))
                                ).token_ids
    r = await client.generate(GenerateRequest(PROMPTS[2], _greedy(6)))
    assert r.token_ids == (await local.generate(GenerateRequest(PROMPTS[2], _greedy(6)))
                           ).token_ids and r.weight_version == "2"

    # Load refusals in SGLang's LoRAUpdateOutput shape: outside the weight roots (403), a rank
    # above the slot's, a name already loaded; the LoRA routes need the key.
    save_adapter(first, str(base / "outside"))
    status, out = _post(url, "/load_lora_adapter", {"lora_name": "x",
                                                    "lora_path": str(base / "outside")})
    assert status == 403 and out["success"] is False and "lora_path" in out["error_message"]
    assert out["loaded_adapters"] == {"rao-v2": os.path.join(str(roots), "v000002")}
    big = lora_lib.add_adapters(tiny_model(), {"rank": 2 * RANK})
    save_adapter(big, str(roots / "big"))
    status, out = _post(url, "/load_lora_adapter", {"lora_name": "big",
                                                    "lora_path": str(roots / "big")})
    assert status == 400 and "--max-lora-rank 8" in out["error_message"], out
    status, out = _post(url, "/load_lora_adapter", {"lora_name": "rao-v2",
                                                    "lora_path": str(roots / "v000002")})
    assert status == 400 and "already loaded" in out["error_message"], out
    for path, body in (("/load_lora_adapter", {"lora_name": "y", "lora_path": folder}),
                       ("/unload_lora_adapter", {"lora_name": "rao-v2"})):
      for key in (None, "wrong"):
        status, out = _post(url, path, body, key=key)
        assert status == 401 and "API key" in out["error"]["message"], (path, key)
    assert _gen(url, PROMPTS[0], lora_path="rao-v2")[0] == 200   # still served

    # Unloading serves the base again, as before any adapter.
    status, out = _post(url, "/unload_lora_adapter", {"lora_name": "rao-v2",
                                                      "weight_version": "base"})
    assert status == 200 and out["loaded_adapters"] == {} and out["weight_version"] == "base"
    status, out = _gen(url, PROMPTS[0])
    assert status == 200 and out["output_ids"] == before[0].token_ids

    # A server that lost the adapter (as a restarted one has) gets it back from the re-sync.
    _post(url, "/update_weight_version", {"new_version": "default"})
    assert await client._resync(url) == "2"
    assert (await client.get_weight_versions())[url] == "2"
    r = await client.generate(GenerateRequest(PROMPTS[2], _greedy(6)))
    assert r.token_ids == (await local.generate(GenerateRequest(PROMPTS[2], _greedy(6)))
                           ).token_ids
    for e in (client, local):
      await e.close()
  asyncio.run(go())
