"""SGLang's LoRA routes: /load_lora_adapter and /unload_lora_adapter (one adapter at a time).

Both answer SGLang's LoRAUpdateOutput, ``{"success", "error_message", "loaded_adapters":
{name: path}}``, with 200 on success and 400 when refused (403 for a folder outside the weight
roots), plus ``weight_version``. The adapter is merged into the engine's weights
(``adapters.AdapterSlot``), so a load or unload changes what every request runs on: requests
arriving meanwhile wait, and the ones the engine holds are aborted (their ``finish_reason`` is
``abort``: the SGLang client continues them on the new weights), because they asked for the
adapter that is going away. The engine drops every kept KV (sessions included) with the old
weights.
"""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from rao_jax.rollout.serve import door
from rao_jax.rollout.serve.core import ServerCore
from rao_jax.rollout.serve.schema import BadRequest, LoadLoraAdapterIn, UnloadLoraAdapterIn

log = logging.getLogger(__name__)


class LoraRoutes(ServerCore):
  """/load_lora_adapter and /unload_lora_adapter."""

  def _lora_answer(self, success: bool, message: str | None = None, status: int | None = None,
                   **extra) -> web.Response:
    slot = self.adapter_slot
    body = {"success": success, "error_message": message,
            "loaded_adapters": slot.loaded if slot is not None else {},
            "weight_version": str(self.engine.weight_version), **extra}
    return web.json_response(body, status=status or (200 if success else 400))

  def _no_slot(self) -> web.Response | None:
    if self.adapter_slot is not None:
      return None
    return self._lora_answer(False, "this server was started without LoRA support; restart it "
                                    "with --max-lora-rank R (and --lora-target-modules, "
                                    "--lora-alpha) to load adapters.")

  async def _swap_adapter(self, state, version, why: str) -> None:
    """Serves adapter ``state`` (an nnx.State of the slot) from now on, labelled ``version``
    (None keeps the label). New requests wait until it is in place; those the engine holds are
    aborted with ``why``."""
    self.weights_ready.clear()
    try:
      self.engine.abort_all(why)
      new_version = version if version is not None else self.engine.weight_version
      await self.engine.update_adapter(state, str(new_version))
    finally:
      self.weights_ready.set()

  async def load_lora_adapter(self, request):
    """POST /load_lora_adapter ``{"lora_name", "lora_path"}``: serves the PEFT adapter folder
    ``lora_path`` as ``lora_name``, replacing the active adapter."""
    try:
      body = LoadLoraAdapterIn.from_json(await self._json(request))
    except BadRequest as e:
      return self._lora_answer(False, str(e))
    refused = self._no_slot()
    if refused is not None:
      return refused
    try:
      # Read by its resolved path, the one checked (door.WeightRoots.resolve).
      path = self.weight_roots.resolve(body.lora_path, field="lora_path")
    except door.PathOutsideRoots as e:
      log.warning("load_lora_adapter refused: %s", e)
      return self._lora_answer(False, str(e), status=403,
                               weight_roots=list(self.weight_roots.roots))
    slot = self.adapter_slot
    async with self._update_lock:
      if body.lora_name in slot.loaded:
        # SGLang's rule: a name stands for one adapter; reloading it under the same name could
        # leave clients unsure which weights answered.
        return self._lora_answer(False, f"an adapter named {body.lora_name!r} is already "
                                        f"loaded (from {slot.loaded[body.lora_name]!r}); "
                                        "unload it first, or load under another name.")
      try:
        state = await asyncio.to_thread(slot.fit, path)
      except (ValueError, OSError) as e:   # a bad folder: the caller's to fix
        return self._lora_answer(False, f"{type(e).__name__}: {e}")
      try:
        await self._swap_adapter(
            state, body.weight_version,
            f"aborted: /load_lora_adapter replaced the served adapter with {body.lora_name!r}")
      except Exception as e:  # noqa: BLE001 - the engine failed: reported, the server goes on
        log.exception("load_lora_adapter failed")
        return self._lora_answer(False, f"{type(e).__name__}: {e}", status=500)
      slot.activate(body.lora_name, body.lora_path,
                    f"/load_lora_adapter replaced it with {body.lora_name!r}")
    log.info("serving LoRA adapter %r from %s (weight version %s)", body.lora_name, path,
             self.engine.weight_version)
    return self._lora_answer(True)

  async def unload_lora_adapter(self, request):
    """POST /unload_lora_adapter ``{"lora_name"}``: serves the base model again."""
    try:
      body = UnloadLoraAdapterIn.from_json(await self._json(request))
    except BadRequest as e:
      return self._lora_answer(False, str(e))
    refused = self._no_slot()
    if refused is not None:
      return refused
    slot = self.adapter_slot
    async with self._update_lock:
      if body.lora_name not in slot.loaded:
        gone = slot.replaced.get(body.lora_name)
        why = f" ({gone})" if gone else ""
        return self._lora_answer(False, f"no adapter named {body.lora_name!r} is loaded{why}; "
                                        f"loaded_adapters: {slot.loaded}.")
      try:
        await self._swap_adapter(
            slot.zero(), body.weight_version,
            f"aborted: /unload_lora_adapter removed the served adapter {body.lora_name!r}")
      except Exception as e:  # noqa: BLE001 - the engine failed: reported, the server goes on
        log.exception("unload_lora_adapter failed")
        return self._lora_answer(False, f"{type(e).__name__}: {e}", status=500)
      slot.activate(None, None, "/unload_lora_adapter removed it")
    log.info("unloaded LoRA adapter %r: serving the base model", body.lora_name)
    return self._lora_answer(True)

