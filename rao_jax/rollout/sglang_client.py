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

Weight sync (``Engine.update_weights``, ``update_adapter``, ``update_weights_from_disk``) and the
re-sync of a returning server are in ``rao_jax.rollout.sglang_sync`` (the ``WeightSync`` half
of the engine): pause -> flush -> update_weights_from_disk -> continue on every server, LoRA
adapters by /load_lora_adapter, and the server's weight version read from ``/model_info``
(current SGLang), ``/get_model_info`` or ``/get_weight_version`` (0.5.x).

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
import json
import logging
import random
import time
import uuid
from typing import Any, Sequence

import aiohttp

from rao_jax.rollout.base import Engine, FinishReason, GenerateRequest, GenerateResult
from rao_jax.rollout.server_pool import ServerPool
# The shared pieces keep their old import path (the OpenAI client, the serve door, the
# entry points and tests import them from here).
from rao_jax.rollout.sglang_http import (_RETRYABLE, API_KEY_ENV,  # noqa: F401
                                         ClientConfig, ServerError, api_key_from_env,
                                         auth_headers, error_message, honours_seed)
from rao_jax.rollout.sglang_sync import ADAPTER_PREFIX, WeightSync  # noqa: F401

log = logging.getLogger(__name__)


class SGLangEngine(WeightSync, Engine):
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

  # ---- state ----------------------------------------------------------------------------------
  def check_available(self) -> None:
    """Raises EngineUnavailableError when every server has been down past retry_timeout."""
    err = self.pool.unavailable_error()
    if err is not None:
      raise err

  def health_metrics(self) -> dict[str, float]:
    return self.pool.metrics()

  async def close(self) -> None:
    await self.pool.close()
    if self._http is not None and not self._http.closed:
      await self._http.close()
    self._http = None
