"""An SGLang-compatible and OpenAI-compatible HTTP server (aiohttp) over the embedded JAX engine.

    python -m rao_jax.rollout.serve --model smollm2-135m --port 30000
    python -m rao_jax.rollout.serve --checkpoint runs/x [--step N]    # a training run's weights

SGLang-native endpoints in the shapes of SGLang 0.5.6 (``SGLANG_API.md``): /generate (single,
batch, ``n`` samples, SSE streaming, stop strings, prompt and top log-probs, ``max_new_tokens:
0`` scoring, min-p and penalties), /health, /health_generate, /get_model_info,
/get_server_info, /flush_cache, /abort_request, /update_weights_from_disk,
/update_weight_version, /get_weight_version, /pause_generation, /continue_generation; and the
OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions (chat template applied,
streaming, ``n``, ``stop``, ``max_tokens``, ``logprobs``). Invalid requests, and fields this
server does not implement, get HTTP 400 naming the field: ``{"error": {"message": ...}}`` on
the SGLang endpoints, OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on /v1.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import time
import uuid
from typing import Any, Callable

from aiohttp import web

import rao_jax
from rao_jax.rollout.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.6"     # the release whose request/response shapes this server follows

_SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n",
    "sampling_seed", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "custom_params", "json_schema", "regex", "ebnf", "structural_tag",
    "stop_regex", "logit_bias"}
# Sampling fields SGLang has and this server does not implement: refused when set.
_UNSUPPORTED_SAMPLING = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex",
                         "logit_bias")
# GenerateReqInput fields this server does not implement: refused when set to a non-default.
_UNSUPPORTED_BODY = ("input_embeds", "image_data", "video_data", "audio_data", "lora_path",
                     "custom_logit_processor", "token_ids_logprob", "return_hidden_states",
                     "bootstrap_host", "bootstrap_port", "bootstrap_room")
_TOP_LOGPROBS_MAX = 20


class BadRequest(ValueError):
  """A request this server refuses (HTTP 400); ``param`` names the offending field."""

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.param = param


def _error(message: str, status: int = 400) -> web.Response:
  """SGLang's /generate error shape."""
  return web.json_response({"error": {"message": message}}, status=status)


def _openai_error(message: str, param: str | None = None, status: int = 400) -> web.Response:
  return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                      "param": param, "code": status}}, status=status)


def _num(sp: dict, key: str, default, kind=float, where: str = "sampling_params"):
  v = sp.get(key, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise BadRequest(f"{where}.{key}={v!r} must be a number.", key)
  if kind is int and float(v) != int(v):
    raise BadRequest(f"{where}.{key}={v!r} must be an integer.", key)
  return kind(v)


def _bool(d: dict, key: str, default: bool, where: str = "sampling_params") -> bool:
  v = d.get(key, default)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise BadRequest(f"{where}.{key}={v!r} must be true or false.", key)
  return v


def _stop_strings(v, where: str) -> tuple[str, ...]:
  if v is None:
    return ()
  if isinstance(v, str):
    v = [v]
  if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
    raise BadRequest(f"{where}={v!r} must be a string or a list of strings.", "stop")
  return tuple(s for s in dict.fromkeys(v) if s)


def _int_list(v, key: str) -> tuple[int, ...]:
  if v is None:
    return ()
  if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                        and t >= 0 for t in v):
    raise BadRequest(f"{key}={v!r} must be a list of token ids.", key)
  return tuple(v)


@dataclasses.dataclass
class _Sampling:
  """One request's sampling settings: the engine's SamplingParams plus what the server does."""
  params: SamplingParams | None      # None when max_new_tokens == 0 (scoring only)
  max_new: int
  n: int
  stop_strs: tuple[str, ...]
  stop_ids: tuple[int, ...]
  no_stop_trim: bool
  skip_special: bool


def parse_sampling(sp: Any, default_stop_ids: tuple[int, ...], has_tokenizer: bool,
                   preferred: dict | None = None) -> _Sampling:
  """Validates one SGLang ``sampling_params`` dict (0.5.6 names, defaults and ranges)."""
  if sp is None:
    sp = {}
  if not isinstance(sp, dict):
    raise BadRequest(f"sampling_params must be an object, got {type(sp).__name__}.",
                     "sampling_params")
  if preferred:
    sp = {**preferred, **sp}
  unknown = set(sp) - _SAMPLING_KEYS
  if unknown:
    raise BadRequest(f"unknown sampling_params: {sorted(unknown)}.", sorted(unknown)[0])
  for k in _UNSUPPORTED_SAMPLING:
    if sp.get(k) not in (None, {}, ""):
      raise BadRequest(f"sampling_params.{k} is not supported by this server (no constrained "
                       "decoding or logit bias).", k)
  temperature = _num(sp, "temperature", 1.0)
  top_p = _num(sp, "top_p", 1.0)
  top_k = _num(sp, "top_k", -1, int)
  max_new = _num(sp, "max_new_tokens", 128, int)
  min_p = _num(sp, "min_p", 0.0)
  n = _num(sp, "n", 1, int)
  freq = _num(sp, "frequency_penalty", 0.0)
  pres = _num(sp, "presence_penalty", 0.0)
  rep = _num(sp, "repetition_penalty", 1.0)
  min_new = _num(sp, "min_new_tokens", 0, int)
  if temperature < 0:
    raise BadRequest(f"temperature={temperature} must be >= 0 (0 = greedy).", "temperature")
  if temperature < 1e-6:
    temperature = 0.0      # SGLang treats temperatures below 1e-6 as greedy
  if not 0 < top_p <= 1:
    raise BadRequest(f"top_p={top_p} must be in (0, 1].", "top_p")
  if top_k == 0 or top_k < -1:
    raise BadRequest(f"top_k={top_k} must be -1 (all) or >= 1.", "top_k")
  if max_new < 0:
    raise BadRequest(f"max_new_tokens={max_new} must be >= 0 (0 = score the prompt only).",
                     "max_new_tokens")
  if not 0 <= min_p <= 1:
    raise BadRequest(f"min_p={min_p} must be in [0, 1].", "min_p")
  if n < 1:
    raise BadRequest(f"n={n} must be >= 1.", "n")
  for k, v in (("frequency_penalty", freq), ("presence_penalty", pres)):
    if not -2 <= v <= 2:
      raise BadRequest(f"{k}={v} must be in [-2, 2].", k)
  if not 0 < rep <= 2:
    raise BadRequest(f"repetition_penalty={rep} must be in (0, 2].", "repetition_penalty")
  if min_new:
    raise BadRequest("sampling_params.min_new_tokens > 0 is not supported by this server.",
                     "min_new_tokens")
  custom = sp.get("custom_params")
  if custom is not None and not isinstance(custom, dict):
    raise BadRequest(f"custom_params={custom!r} must be an object.", "custom_params")
  # custom_params only feed a custom_logit_processor (refused at the body level), so, as on
  # SGLang without one, they change nothing.
  stop_strs = _stop_strings(sp.get("stop"), "sampling_params.stop")
  if stop_strs and not has_tokenizer:
    raise BadRequest("stop strings need a tokenizer and this server has none; use "
                     "stop_token_ids.", "stop")
  stop_ids = _int_list(sp.get("stop_token_ids"), "stop_token_ids")
  ignore_eos = _bool(sp, "ignore_eos", False)
  stops = tuple(dict.fromkeys(stop_ids + (() if ignore_eos else default_stop_ids)))
  no_trim = _bool(sp, "no_stop_trim", False)
  skip_special = _bool(sp, "skip_special_tokens", True)
  _bool(sp, "spaces_between_special_tokens", True)
  seed = sp.get("sampling_seed")
  if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
    raise BadRequest(f"sampling_seed={seed!r} must be an int.", "sampling_seed")
  params = None
  if max_new > 0:
    try:
      params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                              max_new_tokens=max_new, stop_token_ids=stops, seed=seed,
                              min_p=min_p, frequency_penalty=freq, presence_penalty=pres,
                              repetition_penalty=rep)
    except ValueError as e:
      raise BadRequest(str(e)) from None
  return _Sampling(params=params, max_new=max_new, n=n, stop_strs=stop_strs, stop_ids=stops,
                   no_stop_trim=no_trim, skip_special=skip_special)


@dataclasses.dataclass
class _Item:
  """One generation the server runs (a batch item, or one of its n samples)."""
  prompt: list[int]
  sampling: _Sampling
  params: SamplingParams | None
  rid: str
  return_logprob: bool = False
  logprob_start_len: int = -1
  top_logprobs_num: int = 0
  text_in_logprobs: bool = False
  session_id: str | None = None
  temperature: float = 1.0


@dataclasses.dataclass
class _Done:
  """A finished item: everything the SGLang and OpenAI formatters need."""
  item: _Item
  ids: list[int]                   # every generated id (a matched stop token included)
  logps: list[float]
  finish: dict[str, Any]
  text: str | None                 # decoded, trimmed at the stop (unless no_stop_trim)
  cached: int
  version: str
  latency: float
  input_lps: list | None = None    # [logprob|None, id] per prompt position from logprob_start_len
  input_top: list | None = None
  output_top: list | None = None


def _per_item(v, n: int, key: str):
  if isinstance(v, list):
    if len(v) != n:
      raise BadRequest(f"{key} is a list of {len(v)}; give one value or one per item ({n}).",
                       key)
    return v
  return [v] * n


def parse_generate(body: Any, tokenizer, vocab_size: int, eos_ids: tuple[int, ...],
                   preferred: dict | None = None) -> tuple[list[_Item], bool]:
  """Validates a GenerateReqInput body. Returns (items, answer_with_a_list).

  A batch of B items with ``n`` samples each becomes B * n items, item-major (SGLang's order);
  a string ``rid`` becomes ``rid_0, rid_1, ...``, a list of rids gets ``_j`` suffixes per
  sample when n > 1; sample j > 0 of a seeded request uses ``sampling_seed + j`` so the n
  samples differ.
  """
  if not isinstance(body, dict):
    raise BadRequest("the body must be a JSON object (GenerateReqInput).")
  for k in _UNSUPPORTED_BODY:
    if body.get(k) not in (None, False, [], {}):
      raise BadRequest(f"{k} is not supported by this server.", k)
  text, ids = body.get("text"), body.get("input_ids")
  if (text is None) == (ids is None):
    raise BadRequest("give exactly one of `text` or `input_ids`.", "text")
  if ids is not None:
    if not isinstance(ids, list) or not ids:
      raise BadRequest("input_ids must be a non-empty list of ints (or a list of such lists).",
                       "input_ids")
    is_batch = isinstance(ids[0], list)
    rows = ids if is_batch else [ids]
    for r in rows:
      if not isinstance(r, list) or not r or not all(
          isinstance(t, int) and not isinstance(t, bool) for t in r):
        raise BadRequest("input_ids must be non-empty lists of ints.", "input_ids")
      if any(not 0 <= t < vocab_size for t in r):
        raise BadRequest(f"input_ids contain ids outside [0, {vocab_size}).", "input_ids")
  else:
    if tokenizer is None:
      raise BadRequest("this server has no tokenizer; send input_ids.", "text")
    is_batch = isinstance(text, list)
    texts = text if is_batch else [text]
    if not texts or not all(isinstance(t, str) for t in texts):
      raise BadRequest("text must be a string or a non-empty list of strings.", "text")
    rows = [tokenizer.encode(t) for t in texts]
    if any(not r for r in rows):
      raise BadRequest("text encodes to no tokens.", "text")
  B = len(rows)
  sps = body.get("sampling_params")
  if isinstance(sps, list):
    if not is_batch or len(sps) != B:
      raise BadRequest(f"sampling_params is a list of {len(sps)}; give one dict, or one per "
                       f"item ({B}).", "sampling_params")
  else:
    sps = [sps] * B
  samplings = [parse_sampling(sp, eos_ids, tokenizer is not None, preferred) for sp in sps]
  n = samplings[0].n
  if any(s.n != n for s in samplings):
    raise BadRequest("n must be the same for every item of a batch (SGLang's rule).", "n")
  total = B * n
  rids = body.get("rid")
  if rids is None:
    base = [uuid.uuid4().hex for _ in range(B)]
    rids = [f"{base[i]}_{j}" if n > 1 else base[i] for i in range(B) for j in range(n)]
  elif isinstance(rids, str):
    rids = [rids] if total == 1 else [f"{rids}_{k}" for k in range(total)]
  elif isinstance(rids, list):
    if len(rids) != B or not all(isinstance(r, str) for r in rids):
      raise BadRequest(f"rid must be a string or a list of {B} strings (one per item).", "rid")
    rids = [f"{rids[i]}_{j}" if n > 1 else rids[i] for i in range(B) for j in range(n)]
  else:
    raise BadRequest("rid must be a string or a list of strings.", "rid")
  if len(set(rids)) != total:
    raise BadRequest("rids must be unique.", "rid")
  ret_lp = _per_item(body.get("return_logprob", False), B, "return_logprob")
  start = _per_item(body.get("logprob_start_len", -1), B, "logprob_start_len")
  top_n = _per_item(body.get("top_logprobs_num", 0), B, "top_logprobs_num")
  text_lp = body.get("return_text_in_logprobs", False)
  if not isinstance(text_lp, bool):
    raise BadRequest("return_text_in_logprobs must be true or false.", "return_text_in_logprobs")
  if text_lp and tokenizer is None:
    raise BadRequest("return_text_in_logprobs needs a tokenizer; this server has none.",
                     "return_text_in_logprobs")
  session = body.get("session_params")
  sid = session.get("id") if isinstance(session, dict) else None
  items = []
  for i in range(B):
    rl = ret_lp[i] if ret_lp[i] is not None else False
    if not isinstance(rl, bool):
      raise BadRequest("return_logprob must be true or false.", "return_logprob")
    s0 = -1 if start[i] is None else start[i]
    if isinstance(s0, bool) or not isinstance(s0, int) or s0 < -1:
      raise BadRequest(f"logprob_start_len={s0!r} must be -1 (output only) or >= 0.",
                       "logprob_start_len")
    if rl and s0 >= len(rows[i]):
      raise BadRequest(f"logprob_start_len={s0} must be less than the input length "
                       f"({len(rows[i])}).", "logprob_start_len")
    k = 0 if top_n[i] is None else top_n[i]
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= _TOP_LOGPROBS_MAX:
      raise BadRequest(f"top_logprobs_num={k!r} must be an int in [0, {_TOP_LOGPROBS_MAX}].",
                       "top_logprobs_num")
    smp = samplings[i]
    for j in range(n):
      params = smp.params
      if params is not None and j and params.seed is not None:
        params = dataclasses.replace(params, seed=params.seed + j)
      items.append(_Item(prompt=list(rows[i]), sampling=smp, params=params,
                         rid=rids[i * n + j], return_logprob=rl, logprob_start_len=s0,
                         top_logprobs_num=k if rl else 0, text_in_logprobs=text_lp,
                         session_id=sid if total == 1 else None,
                         temperature=params.temperature if params else 1.0))
  return items, is_batch or n > 1


def finish_reason_json(r: GenerateResult, max_new: int, matched: Any = None) -> dict:
  if r.finish_reason == FinishReason.STOP:
    return {"type": "stop", "matched": matched if matched is not None else r.token_ids[-1]}
  if r.finish_reason == FinishReason.LENGTH:
    return {"type": "length", "length": max_new}
  if r.finish_reason == FinishReason.CONTEXT:
    # SGLang reports running into the context window as "length"; "reason" tells them apart.
    return {"type": "length", "length": len(r.token_ids), "reason": "context",
            "message": r.message}
  return {"type": "abort", "message": r.message or "aborted"}


def _held_back(text: str, stops: tuple[str, ...]) -> int:
  """How many trailing characters of a partial output a stream must not send yet: an
  incomplete UTF-8 character, or the start of a stop string that may complete later."""
  hold = 0
  for s in stops:
    for k in range(min(len(s) - 1, len(text)), 0, -1):
      if text.endswith(s[:k]):
        hold = max(hold, k)
        break
  if text.endswith("\ufffd"):
    hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
  return hold


class Server:
  """The aiohttp application state around one engine (an EmbeddedEngine)."""

  def __init__(self, engine, tokenizer=None, *, model_path: str = "",
               loader: Callable[[str], Any] | None = None, server_args: dict | None = None,
               served_model_name: str | None = None,
               preferred_sampling_params: dict | None = None):
    self.engine = engine
    self.tokenizer = tokenizer
    self.model_path = model_path
    self.served_model_name = served_model_name or model_path or "rao_jax"
    self.preferred = preferred_sampling_params
    self.loader = loader
    self.server_args = server_args or {}
    self.ready = True
    self.created = int(time.time())
    self.unpaused = asyncio.Event()
    self.unpaused.set()
    eos = []
    if tokenizer is not None:
      eos = [tokenizer.eos_token_id] + list(getattr(tokenizer, "stop_token_ids", []))
    self.eos_ids = tuple(dict.fromkeys(int(t) for t in eos if t is not None))
    self._update_lock = asyncio.Lock()

  def app(self) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 ** 2)
    r = app.router
    r.add_post("/generate", self.generate)
    for path, fn in (("/health", self.health), ("/health_generate", self.health_generate),
                     ("/get_model_info", self.model_info), ("/get_server_info", self.server_info),
                     ("/get_weight_version", self.weight_version),
                     ("/flush_cache", self.flush_cache), ("/v1/models", self.models)):
      r.add_get(path, fn)
      r.add_post(path, fn)
    r.add_post("/abort_request", self.abort_request)
    r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
    r.add_post("/update_weight_version", self.update_weight_version)
    r.add_post("/pause_generation", self.pause_generation)
    r.add_post("/continue_generation", self.continue_generation)
    r.add_post("/v1/completions", self.completions)
    r.add_post("/v1/chat/completions", self.chat_completions)
    return app

  async def _json(self, request: web.Request, allow_empty: bool = False):
    raw = await request.read()
    if not raw.strip():
      if allow_empty:
        return {}
      raise BadRequest("empty body; send a JSON object.")
    try:
      return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise BadRequest(f"malformed JSON: {e}") from None

  # ---- running one item ------------------------------------------------------------------------
  def _decode(self, ids, skip_special: bool = True) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

  def _visible_text(self, it: _Item, ids: list[int]) -> str | None:
    """A partial output's text as a stream may show it (see _held_back)."""
    if self.tokenizer is None:
      return None
    smp = it.sampling
    text = self._decode(ids, smp.skip_special)
    for s in smp.stop_strs:
      pos = text.find(s)
      if pos >= 0:
        return text[:pos] if not smp.no_stop_trim else text[:pos + len(s)]
    return text[:len(text) - _held_back(text, smp.stop_strs)]

  async def _run(self, it: _Item, progress: Callable[[list[int], list[float]], None] | None = None
                 ) -> _Done:
    """Generates (or, for max_new_tokens 0, only scores) one item."""
    t0 = time.perf_counter()
    smp = it.sampling
    loop = asyncio.get_running_loop()
    matched: list[str] = []
    if it.params is None:
      r = GenerateResult([], [], FinishReason.LENGTH, self.engine.weight_version,
                         len(it.prompt))
    else:
      tail = max((len(s) for s in smp.stop_strs), default=0) + 8

      def on_token(out, logps):   # on the engine's scheduler thread: quick, no blocking
        if progress is not None:
          snap = (list(out), list(logps))
          loop.call_soon_threadsafe(progress, *snap)
        if smp.stop_strs:
          piece = self._decode(out[-tail:], smp.skip_special)
          for s in smp.stop_strs:
            if s in piece:
              matched.append(s)
              return True
        return False
      r = await self.engine.generate(
          GenerateRequest(prompt_ids=it.prompt, params=it.params, session_id=it.session_id,
                          rid=it.rid), on_token=on_token)
    ids = list(r.token_ids)
    match = None
    if r.finish_reason == FinishReason.STOP:
      # A stop token takes precedence over a stop string ending on the same token (SGLang
      # checks the ids first).
      match = ids[-1] if ids and ids[-1] in smp.stop_ids else (matched[0] if matched else None)
    text = None
    if self.tokenizer is not None:
      shown = ids[:-1] if (isinstance(match, int) and not smp.no_stop_trim) else ids
      text = self._decode(shown, smp.skip_special)
      if isinstance(match, str) and not smp.no_stop_trim:
        pos = text.find(match)
        text = text[:pos] if pos >= 0 else text
    done = _Done(item=it, ids=ids, logps=[float(x) for x in r.logprobs],
                 finish=finish_reason_json(r, smp.max_new, match), text=text,
                 cached=r.cached_tokens, version=str(r.weight_version), latency=0.0)
    if it.return_logprob and (it.logprob_start_len >= 0 or it.top_logprobs_num > 0):
      await self._score(done)
    done.latency = time.perf_counter() - t0
    return done

  async def _score(self, d: _Done) -> None:
    """Prompt log-probs from logprob_start_len, and top-k alternatives, by one extra prefill."""
    it = d.item
    seq = it.prompt + d.ids
    lps, top = await asyncio.to_thread(self.engine.score, seq, temperature=it.temperature,
                                       top_k=it.top_logprobs_num)
    P = len(it.prompt)
    if it.logprob_start_len >= 0:
      d.input_lps = [[lps[p], it.prompt[p]] for p in range(it.logprob_start_len, P)]
      if it.top_logprobs_num:
        d.input_top = [top[p] if p else None for p in range(it.logprob_start_len, P)]
    if it.top_logprobs_num:
      d.output_top = [top[P + k] for k in range(len(d.ids))]

  # ---- SGLang /generate --------------------------------------------------------------------------
  def _lp_entry(self, lp, tok, it: _Item):
    text = self._decode([tok], False) if it.text_in_logprobs else None
    return [lp, int(tok), text]

  def _top_entry(self, alts, it: _Item):
    if alts is None:
      return None
    return [self._lp_entry(lp, t, it) for lp, t in alts]

  def _sglang_json(self, d: _Done, index: int | None = None) -> dict:
    it = d.item
    meta = {
        "id": it.rid, "finish_reason": d.finish, "prompt_tokens": len(it.prompt),
        "weight_version": d.version, "completion_tokens": len(d.ids),
        "cached_tokens": d.cached, "e2e_latency": d.latency,
    }
    if it.return_logprob:
      meta["input_token_logprobs"] = [self._lp_entry(lp, t, it) for lp, t in (d.input_lps or [])]
      meta["output_token_logprobs"] = [self._lp_entry(lp, t, it) for lp, t in zip(d.logps, d.ids)]
      if it.top_logprobs_num:
        meta["input_top_logprobs"] = [self._top_entry(a, it) for a in (d.input_top or [])]
        meta["output_top_logprobs"] = [self._top_entry(a, it) for a in (d.output_top or [])]
    # SGLang trims only the text at a stop: output_ids keep every generated id, matching
    # completion_tokens and output_token_logprobs.
    out = {"output_ids": d.ids, "meta_info": meta}
    if d.text is not None:
      out = {"text": d.text, **out}
    if index is not None:
      out["index"] = index
    return out

  def _sglang_partial(self, it: _Item, ids, logps, index: int | None) -> dict:
    meta = {"id": it.rid, "finish_reason": None, "prompt_tokens": len(it.prompt),
            "weight_version": str(self.engine.weight_version), "completion_tokens": len(ids),
            "cached_tokens": 0}
    if it.return_logprob:
      meta["input_token_logprobs"] = []
      meta["output_token_logprobs"] = [self._lp_entry(lp, t, it) for lp, t in zip(logps, ids)]
    out = {"output_ids": list(ids), "meta_info": meta}
    text = self._visible_text(it, ids)
    if text is not None:
      out = {"text": text, **out}
    if index is not None:
      out["index"] = index
    return out

  async def generate(self, request: web.Request) -> web.StreamResponse:
    try:
      body = await self._json(request)
      items, as_list = parse_generate(body, self.tokenizer, self.engine.vocab_size,
                                      self.eos_ids, self.preferred)
      stream = body.get("stream", False)
      if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false.", "stream")
    except BadRequest as e:
      return _error(str(e))
    # Like SGLang, requests that arrive while paused wait here, outside the engine, so a
    # /flush_cache during a weight update sees an idle engine.
    await self.unpaused.wait()
    if stream:
      return await self._stream(
          request, items,
          partial=lambda k, ids, lps: [self._sglang_partial(items[k], ids, lps,
                                                            k if as_list else None)],
          final=lambda k, d: [self._sglang_json(d, k if as_list else None)],
          error=lambda msg: {"error": {"message": msg}})
    try:
      done = await asyncio.gather(*[self._run(it) for it in items])
    except ValueError as e:
      return _error(str(e))
    out = [self._sglang_json(d) for d in done]
    return web.json_response(out if as_list else out[0])

  async def _stream(self, request, items, partial, final, error, tail=()) -> web.StreamResponse:
    """Server-Sent Events: ``data: {json}`` per update, ``data: [DONE]`` at the end.

    ``partial(k, ids, logps)`` / ``final(k, done)`` turn item k's progress / result into the
    list of chunks to send (possibly empty); ``tail()`` gives chunks after all items.
    Updates that pile up while a chunk is written are merged (the newest per item is sent).
    """
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    queue: asyncio.Queue = asyncio.Queue()

    async def run(k, it):
      try:
        d = await self._run(it, progress=lambda ids, lps: queue.put_nowait((k, "part", ids, lps)))
        queue.put_nowait((k, "done", d, None))
      except ValueError as e:
        queue.put_nowait((k, "error", str(e), None))
    tasks = [asyncio.create_task(run(k, it)) for k, it in enumerate(items)]
    left = len(items)

    async def send(obj):
      await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
    try:
      while left:
        events = [await queue.get()]
        while not queue.empty():
          events.append(queue.get_nowait())
        latest = {}
        for ev in events:
          if ev[1] == "part":
            latest[ev[0]] = ev
          else:
            latest.pop(ev[0], None)
            if ev[1] == "error":
              await send(error(ev[2]))
            else:
              for chunk in final(ev[0], ev[2]) or []:
                await send(chunk)
            left -= 1
        for k, ev in latest.items():
          for chunk in partial(k, ev[2], ev[3]) or []:
            await send(chunk)
      for chunk in (tail() if tail else []):
        await send(chunk)
      await resp.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
      for t in tasks:      # the client went away: abort what it no longer reads
        t.cancel()
      raise
    return resp

  # ---- OpenAI-compatible ---------------------------------------------------------------------------
  async def models(self, request):
    return web.json_response({"object": "list", "data": [{
        "id": self.served_model_name, "object": "model", "created": self.created,
        "owned_by": "rao_jax", "root": self.model_path,
        "max_model_len": int(self.engine.config.capacity)}]})

  def _openai_sampling(self, body: dict, chat: bool) -> tuple[dict, int]:
    """An OpenAI request's sampling fields as SGLang sampling_params (plus n)."""
    known = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens",
             "temperature", "top_p", "n", "stream", "stream_options", "stop", "logprobs",
             "top_logprobs", "echo", "presence_penalty", "frequency_penalty", "seed", "user",
             "best_of", "logit_bias", "suffix", "response_format", "tools", "tool_choice",
             "parallel_tool_calls", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
             "ignore_eos", "skip_special_tokens", "no_stop_trim", "rid", "metadata", "store",
             "service_tier", "reasoning_effort", "modalities", "audio", "prediction",
             "chat_template_kwargs", "separate_reasoning", "continue_final_message",
             "return_token_ids"}
    unknown = sorted(set(body) - known)
    if unknown:
      raise BadRequest(f"unknown fields: {unknown}.", unknown[0])
    for k in ("logit_bias", "suffix", "tools", "audio", "prediction", "modalities",
              "reasoning_effort"):
      if body.get(k) not in (None, [], {}, ""):
        raise BadRequest(f"{k} is not supported by this server.", k)
    if body.get("tool_choice") not in (None, "none"):
      raise BadRequest("tool_choice is not supported by this server (no tools).", "tool_choice")
    rf = body.get("response_format")
    if rf not in (None, {"type": "text"}):
      raise BadRequest("response_format other than {\"type\": \"text\"} is not supported by "
                       "this server.", "response_format")
    n = _num(body, "n", 1, int, "request")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
      raise BadRequest("best_of != n is not supported by this server.", "best_of")
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
      max_tokens = body.get("max_tokens")
    if max_tokens is None:
      max_tokens = None if chat else 16         # OpenAI's completions default
    sp: dict[str, Any] = {"n": n}
    if max_tokens is not None:
      sp["max_new_tokens"] = max_tokens
    else:
      sp["max_new_tokens"] = int(self.engine.config.capacity)   # chat: up to the context end
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                     ("min_p", "min_p"), ("presence_penalty", "presence_penalty"),
                     ("frequency_penalty", "frequency_penalty"),
                     ("repetition_penalty", "repetition_penalty"), ("seed", "sampling_seed"),
                     ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"),
                     ("skip_special_tokens", "skip_special_tokens"),
                     ("no_stop_trim", "no_stop_trim")):
      if body.get(src) is not None:
        sp[dst] = body[src]
    if body.get("stop") is not None:
      stops = _stop_strings(body["stop"], "stop")
      sp["stop"] = list(stops)
    return sp, n

  def _openai_items(self, prompts: list[list[int]], sp: dict, n: int, logprobs: bool,
                    top: int, echo: bool) -> list[_Item]:
    smp = parse_sampling(sp, self.eos_ids, self.tokenizer is not None, self.preferred)
    base = uuid.uuid4().hex
    items = []
    for i, p in enumerate(prompts):
      if not p:
        raise BadRequest("the prompt encodes to no tokens.", "prompt")
      if any(not 0 <= t < self.engine.vocab_size for t in p):
        raise BadRequest(f"prompt token ids outside [0, {self.engine.vocab_size}).", "prompt")
      for j in range(n):
        params = smp.params
        if params is not None and j and params.seed is not None:
          params = dataclasses.replace(params, seed=params.seed + j)
        items.append(_Item(prompt=list(p), sampling=smp, params=params,
                           rid=f"{base}_{i * n + j}", return_logprob=logprobs or echo,
                           logprob_start_len=0 if echo and logprobs else -1,
                           top_logprobs_num=top, temperature=params.temperature if params
                           else 1.0))
    return items

  def _token_str(self, t: int) -> str:
    return self._decode([t], False) if self.tokenizer is not None else str(t)

  def _usage(self, done: list[_Done], n_prompts_tokens: int) -> dict:
    c = sum(len(d.ids) for d in done)
    return {"prompt_tokens": n_prompts_tokens, "completion_tokens": c,
            "total_tokens": n_prompts_tokens + c}

  @staticmethod
  def _oa_finish(d: _Done) -> str:
    kind = d.finish.get("type")
    return "stop" if kind == "stop" else "length" if kind == "length" else "abort"

  def _completion_logprobs(self, d: _Done, echo: bool, top: int) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    toks, lps, tops = [], [], []
    if echo:
      prompt_top = d.input_top or [None] * len(d.input_lps or [])
      for (lp, t), alts in zip(d.input_lps or [], prompt_top):
        toks.append(t)
        lps.append(lp)
        tops.append(alts if top else None)
    for k, t in enumerate(d.ids):
      toks.append(t)
      lps.append(d.logps[k])
      tops.append(d.output_top[k] if top and d.output_top else None)
    strs = [self._token_str(t) for t in toks]
    offsets, pos = [], 0
    for s in strs:
      offsets.append(pos)
      pos += len(s)
    return {"tokens": strs, "token_logprobs": lps, "text_offset": offsets,
            "top_logprobs": [None if a is None else {self._token_str(t): lp for lp, t in a}
                             for a in tops]}

  async def completions(self, request: web.Request) -> web.StreamResponse:
    try:
      body = await self._json(request)
      if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object.")
      prompt = body.get("prompt")
      if isinstance(prompt, str):
        prompts = [prompt]
      elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
      elif isinstance(prompt, list) and prompt and all(
          isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
      elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = prompt
      else:
        raise BadRequest("prompt must be a string, a list of strings, a list of token ids or "
                         "a list of such lists.", "prompt")
      if any(isinstance(p, str) for p in prompts):
        if self.tokenizer is None:
          raise BadRequest("this server has no tokenizer; send token ids as the prompt.",
                           "prompt")
        ids = [self.tokenizer.encode(p) for p in prompts]
      else:
        ids = [list(p) for p in prompts]
      sp, n = self._openai_sampling(body, chat=False)
      lp = body.get("logprobs")
      if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int)
                             or not 0 <= lp <= _TOP_LOGPROBS_MAX):
        raise BadRequest(f"logprobs={lp!r} must be an int in [0, {_TOP_LOGPROBS_MAX}].",
                         "logprobs")
      echo = _bool(body, "echo", False, "request")
      want_ids = _bool(body, "return_token_ids", False, "request")
      stream = _bool(body, "stream", False, "request")
      include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
      items = self._openai_items(ids, sp, n, lp is not None, lp or 0, echo)
    except BadRequest as e:
      return _openai_error(str(e), e.param)
    await self.unpaused.wait()
    rid = f"cmpl-{uuid.uuid4().hex}"
    model = body.get("model") or self.served_model_name
    prompt_tokens = sum(len(p) for p in ids)
    echo_text = [self._decode(p) if self.tokenizer is not None else "" for p in ids]

    def choice(k: int, d: _Done) -> dict:
      text = d.text or ""
      if echo:
        text = echo_text[k // n] + text
      out = {"index": k, "text": text,
             "logprobs": self._completion_logprobs(d, echo, lp or 0) if lp is not None
             else None,
             "finish_reason": self._oa_finish(d), "matched_stop": d.finish.get("matched")}
      if want_ids:     # vLLM's extension: the generated ids (stop token included), untrimmed
        out["token_ids"] = d.ids
      return out

    def envelope(choices, **extra):
      return {"id": rid, "object": "text_completion", "created": int(time.time()),
              "model": model, "choices": choices, **extra}
    if not stream:
      try:
        done = await asyncio.gather(*[self._run(it) for it in items])
      except ValueError as e:
        return _openai_error(str(e))
      return web.json_response(envelope(
          [choice(k, d) for k, d in enumerate(done)], usage=self._usage(done, prompt_tokens * n),
          metadata={"weight_version": done[0].version if done else None}))
    sent = [""] * len(items)      # text already streamed per choice
    results: list[_Done] = []

    def partial(k, ids_, lps_):
      full = (echo_text[k // n] if echo else "") + (self._visible_text(items[k], ids_) or "")
      delta = full[len(sent[k]):]
      if not delta:
        return []
      sent[k] = full
      return [envelope([{"index": k, "text": delta, "logprobs": None, "finish_reason": None}])]

    def final(k, d):
      results.append(d)
      full = choice(k, d)["text"]
      delta = full[len(sent[k]):] if full.startswith(sent[k]) else full
      c = {"index": k, "text": delta, "finish_reason": self._oa_finish(d),
           "matched_stop": d.finish.get("matched"),
           "logprobs": self._completion_logprobs(d, echo, lp or 0) if lp is not None else None}
      return [envelope([c])]

    def tail():
      if include_usage:
        return [envelope([], usage=self._usage(results, prompt_tokens * n))]
      return []
    return await self._stream(request, items, partial, final,
                              lambda msg: {"error": {"message": msg, "code": 400}}, tail)

  def _chat_prompt(self, body: dict) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
      raise BadRequest("messages must be a non-empty list of {role, content} objects.",
                       "messages")
    clean = []
    for m in msgs:
      if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest("each message needs a string `role`.", "messages")
      content = m.get("content")
      if isinstance(content, list):
        parts = []
        for p in content:
          if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(
              p.get("text"), str):
            raise BadRequest("only text content parts ({\"type\": \"text\", \"text\": ...}) are "
                             "supported by this server.", "messages")
          parts.append(p["text"])
        content = "".join(parts)
      if content is None:
        content = ""
      if not isinstance(content, str):
        raise BadRequest("message content must be a string or a list of text parts.",
                         "messages")
      if m.get("tool_calls"):
        raise BadRequest("tool_calls in messages are not supported by this server.", "messages")
      clean.append({"role": m["role"], "content": content})
    if self.tokenizer is None:
      raise BadRequest("this server has no tokenizer, so no chat template; use /generate with "
                       "input_ids.", "messages")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
      raise BadRequest("chat_template_kwargs must be an object.", "chat_template_kwargs")
    try:
      return self.tokenizer.apply_chat_template(clean, add_generation_prompt=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template error is the caller's input problem
      raise BadRequest(f"the chat template failed on these messages: {e}", "messages") from None

  def _chat_logprobs(self, d: _Done, top: int) -> dict:
    content = []
    for k, (t, lp) in enumerate(zip(d.ids, d.logps)):
      s = self._token_str(t)
      alts = (d.output_top[k] if top and d.output_top else [])[:top]
      content.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                      "top_logprobs": [{"token": self._token_str(a), "logprob": alp,
                                        "bytes": list(self._token_str(a).encode("utf-8"))}
                                       for alp, a in alts]})
    return {"content": content}

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    try:
      body = await self._json(request)
      if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object.")
      prompt = self._chat_prompt(body)
      sp, n = self._openai_sampling(body, chat=True)
      want_lp = _bool(body, "logprobs", False, "request")
      top = body.get("top_logprobs")
      if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
          raise BadRequest(f"top_logprobs={top!r} must be an int in [0, 20].", "top_logprobs")
        if top and not want_lp:
          raise BadRequest("top_logprobs needs logprobs: true.", "top_logprobs")
      if "echo" in body:
        raise BadRequest("echo is a /v1/completions field.", "echo")
      stream = _bool(body, "stream", False, "request")
      include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
      items = self._openai_items([prompt], sp, n, want_lp, top or 0, False)
    except BadRequest as e:
      return _openai_error(str(e), e.param)
    await self.unpaused.wait()
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    model = body.get("model") or self.served_model_name

    def envelope(choices, obj="chat.completion", **extra):
      return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
              "choices": choices, **extra}
    if not stream:
      try:
        done = await asyncio.gather(*[self._run(it) for it in items])
      except ValueError as e:
        return _openai_error(str(e))
      choices = [{"index": k, "message": {"role": "assistant", "content": d.text or ""},
                  "logprobs": self._chat_logprobs(d, top or 0) if want_lp else None,
                  "finish_reason": self._oa_finish(d), "matched_stop": d.finish.get("matched")}
                 for k, d in enumerate(done)]
      return web.json_response(envelope(choices, usage=self._usage(done, len(prompt) * n),
                                        metadata={"weight_version": done[0].version}))
    sent: dict[int, str] = {}
    results: list[_Done] = []

    def chunk(k, delta, finish=None, logprobs=None):
      return envelope([{"index": k, "delta": delta, "logprobs": logprobs,
                        "finish_reason": finish}], obj="chat.completion.chunk")

    def partial(k, ids_, lps_):
      out = []
      if k not in sent:
        sent[k] = ""
        out.append(chunk(k, {"role": "assistant", "content": ""}))
      text = self._visible_text(items[k], ids_) or ""
      if len(text) > len(sent[k]):
        out.append(chunk(k, {"content": text[len(sent[k]):]}))
        sent[k] = text
      return out

    def final(k, d):
      results.append(d)
      out = []
      if k not in sent:
        sent[k] = ""
        out.append(chunk(k, {"role": "assistant", "content": ""}))
      text = d.text or ""
      rest = text[len(sent[k]):] if text.startswith(sent[k]) else text
      out.append(chunk(k, {"content": rest} if rest else {}, self._oa_finish(d),
                       self._chat_logprobs(d, top or 0) if want_lp else None))
      return out

    def tail():
      if include_usage:
        return [envelope([], obj="chat.completion.chunk",
                         usage=self._usage(results, len(prompt) * n))]
      return []

    return await self._stream(request, items, partial, final,
                              lambda msg: {"error": {"message": msg, "code": 400}}, tail)

  # ---- control -----------------------------------------------------------------------------------
  async def health(self, request):
    return web.Response(status=200 if self.ready else 503)

  async def health_generate(self, request):
    if not self.ready:
      return web.Response(status=503)
    if not self.unpaused.is_set() or self.engine.num_running:
      return web.Response(status=200)     # busy serving: healthy (as SGLang answers)
    try:
      await asyncio.wait_for(self.engine.generate(GenerateRequest(
          [0], SamplingParams(temperature=0.0, max_new_tokens=1),
          rid=f"HEALTH_CHECK_{time.time()}")), timeout=20)
    except (asyncio.TimeoutError, RuntimeError):
      return web.Response(status=503)
    return web.Response(status=200)

  async def model_info(self, request):
    return web.json_response({
        "model_path": self.model_path, "tokenizer_path": self.model_path,
        "is_generation": True,
        "preferred_sampling_params": (json.dumps(self.preferred) if self.preferred else None),
        "weight_version": str(self.engine.weight_version),
        "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": self.server_args.get("model_type"),
        "architectures": self.server_args.get("architectures")})

  async def server_info(self, request):
    return web.json_response({
        **self.server_args, "model_path": self.model_path, "tokenizer_path": self.model_path,
        "served_model_name": self.served_model_name,
        "version": f"rao_jax-{rao_jax.__version__}", "sglang_api_version": SGLANG_VERSION,
        "engine": "rao_jax.embedded", "weight_version": str(self.engine.weight_version),
        # Seeded requests reproduce whatever else shares their batch (sampling.gumbel_noise).
        "sampling_seed_honoured": True,
        "context_length": int(self.engine.config.capacity),
        "engine_config": dataclasses.asdict(self.engine.config)})

  async def weight_version(self, request):
    return web.json_response({"weight_version": str(self.engine.weight_version)})

  async def update_weight_version(self, request):
    try:
      body = await self._json(request)
      new = body.get("new_version") if isinstance(body, dict) else None
      if not isinstance(new, str) or not new:
        raise BadRequest("new_version (a non-empty string) is required.", "new_version")
      abort = _bool(body, "abort_all_requests", False, "request")
    except BadRequest as e:
      return _error(str(e))
    if abort:
      self.engine.abort_all("aborted by /update_weight_version")
    await asyncio.to_thread(self.engine.set_weight_version, new)
    return web.json_response({"success": True, "new_version": new,
                              "message": f"Weight version updated to {new}"})

  async def flush_cache(self, request):
    ok = await asyncio.to_thread(self.engine.flush_cache)
    if ok:
      return web.Response(text="Cache flushed.\n", status=200)
    return web.Response(text="Cache not flushed: requests are running.\n", status=400)

  async def abort_request(self, request):
    try:
      body = await self._json(request, allow_empty=True)
    except BadRequest as e:
      return _error(str(e))
    if body.get("abort_all"):
      self.engine.abort_all("aborted by /abort_request")
    elif isinstance(body.get("rid"), str):
      await self.engine.abort(body["rid"])
    else:
      return _error("give `rid` (a string) or `abort_all: true`.")
    return web.Response(status=200)

  async def pause_generation(self, request):
    try:
      body = await self._json(request, allow_empty=True)
    except BadRequest as e:
      return _error(str(e))
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
      return _error(f"mode={mode!r}: use 'abort', 'retract' or 'in_place'.")
    self.unpaused.clear()
    if mode == "abort":
      self.engine.abort_all("aborted by /pause_generation")
    else:
      self.engine.pause()
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

  async def continue_generation(self, request):
    self.engine.resume()
    self.unpaused.set()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

  async def update_weights_from_disk(self, request):
    try:
      body = await self._json(request)
      path = body.get("model_path")
      if not isinstance(path, str) or not path:
        raise BadRequest("model_path (a checkpoint folder) is required.")
    except BadRequest as e:
      return _error(str(e))
    if self.loader is None:
      return web.json_response({"success": False, "message": "this server cannot load weights",
                                "num_paused_requests": 0}, status=400)
    version = body.get("weight_version")
    async with self._update_lock:
      try:
        model = await asyncio.to_thread(self.loader, path)
        new_version = version if version is not None else self.engine.weight_version
        await asyncio.to_thread(self.engine.update_weights, model, str(new_version))
      except Exception as e:  # noqa: BLE001 - reported to the caller, the server goes on
        log.exception("update_weights_from_disk failed")
        return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}",
                                  "num_paused_requests": 0}, status=400)
    self.model_path = path
    msg = "Succeeded to update model weights."
    if version is not None:
      msg += f" Weight version updated to {version}."
    return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})


def build_server(argv=None) -> tuple[Server, argparse.Namespace]:
  """Parses serve's command line and loads the model: (Server, args), not yet listening."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  src = ap.add_mutually_exclusive_group()
  src.add_argument("--model", default=None,
                   help="registry name, .gguf file or HF folder (load_pretrained); default "
                        "smollm2-135m")
  src.add_argument("--checkpoint", default=None,
                   help="a training run directory (has config.json and checkpoints/): serves "
                        "its newest checkpoint (or --step)")
  ap.add_argument("--step", type=int, default=None, help="checkpoint step with --checkpoint")
  ap.add_argument("--tiny", action="store_true",
                  help="serve a tiny random model with --model's tokenizer (tests, smoke runs)")
  ap.add_argument("--host", default="127.0.0.1")
  ap.add_argument("--port", type=int, default=30000)
  ap.add_argument("--dtype", default=None, help="activation/param dtype (default per backend)")
  ap.add_argument("--num-slots", type=int, default=16)
  ap.add_argument("--max-len", type=int, default=2048)
  ap.add_argument("--min-cache-len", type=int, default=128)
  ap.add_argument("--chunk-sizes", default="16,64,256")
  ap.add_argument("--prefill-rows", default="1,4")
  ap.add_argument("--warmup", action="store_true", help="compile every shape before serving")
  ap.add_argument("--weight-version", default="default",
                  help="reported until a weight update sets another (SGLang's default)")
  ap.add_argument("--served-model-name", default=None,
                  help="the model id /v1/models reports (default: --model or --checkpoint)")
  ap.add_argument("--preferred-sampling-params", default=None,
                  help="JSON object of sampling_params defaults (SGLang's flag)")
  args = ap.parse_args(argv)
  preferred = None
  if args.preferred_sampling_params:
    try:
      preferred = json.loads(args.preferred_sampling_params)
      parse_sampling(preferred, (), True)
    except (ValueError, BadRequest) as e:
      ap.error(f"--preferred-sampling-params: {e}")

  from flax import nnx
  from rao_jax.model import Transformer, load_pretrained
  from rao_jax.model.weights import load_model
  from rao_jax.rollout.embedded import EmbeddedEngine

  model_name = args.model or "smollm2-135m"
  if args.checkpoint:
    from rao_jax import evaluation
    model, tokenizer, step, _ = evaluation.load_checkpoint(args.checkpoint, args.step)
    model_path = f"{args.checkpoint}@step{step}"
  elif args.tiny:
    from rao_jax.testing import tiny_config
    model, tokenizer = Transformer(tiny_config(), rngs=nnx.Rngs(0)), None
    try:
      from rao_jax.model.tokenizer import Tokenizer
      from rao_jax.model.weights import resolve_model_path
      tokenizer = Tokenizer.from_gguf(resolve_model_path(model_name))
    except Exception as e:  # noqa: BLE001 - a tiny test model can serve input_ids only
      log.warning("no tokenizer for the tiny model (%s); input_ids only", e)
    model_path = model_name
  else:
    model, tokenizer = load_pretrained(model_name, dtype=args.dtype)
    model_path = model_name

  def ints(s):
    return tuple(int(x) for x in s.split(","))
  stops = ()
  if tokenizer is not None:
    stops = tuple(dict.fromkeys([t for t in [tokenizer.eos_token_id,
                                             *tokenizer.stop_token_ids] if t is not None]))
  engine = EmbeddedEngine(model, num_slots=args.num_slots, max_len=args.max_len,
                          min_cache_len=args.min_cache_len, chunk_sizes=ints(args.chunk_sizes),
                          prefill_rows=ints(args.prefill_rows),
                          weight_version=args.weight_version, default_stop_token_ids=stops)
  if args.warmup:
    log.info("warm-up compiled every shape in %.1f s", engine.warmup())
  loader = (lambda path: load_model(path, dtype=args.dtype))
  info = dict(vars(args))
  cfg = getattr(model, "cfg", None)
  info["model_type"] = getattr(cfg, "model_type", None) if cfg is not None else None
  server = Server(engine, tokenizer, model_path=model_path, loader=loader, server_args=info,
                  served_model_name=args.served_model_name or args.checkpoint or model_name,
                  preferred_sampling_params=preferred)
  return server, args


def main(argv=None):
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
  server, args = build_server(argv)
  print(f"rao_jax rollout server on http://{args.host}:{args.port}", file=sys.stderr,
        flush=True)
  web.run_app(server.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
  main()
