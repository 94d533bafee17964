"""An SGLang-compatible HTTP server (aiohttp) over the embedded JAX engine.

    python -m rao_jax.rollout.serve --model smollm2-135m --port 30000

Speaks the SGLang-native endpoints of ``SGLANG_API.md`` (/generate single and batch, /health,
/health_generate, /get_model_info, /get_server_info, /flush_cache, /abort_request,
/update_weights_from_disk, /get_weight_version, /pause_generation, /continue_generation), so
rollout workers can run as separate processes or hosts behind ``SGLangEngine``. Requests SGLang
would refuse get HTTP 400 with ``{"error": {"message": ...}}``.
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

_SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n",
    "sampling_seed", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens"}


class BadRequest(ValueError):
  """A request SGLang would refuse (HTTP 400)."""


def _error(message: str, status: int = 400) -> web.Response:
  return web.json_response({"error": {"message": message}}, status=status)


@dataclasses.dataclass
class _Item:
  prompt: list[int]
  params: SamplingParams
  rid: str
  return_logprob: bool
  no_stop_trim: bool
  session_id: str | None


def _num(sp: dict, key: str, default, kind=float):
  v = sp.get(key, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise BadRequest(f"sampling_params.{key}={v!r} must be a number.")
  if kind is int and float(v) != int(v):
    raise BadRequest(f"sampling_params.{key}={v!r} must be an integer.")
  return kind(v)


def _sampling(sp: Any, stop_ids_default: tuple[int, ...]) -> tuple[SamplingParams, bool]:
  if sp is None:
    sp = {}
  if not isinstance(sp, dict):
    raise BadRequest(f"sampling_params must be an object, got {type(sp).__name__}.")
  unknown = set(sp) - _SAMPLING_KEYS
  if unknown:
    raise BadRequest(f"unknown sampling_params: {sorted(unknown)}.")
  temperature = _num(sp, "temperature", 1.0)
  top_p = _num(sp, "top_p", 1.0)
  top_k = _num(sp, "top_k", -1, int)
  max_new = _num(sp, "max_new_tokens", 128, int)
  min_p = _num(sp, "min_p", 0.0)
  n = _num(sp, "n", 1, int)
  if temperature < 0:
    raise BadRequest(f"temperature={temperature} must be >= 0 (0 = greedy).")
  if not 0 < top_p <= 1:
    raise BadRequest(f"top_p={top_p} must be in (0, 1].")
  if top_k == 0 or top_k < -1:
    raise BadRequest(f"top_k={top_k} must be -1 (all) or >= 1.")
  if max_new < 1:
    raise BadRequest(f"max_new_tokens={max_new} must be >= 1 on this server.")
  if not 0 <= min_p <= 1:
    raise BadRequest(f"min_p={min_p} must be in [0, 1].")
  if min_p > 0:
    raise BadRequest("min_p > 0 is not supported by this server; use top_p / top_k.")
  for k in ("frequency_penalty", "presence_penalty", "min_new_tokens"):
    if sp.get(k) not in (None, 0, 0.0):
      raise BadRequest(f"sampling_params.{k} is not supported by this server.")
  if sp.get("repetition_penalty") not in (None, 1, 1.0):
    raise BadRequest("sampling_params.repetition_penalty is not supported by this server.")
  if n != 1:
    raise BadRequest(f"n={n}: only n=1 is supported; send n copies of the request.")
  if sp.get("stop"):
    raise BadRequest("stop strings are not supported (token-in, token-out server); use "
                     "stop_token_ids.")
  stop_ids = sp.get("stop_token_ids") or []
  if not isinstance(stop_ids, list) or not all(
      isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
    raise BadRequest(f"stop_token_ids={stop_ids!r} must be a list of ints.")
  stops = tuple(stop_ids) + (() if sp.get("ignore_eos") else stop_ids_default)
  seed = sp.get("sampling_seed")
  if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
    raise BadRequest(f"sampling_seed={seed!r} must be an int.")
  try:
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                            max_new_tokens=max_new, stop_token_ids=tuple(dict.fromkeys(stops)),
                            seed=seed)
  except ValueError as e:
    raise BadRequest(str(e)) from None
  return params, bool(sp.get("no_stop_trim", False))


def parse_generate(body: Any, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]
                   ) -> tuple[list[_Item], bool]:
  """Validates a GenerateReqInput body. Returns (items, is_batch)."""
  if not isinstance(body, dict):
    raise BadRequest("the body must be a JSON object (GenerateReqInput).")
  text, ids = body.get("text"), body.get("input_ids")
  if (text is None) == (ids is None):
    raise BadRequest("give exactly one of `text` or `input_ids`.")
  if body.get("stream"):
    raise BadRequest("stream=true is not supported by this server; send stream=false.")
  if ids is not None:
    if not isinstance(ids, list) or not ids:
      raise BadRequest("input_ids must be a non-empty list of ints (or a list of such lists).")
    is_batch = isinstance(ids[0], list)
    rows = ids if is_batch else [ids]
    for r in rows:
      if not isinstance(r, list) or not r or not all(
          isinstance(t, int) and not isinstance(t, bool) for t in r):
        raise BadRequest("input_ids must be non-empty lists of ints.")
      if any(not 0 <= t < vocab_size for t in r):
        raise BadRequest(f"input_ids contain ids outside [0, {vocab_size}).")
  else:
    if tokenizer is None:
      raise BadRequest("this server has no tokenizer; send input_ids.")
    is_batch = isinstance(text, list)
    texts = text if is_batch else [text]
    if not texts or not all(isinstance(t, str) for t in texts):
      raise BadRequest("text must be a string or a non-empty list of strings.")
    rows = [tokenizer.encode(t) for t in texts]
    if any(not r for r in rows):
      raise BadRequest("text encodes to no tokens.")
  n = len(rows)
  sps = body.get("sampling_params")
  if isinstance(sps, list):
    if not is_batch or len(sps) != n:
      raise BadRequest(f"sampling_params is a list of {len(sps)}; give one dict, or one per "
                       f"item ({n}).")
  else:
    sps = [sps] * n
  rids = body.get("rid")
  if isinstance(rids, list):
    if len(rids) != n or not all(isinstance(r, str) for r in rids):
      raise BadRequest(f"rid must be a string or a list of {n} strings.")
  elif rids is None:
    rids = [uuid.uuid4().hex for _ in range(n)]
  elif isinstance(rids, str):
    if n > 1:
      raise BadRequest("a batch needs one rid per item.")
    rids = [rids]
  else:
    raise BadRequest("rid must be a string or a list of strings.")
  if len(set(rids)) != n:
    raise BadRequest("rids must be unique.")
  for k in ("return_logprob", "return_text_in_logprobs"):
    v = body.get(k, False)
    if not isinstance(v, (bool, list)):
      raise BadRequest(f"{k} must be a bool.")
  if body.get("top_logprobs_num", 0):
    raise BadRequest("top_logprobs_num > 0 is not supported by this server.")
  lp = body.get("logprob_start_len", -1)
  if lp not in (-1, None):
    raise BadRequest("logprob_start_len must be -1 (output tokens only) on this server.")
  ret_lp = body.get("return_logprob", False)
  ret_lp = ret_lp if isinstance(ret_lp, list) else [ret_lp] * n
  session = body.get("session_params")
  sid = session.get("id") if isinstance(session, dict) else None
  items = []
  for i in range(n):
    params, no_trim = _sampling(sps[i], eos_ids)
    items.append(_Item(prompt=list(rows[i]), params=params, rid=rids[i],
                       return_logprob=bool(ret_lp[i]), no_stop_trim=no_trim,
                       session_id=sid if not is_batch else None))
  return items, is_batch


def finish_reason_json(r: GenerateResult, max_new: int) -> dict:
  if r.finish_reason == FinishReason.STOP:
    return {"type": "stop", "matched": r.token_ids[-1]}
  if r.finish_reason == FinishReason.LENGTH:
    return {"type": "length", "length": max_new}
  if r.finish_reason == FinishReason.CONTEXT:
    # SGLang reports running into the context window as "length"; "reason" tells them apart.
    return {"type": "length", "length": len(r.token_ids), "reason": "context",
            "message": r.message}
  return {"type": "abort", "message": r.message or "aborted"}


class Server:
  """The aiohttp application state around one engine."""

  def __init__(self, engine, tokenizer=None, *, model_path: str = "",
               loader: Callable[[str], Any] | None = None, server_args: dict | None = None):
    self.engine = engine
    self.tokenizer = tokenizer
    self.model_path = model_path
    self.loader = loader
    self.server_args = server_args or {}
    self.ready = True
    self.unpaused = asyncio.Event()
    self.unpaused.set()
    eos = []
    if tokenizer is not None:
      eos = [tokenizer.eos_token_id] + list(getattr(tokenizer, "stop_token_ids", []))
    self.eos_ids = tuple(dict.fromkeys(t for t in eos if t is not None))
    self._update_lock = asyncio.Lock()

  def app(self) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 ** 2)
    r = app.router
    r.add_post("/generate", self.generate)
    for path, fn in (("/health", self.health), ("/health_generate", self.health_generate),
                     ("/get_model_info", self.model_info), ("/get_server_info", self.server_info),
                     ("/get_weight_version", self.weight_version)):
      r.add_get(path, fn)
      r.add_post(path, fn)
    r.add_post("/flush_cache", self.flush_cache)
    r.add_get("/flush_cache", self.flush_cache)
    r.add_post("/abort_request", self.abort_request)
    r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
    r.add_post("/pause_generation", self.pause_generation)
    r.add_post("/continue_generation", self.continue_generation)
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

  # ---- generation ------------------------------------------------------------------------------
  async def generate(self, request: web.Request) -> web.Response:
    try:
      body = await self._json(request)
      items, is_batch = parse_generate(body, self.tokenizer, self.engine.vocab_size,
                                       self.eos_ids)
    except BadRequest as e:
      return _error(str(e))
    # Like SGLang, requests that arrive while paused wait here, outside the engine, so a
    # /flush_cache during a weight update sees an idle engine.
    await self.unpaused.wait()
    try:
      results = await asyncio.gather(*[self._one(it) for it in items])
    except ValueError as e:
      return _error(str(e))
    return web.json_response(results if is_batch else results[0])

  async def _one(self, it: _Item) -> dict:
    r = await self.engine.generate(GenerateRequest(
        prompt_ids=it.prompt, params=it.params, session_id=it.session_id, rid=it.rid))
    out_ids = list(r.token_ids)
    if r.finish_reason == FinishReason.STOP and not it.no_stop_trim and out_ids:
      out_ids = out_ids[:-1]
    meta = {
        "id": it.rid, "prompt_tokens": len(it.prompt), "completion_tokens": len(r.token_ids),
        "cached_tokens": r.cached_tokens, "weight_version": str(r.weight_version),
        "finish_reason": finish_reason_json(r, it.params.max_new_tokens),
    }
    if it.return_logprob:
      meta["output_token_logprobs"] = [[float(lp), int(t), None]
                                       for lp, t in zip(r.logprobs, r.token_ids)]
      meta["input_token_logprobs"] = []
    out = {"output_ids": out_ids, "meta_info": meta}
    if self.tokenizer is not None:
      out["text"] = self.tokenizer.decode(out_ids)
    return out

  # ---- control ---------------------------------------------------------------------------------
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
        "is_generation": True, "weight_version": str(self.engine.weight_version)})

  async def server_info(self, request):
    return web.json_response({
        **self.server_args, "version": f"rao_jax-{rao_jax.__version__}",
        "engine": "rao_jax.embedded", "weight_version": str(self.engine.weight_version),
        "engine_config": dataclasses.asdict(self.engine.config)})

  async def weight_version(self, request):
    return web.json_response({"weight_version": str(self.engine.weight_version)})

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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m",
                  help="registry name, .gguf file or HF folder (load_pretrained)")
  ap.add_argument("--tiny", action="store_true",
                  help="serve a tiny random model with --model's config (tests, smoke runs)")
  ap.add_argument("--host", default="127.0.0.1")
  ap.add_argument("--port", type=int, default=30000)
  ap.add_argument("--dtype", default=None, help="activation/param dtype (default per backend)")
  ap.add_argument("--num-slots", type=int, default=16)
  ap.add_argument("--max-len", type=int, default=2048)
  ap.add_argument("--min-cache-len", type=int, default=128)
  ap.add_argument("--chunk-sizes", default="16,64,256")
  ap.add_argument("--prefill-rows", default="1,4")
  ap.add_argument("--warmup", action="store_true", help="compile every shape before serving")
  ap.add_argument("--weight-version", default="0")
  args = ap.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

  from flax import nnx
  from rao_jax.model import Transformer, load_pretrained
  from rao_jax.model.weights import load_model
  from rao_jax.rollout.embedded import EmbeddedEngine

  if args.tiny:
    from rao_jax.testing import tiny_config
    model, tokenizer = Transformer(tiny_config(), rngs=nnx.Rngs(0)), None
    try:
      from rao_jax.model.tokenizer import Tokenizer
      from rao_jax.model.weights import resolve_model_path
      tokenizer = Tokenizer.from_gguf(resolve_model_path(args.model))
    except Exception as e:  # noqa: BLE001 - a tiny test model can serve input_ids only
      log.warning("no tokenizer for the tiny model (%s); input_ids only", e)
  else:
    model, tokenizer = load_pretrained(args.model, dtype=args.dtype)

  def ints(s):
    return tuple(int(x) for x in s.split(","))
  engine = EmbeddedEngine(model, num_slots=args.num_slots, max_len=args.max_len,
                          min_cache_len=args.min_cache_len, chunk_sizes=ints(args.chunk_sizes),
                          prefill_rows=ints(args.prefill_rows),
                          weight_version=args.weight_version)
  if args.warmup:
    log.info("warm-up compiled every shape in %.1f s", engine.warmup())
  loader = (lambda path: load_model(path, dtype=args.dtype))
  server = Server(engine, tokenizer, model_path=args.model, loader=loader,
                  server_args=vars(args))
  print(f"rao_jax rollout server on http://{args.host}:{args.port}", file=sys.stderr,
        flush=True)
  web.run_app(server.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
  main()
