"""The rollout server's door: the API key (401 without it, health checks open), the refusal to
serve a non-loopback address without one, weight loads confined to the server's weight roots
(403 outside), the clients sending the key end to end against a real server process, and the
key kept out of logs, printed output, /get_server_info and config.json."""
import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import openai
import pytest
import requests
from flax import nnx
from ml_collections import config_dict

from rao_jax import experiment as X
from rao_jax.model import Transformer
from rao_jax.rollout import FinishReason, GenerateRequest, SamplingParams
from rao_jax.rollout.serve import cli, door
from rao_jax.rollout.openai_client import OpenAIEngine
from rao_jax.rollout.sglang_client import SGLangEngine, auth_headers
from rao_jax.testing import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "rk-" + secrets.token_hex(16)
ARGS = ["--tiny", "--num-slots", "2", "--max-len", "64", "--min-cache-len", "64",
        "--chunk-sizes", "16", "--prefill-rows", "1", "--decode-rows", "2"]
# Every route but the health checks, with a body that would be valid (or harmless) if admitted.
GUARDED = [("GET", "/get_model_info", None), ("GET", "/get_server_info", None),
           ("GET", "/get_weight_version", None), ("GET", "/v1/models", None),
           ("POST", "/flush_cache", {}), ("POST", "/generate", {"input_ids": [1, 2]}),
           ("POST", "/abort_request", {"abort_all": True}),
           ("POST", "/update_weights_from_disk", {"model_path": "/etc"}),
           ("POST", "/update_weight_version", {"new_version": "x"}),
           ("POST", "/pause_generation", {}), ("POST", "/continue_generation", {}),
           ("POST", "/v1/completions", {"model": "m", "prompt": [1, 2], "max_tokens": 1}),
           ("POST", "/v1/chat/completions", {"model": "m", "max_tokens": 1,
                                             "messages": [{"role": "user", "content": "hi"}]})]


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """A real `python -m rao_jax.rollout.serve` process whose key comes from RAO_JAX_API_KEY,
  loading weights only under its own `weights` folder; stdout and stderr go to `server.log`."""
  base = tmp_path_factory.mktemp("door")
  roots = base / "weights"
  roots.mkdir()
  log_path = base / "server.log"
  port = _free_port()
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env[door.API_KEY_ENV] = KEY
  with open(log_path, "wb") as log_file:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rao_jax.rollout.serve", "--port", str(port), "--weight-roots",
         str(roots), *ARGS], env=env, stdout=log_file, stderr=subprocess.STDOUT)
  url = f"http://127.0.0.1:{port}"
  t0 = time.time()
  while True:
    if proc.poll() is not None:
      raise RuntimeError("server died: " + log_path.read_text()[-3000:])
    try:
      if requests.get(url + "/health", timeout=1).status_code == 200:   # no key: open
        break
    except requests.ConnectionError:
      pass
    if time.time() - t0 > 120:
      raise TimeoutError("server did not become healthy")
    time.sleep(0.2)
  yield types.SimpleNamespace(url=url, roots=roots, log=log_path, base=base, proc=proc)
  if proc.poll() is None:
    proc.send_signal(signal.SIGKILL)
  proc.wait(30)


def _call(url, method, path, body=None, key=None, auth=None):
  headers = {"Authorization": auth if auth is not None else f"Bearer {key}"} if (
      key or auth) else {}
  return requests.request(method, url + path, json=body, headers=headers, timeout=120)


def test_loopback_bind_and_bearer_rules():
  for host in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost", "LOCALHOST",
               "::ffff:127.0.0.1"):
    assert door.is_loopback(host), host
  for host in ("0.0.0.0", "::", "", None, "10.0.0.5", "192.168.1.2", "example.org",
               "localhost.evil.org"):
    assert not door.is_loopback(host), host
  assert door.check_bind("127.0.0.1", None, False) is None
  assert door.check_bind("0.0.0.0", "k", False) is None
  assert door.check_bind("0.0.0.0", None, True) is None
  assert "--api-key" in door.check_bind("0.0.0.0", "", False)
  assert door.bearer_token("Bearer abc ") == "abc" and door.bearer_token("bearer abc") == "abc"
  for bad in (None, "", "Bearer", "Bearer  ", "Basic abc", "abc"):
    assert door.bearer_token(bad) is None, bad
  with pytest.raises(ValueError, match="empty"):
    door.api_key_middleware("")
  # The clients: one header, none without a key, and a malformed key refused unechoed.
  assert auth_headers(KEY) == {"Authorization": f"Bearer {KEY}"} and auth_headers("") is None
  for bad in (" " + KEY, KEY + "\n", KEY + "\r\nX-Evil: 1"):
    with pytest.raises(ValueError) as e:
      SGLangEngine("http://127.0.0.1:1", api_key=bad)
    assert KEY not in str(e.value)


def test_weight_roots_resolve_symlinks_and_dotdot(tmp_path, monkeypatch):
  root, outside = tmp_path / "root", tmp_path / "outside"
  (root / "v1").mkdir(parents=True)
  outside.mkdir()
  (root / "escape").symlink_to(outside)
  roots = door.WeightRoots([str(root)])
  assert roots.resolve(str(root / "v1")) == str(root / "v1")
  assert roots.resolve(str(root)) == str(root)
  monkeypatch.chdir(root)
  assert roots.resolve("v1") == str(root / "v1")           # relative: the server's cwd
  for bad in (str(outside), str(root / ".." / "outside"), str(root / "escape"),
              str(root / "escape" / "x"), str(tmp_path / "rootx"), "/etc/passwd", ".."):
    with pytest.raises(door.PathOutsideRoots) as e:
      roots.resolve(bad)
    assert str(root) in str(e.value), bad                   # names the allowed roots
  with pytest.raises(ValueError, match="--weight-roots"):
    door.WeightRoots([])


def test_non_loopback_bind_without_key_refuses(monkeypatch, capsys):
  monkeypatch.delenv(door.API_KEY_ENV, raising=False)
  for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
    with pytest.raises(SystemExit) as e:
      cli.build_server(["--tiny", "--host", host])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "--allow-no-api-key" in err and door.API_KEY_ENV in err, err
  # Help shows the variable's name, never its value.
  monkeypatch.setenv(door.API_KEY_ENV, KEY)
  assert door.API_KEY_ENV in cli.parser().format_help()
  assert KEY not in cli.parser().format_help()


def test_every_route_but_health_needs_the_key(served):
  for method, path, body in GUARDED:
    for kw in ({}, {"key": "wrong-" + KEY[:8]}, {"key": KEY + "x"}, {"key": KEY[:-1]},
               {"auth": f"Basic {KEY}"}, {"auth": KEY}):
      r = _call(served.url, method, path, body, **kw)
      assert r.status_code == 401, (method, path, kw, r.status_code, r.text)
      err = r.json()["error"]
      assert err["message"].startswith(("missing API key", "invalid API key")), err
      assert KEY[3:] not in r.text and "wrong-" not in r.text       # nothing sent is echoed
      assert r.headers["WWW-Authenticate"].startswith("Bearer")
      if path.startswith("/v1/"):
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
  for path in ("/health", "/health_generate"):
    assert _call(served.url, "GET", path).status_code == 200, path
  for path in ("/get_model_info", "/get_weight_version", "/v1/models"):
    assert _call(served.url, "GET", path, key=KEY).status_code == 200, path
  # The key is not among the reported server args; whether one is required is.
  info = _call(served.url, "GET", "/get_server_info", key=KEY)
  assert info.status_code == 200 and KEY not in info.text
  assert info.json()["api_key_required"] is True
  assert info.json()["weight_roots"] == [str(served.roots)]
  # The official OpenAI client with api_key=... gets through; a wrong key raises its error.
  client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
  assert [m.id for m in client.models.list().data]
  bad = openai.OpenAI(base_url=served.url + "/v1", api_key="nope", max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    bad.models.list()


def test_weight_loads_outside_roots_get_403_naming_them(served, tmp_path):
  (served.roots / "escape").symlink_to(tmp_path)
  for path in ("/etc", str(tmp_path), str(served.roots / ".." / "server.log"),
               str(served.roots / "escape")):
    r = _call(served.url, "POST", "/update_weights_from_disk",
              {"model_path": path, "weight_version": "9"}, key=KEY)
    assert r.status_code == 403, (path, r.text)
    out = r.json()
    assert out["success"] is False and str(served.roots) in out["message"], out
    assert out["weight_roots"] == [str(served.roots)]
  assert _call(served.url, "GET", "/get_weight_version", key=KEY).json()["weight_version"] == (
      "default")


def test_clients_with_the_key_generate_and_sync_weights(served, monkeypatch, tmp_path, caplog):
  """The trainer's path: the config names only the key's environment variable; make_engine
  builds the client with the key; generation and a real weight sync (export under the server's
  roots, load from disk) go through; without the key, or exporting elsewhere, they do not."""
  caplog.set_level(logging.DEBUG)
  monkeypatch.setenv("DOOR_TEST_KEY", KEY)
  config = config_dict.ConfigDict({"rollout": {"engine": "sglang", "urls": (served.url,),
                                               "api_key_env": "DOOR_TEST_KEY"}})
  with open(X.save_config(config, str(tmp_path / "run"))) as f:
    saved = f.read()
  assert "DOOR_TEST_KEY" in saved and KEY not in saved
  model = Transformer(tiny_config(), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  other = nnx.merge(graphdef, jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, state))
  greedy = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=())
  prompt = [5, 17, 300, 4000, 12]

  async def go():
    engine = X.make_engine(config, model, None, export_dir=str(served.roots / "run"))
    before = await engine.generate(GenerateRequest(prompt, greedy))
    assert before.finish_reason == FinishReason.LENGTH and len(before.token_ids) == 6
    await engine.update_weights(other, 1)                  # export + pause/flush/load/continue
    assert (await engine.get_weight_versions()) == {served.url: "1"}
    after = await engine.generate(GenerateRequest(prompt, greedy))
    assert after.weight_version == "1" and after.token_ids != before.token_ids
    assert KEY not in repr(after)
    # The OpenAI-shaped client sends the key too.
    oa = OpenAIEngine(served.url, tokenizer=None, api_key=KEY)
    r = await oa.generate(GenerateRequest(prompt, greedy))
    assert r.token_ids == after.token_ids
    # Without the key: generation is refused, a weight sync fails at once (no flush retries).
    bare = SGLangEngine(served.url, retry_timeout=5, flush_timeout=3,
                        export_root=str(served.roots / "bare"))
    with pytest.raises(ValueError, match="401"):
      await bare.generate(GenerateRequest(prompt, greedy))
    t0 = time.monotonic()
    with pytest.raises(PermissionError, match="401"):
      await bare.update_weights(other, 2)
    assert time.monotonic() - t0 < 4
    # With the key but exporting outside the server's roots: 403 naming them.
    elsewhere = SGLangEngine(served.url, export_root=str(tmp_path / "weights"), api_key=KEY)
    with pytest.raises(RuntimeError, match="403") as e:
      await elsewhere.update_weights(other, 3)
    assert str(served.roots) in str(e.value)
    assert (await engine.get_weight_versions()) == {served.url: "1"}
    for c in (engine, oa, bare, elsewhere):
      await c.close()
  asyncio.run(go())
  assert KEY not in caplog.text


def test_key_never_in_server_output(served):
  """Runs after the others: the server's whole log (its printed banner, INFO logging, the
  access log of every request above, refusals included) never shows the key."""
  assert _call(served.url, "GET", "/get_model_info", key=KEY).status_code == 200
  assert _call(served.url, "GET", "/get_model_info", key=KEY + "x").status_code == 401
  time.sleep(0.2)
  text = served.log.read_text()
  assert "API key required" in text                          # the banner was captured
  assert '"GET /get_model_info' in text and " 401 " in text  # so was the access log
  assert KEY not in text and KEY[3:] not in text
