"""SGLangEngine failover against real rao_jax.rollout.serve processes on loopback (tiny random
model): a killed server is skipped for new requests, its requests in flight finish on the other
one, and when it is restarted it is re-synced to the client's weights before it gets work; with
every server gone past the retry timeout the client raises one error naming the URLs."""
import asyncio
import signal
import time
import urllib.request

import jax
import numpy as np
import pytest
from flax import nnx

from rao_jax.model import Transformer
from rao_jax.rollout import (EngineUnavailableError, FinishReason, GenerateRequest,
                             SamplingParams)
from rao_jax.rollout.sglang_client import ClientConfig, SGLangEngine
from rao_jax.testing import tiny_config

# The tiny server of the HTTP tests, on loopback; a restarted one loads the first ones'
# compilations (its cache folder), and weight syncs export under pytest's temporary folders.
from tests.test_rollout_http import free_port, start_server  # noqa: E402


def wait_healthy(proc, port, timeout=120):
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


def kill(proc):
  if proc.poll() is None:
    proc.send_signal(signal.SIGKILL)
  proc.wait(30)


def prompts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [list(map(int, rng.integers(3, 49152, size=int(rng.integers(4, 13)))))
          for _ in range(n)]


def greedy(n):
  return SamplingParams(temperature=0.0, max_new_tokens=n)


async def greedy_on(url, ids, n=6):
  """A greedy /generate sent to one server directly (bypassing the client's choice)."""
  import aiohttp
  async with aiohttp.ClientSession() as s:
    async with s.post(url + "/generate", json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n}}) as r:
      assert r.status == 200, await r.text()
      return (await r.json())["output_ids"]


async def until(cond, timeout, what):
  t0 = time.monotonic()
  while not cond():
    if time.monotonic() - t0 > timeout:
      raise TimeoutError(f"timed out waiting for {what}")
    await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
  cache = str(tmp_path_factory.mktemp("jaxcache"))
  ports = [free_port(), free_port()]
  root = str(tmp_path_factory.getbasetemp())
  procs = [start_server(p, cache, root) for p in ports]
  for proc, port in zip(procs, ports):
    wait_healthy(proc, port)
  yield procs, ports, cache, root
  for proc in procs:
    kill(proc)


def test_client_config_validates_the_failover_timings():
  for name in ("retry_timeout", "health_interval"):
    with pytest.raises(ValueError, match=rf"ClientConfig\.{name}=0: must be > 0"):
      ClientConfig(**{name: 0})


@pytest.mark.slow
def test_dead_server_is_skipped_then_resynced_before_work_and_all_gone_raises(servers,
                                                                              tmp_path):
  procs, ports, cache, root = servers
  a, b = [f"http://127.0.0.1:{p}" for p in ports]
  model = Transformer(tiny_config(), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  other = nnx.merge(graphdef, jax.jit(
      lambda st: jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, st))(state))
  ps = prompts(12)

  async def go():
    client = SGLangEngine([a, b], retry_timeout=30, health_interval=0.2, backoff=0.1,
                          export_root=str(tmp_path / "weights"))
    stats = client.pool.stats
    try:
      await client.update_weights(model, 1)
      assert await client.get_weight_versions() == {a: "1", b: "1"}
      v1_out = await greedy_on(a, ps[0])

      # Requests in flight on both servers; b dies under them: they finish on a.
      tasks = [asyncio.create_task(client.generate(GenerateRequest(p, greedy(30))))
               for p in ps[:6]]
      await until(lambda: all(client._inflight[u] > 0 for u in (a, b)), 60, "both busy")
      kill(procs[1])
      done = await asyncio.wait_for(asyncio.gather(*tasks), 120)
      assert all(r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == 30
                 for r in done), [(r.finish_reason, r.message) for r in done]
      assert not client.pool.up[b] and stats[b].marked_down == 1 and stats[b].failures >= 1
      assert client.pool.up[a] and stats[a].failures == 0

      # New requests never touch the dead server (only its health checks do).
      before_b, before_a = stats[b].generate, stats[a].generate
      t0 = time.monotonic()
      more = await asyncio.gather(*[client.generate(GenerateRequest(p, greedy(4)))
                                    for p in ps[6:]])
      assert all(r.finish_reason == FinishReason.LENGTH for r in more)
      assert stats[b].generate == before_b and stats[a].generate == before_a + len(more)
      # No failed connection and no backoff on the way: as fast as a one-server client.
      assert time.monotonic() - t0 < 20
      assert stats[b].probes > 0

      # A weight sync while b is down goes to a alone and succeeds.
      await client.update_weights(other, 2)
      assert await client.get_weight_versions() == {a: "2", b: None}

      # b comes back (with its start-up weights): re-synced to version 2, then given work.
      procs[1] = start_server(ports[1], cache, root)
      await until(lambda: client.pool.up[b], 120, "b back in rotation")
      assert stats[b].resyncs == 1 and stats[b].recovered == 1
      events = [(kind, detail, n) for url, kind, detail, n in client.pool.events if url == b]
      assert [e[0] for e in events] == ["down", "resynced", "up"], events
      assert events[1][1] == "2" == str(client.weight_version)
      # It got no request between going down and coming back re-synced.
      assert events[0][2] == events[1][2] == events[2][2] == before_b
      assert (await client.get_weight_versions())[b] == "2"
      # Both serve version 2's weights, not b's start-up ones.
      assert await greedy_on(a, ps[0]) == await greedy_on(b, ps[0]) != v1_out
      back = await asyncio.gather(*[client.generate(GenerateRequest(p, greedy(4)))
                                    for p in ps[:6]])
      assert all(r.finish_reason == FinishReason.LENGTH for r in back)
      assert stats[b].generate > before_b
      m = client.health_metrics()
      assert m["servers_up"] == 2 and m["server_resyncs"] == 1 and m["server_recovered"] == 1
    finally:
      await client.close()

    # Every server gone: after retry_timeout one error naming both URLs, from generate, from
    # a weight sync and from check_available (what the trainer asks after a step's rollouts).
    kill(procs[0])
    kill(procs[1])
    client = SGLangEngine([a, b], retry_timeout=1.5, health_interval=0.2,
                          export_root=str(tmp_path / "weights2"))
    try:
      client.check_available()             # nothing failed yet
      t0 = time.monotonic()
      with pytest.raises(EngineUnavailableError) as err:
        await client.generate(GenerateRequest(ps[0], greedy(4)))
      waited = time.monotonic() - t0
      assert 1.5 <= waited < 15, waited
      assert a in str(err.value) and b in str(err.value) and err.value.urls == (a, b)
      assert "retry_timeout=1.5" in str(err.value)
      with pytest.raises(EngineUnavailableError, match="no rollout server answered"):
        client.check_available()
      t0 = time.monotonic()
      with pytest.raises(EngineUnavailableError):   # already past the timeout: at once
        await client.generate(GenerateRequest(ps[1], greedy(4)))
      assert time.monotonic() - t0 < 1.0
      with pytest.raises(EngineUnavailableError):
        await client.update_weights(model, 3)
      assert client.health_metrics()["servers_up"] == 0
    finally:
      await client.close()

  asyncio.run(go())
