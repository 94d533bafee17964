"""Weight sync of SGLangEngine: full weights from disk, LoRA adapters, and re-syncing a server
that returns after a failure (the ``WeightSync`` half of the client).

Full weights (``update_weights``) are exported as an HF checkpoint folder under ``export_root``
and loaded on every server with the SGLang RL recipe: pause_generation -> flush_cache (retried
until 200) -> update_weights_from_disk -> continue_generation. Servers that are down are skipped
(they are re-synced when they return); a server that fails its update is marked down.

LoRA (``update_adapter``): a policy whose adapter alone changed is synced by writing the adapter
in PEFT's format (``rao_jax.model.peft.save_adapter``, a few MB) to ``export_dir`` and loading it
on every server with SGLang's ``/load_lora_adapter`` under the name ``rao-v{version}`` (same
pause -> load -> continue recipe; ``weight_version`` relabelled with it); every /generate then
sends ``lora_path`` = that name, and the previous ``rao-v*`` adapters are unloaded (SGLang keeps
several loaded; rao_jax.rollout.serve applies one at a time and replaces it on load). Servers
need LoRA enabled (SGLang: ``--enable-lora --max-lora-rank R --lora-target-modules ...``;
rao_jax.rollout.serve: ``--max-lora-rank R``).

A server that returns is asked which version it serves, then given the newest full weights
(when a full sync replaced its base) and then the newest adapter. The version is read where the
server keeps it: ``GET /model_info`` on current SGLang (whose ``/get_weight_version`` answers 404,
"deprecated"), ``/get_model_info`` on servers with only that spelling, and
``/get_weight_version`` on 0.5.x servers that have neither (``VERSION_ROUTES``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os

import aiohttp

from rao_jax.rollout.sglang_http import _RETRYABLE, API_KEY_ENV, error_message

log = logging.getLogger(__name__)

# Adapters this client loads are named ADAPTER_PREFIX + version; older ones of that prefix are
# unloaded after a newer one loads (names of other prefixes are someone else's).
ADAPTER_PREFIX = "rao-v"

# Where a server's current weight version is read, in order: current SGLang answers the last
# one with 404 ("deprecated. Please use '/model_info' instead"); 0.5.x servers have only it.
VERSION_ROUTES = ("/model_info", "/get_model_info", "/get_weight_version")


class WeightSync:
  """Weight and adapter sync over SGLangEngine's servers (a mixin: the engine holds the state
  these methods read, ``urls``, ``pool``, ``config``, ``_synced``, ``_adapter``,
  ``_base_versions``, ``_version``, and gives ``_post`` and ``_session``)."""

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
    """The weight version ``url`` serves, from the first of ``VERSION_ROUTES`` that carries one.

    A route the server lacks (404, 405, or a 200 without ``weight_version``) moves on to the
    next; 401 raises PermissionError at once; any other answer, or no route with a version,
    raises ValueError naming what each route said."""
    said = []
    for path in VERSION_ROUTES:
      async with self._session().get(
          url + path, timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout)) as resp:
        status, text = resp.status, await resp.text()
      try:
        data = json.loads(text) if text else None
      except ValueError:
        data = text
      if status == 401:   # a key problem is the user's to fix, not a server that is down
        raise PermissionError(f"{url}{path} refused the client (HTTP 401): "
                              f"{error_message(data)}; check the servers' --api-key and "
                              f"{API_KEY_ENV}.")
      if status == 200 and isinstance(data, dict) and data.get("weight_version") is not None:
        return str(data["weight_version"])
      said.append(f"{path}: HTTP {status} {error_message(data)[:200]}")
      if status not in (200, 404, 405):
        break         # the server has the route and failed: the next one would not help
    raise ValueError(f"{url} reported no weight version ({'; '.join(said)}).")

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
    """Each server's current weight version, read where it keeps it (``VERSION_ROUTES``);
    None for a server that does not answer."""
    out = {}
    for u in self.urls:
      try:
        out[u] = await self._server_version(u)
      except _RETRYABLE + (ValueError,):
        out[u] = None
    return out

