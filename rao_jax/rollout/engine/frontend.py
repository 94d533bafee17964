"""EmbeddedEngine: the threaded front end of the embedded JAX engine.

The asyncio side (``generate``, ``abort``, ``end_session``, ``update_weights``, ...) hands
everything to one scheduler thread through a condition variable; the thread applies controls
and new weights between two device steps and runs ``Scheduler.step`` while requests wait or
run. Slot state is only ever touched on that thread. Results go back to each caller's event
loop with ``call_soon_threadsafe``.

A failed step (a device error or out of memory inside a jitted call) is an infrastructure
fault, not a reason to stop: every request the engine holds ends with ``FinishReason.ERROR``,
the scheduler rebuilds its device state (KV page pool and slot table; weights kept) and
serves what comes next. ``EngineConfig.max_consecutive_faults`` failed steps in a row mean the
device does not recover: the engine then stops for good and every call raises
``EngineFailedError``, so callers stop rather than re-submit forever.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rao_jax.rollout.base import (Engine, EngineFailedError, FinishReason, GenerateRequest,
                                  GenerateResult)
from rao_jax.rollout.engine import programs as P
from rao_jax.rollout.engine.config import EngineConfig, bucket
from rao_jax.rollout.engine.scheduler import Scheduler
from rao_jax.rollout.engine.slot_table import Req

log = logging.getLogger(__name__)


def _own_copy(x, device, dtype):
  """``x`` on ``device`` in ``dtype``, in a buffer that nothing else holds.

  ``jax.device_put(..., may_alias=False)`` is not enough: from an array replicated over several
  devices (the learner's, on a data-parallel mesh) onto one of them it returns that device's
  shard itself, so the learner's next step, which donates its state, deleted the engine's
  weights under it ("Buffer has been deleted or donated"). A shard kept as it is gets copied.
  """
  moved = jax.device_put(x, device, may_alias=False)
  if moved.dtype != dtype:
    return moved.astype(dtype)   # a new buffer
  if not isinstance(x, jax.Array):
    return moved                 # from host memory: a new buffer
  try:
    ptr = moved.unsafe_buffer_pointer()
    shared = any(s.data.unsafe_buffer_pointer() == ptr for s in x.addressable_shards)
  except Exception:   # noqa: BLE001 - a platform without buffer pointers: copy to be sure
    shared = True
  return jnp.copy(moved) if shared else moved


class EmbeddedEngine(Engine):
  """Continuous-batching JAX engine over a model implementing the rao_jax model contract.

  Args:
    model: an nnx Module with ``init_cache``, ``forward_cached`` and ``logits``.
    config: an EngineConfig; or pass its fields as keyword arguments.
    weight_version: version recorded on results until ``update_weights`` changes it.
    **kwargs: EngineConfig fields (num_slots, max_len, ...).
  """

  def __init__(self, model, config: EngineConfig | None = None, *,
               weight_version: int | str = 0, tokenizer=None, **kwargs):
    if config is None:
      config = EngineConfig(**kwargs)
    elif kwargs:
      config = dataclasses.replace(config, **kwargs)
    self.config = config
    # Graphdef and the abstract state check and convert what update_weights() receives.
    self._graphdef, state = nnx.split(model)
    self._state_tree = jax.tree.structure(state)
    self._abstract_state = jax.eval_shape(lambda: state)
    # With a LoRA model the engine keeps its own copy of the base weights, so that a sync can
    # send the adapter alone (update_adapter) and be merged here.
    lora = getattr(getattr(model, "cfg", None), "lora", None)
    self._lora = lora if lora is not None and lora.enabled else None
    self._base = None
    if self._lora is not None:
      self._abstract_adapter = nnx.split_state(self._abstract_state, nnx.LoRAParam, ...)[0]
    # The engine runs on one device: the first of those the model's weights are on. New weights
    # come here too: arriving sharded on the learner's mesh, they would make every program's
    # outputs (the KV cache) mesh-sharded, and each program compile again for those inputs.
    leaf = jax.tree.leaves(state)[0]
    devices = leaf.devices() if hasattr(leaf, "devices") else {jax.devices()[0]}
    self._device = jax.sharding.SingleDeviceSharding(min(devices, key=lambda d: d.id))
    probe = jax.eval_shape(lambda: model.logits(
        model.forward_cached(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                             model.init_cache(batch_size=1, max_len=8),
                             jnp.zeros((1,), jnp.int32))[0]))
    self.vocab_size = int(probe.shape[-1])
    self._init_cache = model.init_cache
    self._tokenizer = tokenizer
    self._version = weight_version
    self._traces: collections.Counter = collections.Counter()
    self.stats = collections.Counter()
    self._sched = Scheduler(config, model, self._as_params(state), self.vocab_size,
                            self._finish, self.stats)
    self._by_rid: dict[str, Req] = {}
    self._seed_rng = np.random.default_rng(config.seed)
    # Everything the asyncio side hands to the scheduler thread goes through _cv.
    self._cv = threading.Condition()
    self._inbox: list[Req] = []
    self._controls: list[tuple[Any, concurrent.futures.Future]] = []
    self._pending_weights: tuple[Any, Any] | None = None
    self._weight_waiters: list[concurrent.futures.Future] = []
    self._paused = False
    self._closed = False
    self._thread: threading.Thread | None = None
    self._faults_in_row = 0
    self._failed: str | None = None   # why the engine stopped for good (EngineFailedError)
    self._deferred: list | None = None   # results held back while a fault is handled

  # ---- public API ----------------------------------------------------------------------------
  @property
  def weight_version(self) -> int | str:
    return self._version

  @property
  def params(self):
    """The inference params the engine serves (its own copy)."""
    return self._sched.state.params

  @property
  def trace_counts(self) -> dict[str, int]:
    """How many times this engine traced each device program (a trace means a compilation;
    programs compiled by another engine over the same architecture are reused, not
    counted)."""
    return dict(self._traces)

  @property
  def failure(self) -> str | None:
    """Why the engine stopped serving (``EngineFailedError``'s message), or None."""
    return self._failed

  @property
  def num_running(self) -> int:
    with self._cv:
      return len(self._by_rid)

  async def generate(self, request: GenerateRequest, *, on_token=None) -> GenerateResult:
    """Generates a continuation of ``request.prompt_ids``; see GenerateRequest.

    Args:
      request: the request.
      on_token: optional ``fn(token_ids, logprobs) -> bool`` called on the engine's scheduler
        thread after every generated token with the output so far (the lists are the
        engine's: copy what you keep). Returning True ends the request with
        FinishReason.STOP (the server uses it for stop strings and streaming). It must be
        quick and must not block; if it raises, the request is aborted with the error.
    """
    req = self._make_req(request)
    req.on_token = self._stop_strings_hook(request.params.stop, on_token)
    if req.done:     # answered at admission (e.g. the prompt already fills the context)
      return req.future.result()
    with self._cv:
      if self._failed is not None:
        raise EngineFailedError(self._failed)
      if self._closed:
        raise RuntimeError("EmbeddedEngine is closed.")
      if req.rid in self._by_rid:
        raise ValueError(f"GenerateRequest.rid={req.rid!r} is already in flight; rids must "
                         "be unique among running requests.")
      self._by_rid[req.rid] = req
      self._inbox.append(req)
      self._ensure_thread()
      self._cv.notify()
    try:
      return await asyncio.shield(req.future)
    except asyncio.CancelledError:
      await self.abort(req.rid)
      raise

  def _stop_strings_hook(self, stop: tuple[str, ...], on_token):
    """``on_token`` that also ends the request at the first token completing a stop string."""
    if not stop:
      return on_token
    if self._tokenizer is None:
      raise ValueError(f"SamplingParams.stop={stop!r}: this EmbeddedEngine has no tokenizer to "
                       "match stop strings on; build it with EmbeddedEngine(model, ..., "
                       "tokenizer=tokenizer).")
    decode = self._tokenizer.decode
    # A token decodes to at least one character, so the last len(s) tokens hold any match that
    # the newest token completes; a few more absorb tokens that decode to nothing alone.
    tail = max(len(s) for s in stop) + 8

    def hook(out, logps):
      if on_token is not None and on_token(out, logps):
        return True
      text = decode(out[-tail:], skip_special_tokens=True)
      return any(s in text for s in stop)
    return hook

  async def abort(self, rid: str) -> None:
    self._control(lambda: self._abort_where(lambda r: r.rid == rid, "aborted by the caller"))

  def abort_all(self, message: str = "aborted") -> None:
    """Aborts every waiting and running request (they return FinishReason.ABORT)."""
    self._control(lambda: self._abort_where(lambda r: True, message))

  async def end_session(self, session_id: str) -> None:
    await asyncio.wrap_future(self._control(lambda: self._sched.table.end_session(session_id)))

  def pause(self) -> None:
    """Stops scheduling (requests wait, state is kept) until ``resume``."""
    with self._cv:
      self._paused = True

  def resume(self) -> None:
    with self._cv:
      self._paused = False
      self._cv.notify()

  @property
  def paused(self) -> bool:
    return self._paused

  def flush_cache(self, timeout: float | None = 60.0) -> bool:
    """Drops every kept session cache. Returns False (and drops nothing) while requests run,
    like SGLang's /flush_cache."""
    with self._cv:
      if self._inbox:
        return False
    return self._control(self._sched.table.flush).result(timeout)

  def _control(self, fn) -> concurrent.futures.Future:
    """Runs ``fn`` on the scheduler thread between two device steps (slot state is only ever
    touched there); returns a Future of its result."""
    fut = concurrent.futures.Future()
    with self._cv:
      if self._failed is not None:   # no scheduler thread will ever run it
        fut.set_exception(EngineFailedError(self._failed))
        return fut
      self._controls.append((fn, fut))
      self._ensure_thread()
      self._cv.notify()
    return fut

  async def update_weights(self, model, version: int | str) -> None:
    """Serves ``model``'s weights from the next device step on (``Engine.update_weights``).

    The engine takes them in memory: it copies them (the learner may donate the originals to
    its next step), casts them to its dtypes and swaps them in between two device steps.
    Requests running keep their KV and finish on the new weights.

    Args:
      model: an nnx Module of the same architecture, its nnx.State, or a pure dict
        (``nnx.State.to_pure_dict()``).
      version: the weight version recorded on results from now on.
    """
    params = await asyncio.to_thread(self._as_params, model)
    await asyncio.wrap_future(self._swap(params, version))

  async def update_adapter(self, model, version: int | str) -> None:
    """Serves ``model``'s LoRA adapter over the base the engine holds (``Engine.update_adapter``).

    Only the adapter's arrays are copied in; the engine merges them into its own copy of the
    base (W + alpha / r A B) once, so decode steps cost what they cost without an adapter
    (``benchmarks/bench_lora.py`` measures merged against applied-per-step). KV kept from
    older weights is dropped, as with any weight update.

    Args:
      model: the policy with its adapter (a Module), or the adapter's nnx.State
        (``nnx.state(model, nnx.LoRAParam)``).
      version: the weight version recorded on results from now on.
    """
    if isinstance(model, nnx.Module) and not model.cfg.lora.enabled:
      return await self.update_weights(model, version)
    params = await asyncio.to_thread(self._adapter_params, model)
    await asyncio.wrap_future(self._swap(params, version))

  def load_weights(self, params_or_model, version: int | str, *, wait: bool = True,
                   timeout: float | None = None) -> None:
    """``update_weights`` for threads without an event loop (and the scheduler thread itself,
    with ``wait=False``).

    Args:
      params_or_model: as ``update_weights``'s model.
      version: the new weight version recorded on results from now on.
      wait: block until the scheduler has swapped them in.
      timeout: seconds to wait at most (None: no limit).
    """
    fut = self._swap(self._as_params(params_or_model), version)
    if wait:
      try:
        fut.result(timeout)
      except concurrent.futures.TimeoutError:
        raise TimeoutError(f"load_weights(version={version!r}) was not applied within "
                           f"{timeout} s; is the scheduler paused?") from None

  def _swap(self, params, version) -> concurrent.futures.Future:
    """Hands new params to the scheduler thread; the Future resolves once they are in use (a
    newer update arriving first supersedes them and resolves it too)."""
    fut = concurrent.futures.Future()
    with self._cv:
      if self._failed is not None:
        fut.set_exception(EngineFailedError(self._failed))
        return fut
      self._pending_weights = (params, version)
      self._weight_waiters.append(fut)
      self._ensure_thread()
      self._cv.notify()
    return fut

  def set_weight_version(self, version: int | str, timeout: float | None = 60.0) -> None:
    """Relabels the current weights (SGLang's /update_weight_version); results finished from
    now on carry ``version``. The weights and kept sessions are unchanged."""
    def relabel():
      self._version = version
    self._control(relabel).result(timeout)

  def warmup(self, max_cache_len: int | None = None, verbose: bool = False) -> float:
    """Compiles every shape the scheduler can use, so no compilation happens during a run.

    Args:
      max_cache_len: compile only the prefill views (``EngineConfig.cache_lens``) up to this
        length (a longer context then compiles its view when it first meets it); default all.
      verbose: log each compilation.

    Returns:
      Seconds spent.
    """
    t0 = time.perf_counter()
    with self._cv:
      busy = bool(self._by_rid)
    if busy:
      raise RuntimeError("EmbeddedEngine.warmup() must run before requests are submitted.")
    # On the scheduler thread, between two steps: the warm-up runs the programs on the
    # engine's own page pool, so nothing else may touch the device state meanwhile (a weight
    # update arriving is applied after it). That thread is also bare of the caller's JAX
    # context (a mesh set by `jax.set_mesh` / `use_mesh`, copied into `asyncio.to_thread`
    # workers), which is part of every program's cache key; programs compiled under it would
    # be compiled again by the scheduler thread, inside the first step.
    self._control(lambda: self._sched.warmup(max_cache_len, verbose)).result()
    return time.perf_counter() - t0

  def score(self, token_ids: Sequence[int], *, temperature: float = 1.0,
            top_k: int = 0) -> tuple[list[float | None], list[list[tuple[float, int]]]]:
    """Log-probs of each token given the ones before it, and the top-k alternatives.

    What SGLang's ``input_token_logprobs`` / ``*_top_logprobs`` report (and ``max_new_tokens:
    0`` scoring requests): one extra prefill of ``token_ids`` on the current weights, outside
    the slots (it neither reads nor disturbs running requests or kept sessions). Blocking; call
    it from a worker thread in async code.

    Args:
      token_ids: the sequence (prompt, or prompt + output), at most ``config.max_len`` ids.
      temperature: logits are divided by it (<= 0: by 1, as for greedy requests).
      top_k: alternatives per position (0 to 20).

    Returns:
      (logprobs, top): ``logprobs[i]`` is log p(token_ids[i] | token_ids[:i]) (None for i = 0);
      ``top[i]`` lists (logprob, id) of the top_k most likely tokens at position i given
      token_ids[:i] (empty for i = 0).
    """
    ids = [int(t) for t in token_ids]
    if not ids:
      raise ValueError("EmbeddedEngine.score: token_ids is empty.")
    if len(ids) > self.config.max_len:
      raise ValueError(f"EmbeddedEngine.score: {len(ids)} tokens exceed max_len="
                       f"{self.config.max_len}.")
    if any(not 0 <= t < self.vocab_size for t in ids):
      raise ValueError(f"EmbeddedEngine.score: ids outside [0, {self.vocab_size}).")
    if not 0 <= int(top_k) <= 20:
      raise ValueError(f"EmbeddedEngine.score: top_k={top_k!r} must be in [0, 20].")
    chunk = 64
    T = -(-bucket(self.config.cache_lens, len(ids)) // chunk) * chunk
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :len(ids)] = ids
    # top-k is compiled for 0 or 20 alternatives only (two programs per length bucket).
    k_static = 20 if top_k else 0
    with P.counting(self._traces):
      lp_T, top_lp, top_id = self._sched.score_fn(
          chunk, k_static, self.params, self._init_cache(batch_size=1, max_len=T), tokens,
          np.float32(temperature))
    lp_T, top_lp, top_id = np.asarray(lp_T), np.asarray(top_lp), np.asarray(top_id)
    n = len(ids)
    logprobs = [None] + [float(x) for x in lp_T[:n - 1]]
    top = [[]] + [[(float(top_lp[i, j]), int(top_id[i, j])) for j in range(int(top_k))]
                  for i in range(n - 1)]
    return logprobs, top

  async def close(self) -> None:
    with self._cv:
      self._closed = True
      self._cv.notify()
    thread = self._thread
    if thread is not None:
      await asyncio.get_running_loop().run_in_executor(None, thread.join)

  # ---- admission (caller thread) --------------------------------------------------------------
  def _make_req(self, request: GenerateRequest) -> Req:
    if not isinstance(request, GenerateRequest):
      raise TypeError(f"generate() takes a GenerateRequest, got {type(request).__name__}.")
    prompt = [int(t) for t in request.prompt_ids]
    if not prompt:
      raise ValueError("GenerateRequest.prompt_ids is empty: give at least one token id.")
    bad = [t for t in prompt if not 0 <= t < self.vocab_size]
    if bad:
      raise ValueError(f"GenerateRequest.prompt_ids has ids outside [0, {self.vocab_size}): "
                       f"{bad[:5]}.")
    p = request.params
    limit = self.config.capacity
    if request.context_limit is not None:
      if request.context_limit < 1:
        raise ValueError(f"GenerateRequest.context_limit={request.context_limit!r}: must be >= 1.")
      limit = min(limit, int(request.context_limit))
    seed = int(p.seed) if p.seed is not None else int(self._seed_rng.integers(0, 2**31 - 1))
    loop = asyncio.get_running_loop()
    stops = (p.stop_token_ids if p.stop_token_ids is not None
             else self.config.default_stop_token_ids)
    req = Req(rid=request.rid or uuid.uuid4().hex, prompt=prompt, params=p, limit=limit,
              seed=seed & 0xFFFFFFFF, stop_ids=frozenset(int(t) for t in stops),
              session_id=request.session_id, request=request, loop=loop,
              future=loop.create_future())
    if len(prompt) >= limit:
      req.done = True
      req.future.set_result(GenerateResult(
          token_ids=[], logprobs=[], finish_reason=FinishReason.CONTEXT,
          weight_version=self._version, prompt_len=len(prompt),
          message=f"the prompt ({len(prompt)} tokens) already fills the context limit "
                  f"({limit} tokens)"))
    return req

  def _ensure_thread(self):
    if self._thread is None or not self._thread.is_alive():
      self._thread = threading.Thread(target=self._run, name="rao-embedded-engine", daemon=True)
      self._thread.start()

  def _as_params(self, x):
    """New weights (Module, nnx.State or pure dict) -> the engine's own inference params.

    The weight-sync boundary: every array is copied into new buffers (in the engine's dtype),
    so nothing the engine serves is a view of the caller's arrays. The trainer's learner
    donates its state to each step; a view (``inference_params()`` returns e.g. the embedding
    itself when no cast is needed) would be deleted under a rollout in flight.
    """
    if isinstance(x, nnx.Module):
      _, state = nnx.split(x)
    elif isinstance(x, nnx.State):
      state = x
    else:
      state = jax.tree.map(lambda a: a, self._abstract_state)
      nnx.replace_by_pure_dict(state, x)
    if jax.tree.structure(state) != self._state_tree:
      raise ValueError("update_weights: the new parameters do not have the engine model's "
                       "structure; pass a model of the same config (or its nnx.State).")
    state = self._own_tree(state, self._abstract_state, "update_weights: a parameter",
                           "the configs differ")
    if self._lora is not None:
      self._base = nnx.split_state(state, nnx.LoRAParam, ...)[1]
    return nnx.merge(self._graphdef, state).inference_params()

  def _own_tree(self, tree, abstract, what: str, why: str):
    """The engine's own copies of ``tree``'s arrays, shapes checked against ``abstract``."""
    def own(new, old):
      if new.shape != old.shape:
        raise ValueError(f"{what} has shape {new.shape}, the engine's has {old.shape}; {why}.")
      return _own_copy(new, self._device, old.dtype)
    return jax.tree.map(own, tree, abstract)

  def _adapter_params(self, x):
    """A new LoRA adapter (Module or its nnx.LoRAParam state) -> inference params with it
    merged into the engine's own base copy."""
    if self._lora is None or self._base is None:
      raise ValueError("update_adapter: this engine's model has no LoRA adapter "
                       "(model.cfg.lora.rank is 0); build the engine from the adapted model, or "
                       "send the whole model with update_weights.")
    adapter = nnx.state(x, nnx.LoRAParam) if isinstance(x, nnx.Module) else x
    if jax.tree.structure(adapter) != jax.tree.structure(self._abstract_adapter):
      raise ValueError("update_adapter: the adapter's structure differs from the engine's "
                       f"(model.lora={self._lora}); pass nnx.state(model, nnx.LoRAParam) of a "
                       "model with the same model.lora.")
    adapter = self._own_tree(adapter, self._abstract_adapter, "update_adapter: an adapter array",
                             "the model.lora ranks or targets differ")
    return nnx.merge(self._graphdef, adapter, self._base).inference_params()

  # ---- scheduler thread -----------------------------------------------------------------------
  def _run(self):
    P.count_traces_on_this_thread(self._traces)
    while True:
      # Read afresh each time: a rebuild after a fault replaces the table.
      table = self._sched.table
      with self._cv:
        while not (self._inbox or self._controls or self._pending_weights is not None
                   or self._closed
                   or (not self._paused and (table.waiting or table.any_running()))):
          self._cv.wait()
        inbox, self._inbox = self._inbox, []
        controls, self._controls = self._controls, []
        weights, self._pending_weights = self._pending_weights, None
        waiters, self._weight_waiters = self._weight_waiters, []
        paused, closed = self._paused, self._closed
      try:
        table.waiting.extend(inbox)
        for fn, fut in controls:
          _settle(fut, fn)
        if weights is not None:
          params, self._version = weights
          self._sched.set_params(params)
          for fut in waiters:
            _settle(fut, lambda: None)
        if closed:
          self._abort_where(lambda r: True, "engine closed")
          return
        if not paused and self._sched.step():
          self._faults_in_row = 0
      except Exception as e:   # a failed step fails its requests, not the engine
        if not self._recover(e):
          return

  def _recover(self, exc: Exception) -> bool:
    """After a failed step: ends every held request with FinishReason.ERROR and rebuilds the
    device state; returns False when the engine stops for good instead.

    The results go out once the engine is rebuilt (or stopped): a caller that re-submits on
    seeing one must meet the new state, not be swept up by the end of this fault.
    """
    self._deferred = []
    try:
      return self._handle_fault(exc)
    finally:
      deliveries, self._deferred = self._deferred, None
      for loop, deliver in deliveries:
        _call_soon(loop, deliver)

  def _handle_fault(self, exc: Exception) -> bool:
    self._faults_in_row += 1
    self.stats["faults"] += 1
    n, limit = self._faults_in_row, self.config.max_consecutive_faults
    log.error("embedded engine step failed (%d in a row, max_consecutive_faults=%d): %r",
              n, limit, exc, exc_info=exc)
    cause = f"{type(exc).__name__}: {exc}"
    if n >= limit:
      self._stop_for_good(f"{n} device steps failed in a row (EngineConfig."
                          f"max_consecutive_faults={limit}); the last: {cause}")
      return False
    self._abort_where(lambda r: True,
                      f"the engine's device step failed (infrastructure, not the policy): "
                      f"{cause}", FinishReason.ERROR)
    try:
      self._sched.rebuild()
    except Exception as e:  # noqa: BLE001 - without a cache there is nothing left to serve
      log.exception("embedded engine could not rebuild its device state")
      self._stop_for_good(f"rebuilding the device state after a failed step ({cause}) failed "
                          f"too: {type(e).__name__}: {e}")
      return False
    self.stats["rebuilds"] += 1
    return True

  def _stop_for_good(self, why: str) -> None:
    """Marks the engine failed: the requests it holds and every later call raise
    EngineFailedError (a caller then knows that re-submitting cannot help)."""
    msg = (f"EmbeddedEngine stopped serving: {why}. Free accelerator memory or lower "
           "EngineConfig.num_pages (the KV pool) / num_slots / max_len, or raise "
           "EngineConfig.max_consecutive_faults.")
    with self._cv:
      self._failed = msg
      controls, self._controls = self._controls, []
      waiters, self._weight_waiters = self._weight_waiters, []
      self._pending_weights = None
    self._abort_where(lambda r: True, msg, FinishReason.ERROR, EngineFailedError(msg))
    for fut in [f for _, f in controls] + waiters:
      if fut.set_running_or_notify_cancel():   # a caller that gave up needs no answer
        fut.set_exception(EngineFailedError(msg))

  def _abort_where(self, pred, message, reason: FinishReason = FinishReason.ABORT,
                   error: Exception | None = None):
    table = self._sched.table
    for r in [r for r in table.requests() if pred(r)]:
      if r in table.waiting:
        table.waiting.remove(r)
      self._finish(r, reason, message, error)
    # Requests handed over but not yet moved to the waiting queue are ended there too.
    with self._cv:
      pending = [r for r in self._inbox if pred(r)]
      self._inbox = [r for r in self._inbox if not pred(r)]
    for r in pending:
      self._finish(r, reason, message, error)

  def _finish(self, req: Req, reason: FinishReason, message: str = "",
              error: Exception | None = None):
    """Ends ``req``: its caller gets the result, or ``error`` raised when one is given."""
    if req.done:
      return
    req.done = True
    result = GenerateResult(token_ids=list(req.out), logprobs=list(req.logps),
                            finish_reason=reason, weight_version=self._version,
                            prompt_len=len(req.prompt), cached_tokens=req.cached,
                            message=message)
    self._sched.table.release(req)
    with self._cv:
      self._by_rid.pop(req.rid, None)
    self.stats[f"finish_{reason.value}"] += 1

    def deliver(fut=req.future, res=result):
      if fut.done():
        return
      if error is not None:   # one instance per caller: a raise writes its traceback into it
        fut.set_exception(type(error)(*error.args))
      else:
        fut.set_result(res)
    if self._deferred is not None:
      self._deferred.append((req.loop, deliver))
    else:
      _call_soon(req.loop, deliver)


def _call_soon(loop, fn) -> None:
  try:
    loop.call_soon_threadsafe(fn)
  except RuntimeError:   # the caller's loop is gone; nobody is waiting
    pass


__all__ = ["EmbeddedEngine"]


def _settle(fut: concurrent.futures.Future, fn) -> None:
  """Runs a control ``fn`` for the caller waiting on ``fut`` and hands it the outcome. A caller
  that gave up (its future cancelled: an awaiting task cancelled, a timeout) still has ``fn``
  run, since the engine's state may depend on it, but gets nothing: setting a cancelled
  future's result raises, which the scheduler would take for a failed device step and fail
  every running request for."""
  wanted = fut.set_running_or_notify_cancel()
  try:
    result = fn()
  except Exception as e:   # noqa: BLE001 - handed to the caller
    if wanted:
      fut.set_exception(e)
    else:
      log.warning("An engine control whose caller gave up failed: %r", e)
    return
  if wanted:
    fut.set_result(result)
