"""A client for one OpenAI-compatible completions server (vLLM, SGLang's /v1, llama.cpp,
rao_jax.rollout.serve's /v1 routes): the Engine for models a user serves elsewhere.

It shares the SGLang client's timeouts, retries, key and error handling
(`rao_jax.rollout.sglang_client`); it has no weight sync (evaluation only).
"""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp

from rao_jax.rollout.base import Engine, FinishReason, GenerateRequest, GenerateResult
from rao_jax.rollout.sglang_client import (_RETRYABLE, ClientConfig, ServerError, auth_headers,
                                           error_message)


class OpenAIEngine(Engine):
  """An Engine over an OpenAI-compatible ``/v1/completions`` server (vLLM, SGLang's OpenAI
  API, rao_jax.rollout.serve), for evaluation: prompts go as token ids; the output's ids come
  from the answer's ``token_ids`` when the server returns them (``return_token_ids``, vLLM's
  extension, which serve honours) and otherwise from re-encoding the text (a matched stop
  token is then appended). Re-encoded ids can differ from what the server sampled, so train
  only on rollouts from engines that return ids (SGLangEngine); ``logprobs`` are the
  server's when it returns one per id, else zeros.

  Args:
    url: the server's base URL (``http://host:port``, without ``/v1``).
    tokenizer: encodes returned text when the server gives no ids.
    model: the ``model`` field sent (default: the first id ``/v1/models`` lists).
    config: a ClientConfig (timeouts and retries).
    api_key: sent as ``Authorization: Bearer <api_key>`` (what OpenAI clients send for
      ``api_key=``); None sends none.
  """

  def __init__(self, url: str, tokenizer, model: str | None = None,
               config: ClientConfig | None = None, api_key: str | None = None, **kwargs):
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
      raise ValueError(f"OpenAIEngine url={url!r}: give an http(s):// base URL.")
    self.url = url.rstrip("/").removesuffix("/v1")
    self.tokenizer = tokenizer
    self.model = model
    self.config = config if config is not None else ClientConfig(**kwargs)
    self._ids_supported = True
    self._headers = auth_headers(api_key)
    self._http: aiohttp.ClientSession | None = None
    self._http_loop = None

  @property
  def weight_version(self) -> int | str:
    return f"openai:{self.model}"

  async def update_weights(self, model, version: int | str) -> None:
    """Refused: the OpenAI API has no weight-update route, so this engine cannot follow a
    learner (serving stale weights silently would train off-policy)."""
    raise RuntimeError("OpenAIEngine cannot load new weights (the OpenAI API has no route for "
                       "it); train with SGLangEngine or the embedded engine.")

  def _session(self) -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    if self._http is None or self._http.closed or self._http_loop is not loop:
      c = self.config
      self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
          total=c.request_timeout, sock_connect=c.connect_timeout), headers=self._headers)
      self._http_loop = loop
    return self._http

  async def _call(self, method: str, path: str, body=None):
    """One request with retries on connection errors and 5xx; returns (status, JSON)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + self.config.retry_timeout
    delay = self.config.backoff
    while True:
      try:
        async with self._session().request(method, self.url + path, json=body) as resp:
          text = await resp.text()
          try:
            data = json.loads(text) if text else None
          except ValueError:
            data = text
          if resp.status < 500 and resp.status != 429:
            return resp.status, data
          err = f"HTTP {resp.status}: {str(data)[:200]}"
      except _RETRYABLE as e:
        err = f"{type(e).__name__}: {e}"
      if loop.time() + delay > deadline:
        raise ConnectionError(f"{self.url}{path} failed until the retry timeout: {err}")
      await asyncio.sleep(delay * (0.5 + random.random()))
      delay = min(delay * 2, self.config.max_backoff)

  async def generate(self, request: GenerateRequest) -> GenerateResult:
    p = request.params
    prompt = [int(t) for t in request.prompt_ids]
    if not prompt:
      raise ValueError("GenerateRequest.prompt_ids is empty: give at least one token id.")
    budget, capped = p.max_new_tokens, False
    if request.context_limit is not None:
      room = request.context_limit - len(prompt)
      if room <= 0:
        return GenerateResult([], [], FinishReason.CONTEXT, self.weight_version, len(prompt),
                              message=f"the prompt ({len(prompt)} tokens) already fills the "
                                      f"context limit ({request.context_limit} tokens)")
      if room < budget:
        budget, capped = room, True
    if self.model is None:
      status, data = await self._call("GET", "/v1/models")
      try:
        self.model = data["data"][0]["id"]
      except (KeyError, IndexError, TypeError) as e:
        raise ServerError(f"{self.url}/v1/models listed no model (HTTP {status}): "
                          f"{error_message(data)}") from e
    body = {"model": self.model, "prompt": prompt, "max_tokens": int(budget),
            "temperature": float(p.temperature), "top_p": float(p.top_p), "logprobs": 0}
    if p.top_k != -1:
      body["top_k"] = int(p.top_k)
    if p.seed is not None:
      body["seed"] = int(p.seed)
    if p.min_new_tokens:                 # vLLM / SGLang's name on the OpenAI route
      body["min_tokens"] = int(p.min_new_tokens)
    if p.stop:
      body["stop"] = list(p.stop)
    if p.stop_token_ids is not None:     # exactly these ids (vLLM / SGLang extensions)
      body["stop_token_ids"] = [int(t) for t in p.stop_token_ids]
      body["ignore_eos"] = True
    for k, off in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("min_p", 0.0),
                   ("repetition_penalty", 1.0)):
      if getattr(p, k) != off:
        body[k] = float(getattr(p, k))
    if self._ids_supported:
      body["return_token_ids"] = True
    status, data = await self._call("POST", "/v1/completions", body)
    if status == 400 and self._ids_supported and "return_token_ids" in error_message(data):
      self._ids_supported = False          # a strict server: fall back to re-encoding text
      body.pop("return_token_ids")
      status, data = await self._call("POST", "/v1/completions", body)
    if status != 200:
      raise ValueError(f"{self.url}/v1/completions refused the request (HTTP {status}): "
                       f"{error_message(data)}")
    try:
      choice = data["choices"][0]
      text, reason = choice.get("text") or "", choice.get("finish_reason")
    except (KeyError, IndexError, TypeError) as e:
      raise ServerError(f"malformed /v1/completions answer: {str(data)[:300]}") from e
    ids = choice.get("token_ids")
    if ids is None:
      ids = list(self.tokenizer.encode(text))
      matched = choice.get("matched_stop", choice.get("stop_reason"))
      stops = (p.stop_token_ids if p.stop_token_ids is not None
               else tuple(getattr(self.tokenizer, "stop_token_ids", ())))
      if reason == "stop" and (isinstance(matched, int) or matched is None) and stops:
        ids.append(int(matched) if isinstance(matched, int) else int(stops[0]))
    ids = [int(t) for t in ids]
    lps = ((choice.get("logprobs") or {}).get("token_logprobs") or [])
    logps = [float(x) for x in lps] if len(lps) == len(ids) else [0.0] * len(ids)
    if reason == "stop":
      fr = FinishReason.STOP
    elif reason == "length":
      fr = FinishReason.CONTEXT if capped and len(ids) >= budget else FinishReason.LENGTH
    else:
      fr = FinishReason.ABORT
    return GenerateResult(ids, logps, fr, self.weight_version, len(prompt),
                          message="" if fr != FinishReason.ABORT else f"finish_reason={reason}")

  async def close(self) -> None:
    if self._http is not None and not self._http.closed:
      await self._http.close()
    self._http = None
