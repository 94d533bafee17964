"""SGLangEngine: the rollout interface over SGLang-native HTTP servers (or rao_jax.rollout.serve).

Token in, token out: requests send ``input_ids`` with ``return_logprob`` and ``no_stop_trim``
and explicit sampling parameters; tokens and logprobs are read from
``meta_info.output_token_logprobs`` (their count is checked against ``completion_tokens``).

Failover (``rao_jax.rollout.server_pool``): a server that fails a request (connection refused or
reset, a timeout, HTTP 5xx) is marked down and gets no new request until its ``/health``
answers again and it has been re-synced to the run's current weights; the failed request is
retried at once on a server that is up. Other failures (429, a malformed answer) are retried
with exponential backoff; a request still failing ``retry_timeout`` seconds after its first
failure returns FinishReason.ABORT (never hangs). When every server has been down for
``retry_timeout`` seconds, ``generate``, ``update_weights`` and ``check_available`` raise
EngineUnavailableError naming the URLs. Requests the server aborted on its own (a weight
update pausing with mode "abort") are continued: prompt + partial output is re-sent with the
remaining token budget, and the pieces are joined.

Weight sync (``Engine.update_weights``) exports the model as an HF checkpoint folder under
``export_root`` and follows the SGLang RL recipe on every server (``update_weights_from_disk``):
pause_generation -> flush_cache (retried until 200) -> update_weights_from_disk ->
continue_generation. Servers that are down are skipped (they are re-synced when they return);
a server that fails its update is marked down.

LoRA (``Engine.update_adapter``): a policy whose adapter alone changed is synced by writing the
adapter in PEFT's format (``rao_jax.model.peft.save_adapter``, a few MB) to ``export_dir`` and
loading it on every server with SGLang's ``/load_lora_adapter`` under the name ``rao-v{version}``
(same pause -> load -> continue recipe; ``weight_version`` relabelled with it); every /generate
then sends ``lora_path`` = that name, and the previous ``rao-v*`` adapters are unloaded (SGLang
keeps several loaded; rao_jax.rollout.serve applies one at a time and replaces it on load). A
server that returns is given the newest full weights (when a full sync replaced its base) and
then the newest adapter. Servers need LoRA enabled (SGLang: ``--enable-lora --max-lora-rank R
--lora-target-modules ...``; rao_jax.rollout.serve: ``--max-lora-rank R``).

Servers started with ``--api-key`` (SGLang's, or rao_jax.rollout.serve's) get it as
``Authorization: Bearer <key>`` on every request (``api_key=``; entry points read it from
``RAO_JAX_API_KEY``, never from a config); a 401 raises at once instead of being retried.

Server quirks handled: refusals come as ``{"error": {"message": ...}}`` (SGLang's /generate) or
flat ``{"object": "error", "message": ...}`` (its request validation, OpenAI-style), and both
reach the caller's ValueError; a server that never had its weights updated reports
``weight_version: "default"``, which the client replaces by its own version (the constructor's
``weight_version`` until a sync sets another); and ``sampling_seed`` is honoured by SGLang only
with ``--enable-deterministic-inference``, so the first seeded request per server reads
/get_server_info and logs one warning when seeded rollouts will not be reproducible there
(rao_jax.rollout.serve always honours seeds).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import time
import uuid
from typing import Any, Sequence

import aiohttp

from rao_jax.rollout.base import (Engine, FinishReason,
                                  GenerateRequest, GenerateResult)
from rao_jax.rollout.server_pool import ServerPool

log = logging.getLogger(__name__)

# The environment variable the entry points read the servers' key from; rao_jax.rollout.serve's
# --api-key defaults to it too (its door imports this name: one spelling for both ends).
API_KEY_ENV = "RAO_JAX_API_KEY"

# Adapters this client loads are named ADAPTER_PREFIX + version; older ones of that prefix are
# unloaded after a newer one loads (names of other prefixes are someone else's).
ADAPTER_PREFIX = "rao-v"

_RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError,
              ConnectionError)


class ServerError(RuntimeError):
  """A retryable server failure (5xx or a malformed answer)."""


def error_message(data: Any) -> str:
  """The message of an error answer in any of SGLang's shapes (nested, flat, or plain text)."""
  if isinstance(data, dict):
    err = data.get("error")
    if isinstance(err, dict) and err.get("message") is not None:
      return str(err["message"])
    if isinstance(err, str) and err:
      return err
    if data.get("message") is not None:
      return str(data["message"])
    if data.get("detail") is not None:       # FastAPI's default validation shape
      return str(data["detail"])
    return json.dumps(data)[:500]
  return str(data)[:500]


def auth_headers(api_key: str | None) -> dict[str, str] | None:
  """The ``Authorization`` header carrying ``api_key`` (None without one)."""
  if api_key is None or api_key == "":
    return None
  if not isinstance(api_key, str) or api_key != api_key.strip() or any(
      c in api_key for c in "\r\n"):
    # Not echoed: the value is a secret.
    raise ValueError("api_key: give the server's key as one line of text without surrounding "
                     "spaces.")
  return {"Authorization": f"Bearer {api_key}"}


def api_key_from_env(name: str = API_KEY_ENV) -> str | None:
  """The rollout servers' API key from the environment variable ``name`` (None when unset or
  empty): how entry points hand the key to the clients without writing it anywhere."""
  return os.environ.get(name) or None


def honours_seed(server_info: Any) -> bool:
  """Whether a server's /get_server_info says it reproduces ``sampling_seed``."""
  if not isinstance(server_info, dict):
    return False
  return bool(server_info.get("sampling_seed_honoured")
              or server_info.get("enable_deterministic_inference"))


@dataclasses.dataclass(frozen=True)
class ClientConfig:
  """Timeouts and retry policy of SGLangEngine.

  Attributes:
    request_timeout: seconds one HTTP /generate may take.
    connect_timeout: seconds to establish a connection.
    retry_timeout: seconds a request keeps retrying after its first failure before it is
      reported aborted; and seconds every server may be down before the client raises
      EngineUnavailableError (the trainer then stops with a checkpoint).
    health_interval: seconds between two health checks of a server marked down.
    backoff: first retry delay in seconds (doubles each retry, with jitter).
    max_backoff: cap on the retry delay.
    max_continuations: times a server-aborted request is continued before giving up.
    flush_timeout: seconds /flush_cache is retried during a weight update.
    forward_session_ids: send ``session_params: {"id": ...}`` (understood by
      rao_jax.rollout.serve; real SGLang servers reuse prefixes with their radix cache instead).
  """
  request_timeout: float = 600.0
  connect_timeout: float = 10.0
  retry_timeout: float = 120.0
  health_interval: float = 1.0
  backoff: float = 0.25
  max_backoff: float = 4.0
  max_continuations: int = 16
  flush_timeout: float = 120.0
  forward_session_ids: bool = False

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.type in ("float", "int") and not v > 0 and f.name != "max_continuations":
        raise ValueError(f"ClientConfig.{f.name}={v!r}: must be > 0.")
    if self.max_continuations < 0:
      raise ValueError(f"ClientConfig.max_continuations={self.max_continuations!r}: must be "
                       ">= 0.")


class SGLangEngine(Engine):
  """An Engine that sends requests to one or more SGLang-native servers.

  Args:
    urls: base URLs (``http://host:port``); load is spread by fewest requests in flight, and a
      session sticks to one server while it is healthy (its prefix cache stays warm).
    config: a ClientConfig, or its fields as keyword arguments.
    weight_version: reported until a server answers with its own.
    export_root: the folder ``update_weights`` writes checkpoints under (one ``v{version}``
      folder each); every server must be able to read it (a shared filesystem when they run
      on other hosts). None: ``update_weights`` refuses, ``update_weights_from_disk`` works.
    tokenizer: written into each exported checkpoint (None: weights and config only).
    api_key: sent as ``Authorization: Bearer <api_key>`` on every request (the servers'
      ``--api-key``); None sends none. Kept out of the config, logs and errors.
  """

  def __init__(self, urls: str | Sequence[str], config: ClientConfig | None = None, *,
               weight_version: int | str = 0, export_root: str | None = None, tokenizer=None,
               api_key: str | None = None, **kwargs):
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                           for u in urls):
      raise ValueError(f"SGLangEngine urls={urls!r}: give one or more http(s):// base URLs.")
    # One entry per server: the same server given twice would be synced twice.
    self.urls = list(dict.fromkeys(u.rstrip("/") for u in urls))
    self.config = config if config is not None else ClientConfig(**kwargs)
    self.pool = ServerPool(self.urls, retry_timeout=self.config.retry_timeout,
                           health_interval=self.config.health_interval, health=self._health,
                           resync=self._resync)
    # (checkpoint folder, version) of the newest full weight sync: what a returning server loads.
    self._synced: tuple[str, str] | None = None
    # (adapter name, PEFT folder, version) of the newest adapter sync over that base (None:
    # the base alone); its name goes on every /generate as lora_path.
    self._adapter: tuple[str, str, str] | None = None
    # Versions served over the current base (the last full sync's, then each adapter's): a
    # server reporting one of them needs only the newest adapter to catch up.
    self._base_versions: set[str] = set()
    self._adapter_syncs = 0       # adapter syncs in progress (lora_path refusals are retried)
    self._version = weight_version
    self.export_root = export_root
    self.tokenizer = tokenizer
    self._headers = auth_headers(api_key)
    self._inflight = {u: 0 for u in self.urls}
    self._rr = 0
    self._sessions: dict[str, str] = {}
    self._current: dict[str, tuple[str, str]] = {}     # rid -> (url, http rid)
    self._aborted: set[str] = set()
    self._seed_checked: set[str] = set()
    self.seed_warnings = 0        # how many servers were found not to honour sampling_seed
    self._http: aiohttp.ClientSession | None = None
    self._http_loop = None

  @property
  def weight_version(self) -> int | str:
    return self._version

  # ---- HTTP plumbing --------------------------------------------------------------------------
  def _session(self) -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    if self._http is None or self._http.closed or self._http_loop is not loop:
      c = self.config
      self._http = aiohttp.ClientSession(
          timeout=aiohttp.ClientTimeout(total=c.request_timeout, sock_connect=c.connect_timeout),
          connector=aiohttp.TCPConnector(limit=0, force_close=False), headers=self._headers)
      self._http_loop = loop
    return self._http

  async def _pick(self, session_id: str | None, avoid: str | None) -> str:
    """A server that is up (waiting for one while all are down, see ServerPool)."""
    self.pool.ensure_probes()
    if not self.pool.healthy():
      await self.pool.wait_for_any()
    up = self.pool.healthy()
    sticky = self._sessions.get(session_id) if session_id is not None else None
    if sticky is not None and sticky != avoid and self.pool.up.get(sticky):
      return sticky
    cands = [u for u in up if u != avoid] or up
    self._rr += 1
    url = min(cands, key=lambda u: (self._inflight[u], (self.urls.index(u) - self._rr)
                                    % len(self.urls)))
    if session_id is not None:
      self._sessions[session_id] = url
    return url

  async def _post(self, url: str, path: str, body: Any = None, timeout: float | None = None):
    """One POST; returns (status, parsed JSON or text). Raises on connection problems."""
    kw = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout else {}
    async with self._session().post(url + path, json=body if body is not None else {},
                                    **kw) as resp:
      text = await resp.text()
      try:
        data = json.loads(text) if text else None
      except ValueError:
        data = text
      return resp.status, data

  # ---- generation -----------------------------------------------------------------------------
  async def generate(self, request: GenerateRequest) -> GenerateResult:
    p = request.params
    prompt = [int(t) for t in request.prompt_ids]
    if not prompt:
      raise ValueError("GenerateRequest.prompt_ids is empty: give at least one token id.")
    rid = request.rid or uuid.uuid4().hex
    budget = p.max_new_tokens
    capped = False
    if request.context_limit is not None:
      room = request.context_limit - len(prompt)
      if room <= 0:
        return GenerateResult([], [], FinishReason.CONTEXT, self._version, len(prompt),
                              message=f"the prompt ({len(prompt)} tokens) already fills the "
                                      f"context limit ({request.context_limit} tokens)")
      if room < budget:
        budget, capped = room, True
    tokens: list[int] = []
    logps: list[float] = []
    cached = 0
    version = self._version
    continuations = 0
    try:
      while True:
        left = budget - len(tokens)
        meta, out_tok, out_lp = await self._generate_once(rid, request, prompt + tokens, left)
        if meta is None:      # retries exhausted or the caller aborted while we waited
          return GenerateResult(tokens, logps, FinishReason.ABORT, version, len(prompt), cached,
                                message=out_tok)
        tokens += out_tok
        logps += out_lp
        cached += int(meta.get("cached_tokens") or 0)
        reported = meta.get("weight_version")
        # "default": SGLang's label for weights no update has touched; the client knows better.
        if reported is not None and reported != "default":
          version = reported
          self._version = version
        fr = meta.get("finish_reason") or {}
        kind = fr.get("type") if isinstance(fr, dict) else None
        if kind == "stop":
          reason = FinishReason.STOP
        elif kind == "length":
          reason = (FinishReason.CONTEXT if fr.get("reason") == "context"
                    or (capped and len(tokens) >= budget) else FinishReason.LENGTH)
        elif kind == "abort" or kind is None:
          if rid in self._aborted or continuations >= self.config.max_continuations:
            return GenerateResult(tokens, logps, FinishReason.ABORT, version, len(prompt),
                                  cached, message=str(fr.get("message", "aborted")
                                                      if isinstance(fr, dict) else fr))
          if len(tokens) >= budget:
            reason = FinishReason.CONTEXT if capped else FinishReason.LENGTH
          else:
            continuations += 1    # aborted by the server (e.g. a weight update): continue
            continue
        else:
          raise ServerError(f"unknown finish_reason {fr!r}")
        msg = fr.get("message", "") if reason == FinishReason.CONTEXT else ""
        return GenerateResult(tokens, logps, reason, version, len(prompt), cached, message=msg)
    finally:
      self._current.pop(rid, None)
      self._aborted.discard(rid)

  def _payload(self, request: GenerateRequest, ids: list[int], max_new: int, http_rid: str):
    p = request.params
    sp = {"max_new_tokens": int(max_new), "temperature": float(p.temperature),
          "top_p": float(p.top_p), "top_k": int(p.top_k),
          "no_stop_trim": True, "skip_special_tokens": False}
    if p.stop_token_ids is not None:
      # Exactly these ids (SamplingParams' contract); None leaves the server's default (EOS).
      sp["stop_token_ids"] = [int(t) for t in p.stop_token_ids]
      sp["ignore_eos"] = True
    for k, off in (("min_p", 0.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                   ("repetition_penalty", 1.0)):
      if getattr(p, k) != off:
        sp[k] = float(getattr(p, k))
    if p.min_new_tokens:
      sp["min_new_tokens"] = int(p.min_new_tokens)
    if p.stop:
      sp["stop"] = list(p.stop)
    if p.seed is not None:
      sp["sampling_seed"] = int(p.seed)
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True,
            "logprob_start_len": -1, "rid": http_rid, "stream": False}
    if self._adapter is not None:
      body["lora_path"] = self._adapter[0]
    if self.config.forward_session_ids and request.session_id is not None:
      body["session_params"] = {"id": request.session_id}
    return body

  async def _generate_once(self, rid, request, ids, max_new):
    """One /generate with retries. Returns (meta, tokens, logprobs), or (None, message, None)
    when it could not be served. Raises EngineUnavailableError when every server is gone."""
    c = self.config
    deadline = None     # retry_timeout counts from the first failure, not from the start
    delay = c.backoff
    avoid = None
    attempt = 0
    last_error = ""
    while True:
      if rid in self._aborted:
        return None, "aborted by the caller", None
      url = await self._pick(request.session_id, avoid)
      if rid in self._aborted:      # the caller gave up while every server was down
        return None, "aborted by the caller", None
      if request.params.seed is not None and url not in self._seed_checked:
        await self._check_seed(url)
      http_rid = f"{rid}-{uuid.uuid4().hex[:8]}"
      self._current[rid] = (url, http_rid)
      self._inflight[url] += 1
      self.pool.stats[url].generate += 1
      down = False
      try:
        payload = self._payload(request, ids, max_new, http_rid)
        status, data = await self._post(url, "/generate", payload)
        if status >= 500 or status == 429:
          down = status != 429          # 429 is a busy server, not a broken one
          raise ServerError(f"HTTP {status}: {str(data)[:200]}")
        if status == 400 and self._adapter_moved(payload, data):
          raise ServerError(f"the adapter changed under the request: {error_message(data)}")
        if status != 200:
          raise ValueError(f"{url}/generate refused the request (HTTP {status}): "
                           f"{error_message(data)}")
        return (data["meta_info"], *self._read_tokens(data))
      except _RETRYABLE as e:
        down = True
        last_error = f"{type(e).__name__}: {e}"
      except (ServerError, KeyError, TypeError) as e:
        last_error = f"{type(e).__name__}: {e}"
      finally:
        self._inflight[url] -= 1
      attempt += 1
      now = time.monotonic()
      deadline = deadline if deadline is not None else now + c.retry_timeout
      if down:
        self.pool.mark_down(url, last_error)
      if len(self.urls) > 1:
        avoid = url
      if request.session_id is not None:
        self._sessions.pop(request.session_id, None)
      if down and now < deadline:
        # The server is out of rotation: the next pick is another one that is up (or waits
        # for one to return), so there is nothing to back off from.
        log.info("request %s: %s failed (%s); retrying on another server", rid, url,
                 last_error)
        continue
      if now + delay > deadline:
        log.warning("request %s gave up after %d attempts: %s", rid, attempt, last_error)
        return None, f"server unreachable after {attempt} attempts: {last_error}", None
      log.info("request %s attempt %d failed (%s); retrying in %.2f s", rid, attempt,
               last_error, delay)
      await asyncio.sleep(delay * (0.5 + random.random()))
      delay = min(delay * 2, c.max_backoff)

  def _adapter_moved(self, payload: dict, data: Any) -> bool:
    """Whether a 400 refusing ``lora_path`` came from an adapter sync racing the request (the
    name it sent is no longer the newest, or a sync is loading it now): then it is retried,
    with the newest name, instead of failing."""
    if "lora_path" not in error_message(data):
      return False
    sent = payload.get("lora_path")
    return self._adapter_syncs > 0 or sent != (self._adapter[0] if self._adapter else None)

  async def _check_seed(self, url: str) -> None:
    """Warns (once per server) when ``url`` will ignore sampling_seed."""
    try:
      async with self._session().get(
          url + "/get_server_info",
          timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout)) as resp:
        info = await resp.json(content_type=None) if resp.status == 200 else None
    except _RETRYABLE + (ValueError,) as e:
      log.info("could not read %s/get_server_info to check sampling_seed support: %s", url, e)
      return          # checked again on the next seeded request
    self._seed_checked.add(url)
    if not honours_seed(info):
      self.seed_warnings += 1
      log.warning("%s does not say it honours sampling_seed (SGLang needs "
                  "--enable-deterministic-inference): seeded rollouts from it will NOT be "
                  "reproducible.", url)

  @staticmethod
  def _read_tokens(data: dict) -> tuple[list[int], list[float]]:
    meta = data["meta_info"]
    lps = meta.get("output_token_logprobs")
    if lps is None:
      raise ServerError("meta_info.output_token_logprobs is missing (return_logprob ignored?)")
    n = int(meta.get("completion_tokens", len(lps)))
    if len(lps) != n:
      raise ServerError(f"{len(lps)} output_token_logprobs for {n} completion_tokens")
    return [int(x[1]) for x in lps], [float(x[0]) for x in lps]

  async def abort(self, rid: str) -> None:
    """Aborts ``rid``: it returns FinishReason.ABORT with the tokens produced so far."""
    self._aborted.add(rid)
    cur = self._current.get(rid)
    if cur is not None:
      url, http_rid = cur
      try:
        await self._post(url, "/abort_request", {"rid": http_rid, "abort_all": False},
                         timeout=self.config.connect_timeout)
      except _RETRYABLE as e:
        log.warning("abort of %s on %s failed: %s", rid, url, e)

  async def end_session(self, session_id: str) -> None:
    self._sessions.pop(session_id, None)

  # ---- control --------------------------------------------------------------------------------
  async def _control(self, url: str, path: str, body=None, patience: float | None = None):
    """A control POST retried on connection errors and 5xx for ``patience`` seconds (default
    retry_timeout; 0: one try); then raises ConnectionError."""
    loop = asyncio.get_running_loop()
    patience = self.config.retry_timeout if patience is None else patience
    deadline = loop.time() + patience
    delay = self.config.backoff
    while True:
      try:
        status, data = await self._post(url, path, body, timeout=self.config.request_timeout)
        if status == 401:      # retrying cannot help: say so now, not after the flush timeout
          raise PermissionError(f"{url}{path} refused the client (HTTP 401): "
                                f"{error_message(data)} Give the client the server's key "
                                f"(api_key=, or the {API_KEY_ENV} environment variable).")
        if status < 500:
          return status, data
        err = f"HTTP {status}"
      except _RETRYABLE as e:
        err = f"{type(e).__name__}: {e}"
      if loop.time() + delay > deadline:
        raise ConnectionError(f"{url}{path} failed until the retry timeout: {err}")
      await asyncio.sleep(delay)
      delay = min(delay * 2, self.config.max_backoff)

  async def update_weights_from_disk(self, model_path: str, version: int | str) -> None:
    """Loads an HF checkpoint folder on every server that is up: pause -> flush -> update ->
    continue. Servers that are down load it when they return (before any request); one that
    fails its update is marked down. With every server down, waits for one to return (it
    loads this version first), raising EngineUnavailableError past the retry timeout.

    Requests in flight are aborted by the pause and continued by their ``generate`` calls
    once generation resumes (with the new weights for the remaining tokens).
    """
    # Set first: a server a probe is re-syncing now must end on this version, not the last.
    self._synced = (model_path, str(version))
    # New full weights replace the base and any adapter (the servers drop theirs too).
    self._adapter = None
    self._base_versions = {str(version)}
    done = await asyncio.gather(*[self._sync_one(u, model_path, version)
                                  for u in self.pool.healthy()])
    if not any(done):
      await self.pool.wait_for_any()
    self._version = str(version)

  async def _sync_one(self, url, model_path, version) -> bool:
    """Updates one server; False when it failed like a dead server (then marked down)."""
    try:
      await self._update_one(url, model_path, version, patience=0)
      return True
    except (ConnectionError,) + _RETRYABLE as e:
      self.pool.mark_down(url, f"weight update failed: {type(e).__name__}: {e}")
      return False

  async def _update_one(self, url, model_path, version, patience=None):
    loop = asyncio.get_running_loop()
    await self._control(url, "/pause_generation", {"mode": "abort"}, patience)
    try:
      deadline = loop.time() + self.config.flush_timeout
      while True:   # 400 while requests are still draining: retry until 200
        status, _ = await self._control(url, "/flush_cache", patience=patience)
        if status == 200:
          break
        if loop.time() > deadline:
          raise TimeoutError(f"{url}/flush_cache kept failing for "
                             f"{self.config.flush_timeout} s.")
        await asyncio.sleep(0.1)
      status, data = await self._control(
          url, "/update_weights_from_disk",
          {"model_path": model_path, "weight_version": str(version), "flush_cache": True},
          patience)
      if status != 200 or not (isinstance(data, dict) and data.get("success")):
        raise RuntimeError(f"{url}/update_weights_from_disk failed (HTTP {status}): {data}")
    finally:
      try:
        await self._control(url, "/continue_generation", patience=patience)
      except (ConnectionError,) + _RETRYABLE as e:
        # A server that died mid-update: the error of the step that failed is the one to see.
        log.info("%s/continue_generation failed: %s", url, e)

  # ---- failover (ServerPool's callbacks) ------------------------------------------------------
  async def _health(self, url: str) -> bool:
    """One health check of a down server: its GET /health answers 200."""
    async with self._session().get(
        url + "/health", timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout)
    ) as resp:
      return resp.status == 200

  async def _server_version(self, url: str) -> str:
    async with self._session().get(
        url + "/get_weight_version",
        timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout)) as resp:
      data = await resp.json(content_type=None)
      if resp.status == 401:   # a key problem is the user's to fix, not a server that is down
        raise PermissionError(f"{url}/get_weight_version refused the client (HTTP 401): "
                              f"{error_message(data)}; check the servers' --api-key and "
                              "RAO_JAX_API_KEY.")
      return str(data["weight_version"])

  async def _resync(self, url: str) -> str | None:
    """Brings a returning server to the newest synced weights and adapter; returns the version
    it serves (None: no sync yet, it serves the weights it started with, as every server did).

    A server reporting a version served over the current base (``_base_versions``) only loads
    the newest adapter; any other (a restart, a missed full sync) loads the newest full weights
    first, when there were any."""
    while self._synced is not None or self._adapter is not None:
      target = (self._synced, self._adapter)
      synced, adapter = target
      version = adapter[2] if adapter is not None else synced[1]
      have = await self._server_version(url)
      if have != version:
        if synced is not None and (adapter is None or have not in self._base_versions):
          await self._update_one(url, synced[0], synced[1], patience=0)
        if adapter is not None:
          await self._adapter_one(url, *adapter, patience=0)
        self.pool.stats[url].resyncs += 1
      if (self._synced, self._adapter) == target:      # no newer sync began meanwhile
        return version
    return None

  def check_available(self) -> None:
    """Raises EngineUnavailableError when every server has been down past retry_timeout."""
    err = self.pool.unavailable_error()
    if err is not None:
      raise err

  def health_metrics(self) -> dict[str, float]:
    return self.pool.metrics()

  def export_dir(self, version: int | str) -> str:
    """The folder ``update_weights`` writes version ``version`` to."""
    if self.export_root is None:
      raise ValueError("SGLangEngine.update_weights: the client has no export_root; construct "
                       "it with export_root=<a folder every server can read> (the trainer "
                       "passes <workdir>/weights).")
    name = f"v{version:06d}" if isinstance(version, int) else f"v{version}"
    # Absolute: a server resolves a relative path against its own working directory.
    return os.path.join(os.path.abspath(self.export_root), name)

  async def update_weights(self, model, version: int | str) -> None:
    """Exports ``model`` as an HF checkpoint folder (``export_dir(version)``) and has every
    server load it (``update_weights_from_disk``). Requests in flight are continued on the
    new weights."""
    out = self.export_dir(version)
    # Imported here: the client itself needs no JAX (a CPU box can drive remote servers).
    from rao_jax.model.weights import export_hf  # pylint: disable=g-import-not-at-top
    await asyncio.to_thread(export_hf, model, None, self.tokenizer, out)
    await self.update_weights_from_disk(out, version)

  async def update_adapter(self, model, version: int | str) -> None:
    """Writes ``model``'s LoRA adapter as a PEFT folder (``export_dir(version)``) and has every
    server load it (``load_adapter_from_disk``); a model without an adapter is sent whole
    (``update_weights``). The servers' base must be the policy's: the weights they started
    with, or the last ``update_weights``."""
    if not model.cfg.lora.enabled:
      return await self.update_weights(model, version)
    out = self.export_dir(version)
    # Imported here: the client itself needs no JAX (a CPU box can drive remote servers).
    from rao_jax.model.peft import save_adapter  # pylint: disable=g-import-not-at-top
    await asyncio.to_thread(save_adapter, model, out)
    await self.load_adapter_from_disk(out, version)

  @staticmethod
  def adapter_name(version: int | str) -> str:
    """The name an adapter of ``version`` is loaded under (``lora_path`` of every request)."""
    return f"{ADAPTER_PREFIX}{version}"

  async def load_adapter_from_disk(self, folder: str, version: int | str) -> None:
    """Loads a PEFT adapter folder on every server that is up (pause -> /load_lora_adapter ->
    continue) as ``adapter_name(version)``; requests send that name from now on. Servers that
    are down load it when they return; one that fails to load it is marked down. With every
    server down, waits for one to return (raising EngineUnavailableError past the retry
    timeout). A server refusing the adapter (LoRA not enabled, a rank above its
    --max-lora-rank, ...) raises RuntimeError naming it and its answer."""
    name, version = self.adapter_name(version), str(version)
    self._adapter_syncs += 1
    try:
      self._adapter = (name, os.path.abspath(folder), version)
      self._base_versions.add(version)
      done = await asyncio.gather(*[self._adapter_sync_one(u, *self._adapter)
                                    for u in self.pool.healthy()])
      if not any(done):
        await self.pool.wait_for_any()
      self._version = version
    finally:
      self._adapter_syncs -= 1

  async def _adapter_sync_one(self, url, name, folder, version) -> bool:
    """Loads the adapter on one server; False when it failed like a dead server (then marked
    down)."""
    try:
      await self._adapter_one(url, name, folder, version, patience=0)
      return True
    except (ConnectionError,) + _RETRYABLE as e:
      self.pool.mark_down(url, f"adapter load failed: {type(e).__name__}: {e}")
      return False

  async def _adapter_one(self, url, name, folder, version, patience=None):
    """pause (abort) -> /load_lora_adapter -> relabel -> unload older rao-v* -> continue."""
    await self._control(url, "/pause_generation", {"mode": "abort"}, patience)
    try:
      body = {"lora_name": name, "lora_path": folder, "weight_version": version}
      status, data = await self._control(url, "/load_lora_adapter", body, patience)
      if status != 200 and "already loaded" in error_message(data):
        # A retried sync that reached the server before: load it afresh under its name.
        await self._control(url, "/unload_lora_adapter", {"lora_name": name}, patience)
        status, data = await self._control(url, "/load_lora_adapter", body, patience)
      if status != 200 or not (isinstance(data, dict) and data.get("success")):
        raise RuntimeError(f"{url}/load_lora_adapter of {folder} failed (HTTP {status}): "
                           f"{error_message(data) if isinstance(data, dict) else data}; the "
                           "server needs LoRA enabled with a rank and targets that fit the "
                           "adapter (rao_jax.rollout.serve: --max-lora-rank R; SGLang: "
                           "--enable-lora --max-lora-rank R --lora-target-modules ...).")
      if str(data.get("weight_version")) != version:
        # SGLang's load leaves the version label as it was: relabel, so samples carry it.
        await self._control(url, "/update_weight_version", {"new_version": version}, patience)
      for old in data.get("loaded_adapters") or {}:
        if old != name and str(old).startswith(ADAPTER_PREFIX):
          # SGLang keeps every loaded adapter resident: free the ones no request names now.
          status, out = await self._control(url, "/unload_lora_adapter", {"lora_name": old},
                                            patience)
          if status != 200:
            log.warning("%s/unload_lora_adapter %s failed (HTTP %s): %s", url, old, status,
                        error_message(out))
    finally:
      try:
        await self._control(url, "/continue_generation", patience=patience)
      except (ConnectionError,) + _RETRYABLE as e:
        log.info("%s/continue_generation failed: %s", url, e)

  async def get_weight_versions(self) -> dict[str, str | None]:
    """Each server's current weight version (None for a server that does not answer)."""
    out = {}
    for u in self.urls:
      try:
        out[u] = await self._server_version(u)
      except _RETRYABLE + (ValueError, KeyError):
        out[u] = None
    return out

  async def close(self) -> None:
    await self.pool.close()
    if self._http is not None and not self._http.closed:
      await self._http.close()
    self._http = None

