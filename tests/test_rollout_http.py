"""SGLangEngine against the rao_jax SGLang-compatible server over loopback (real subprocesses,
the real embedded engine on a tiny random model): parity, validation, weight sync, crashes."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import jax
import numpy as np
import pytest
from flax import nnx

from rao_jax.model import Transformer
from rao_jax.rollout import FinishReason, GenerateRequest, SamplingParams
from rao_jax.rollout.embedded import EmbeddedEngine
from rao_jax.rollout.sglang_client import SGLangEngine
from rao_jax.testing import tiny_config

ENGINE = dict(num_slots=4, max_len=64, cache_lens=(32, 64), chunk_sizes=(16,), prefill_rows=(2,))
ARGS = ["--tiny", "--num-slots", "4", "--max-len", "64", "--min-cache-len", "32",
        "--chunk-sizes", "16", "--prefill-rows", "2"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(port, cache_dir, weight_roots):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             # Restarted servers reuse the first one's compilations.
             JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return subprocess.Popen([sys.executable, "-m", "rao_jax.rollout.serve", "--port", str(port),
                           "--weight-roots", weight_roots, *ARGS], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_healthy(proc, port, timeout=120):
  import urllib.request
  t0 = time.time()
  while time.time() - t0 < timeout:
    if proc.poll() is not None:
      raise RuntimeError("server died: " + proc.stderr.read().decode()[-3000:])
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
        if r.status == 200:
          return
    except OSError:
      time.sleep(0.2)
  raise TimeoutError("server did not become healthy")


def stop(proc):
  if proc.poll() is None:
    proc.send_signal(signal.SIGKILL)
  proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  port = free_port()
  cache = str(tmp_path_factory.mktemp("jaxcache"))
  # The tests' exports live under pytest's base temporary folder: the server loads from there.
  roots = str(tmp_path_factory.getbasetemp())
  proc = start_server(port, cache, roots)
  wait_healthy(proc, port)
  yield f"http://127.0.0.1:{port}", proc, port, (cache, roots)
  stop(proc)


@pytest.fixture(scope="module")
def model():
  return Transformer(tiny_config(), rngs=nnx.Rngs(0))


def prompts(n, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [list(map(int, rng.integers(3, 49152, size=lengths[i % len(lengths)])))
          for i in range(n)]


def greedy(n, **kw):
  return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


async def post(url, path, body=None, raw=None):
  async with aiohttp.ClientSession() as s:
    kw = {"data": raw, "headers": {"Content-Type": "application/json"}} if raw is not None \
        else {"json": body}
    async with s.post(url + path, **kw) as r:
      text = await r.text()
      return r.status, (json.loads(text) if text.startswith(("{", "[")) else text)


@pytest.mark.slow
def test_client_server_parity_validation_and_weight_sync(server, model, tmp_path):
  url, _, _, _ = server
  ps = prompts(5, [4, 20, 9, 30, 2])
  params = [greedy(8), SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=8, seed=3)]

  async def go():
    local = EmbeddedEngine(model, **ENGINE)
    client = SGLangEngine([url, url + "/"], retry_timeout=30, export_root=str(tmp_path))
    reqs = [GenerateRequest(p, params[i % 2]) for i, p in enumerate(ps)]
    remote = await asyncio.gather(*[client.generate(r) for r in reqs])
    ref = await asyncio.gather(*[local.generate(r) for r in reqs])
    for a, b in zip(remote, ref):
      assert a.token_ids == b.token_ids
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
      # The server starts at SGLang's "default" version; the client reports its own (0).
      assert a.finish_reason == FinishReason.LENGTH and a.weight_version == 0
    # Stop ids and context limits map back to the same finish reasons.
    stop_id = ref[0].token_ids[2]
    r = await client.generate(GenerateRequest(ps[0], greedy(8, stop_token_ids=(stop_id,))))
    assert r.finish_reason == FinishReason.STOP and r.token_ids[-1] == stop_id
    r = await client.generate(GenerateRequest(ps[0], greedy(8), context_limit=7))
    assert r.finish_reason == FinishReason.CONTEXT and len(r.token_ids) == 3

    # A batch in SGLang's list form answers in input order.
    status, out = await post(url, "/generate", {
        "input_ids": [ps[0], ps[2]], "return_logprob": True,
        "sampling_params": [{"temperature": 0, "max_new_tokens": 8}] * 2})
    assert status == 200 and [o["output_ids"] for o in out] == [ref[0].token_ids,
                                                                 ref[2].token_ids]
    status, out = await post(url, "/generate", {"text": "Hello there",
                                                "sampling_params": {"max_new_tokens": 3,
                                                                    "temperature": 0}})
    assert status == 200 and isinstance(out["text"], str) and out["meta_info"]["prompt_tokens"]
    # Requests SGLang refuses: HTTP 400 with {"error": {"message": ...}}.
    for body in ({"text": "a", "input_ids": [1, 2]}, {"input_ids": []},
                 {"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
                 {"input_ids": [1, 2], "sampling_params": {"top_p": 0}},
                 {"input_ids": [1, 2], "sampling_params": {"top_k": 0}},
                 {"input_ids": [1, 2], "sampling_params": {"bogus": 1}}):
      status, out = await post(url, "/generate", body)
      assert status == 400 and out["error"]["message"], body
    status, out = await post(url, "/generate", raw=b'{"input_ids": [1, 2')
    assert status == 400 and "JSON" in out["error"]["message"]
    async with aiohttp.ClientSession() as s:
      for path in ("/health", "/health_generate", "/get_model_info", "/get_server_info"):
        async with s.get(url + path) as resp:
          assert resp.status == 200, path

    # Abort: the request returns early with its partial output.
    task = asyncio.create_task(client.generate(GenerateRequest(ps[1], greedy(40), rid="x")))
    await asyncio.sleep(0.5)
    await client.abort("x")
    r = await task
    assert r.finish_reason in (FinishReason.ABORT, FinishReason.CONTEXT)

    # Weight sync through disk: export new weights, pause -> flush -> update -> continue.
    from rao_jax.model.weights import export_hf
    graphdef, state = nnx.split(model)
    other = nnx.merge(graphdef, jax.jit(
        lambda st: jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, st))(state))
    running = asyncio.create_task(client.generate(GenerateRequest(ps[3], greedy(15))))
    await client.update_weights(other, 3)
    assert os.path.isfile(os.path.join(str(tmp_path), "v000003", "model.safetensors"))
    assert (await client.get_weight_versions())[url] == "3"
    mid = await running          # aborted by the pause, continued after it: never lost
    assert mid.finish_reason == FinishReason.LENGTH and len(mid.token_ids) == 15
    new_local = EmbeddedEngine(other, **ENGINE)
    a = await client.generate(GenerateRequest(ps[2], greedy(8)))
    b = await new_local.generate(GenerateRequest(ps[2], greedy(8)))
    assert a.token_ids == b.token_ids and a.weight_version == "3"
    for e in (client, local, new_local):
      await e.close()
  asyncio.run(go())


@pytest.mark.slow
def test_server_killed_and_restarted_mid_run(server):
  url, proc, port, (cache, roots) = server
  ps = prompts(8, [5, 12, 15])

  async def go():
    client = SGLangEngine(url, retry_timeout=90, backoff=0.2, max_backoff=1.0)
    tasks = [asyncio.create_task(client.generate(GenerateRequest(p, greedy(30))))
             for p in ps]
    await asyncio.sleep(0.3)
    stop(proc)                               # the server dies mid-run ...
    await asyncio.sleep(1.0)
    new = start_server(port, cache, roots)   # ... and comes back on the same port
    try:
      results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=150)
      after = await client.generate(GenerateRequest(ps[0], greedy(5)))
    finally:
      await client.close()
      stop(new)
    return results, after
  results, after = asyncio.run(go())
  for r in results:
    assert r.finish_reason in (FinishReason.LENGTH, FinishReason.ABORT)
    if r.finish_reason == FinishReason.LENGTH:
      assert len(r.token_ids) == 30 and len(r.logprobs) == 30
    else:
      assert r.message
  assert sum(r.finish_reason == FinishReason.LENGTH for r in results) >= 1
  assert after.finish_reason == FinishReason.LENGTH
