"""The embedded engine's device side: batch structs and pure jitted programs.

Every program is a pure function of the weights (``params``), the KV cache and a struct
dataclass of host-built arrays, jitted once per bucketed shape. The engine's cache is a pool of
pages (``rao_jax.kernels.paged``); each batch carries its rows' page tables:

  * ``prefill``: P rows x C prompt tokens (``PrefillBatch``) written into their pages;
    returns each row's last-token logits;
  * ``sample``: one token per row from logits (``SamplingArrays``), a separate program so it
    compiles once per P, not once per (P, chunk, view length);
  * ``decode``: ``n_steps`` tokens for R rows (``DecodeBatch``, ``SamplingArrays`` and
    optional ``Penalties``);
  * ``score``: next-token log-probs of one sequence in a fresh (contiguous) cache;
  * ``copy_page``: one page's KV copied onto another (a context's private copy of a page it
    shared, before it writes there).

The programs are module-level, so every engine over the same model architecture shares their
compilations. Traces are counted per engine: an engine marks its threads with
``counting(counter)`` and each trace adds to the counter of the thread that caused it.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rao_jax.rollout import sampling
from rao_jax.rollout.base import SamplingParams

# ---- per-engine trace counts ------------------------------------------------------------------
_tracing = threading.local()


def _traced(name: str) -> None:
  # Runs at trace time only (a Python side effect inside a jitted function).
  counter = getattr(_tracing, "counter", None)
  if counter is not None:
    counter[name] += 1


@contextlib.contextmanager
def counting(counter: collections.Counter):
  """Traces of the programs on this thread count into ``counter`` while the block runs."""
  prev = getattr(_tracing, "counter", None)
  _tracing.counter = counter
  try:
    yield counter
  finally:
    _tracing.counter = prev


def count_traces_on_this_thread(counter: collections.Counter) -> None:
  """From now on, traces on this thread count into ``counter`` (a scheduler thread's own)."""
  _tracing.counter = counter


# ---- batch structs (pytrees; numpy leaves on the host, traced inside the programs) -----------
@struct.dataclass
class SamplingArrays:
  """Per-row sampling parameters. Build them with ``sampling_arrays`` only."""
  temperature_R: Any
  top_p_R: Any
  top_k_R: Any
  seeds_R: Any
  min_p_R: Any

  def sample(self, logits_RxV, positions_R):
    """(token_R, logp_R) drawn from each row's distribution (see ``sampling.sample``)."""
    return sampling.sample(logits_RxV, self.temperature_R, self.top_p_R, self.top_k_R,
                           self.seeds_R, positions_R, self.min_p_R)


def sampling_arrays(n: int, rows: Sequence[tuple[int, SamplingParams, int]] = ()
                    ) -> SamplingArrays:
  """The one place sampling arrays are built.

  Args:
    n: rows of the batch.
    rows: ``(row, params, seed)`` of the rows that sample; the others get greedy defaults
      (their tokens are discarded).
  """
  temp = np.zeros(n, np.float32)
  top_p = np.ones(n, np.float32)
  top_k = -np.ones(n, np.int32)
  seeds = np.zeros(n, np.uint32)
  min_p = np.zeros(n, np.float32)
  for i, p, seed in rows:
    temp[i], top_p[i], top_k[i], seeds[i], min_p[i] = (p.temperature, p.top_p, p.top_k, seed,
                                                       p.min_p)
  return SamplingArrays(temp, top_p, top_k, seeds, min_p)


@struct.dataclass
class PrefillBatch:
  """P rows of one prompt chunk of C tokens.

  Attributes:
    pages_PxV: each row's page table over the view it attends to (V pages, -1 past the row's
      pages). Padding rows repeat a real row exactly (pages, tokens, start), so the duplicate
      scatter writes identical values.
    tokens_PxC: the chunk (zeros past each row's n_valid).
    start_P: cache position of each row's first chunk token (tokens the row already holds).
    n_valid_P: real tokens of each row's chunk (>= 1).
  """
  pages_PxV: Any
  tokens_PxC: Any
  start_P: Any
  n_valid_P: Any

  @classmethod
  def zeros(cls, P: int, C: int, V: int) -> PrefillBatch:
    i32 = functools.partial(np.zeros, dtype=np.int32)
    return cls(np.full((P, V), -1, np.int32), i32((P, C)), i32(P), np.ones(P, np.int32))


@struct.dataclass
class DecodeBatch:
  """R rows, of which the active ones decode.

  Attributes:
    tokens_R: each active row's last token (not yet in the cache).
    lengths_R: tokens each row holds (its next write position).
    active_R: rows that decode; the others are padding (their tables name no page: their
      writes are dropped, their outputs discarded).
    pages_RxW: each row's page table, W = ``EngineConfig.pages_per_row`` (-1 past its pages).
  """
  tokens_R: Any
  lengths_R: Any
  active_R: Any
  pages_RxW: Any

  @classmethod
  def zeros(cls, R: int, W: int) -> DecodeBatch:
    return cls(np.zeros(R, np.int32), np.zeros(R, np.int32), np.zeros(R, bool),
               np.full((R, W), -1, np.int32))


@struct.dataclass
class Penalties:
  """What changes a row's logits before sampling: SGLang's repetition-type penalties over its
  generated tokens, and the masking of its stop ids before ``min_new_tokens``.

  Attributes:
    counts_RxV: times each token was generated so far (carried through the decode steps).
    frequency_R / presence_R / repetition_R: see ``SamplingParams``.
    stops_RxV: the row's stop ids (True), masked while ``min_left_R`` > 0.
    min_left_R: tokens the row must still generate before a stop id may be drawn (counted
      down through the decode steps).
  """
  counts_RxV: Any
  frequency_R: Any
  presence_R: Any
  repetition_R: Any
  stops_RxV: Any
  min_left_R: Any

  def apply(self, logits_RxV, counts_RxV, min_left_R):
    logits_RxV = sampling.apply_penalties(logits_RxV, counts_RxV, self.frequency_R,
                                          self.presence_R, self.repetition_R)
    return jnp.where(self.stops_RxV & (min_left_R > 0)[:, None], -jnp.inf, logits_RxV)


def penalties(R: int, vocab_size: int,
              rows: Sequence[tuple[int, SamplingParams, list[int], Any]]) -> Penalties | None:
  """Penalty arrays of the rows ``(row, params, generated ids, stop ids)`` that need any (a
  penalty, or stop ids still masked by ``min_new_tokens``); None when none does (the programs
  then hold no penalty code)."""
  rows = [r for r in rows
          if r[1].penalized or (r[1].min_new_tokens > len(r[2]) and r[3])]
  if not rows:
    return None
  counts = np.zeros((R, vocab_size), np.float32)
  stops = np.zeros((R, vocab_size), bool)
  freq, pres, rep = np.zeros(R, np.float32), np.zeros(R, np.float32), np.ones(R, np.float32)
  left = np.zeros(R, np.int32)
  for i, p, out, stop_ids in rows:
    np.add.at(counts[i], np.asarray(out, np.int64), 1.0)
    freq[i], pres[i], rep[i] = p.frequency_penalty, p.presence_penalty, p.repetition_penalty
    ids = [t for t in stop_ids if 0 <= t < vocab_size]
    stops[i, ids] = True
    left[i] = max(p.min_new_tokens - len(out), 0)
  return Penalties(counts, freq, pres, rep, stops, left)


@struct.dataclass
class DeviceState:
  """What the engine keeps on the device: the weights it serves and the KV cache.

  Attributes:
    params: ``model.inference_params()``, owned by the engine (copied at every weight sync).
    cache: the page pool, ``model.init_cache(batch_size=num_pages, max_len=page_size)``;
      donated to the programs that write it.
  """
  params: Any
  cache: Any


# ---- cache axes -------------------------------------------------------------------------------
def page_axes(model) -> tuple[int, ...]:
  """The page (batch) axis of each cache leaf, in leaf order, found by comparing two abstract
  caches. A flat tuple is hashable, so ``copy_page`` takes it as a static argument."""
  a = jax.eval_shape(lambda: model.init_cache(batch_size=2, max_len=8))
  b = jax.eval_shape(lambda: model.init_cache(batch_size=3, max_len=8))
  axes = []
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    hits = [i for i, (p, q) in enumerate(zip(x.shape, y.shape)) if (p, q) == (2, 3)]
    if not hits:
      raise ValueError("model.init_cache returned a leaf without a batch axis; the engine "
                       "needs every cache array to have one (its pages).")
    axes.append(hits[0])
  return tuple(axes)


# ---- programs ---------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def prefill(fns, params, cache, batch: PrefillBatch):
  """Prefills one chunk for P rows; returns the cache and each row's last-token logits.

  Only the chunk's keys and values are written into the (donated) pool, through each row's
  page table; the attention reads the row's V pages gathered (``kernels.paged.view``).
  """
  _traced("prefill")
  C = batch.tokens_PxC.shape[1]
  positions_PxC = batch.start_P[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
  hidden_PxCxD, cache = fns(params, batch.tokens_PxC, positions_PxC, cache, batch.start_P,
                            pages_BxW=batch.pages_PxV)
  last_PxD = jnp.take_along_axis(hidden_PxCxD, (batch.n_valid_P - 1)[:, None, None],
                                 axis=1)[:, 0]
  return cache, fns.logits(params, last_PxD[:, None])[:, 0]


@jax.jit
def sample(logits_PxV, arrays: SamplingArrays, positions_P, penalties: Penalties | None = None):
  """One token per row (and its logprob); with penalties (a prefill's first token: nothing
  generated yet, so only the stop-id mask of ``min_new_tokens`` can act) a program of its own."""
  _traced("sample")
  if penalties is not None:
    logits_PxV = penalties.apply(logits_PxV, penalties.counts_RxV, penalties.min_left_R)
  return arrays.sample(logits_PxV, positions_P)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def decode(fns, n_steps: int, params, cache, batch: DecodeBatch, arrays: SamplingArrays,
           penalties: Penalties | None = None):
  """n_steps decode steps of R rows, each reading and writing its pages of the (donated) pool
  in place (the platform's paged decode attention reads only the live ones).

  Returns (cache, tokens_RxN, logps_RxN). A batch with penalties compiles its own program.
  """
  _traced("decode")
  active_R = batch.active_R

  def step(carry, _):
    cache, tok_R, len_R, counts_RxV, left_R = carry
    hidden_Rx1xD, cache = fns(params, tok_R[:, None], len_R[:, None], cache, len_R,
                              pages_BxW=batch.pages_RxW)
    logits_RxV = fns.logits(params, hidden_Rx1xD)[:, 0]
    if penalties is not None:
      logits_RxV = penalties.apply(logits_RxV, counts_RxV, left_R)
    new_R, logp_R = arrays.sample(logits_RxV, len_R + 1)
    if penalties is not None:
      counts_RxV = counts_RxV.at[jnp.arange(new_R.shape[0]), new_R].add(
          active_R.astype(counts_RxV.dtype))
      left_R = left_R - active_R.astype(left_R.dtype)
    tok_R = jnp.where(active_R, new_R, tok_R)
    len_R = len_R + active_R.astype(jnp.int32)
    return (cache, tok_R, len_R, counts_RxV, left_R), (new_R, logp_R)

  counts0 = penalties.counts_RxV if penalties is not None else None
  left0 = penalties.min_left_R if penalties is not None else None
  (cache, _, _, _, _), (toks_NxR, logps_NxR) = jax.lax.scan(
      step, (cache, batch.tokens_R, batch.lengths_R, counts0, left0), None, length=n_steps)
  return cache, toks_NxR.T, logps_NxR.T


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def score(fns, chunk: int, top_k: int, params, cache, tokens_1xT, temperature):
  """Next-token log-probs (and top-k alternatives) at every position of one sequence.

  One prefill of the whole (padded) sequence into a fresh cache; the vocabulary projection
  runs ``chunk`` positions at a time so no [T, V] float32 block is materialised at once.
  """
  _traced("score")
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


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def copy_page(page_axes_: tuple[int, ...], cache, src, dst):
  """The pool with page `dst` replaced by page `src` (a context's own copy of a page it
  shared, made before it writes into it)."""
  _traced("copy_page")

  def one(x, ax):
    page = jax.lax.dynamic_slice_in_dim(x, src, 1, axis=ax)
    return jax.lax.dynamic_update_slice_in_dim(x, page, dst, axis=ax)
  return jax.tree.map(one, cache, jax.tree.unflatten(jax.tree.structure(cache), page_axes_))


__all__ = ["DecodeBatch", "DeviceState", "Penalties", "PrefillBatch", "SamplingArrays",
           "copy_page", "counting", "decode", "page_axes", "penalties", "prefill", "sample",
           "sampling_arrays", "score"]
