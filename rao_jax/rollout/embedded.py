"""The embedded JAX engine: continuous batching over fixed slots, sessions, in-process weights.

Host side (asyncio + one scheduler thread, plain Python/numpy) decides what runs; device side
is three jitted pure functions with bucketed static shapes:

  * ``_prefill``: P rows x C prompt tokens (P from ``prefill_rows``, C from ``chunk_sizes``),
    gathered from / scattered back into their slots of the cache;
  * ``_decode``: ``decode_steps`` tokens for the first R slots (R from ``decode_rows``), every
    row with its own temperature / top-p / top-k / seed arrays;
  * ``_resize``: grows or shrinks the cache's length S between buckets (``cache_lens``).

The cache length follows the longest context currently held (with hysteresis when shrinking),
so decoding short contexts does not pay attention over the longest one. After ``warmup()``
every shape the scheduler can produce has been compiled: nothing compiles during a run
(``EmbeddedEngine.trace_counts`` counts the traces of each function).

A slot holds one context's KV cache. A request with a ``session_id`` keeps its slot after it
finishes; the next request of that session reuses the longest common prefix of the cached
tokens and its prompt, so only the new suffix is prefilled. Idle sessions are evicted (least
recently used first) when a slot is needed; an evicted session is recomputed transparently.

Prefixes are also shared across slots (``share_prefix_min``): a new context whose prompt starts
like another slot's cached tokens (every agent of a run starts with the same system prompt)
gets that slot's KV rows copied (``_copy_row``, one memory copy) instead of recomputing them;
a request whose shared prefix another slot is still prefilling waits for it. Prefill is
compute-bound on CPU: an agent node of ~600 tokens whose first ~430 are the system prompt
prefills ~170.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
import uuid
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rao_jax.rollout import sampling
from rao_jax.rollout.base import (Engine, FinishReason, GenerateRequest, GenerateResult,
                                  SamplingParams)

log = logging.getLogger(__name__)


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
  out, b = [], lo
  while b < hi:
    out.append(b)
    b *= 2
  out.append(hi)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Shapes and policies of the embedded engine.

  Attributes:
    num_slots: concurrent contexts (requests running + sessions kept); the cache's batch size.
    max_len: tokens one slot can hold (the largest cache length).
    cache_lens: cache-length buckets, ascending, ending at max_len; () = doubling from
      min_cache_len up to max_len.
    min_cache_len: the smallest cache bucket when cache_lens is ().
    chunk_sizes: prompt-chunk buckets, ascending; a prompt is prefilled in chunks of these.
    prefill_rows: prefill batch buckets, ascending; at most max(prefill_rows) slots per call.
    decode_rows: decode batch buckets, ascending, ending at num_slots; () = 1, 4, 16, ... up to
      num_slots (a lone agent then decodes one row, not num_slots: ~3x faster on CPU).
      Decoding runs over the first R slots, R the smallest bucket covering every active slot.
    decode_steps: tokens generated per decode call (>1 trades scheduling latency for less
      per-call overhead).
    shrink_patience: scheduler iterations the needed cache length must stay at most half the
      current one before the cache shrinks (avoids resizing back and forth).
    seed: base of the per-request seeds drawn for requests that give none.
    default_stop_token_ids: the stop ids of requests whose ``SamplingParams.stop_token_ids``
      is None (the default): give the tokenizer's ``stop_token_ids`` (end of turn, end of
      text) so generation ends where users expect; () = such requests never stop early.
    share_prefix_min: a new context copies another slot's KV rows for a common prompt prefix
      at least this many tokens longer than its own slot holds (0 = never share across slots).
  """
  num_slots: int = 16
  max_len: int = 2048
  cache_lens: tuple[int, ...] = ()
  # Few buckets by default: each (rows, chunk, cache length) shape is one compilation of the
  # unrolled model (seconds each on CPU), and a short run pays for every shape it meets.
  min_cache_len: int = 512
  chunk_sizes: tuple[int, ...] = (32, 256)
  prefill_rows: tuple[int, ...] = (1, 4)
  decode_rows: tuple[int, ...] = ()
  decode_steps: int = 1
  shrink_patience: int = 32
  seed: int = 0
  default_stop_token_ids: tuple[int, ...] = ()
  share_prefix_min: int = 32

  def __post_init__(self):
    def ascending(name, vals):
      vals = tuple(int(v) for v in vals)
      if not vals or any(v < 1 for v in vals) or list(vals) != sorted(set(vals)):
        raise ValueError(f"EngineConfig.{name}={vals!r}: must be a non-empty, strictly "
                         "ascending tuple of positive ints.")
      object.__setattr__(self, name, vals)
      return vals

    try:
      stops = tuple(int(t) for t in self.default_stop_token_ids)
    except (TypeError, ValueError):
      stops = (-1,)
    if any(t < 0 for t in stops):
      raise ValueError(f"EngineConfig.default_stop_token_ids={self.default_stop_token_ids!r}: "
                       "must be a tuple of token ids (non-negative ints).")
    object.__setattr__(self, "default_stop_token_ids", tuple(dict.fromkeys(stops)))
    if int(self.share_prefix_min) < 0:
      raise ValueError(f"EngineConfig.share_prefix_min={self.share_prefix_min!r}: must be >= 0 "
                       "(0 turns cross-slot prefix sharing off).")
    for name in ("num_slots", "max_len", "min_cache_len", "decode_steps", "shrink_patience"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r}: must be >= 1.")
    if not self.cache_lens:
      object.__setattr__(self, "cache_lens",
                         _pow2_buckets(min(self.min_cache_len, self.max_len), self.max_len))
    lens = ascending("cache_lens", self.cache_lens)
    if lens[-1] != self.max_len:
      raise ValueError(f"EngineConfig.cache_lens={lens!r}: the last bucket must equal "
                       f"max_len={self.max_len}.")
    ascending("chunk_sizes", self.chunk_sizes)
    ascending("prefill_rows", self.prefill_rows)
    if not self.decode_rows:
      ladder, r = [], 1
      while r < self.num_slots:
        ladder.append(r)
        r *= 4
      object.__setattr__(self, "decode_rows", tuple(ladder) + (self.num_slots,))
    rows = ascending("decode_rows", self.decode_rows)
    if rows[-1] != self.num_slots:
      raise ValueError(f"EngineConfig.decode_rows={rows!r}: the last bucket must equal "
                       f"num_slots={self.num_slots}.")
    if self.prefill_rows[-1] > self.num_slots:
      raise ValueError(f"EngineConfig.prefill_rows={self.prefill_rows!r}: buckets larger than "
                       f"num_slots={self.num_slots} can never fill; drop them.")
    if self.margin >= self.max_len:
      raise ValueError(f"EngineConfig.max_len={self.max_len}: must exceed the smallest chunk "
                       f"and decode_steps ({self.margin}); raise max_len.")

  @property
  def margin(self) -> int:
    # Slots past a row's length that a call may write (padding of a chunk, fused decode steps).
    return max(self.decode_steps, self.chunk_sizes[0])

  @property
  def capacity(self) -> int:
    """The most tokens (prompt + generated) one context may reach."""
    return self.max_len - self.margin


def _bucket(buckets: Sequence[int], n: int) -> int:
  for b in buckets:
    if b >= n:
      return b
  return buckets[-1]


# ---- device functions (pure; jitted once per shape) ------------------------------------------
_TRACE_COUNTS: collections.Counter = collections.Counter()


def _cache_axes(model) -> tuple[Any, Any]:
  """(batch axis, length axis) of every cache leaf, found by comparing two abstract caches."""
  a = jax.eval_shape(lambda: model.init_cache(batch_size=2, max_len=8))
  b = jax.eval_shape(lambda: model.init_cache(batch_size=3, max_len=16))

  def axis_where(x, y, want_x, want_y):
    hits = [i for i, (p, q) in enumerate(zip(x.shape, y.shape)) if (p, q) == (want_x, want_y)]
    return hits[0] if hits else -1   # -1, not None: None would vanish from the pytree

  batch_ax = jax.tree.map(lambda x, y: axis_where(x, y, 2, 3), a, b)
  len_ax = jax.tree.map(lambda x, y: axis_where(x, y, 8, 16), a, b)
  for ax in jax.tree.leaves(batch_ax):
    if ax < 0:
      raise ValueError("model.init_cache returned a leaf without a batch axis; the engine "
                       "needs every cache array to have one (rows are slots).")
  return batch_ax, len_ax


def _axes_tree(cache, axes: tuple[int, ...]):
  # Axes travel as a flat tuple (hashable, so the jitted functions can take them as static
  # arguments and be shared by every engine over the same model architecture).
  return jax.tree.unflatten(jax.tree.structure(cache), axes)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _prefill(fns, params, cache, rows_P, tokens_PxC, start_P, n_valid_P):
  """Prefills one chunk for P slots; returns the cache and each row's last-token logits.

  Sampling is a separate program (``_sample``): it then compiles once per P, not once per
  (P, chunk, cache length).

  Padding rows repeat a real row exactly (same slot, tokens, start), so the duplicate scatter
  writes identical values and needs no scratch slot. Only the chunk's keys and values are
  written into the (donated) cache; gathering whole rows out and scattering them back cost
  more than the chunk's compute at long cache lengths.
  """
  _TRACE_COUNTS["prefill"] += 1
  C = tokens_PxC.shape[1]
  positions_PxC = start_P[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
  hidden_PxCxD, cache = fns(params, tokens_PxC, positions_PxC, cache, start_P, rows_P)
  last_PxD = jnp.take_along_axis(hidden_PxCxD, (n_valid_P - 1)[:, None, None], axis=1)[:, 0]
  return cache, fns.logits(params, last_PxD[:, None])[:, 0]


@jax.jit
def _sample(logits_PxV, temperature_P, top_p_P, top_k_P, seeds_P, positions_P, min_p_P):
  _TRACE_COUNTS["sample"] += 1
  return sampling.sample(logits_PxV, temperature_P, top_p_P, top_k_P, seeds_P, positions_P,
                         min_p_P)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _score(fns, chunk, top_k, params, cache, tokens_1xT, temperature):
  """Next-token log-probs (and top-k alternatives) at every position of one sequence.

  One prefill of the whole (padded) sequence into a fresh cache; the vocabulary projection
  runs ``chunk`` positions at a time so no [T, V] float32 block is materialised at once.
  """
  _TRACE_COUNTS["score"] += 1
  T = tokens_1xT.shape[1]
  positions_1xT = jnp.arange(T, dtype=jnp.int32)[None]
  hidden_1xTxD, _ = fns(params, tokens_1xT, positions_1xT, cache, jnp.zeros((1,), jnp.int32))
  targets_T = jnp.concatenate([tokens_1xT[0, 1:], jnp.zeros((1,), tokens_1xT.dtype)])
  hidden_NxCxD = hidden_1xTxD[0].reshape(T // chunk, chunk, -1)

  def one(args):
    h_CxD, tgt_C = args
    logits_CxV = fns.logits(params, h_CxD[None])[0]
    return sampling.score_chunk(logits_CxV, tgt_C, temperature, top_k)
  lp_NxC, top_lp, top_id = jax.lax.map(one, (hidden_NxCxD, targets_T.reshape(T // chunk, chunk)))
  return (lp_NxC.reshape(T), top_lp.reshape(T, top_k), top_id.reshape(T, top_k))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _decode(fns, n_steps, params, cache, tokens_R, lengths_R, active_R,
            temperature_R, top_p_R, top_k_R, seeds_R, min_p_R, penalties=None):
  """n_steps decode steps over the first R slots of the cache.

  Inactive rows (free, idle sessions, mid-prefill) stay in place: they write garbage just past
  their own length, which the next real write there overwrites and nothing reads.

  ``penalties`` is None (the common case: no penalty code in the program) or
  (counts_RxV, frequency_R, presence_R, repetition_R); the counts of generated tokens are
  carried through the steps. A batch with penalties compiles its own program once.
  """
  _TRACE_COUNTS["decode"] += 1
  # fns runs on the first R rows of the larger cache in place: no slice, no copy.

  def step(carry, _):
    cache, tok_R, len_R, counts_RxV = carry
    hidden_Rx1xD, cache = fns(params, tok_R[:, None], len_R[:, None], cache, len_R)
    logits_RxV = fns.logits(params, hidden_Rx1xD)[:, 0]
    if penalties is not None:
      logits_RxV = sampling.apply_penalties(logits_RxV, counts_RxV, *penalties[1:])
    new_R, logp_R = sampling.sample(logits_RxV, temperature_R, top_p_R, top_k_R, seeds_R,
                                    len_R + 1, min_p_R)
    if penalties is not None:
      counts_RxV = counts_RxV.at[jnp.arange(new_R.shape[0]), new_R].add(
          active_R.astype(counts_RxV.dtype))
    tok_R = jnp.where(active_R, new_R, tok_R)
    len_R = len_R + active_R.astype(jnp.int32)
    return (cache, tok_R, len_R, counts_RxV), (new_R, logp_R)

  counts0 = penalties[0] if penalties is not None else None
  (cache, _, _, _), (toks_NxR, logps_NxR) = jax.lax.scan(
      step, (cache, tokens_R, lengths_R, counts0), None, length=n_steps)
  return cache, toks_NxR.T, logps_NxR.T


@functools.partial(jax.jit, static_argnums=(0, 1))
def _resize(len_axes, new_len, cache):
  """The cache with its length axis cut or zero-padded to new_len (no donation: the shape
  changes, so XLA could not reuse the buffer anyway)."""
  _TRACE_COUNTS["resize"] += 1
  len_ax = _axes_tree(cache, len_axes)

  def resize(x, ax):
    if ax < 0:
      return x
    old = x.shape[ax]
    if new_len <= old:
      return jax.lax.slice_in_dim(x, 0, new_len, axis=ax)
    pad = [(0, 0)] * x.ndim
    pad[ax] = (0, new_len - old)
    return jnp.pad(x, pad)
  return jax.tree.map(resize, cache, len_ax)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def _copy_row(batch_axes, cache, src, dst):
  """The cache with slot `dst`'s rows replaced by slot `src`'s (a prefix shared across slots).

  The whole row is copied: positions past the shared prefix are stale for `dst`, as after any
  session's truncation, and are overwritten by its prefill before anything attends to them.
  """
  _TRACE_COUNTS["copy_row"] += 1
  b_ax = _axes_tree(cache, batch_axes)

  def copy(x, ax):
    row = jax.lax.dynamic_slice_in_dim(x, src, 1, axis=ax)
    return jax.lax.dynamic_update_slice_in_dim(x, row, dst, axis=ax)
  return jax.tree.map(copy, cache, b_ax)


# ---- host-side bookkeeping --------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Req:
  request: GenerateRequest
  rid: str
  prompt: list[int]
  params: SamplingParams
  limit: int
  seed: int
  stop_ids: frozenset
  loop: asyncio.AbstractEventLoop
  future: asyncio.Future
  on_token: Any = None
  out: list[int] = dataclasses.field(default_factory=list)
  logps: list[float] = dataclasses.field(default_factory=list)
  slot: int | None = None
  cached: int = 0
  decoding: bool = False
  done: bool = False


@dataclasses.dataclass(eq=False)
class _Slot:
  index: int
  tokens: list[int] = dataclasses.field(default_factory=list)   # tokens whose KV is valid
  session: str | None = None
  req: _Req | None = None
  last_used: float = 0.0
  drop_after: bool = False     # end_session() arrived while a request was running
  shareable: bool = True       # False while its KV holds tokens of replaced weights


def _buffers(x) -> set[int]:
  """Device buffer addresses of an array's local shards (empty for non-arrays)."""
  try:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
  except Exception:   # noqa: BLE001 - not a jax.Array, or a backend without raw pointers
    return set()


def _owned(params, source) -> Any:
  """`params` with every leaf that shares a device buffer with a leaf of `source` copied.

  The trainer's learner donates its state to each step: an engine array that is a view of a
  learner parameter (inference_params() returns e.g. the embedding itself when no dtype cast
  is needed) would be deleted under a rollout in flight. Only such leaves are copied; tied
  leaves (one array twice) stay one copy.
  """
  src = set()
  for leaf in jax.tree.leaves(source):
    src |= _buffers(leaf)
  copies: dict[int, Any] = {}

  def own(x):
    if not isinstance(x, jax.Array) or not (_buffers(x) & src):
      return x
    if id(x) not in copies:
      copies[id(x)] = jnp.copy(x)
    return copies[id(x)]
  return jax.tree.map(own, params)


def _common_prefix(a: list[int], b: list[int]) -> int:
  # Slice comparisons run in C: admission compares every waiting prompt with every slot (tens
  # of ~500-token prefixes per scheduler step), too slow token by token in Python.
  n = min(len(a), len(b))
  if a[:n] == b[:n]:
    return n
  lo, hi = 0, n      # a[:lo] == b[:lo] and a[:hi] != b[:hi]
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if a[lo:mid] == b[lo:mid]:
      lo = mid
    else:
      hi = mid
  return lo


class EmbeddedEngine(Engine):
  """Continuous-batching JAX engine over a model implementing the rao_jax model contract.

  Args:
    model: an nnx Module with ``init_cache``, ``forward_cached`` and ``logits``.
    config: an EngineConfig; or pass its fields as keyword arguments.
    weight_version: version recorded on results until ``update_weights`` changes it.
    **kwargs: EngineConfig fields (num_slots, max_len, ...).
  """

  def __init__(self, model, config: EngineConfig | None = None, *,
               weight_version: int | str = 0, **kwargs):
    if config is None:
      config = EngineConfig(**kwargs)
    elif kwargs:
      config = dataclasses.replace(config, **kwargs)
    self.config = config
    # The engine keeps the weights only as model.inference_params() (one dict per layer);
    # graphdef and the abstract state check and convert what update_weights() receives.
    self._graphdef, state = nnx.split(model)
    self._state_tree = jax.tree.structure(state)
    self._abstract_state = jax.eval_shape(lambda: state)
    # Own buffers: the model may be a view of a learner state that its step donates.
    self._params = _owned(model.inference_params(), state)
    fns = model.inference_fns()
    batch_ax, len_ax = _cache_axes(model)    # also checks every leaf has a batch axis
    self._len_axes = tuple(jax.tree.leaves(len_ax))
    self._copy_fn = functools.partial(_copy_row, tuple(jax.tree.leaves(batch_ax)))
    probe = jax.eval_shape(lambda: model.logits(
        model.forward_cached(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                             model.init_cache(batch_size=1, max_len=8),
                             jnp.zeros((1,), jnp.int32))[0]))
    self.vocab_size = int(probe.shape[-1])
    self._init_cache = model.init_cache
    self._version = weight_version
    c = config
    self._prefill_fn = functools.partial(_prefill, fns)
    self._decode_fn = functools.partial(_decode, fns, c.decode_steps)
    self._score_fn = functools.partial(_score, fns)
    self._resize_fns = {n: functools.partial(_resize, self._len_axes, n) for n in c.cache_lens}
    self._cache_len = c.cache_lens[0]
    self._cache = model.init_cache(batch_size=c.num_slots, max_len=self._cache_len)
    self._slots = [_Slot(i) for i in range(c.num_slots)]
    self._sessions: dict[str, int] = {}
    self._waiting: collections.deque[_Req] = collections.deque()
    self._by_rid: dict[str, _Req] = {}
    self._seed_rng = np.random.default_rng(c.seed)
    self._low_need_iters = 0
    # Everything the asyncio side hands to the scheduler thread goes through _cv.
    self._cv = threading.Condition()
    self._inbox: list[_Req] = []
    self._controls: list[tuple[Any, concurrent.futures.Future]] = []
    self._pending_weights: tuple[Any, Any] | None = None
    self._weights_applied = threading.Event()
    self._paused = False
    self._closed = False
    self._thread: threading.Thread | None = None
    self.stats = collections.Counter()

  # ---- public API ----------------------------------------------------------------------------
  @property
  def weight_version(self) -> int | str:
    return self._version

  @property
  def trace_counts(self) -> dict[str, int]:
    """How many times each device function was traced (a retrace means a compilation)."""
    return dict(_TRACE_COUNTS)

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
    req.on_token = on_token
    if req.done:     # answered at admission (e.g. the prompt already fills the context)
      return req.future.result()
    with self._cv:
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

  async def abort(self, rid: str) -> None:
    self._control(lambda: self._abort_where(lambda r: r.rid == rid, "aborted by the caller"))

  def abort_all(self, message: str = "aborted") -> None:
    """Aborts every waiting and running request (they return FinishReason.ABORT)."""
    self._control(lambda: self._abort_where(lambda r: True, message))

  async def end_session(self, session_id: str) -> None:
    def end():
      idx = self._sessions.get(session_id)
      if idx is not None:
        slot = self._slots[idx]
        if slot.req is None:
          self._free_slot(slot)
        else:
          slot.drop_after = True
    await asyncio.wrap_future(self._control(end))

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
    def flush():
      if self._waiting or self._any_running():
        return False
      for s in self._slots:
        self._free_slot(s)
      return True
    with self._cv:
      if self._inbox:
        return False
    return self._control(flush).result(timeout)

  def _control(self, fn) -> concurrent.futures.Future:
    """Runs ``fn`` on the scheduler thread between two device steps (slot state is only ever
    touched there); returns a Future of its result."""
    fut = concurrent.futures.Future()
    with self._cv:
      self._controls.append((fn, fut))
      self._ensure_thread()
      self._cv.notify()
    return fut

  def update_weights(self, params_or_model, version: int | str, *, wait: bool = True,
                     timeout: float | None = None) -> None:
    """Swaps in new parameters between two device steps.

    Args:
      params_or_model: an nnx Module of the same architecture, its nnx.State, or a pure dict
        (``nnx.State.to_pure_dict()``). Values are cast to the engine's dtypes.
      version: the new weight version recorded on results from now on.
      wait: block until the scheduler has swapped them in.
      timeout: seconds to wait at most (None: no limit).
    """
    params = self._as_params(params_or_model)
    with self._cv:
      self._weights_applied.clear()
      self._pending_weights = (params, version)
      self._ensure_thread()
      self._cv.notify()
    if wait and not self._weights_applied.wait(timeout):
      raise TimeoutError(f"update_weights(version={version!r}) was not applied within "
                         f"{timeout} s; is the scheduler paused?")

  def set_weight_version(self, version: int | str, timeout: float | None = 60.0) -> None:
    """Relabels the current weights (SGLang's /update_weight_version); results finished from
    now on carry ``version``. The weights and kept sessions are unchanged."""
    def relabel():
      self._version = version
    self._control(relabel).result(timeout)

  def warmup(self, max_cache_len: int | None = None, verbose: bool = False) -> float:
    """Compiles every shape the scheduler can use, so no compilation happens during a run.

    Args:
      max_cache_len: compile only cache buckets up to this length (the engine then never
        grows beyond it without compiling); default all buckets.
      verbose: log each compilation.

    Returns:
      Seconds spent.
    """
    t0 = time.perf_counter()
    c = self.config
    lens = [n for n in c.cache_lens if max_cache_len is None or n <= max_cache_len]
    with self._cv:   # the scheduler must not step while the shared cache is borrowed
      busy = bool(self._by_rid)
    if busy:
      raise RuntimeError("EmbeddedEngine.warmup() must run before requests are submitted.")
    i32 = functools.partial(np.zeros, dtype=np.int32)
    for S in lens:
      cache = self._init_cache(batch_size=c.num_slots, max_len=S)
      for R in c.decode_rows:
        cache, toks, _ = self._decode_fn(
            self._params, cache, i32(R), i32(R), np.zeros(R, bool), np.zeros(R, np.float32),
            np.ones(R, np.float32), -np.ones(R, np.int32), np.zeros(R, np.uint32),
            np.zeros(R, np.float32))
        if verbose:
          log.info("warmup decode S=%d R=%d", S, R)
      for P in c.prefill_rows:
        for C in c.chunk_sizes:
          if C > S and C != c.chunk_sizes[0]:
            continue   # the scheduler grows the cache before pairing it with a larger chunk
          cache, logits = self._prefill_fn(
              self._params, cache, i32(P), i32((P, C)), i32(P), np.ones(P, np.int32))
          if S == lens[0] and C == c.chunk_sizes[0]:
            _sample(logits, np.zeros(P, np.float32), np.ones(P, np.float32),
                    -np.ones(P, np.int32), np.zeros(P, np.uint32), i32(P),
                    np.zeros(P, np.float32))
      for S2 in lens:
        if S2 != S:
          self._resize_fns[S2](self._init_cache(batch_size=c.num_slots, max_len=S))
      if c.share_prefix_min:
        cache = self._copy_fn(cache, np.int32(0), np.int32(0))
      jax.block_until_ready(cache)
      del cache
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
    T = -(-_bucket(self.config.cache_lens, len(ids)) // chunk) * chunk
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :len(ids)] = ids
    # top-k is compiled for 0 or 20 alternatives only (two programs per length bucket).
    k_static = 20 if top_k else 0
    lp_T, top_lp, top_id = self._score_fn(chunk, k_static, self._params,
                                          self._init_cache(batch_size=1, max_len=T), tokens,
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
  def _make_req(self, request: GenerateRequest) -> _Req:
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
    req = _Req(request=request, rid=request.rid or uuid.uuid4().hex, prompt=prompt, params=p,
               limit=limit, seed=seed & 0xFFFFFFFF,
               stop_ids=frozenset(int(t) for t in stops), loop=loop,
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
    """New weights (Module, nnx.State or pure dict) -> inference params in the engine's dtypes."""
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

    def cast(new, old):
      if new.shape != old.shape:
        raise ValueError(f"update_weights: a parameter has shape {new.shape}, the engine's "
                         f"has {old.shape}; the configs differ.")
      return jnp.asarray(new, old.dtype)
    given = state
    state = jax.tree.map(cast, state, self._abstract_state)
    return _owned(nnx.merge(self._graphdef, state).inference_params(), given)

  # ---- scheduler thread -----------------------------------------------------------------------
  def _run(self):
    while True:
      with self._cv:
        while not (self._inbox or self._controls or self._pending_weights is not None
                   or self._closed
                   or (not self._paused and (self._waiting or self._any_running()))):
          self._cv.wait()
        inbox, self._inbox = self._inbox, []
        controls, self._controls = self._controls, []
        weights, self._pending_weights = self._pending_weights, None
        paused, closed = self._paused, self._closed
      try:
        self._waiting.extend(inbox)
        for fn, fut in controls:
          try:
            fut.set_result(fn())
          except Exception as e:   # noqa: BLE001 - handed to the caller
            fut.set_exception(e)
        if weights is not None:
          self._params, self._version = weights
          for s in self._slots:   # KV computed by old weights is stale for later turns
            if s.req is None:
              self._free_slot(s)
            else:                 # finishes on the old KV; never a source for new contexts
              s.shareable = False
          self._weights_applied.set()
        if closed:
          self._abort_where(lambda r: True, "engine closed")
          return
        if not paused:
          self._step()
      except Exception as e:   # a failed step fails its requests, not the engine
        log.exception("embedded engine step failed")
        self._fail_all(e)

  def _any_running(self):
    return any(s.req is not None for s in self._slots)

  def _abort_where(self, pred, message):
    targets = [r for r in list(self._waiting) + [s.req for s in self._slots if s.req]
               if pred(r)]
    for r in targets:
      if r in self._waiting:
        self._waiting.remove(r)
      self._finish(r, FinishReason.ABORT, message)
    # Requests handed over but not yet moved to _waiting are aborted there too.
    with self._cv:
      pending = [r for r in self._inbox if pred(r)]
      self._inbox = [r for r in self._inbox if not pred(r)]
    for r in pending:
      self._finish(r, FinishReason.ABORT, message)

  def _fail_all(self, exc):
    self._abort_where(lambda r: True, f"engine error: {exc!r}")
    for s in self._slots:
      self._free_slot(s)

  def _free_slot(self, slot: _Slot):
    if slot.session is not None and self._sessions.get(slot.session) == slot.index:
      del self._sessions[slot.session]
    slot.tokens, slot.session, slot.drop_after, slot.shareable = [], None, False, True

  def _finish(self, req: _Req, reason: FinishReason, message: str = ""):
    if req.done:
      return
    req.done = True
    result = GenerateResult(token_ids=list(req.out), logprobs=list(req.logps),
                            finish_reason=reason, weight_version=self._version,
                            prompt_len=len(req.prompt), cached_tokens=req.cached,
                            message=message)
    if req.slot is not None:
      slot = self._slots[req.slot]
      slot.req = None
      slot.last_used = time.monotonic()
      keep = req.request.session_id is not None and not slot.drop_after
      if keep:
        slot.session = req.request.session_id
        self._sessions[slot.session] = slot.index
      else:
        self._free_slot(slot)
    with self._cv:
      self._by_rid.pop(req.rid, None)
    self.stats[f"finish_{reason.value}"] += 1

    def deliver(fut=req.future, res=result):
      if not fut.done():
        fut.set_result(res)
    try:
      req.loop.call_soon_threadsafe(deliver)
    except RuntimeError:   # the caller's loop is gone; nobody is waiting
      pass

  def _shared_prefix(self, req: _Req, exclude: _Slot | None) -> tuple[_Slot | None, int]:
    """The slot whose cached tokens share the longest prefix with req's prompt, and its length
    (capped so that one prompt token is left to prefill: it yields the first logits)."""
    best, best_n = None, 0
    cap = len(req.prompt) - 1
    for s in self._slots:
      if s is not exclude and s.shareable and len(s.tokens) > best_n:
        n = min(_common_prefix(s.tokens, req.prompt), cap)
        if n > best_n:
          best, best_n = s, n
    return best, best_n

  def _wait_for_peer(self, req: _Req) -> bool:
    """Whether a slot still prefilling the same prompt prefix will soon have it to share."""
    m = self.config.share_prefix_min
    if not m:
      return False
    cap = len(req.prompt) - 1
    promised = 0    # the longest prefix a prefilling peer has yet to compute
    for s in self._slots:
      r = s.req
      if r is not None and not r.decoding and s.shareable:
        n = min(_common_prefix(r.prompt, req.prompt), cap)
        if len(s.tokens) < n:
          promised = max(promised, n)
    # Only then the cached prefixes (most scheduler steps have no prefilling peer at all).
    return promised >= m and promised - self._shared_prefix(req, None)[1] >= m

  def _admit(self):
    blocked = []
    while self._waiting:
      req = self._waiting.popleft()
      sid = req.request.session_id
      if self._wait_for_peer(req):
        blocked.append(req)
        self.stats["prefix_waits"] += 1
        continue
      slot = None
      if sid is not None and sid in self._sessions:
        cand = self._slots[self._sessions[sid]]
        if cand.req is not None:      # the session's previous turn is still running
          blocked.append(req)
          continue
        slot = cand
      if slot is None:
        free = [s for s in self._slots if s.req is None and s.session is None]
        if free:
          slot = free[0]
        else:
          idle = [s for s in self._slots if s.req is None]
          if not idle:
            blocked.append(req)
            break
          slot = min(idle, key=lambda s: s.last_used)
          self.stats["evictions"] += 1
          self._free_slot(slot)
      if sid is not None and slot.session != sid:
        # A new session takes the slot (also: a session re-admitted after eviction).
        old = self._sessions.get(sid)
        if old is not None and old != slot.index:
          self._free_slot(self._slots[old])
      reuse = min(_common_prefix(slot.tokens, req.prompt), len(req.prompt) - 1)
      if self.config.share_prefix_min:
        src, n = self._shared_prefix(req, slot)
        if src is not None and n - reuse >= self.config.share_prefix_min:
          self._cache = self._copy_fn(self._cache, np.int32(src.index), np.int32(slot.index))
          self.stats["prefix_copies"] += 1
          self.stats["prefix_copied_tokens"] += n - reuse
          reuse = n
          slot.shareable = True
      slot.tokens = req.prompt[:reuse]
      slot.req, slot.drop_after = req, False
      req.slot, req.cached = slot.index, reuse
      self.stats["prompt_tokens"] += len(req.prompt)
      self.stats["cached_tokens"] += reuse
    self._waiting.extendleft(reversed(blocked))

  def _ensure_cache_len(self, needed: int, allow_shrink: bool):
    c = self.config
    target = _bucket(c.cache_lens, needed)
    if target > self._cache_len:
      self._low_need_iters = 0
      self._cache = self._resize_fns[target](self._cache)
      self._cache_len = target
      self.stats["cache_grow"] += 1
    elif allow_shrink and target * 2 <= self._cache_len:
      self._low_need_iters += 1
      if self._low_need_iters >= c.shrink_patience:
        self._low_need_iters = 0
        self._cache = self._resize_fns[target](self._cache)
        self._cache_len = target
        self.stats["cache_shrink"] += 1
    else:
      self._low_need_iters = 0

  def _held_need(self) -> int:
    return max([len(s.tokens) + self.config.decode_steps for s in self._slots] + [1])

  def _step(self):
    self._admit()
    prefilling = [s for s in self._slots if s.req is not None and not s.req.decoding]
    if prefilling:
      self._prefill_step(prefilling)
    decoding = [s for s in self._slots if s.req is not None and s.req.decoding]
    if decoding:
      self._decode_step(decoding)

  def _chunk_for(self, slot: _Slot) -> int:
    c = self.config
    start = len(slot.tokens)
    remaining = len(slot.req.prompt) - start
    C = _bucket(c.chunk_sizes, remaining)
    if C > 2 * remaining:
      # Mostly padding (e.g. 65 tokens in a 256 chunk): take the largest chunk that is full.
      full = [b for b in c.chunk_sizes if b <= remaining]
      C = full[-1] if full else C
    fitting = [b for b in c.chunk_sizes if b <= C and start + b <= c.max_len]
    return fitting[-1]    # never empty: capacity leaves room for the smallest chunk

  def _prefill_step(self, prefilling: list[_Slot]):
    c = self.config
    prefilling.sort(key=lambda s: s.last_used)
    C = self._chunk_for(prefilling[0])
    group = [s for s in prefilling if self._chunk_for(s) == C][:c.prefill_rows[-1]]
    P = _bucket(c.prefill_rows, len(group))
    need = max(len(s.tokens) + C for s in group)
    self._ensure_cache_len(max(need, self._held_need()), allow_shrink=False)
    rows = np.zeros(P, np.int32)
    tokens = np.zeros((P, C), np.int32)
    start = np.zeros(P, np.int32)
    n_valid = np.ones(P, np.int32)
    temp = np.zeros(P, np.float32)
    top_p = np.ones(P, np.float32)
    top_k = -np.ones(P, np.int32)
    seeds = np.zeros(P, np.uint32)
    min_p = np.zeros(P, np.float32)
    pieces = []
    for i in range(P):
      s = group[min(i, len(group) - 1)]    # padding rows repeat the last real row exactly
      r = s.req
      a = len(s.tokens)
      piece = r.prompt[a:a + C]
      if i < len(group):
        pieces.append(piece)
      rows[i], start[i], n_valid[i] = s.index, a, len(piece)
      tokens[i, :len(piece)] = piece
      temp[i], top_p[i], top_k[i] = r.params.temperature, r.params.top_p, r.params.top_k
      seeds[i], min_p[i] = r.seed, r.params.min_p
    if P > len(group):   # identical duplicates: the duplicate scatter then writes equal values
      rows[len(group):], tokens[len(group):] = rows[len(group) - 1], tokens[len(group) - 1]
    self._cache, logits_PxV = self._prefill_fn(self._params, self._cache, rows, tokens, start,
                                               n_valid)
    # The first generated token has no earlier output, so the penalties (over generated
    # tokens only) cannot change it: prefill samples without them.
    tok_P, logp_P = _sample(logits_PxV, temp, top_p, top_k, seeds, start + n_valid, min_p)
    tok_P, logp_P = np.asarray(tok_P), np.asarray(logp_P)
    self.stats["prefill_calls"] += 1
    self.stats["prefill_tokens"] += sum(len(p) for p in pieces)
    for i, s in enumerate(group):
      r = s.req
      s.tokens.extend(pieces[i])
      s.last_used = time.monotonic()
      if len(s.tokens) == len(r.prompt):
        r.decoding = True
        self._accept(r, int(tok_P[i]), float(logp_P[i]))

  def _accept(self, r: _Req, token: int, logp: float) -> bool:
    """Records one sampled token; finishes the request when a limit is hit."""
    r.out.append(token)
    r.logps.append(logp)
    hook_stop = False
    if r.on_token is not None:
      try:
        hook_stop = bool(r.on_token(r.out, r.logps))
      except Exception as e:  # noqa: BLE001 - the caller's hook fails its request only
        log.exception("on_token hook of request %s failed", r.rid)
        self._finish(r, FinishReason.ABORT, f"on_token hook failed: {e!r}")
        return True
    if token in r.stop_ids or hook_stop:
      self._finish(r, FinishReason.STOP)
    elif len(r.out) >= r.params.max_new_tokens:
      self._finish(r, FinishReason.LENGTH)
    elif len(r.prompt) + len(r.out) >= r.limit:
      self._finish(r, FinishReason.CONTEXT,
                   f"context limit of {r.limit} tokens reached")
    return r.done

  def _decode_step(self, decoding: list[_Slot]):
    c = self.config
    R = _bucket(c.decode_rows, max(s.index for s in decoding) + 1)
    self._ensure_cache_len(self._held_need(), allow_shrink=True)
    tokens = np.zeros(R, np.int32)
    lengths = np.zeros(R, np.int32)
    active = np.zeros(R, bool)
    temp = np.zeros(R, np.float32)
    top_p = np.ones(R, np.float32)
    top_k = -np.ones(R, np.int32)
    seeds = np.zeros(R, np.uint32)
    min_p = np.zeros(R, np.float32)
    penalized = [s for s in decoding if s.req.params.penalized]
    penalties = None
    if penalized:
      counts = np.zeros((R, self.vocab_size), np.float32)
      freq, pres, rep = (np.zeros(R, np.float32), np.zeros(R, np.float32),
                         np.ones(R, np.float32))
      for s in penalized:
        p = s.req.params
        np.add.at(counts[s.index], np.asarray(s.req.out, np.int64), 1.0)
        freq[s.index], pres[s.index], rep[s.index] = (p.frequency_penalty, p.presence_penalty,
                                                      p.repetition_penalty)
      penalties = (counts, freq, pres, rep)
    for s in self._slots[:R]:
      lengths[s.index] = len(s.tokens)
    for s in decoding:
      r = s.req
      i = s.index
      tokens[i], active[i] = r.out[-1], True
      temp[i], top_p[i], top_k[i], seeds[i] = (r.params.temperature, r.params.top_p,
                                               r.params.top_k, r.seed)
      min_p[i] = r.params.min_p
    self._cache, toks_RxN, logps_RxN = self._decode_fn(
        self._params, self._cache, tokens, lengths, active, temp, top_p, top_k, seeds, min_p,
        penalties)
    toks_RxN, logps_RxN = np.asarray(toks_RxN), np.asarray(logps_RxN)
    self.stats["decode_calls"] += 1
    now = time.monotonic()
    for s in decoding:
      r = s.req
      for n in range(c.decode_steps):
        s.tokens.append(r.out[-1])      # the token just fed now has its KV in the cache
        if self._accept(r, int(toks_RxN[s.index, n]), float(logps_RxN[s.index, n])):
          break
      s.last_used = now
    self.stats["decode_tokens"] += len(decoding) * c.decode_steps


__all__ = ["EmbeddedEngine", "EngineConfig"]
