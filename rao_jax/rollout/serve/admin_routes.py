"""SGLang's control endpoints: health, model and server info, weight versions and updates,
cache flush, aborts, pause and continue."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

import jax
from aiohttp import web

import rao_jax
from rao_jax.rollout.base import GenerateRequest, SamplingParams
from rao_jax.rollout.serve import door
from rao_jax.rollout.serve.core import ServerCore, sglang_error
from rao_jax.rollout.serve.schema import (AbortIn, BadRequest, PauseIn, UpdateWeightsFromDiskIn,
                                          UpdateWeightVersionIn)

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.6"     # the release whose request/response shapes this server follows


class AdminRoutes(ServerCore):
  """Health, info and control endpoints."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    # (time, engine decode-token count) at the previous /get_server_info: the throughput
    # reported is measured between two readings, as SGLang's is between two log intervals.
    self._gen_mark = (time.perf_counter(), int(self.engine.stats.get("decode_tokens", 0)))

  async def health(self, request):
    """GET /health: 200 when serving, 503 while starting."""
    return web.Response(status=200 if self.ready else 503)

  async def health_generate(self, request):
    """GET /health_generate: 200 when the engine generates a token (or is busy serving)."""
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
    """GET /model_info (current SGLang) and /get_model_info (0.5.x): ``weight_version`` is where
    current clients read the served version."""
    return web.json_response({
        "model_path": self.model_path, "tokenizer_path": self.model_path,
        "is_generation": True,
        "preferred_sampling_params": (json.dumps(self.preferred) if self.preferred else None),
        "weight_version": str(self.engine.weight_version),
        "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": self.server_args.get("model_type"),
        "architectures": self.server_args.get("architectures")})

  def internal_state(self) -> dict:
    """The one scheduler's state, in the keys of SGLang's ``get_internal_state``.

    ``last_gen_throughput`` is decode tokens per second since the previous reading (SGLang's
    is over its last log interval); ``memory_usage`` gives the served weights' GB and the
    tokens the KV slots hold; the queue keys count requests handed to the engine and not
    finished (the embedded engine does not tell waiting from running: both are in
    ``prefill_decode_size``).
    """
    now, tokens = time.perf_counter(), int(self.engine.stats.get("decode_tokens", 0))
    (t0, n0), self._gen_mark = self._gen_mark, (now, tokens)
    weight_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(self.engine.params))
    cfg = self.engine.config
    return {
        **self.server_args,
        "last_gen_throughput": (tokens - n0) / (now - t0) if now > t0 else 0.0,
        "memory_usage": {"weight": round(weight_bytes / 2**30, 4),
                         "token_capacity": int(cfg.num_slots) * int(cfg.max_len)},
        "engine_paused": bool(self.engine.paused) or not self.unpaused.is_set(),
        "prefill_decode_size": int(self.engine.num_running),
        "weight_version": str(self.engine.weight_version),
        "engine_stats": {k: int(v) for k, v in sorted(self.engine.stats.items())},
    }

  async def server_info(self, request):
    """GET /get_server_info: server args, version, engine config and ``internal_states``."""
    return web.json_response({
        **self.server_args, "model_path": self.model_path, "tokenizer_path": self.model_path,
        "served_model_name": self.served_model_name,
        "version": f"rao_jax-{rao_jax.__version__}", "sglang_api_version": SGLANG_VERSION,
        "engine": "rao_jax.embedded", "weight_version": str(self.engine.weight_version),
        # Seeded requests reproduce whatever else shares their batch (sampling.gumbel_noise).
        "sampling_seed_honoured": True,
        "context_length": int(self.engine.config.capacity),
        "weight_roots": list(self.weight_roots.roots),
        "engine_config": dataclasses.asdict(self.engine.config),
        # SGLang: one dict per scheduler (data-parallel rank); this server has one.
        "internal_states": [self.internal_state()],
        # The LoRA slot (None without one): rank, alpha, targets and the active adapter.
        "lora": self.adapter_slot.describe() if self.adapter_slot is not None else None})

  async def weight_version(self, request):
    """GET /get_weight_version: 0.5.x servers' route (current SGLang moved it to /model_info)."""
    return web.json_response({"weight_version": str(self.engine.weight_version)})

  async def update_weight_version(self, request):
    """POST /update_weight_version: relabels the served weights."""
    try:
      body = UpdateWeightVersionIn.from_json(await self._json(request))
    except BadRequest as e:
      return sglang_error(str(e))
    if body.abort_all_requests:
      self.engine.abort_all("aborted by /update_weight_version")
    await asyncio.to_thread(self.engine.set_weight_version, body.new_version)
    return web.json_response({"success": True, "new_version": body.new_version,
                              "message": f"Weight version updated to {body.new_version}"})

  async def flush_cache(self, request):
    """POST /flush_cache: 400 while requests run (retry), as SGLang answers."""
    ok = await asyncio.to_thread(self.engine.flush_cache)
    if ok:
      return web.Response(text="Cache flushed.\n", status=200)
    return web.Response(text="Cache not flushed: requests are running.\n", status=400)

  async def abort_request(self, request):
    """POST /abort_request: one rid, or ``abort_all``."""
    try:
      body = AbortIn.from_json(await self._json(request, allow_empty=True))
    except BadRequest as e:
      return sglang_error(str(e))
    if body.abort_all:
      self.engine.abort_all("aborted by /abort_request")
    else:
      await self.engine.abort(body.rid)
    return web.Response(status=200)

  async def pause_generation(self, request):
    """POST /pause_generation: ``abort`` what runs, or hold it (``retract``/``in_place``)."""
    try:
      body = PauseIn.from_json(await self._json(request, allow_empty=True))
    except BadRequest as e:
      return sglang_error(str(e))
    self.unpaused.clear()
    if body.mode == "abort":
      self.engine.abort_all("aborted by /pause_generation")
    else:
      self.engine.pause()
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

  async def continue_generation(self, request):
    """POST /continue_generation."""
    self.engine.resume()
    self.unpaused.set()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

  async def update_weights_from_disk(self, request):
    """POST /update_weights_from_disk: loads a checkpoint folder with ``loader``; a path outside
    the server's weight roots gets 403 naming them. With a LoRA slot the new weights come with a
    zero adapter (the loader adds it): the active adapter, if any, is dropped."""
    try:
      body = UpdateWeightsFromDiskIn.from_json(await self._json(request))
    except BadRequest as e:
      return sglang_error(str(e))
    if self.loader is None:
      return web.json_response({"success": False, "message": "this server cannot load weights",
                                "num_paused_requests": 0}, status=400)
    try:
      # Loaded by its resolved path, the one checked (door.WeightRoots.resolve).
      path = self.weight_roots.resolve(body.model_path)
    except door.PathOutsideRoots as e:
      log.warning("update_weights_from_disk refused: %s", e)
      return web.json_response({"success": False, "message": str(e), "num_paused_requests": 0,
                                "weight_roots": list(self.weight_roots.roots)}, status=403)
    version = body.weight_version
    if body.abort_all_requests:
      self.engine.abort_all("aborted by /update_weights_from_disk")
    async with self._update_lock:
      try:
        model = await asyncio.to_thread(self.loader, path)
        new_version = version if version is not None else self.engine.weight_version
        await self.engine.update_weights(model, str(new_version))
      except Exception as e:  # noqa: BLE001 - reported to the caller, the server goes on
        log.exception("update_weights_from_disk failed")
        return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}",
                                  "num_paused_requests": 0}, status=400)
      if self.adapter_slot is not None:
        # The loader gave the new base a zero adapter: the base alone is served now.
        self.adapter_slot.activate(None, None, "/update_weights_from_disk replaced the "
                                               f"weights with {body.model_path!r}")
    self.model_path = body.model_path
    msg = "Succeeded to update model weights."
    if version is not None:
      msg += f" Weight version updated to {version}."
    return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})
