"""Log-probabilities of target tokens under a model's LM head, in chunks.

``token_logprobs`` gives log softmax(logits / temperature)[target] per position;
``token_logprob_sum`` gives the coefficient-weighted sum the policy-gradient loss needs, with
its gradient fused into the forward pass. Both work on the final hidden states
(``Transformer.__call__``) and the model's head weight, chunk the B*T positions so that no
[B, T, V] float32 array exists, and skip chunks that hold no loss position. Their own module:
the learner, the rollout correction and the tests read log-probs without the decoder's
internals.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from rao_jax.kernels.matmul import dense

if TYPE_CHECKING:
  from rao_jax.model.transformer import Transformer


def _chunk_logits(hidden_NxD, targets_N, w_VxD, temperature, kernels):
  """(logits / temperature [N, V], their logsumexp [N], target log-probs [N]), float32."""
  logits_NxV = dense(hidden_NxD, w_VxD, trans_b=True, preferred_element_type=jnp.float32,
                     kernels=kernels)
  logits_NxV = logits_NxV / temperature
  lse_N = jax.nn.logsumexp(logits_NxV, axis=-1)
  tgt_N = jnp.take_along_axis(logits_NxV, targets_N[:, None], axis=-1)[:, 0]
  return logits_NxV, lse_N, tgt_N - lse_N


def _chunk_logprobs(hidden_NxD, targets_N, w_VxD, temperature, kernels):
  return _chunk_logits(hidden_NxD, targets_N, w_VxD, temperature, kernels)[2]


def _in_chunks(chunk: int, *arrays):
  """Each [N, ...] array zero-padded to C * chunk rows and reshaped [C, chunk, ...]."""
  n = arrays[0].shape[0]
  n_chunks = -(-n // chunk)
  pad = n_chunks * chunk - n
  return tuple(jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(
      (n_chunks, chunk) + a.shape[1:]) for a in arrays)


def _loss_positions_first(chunk: int, mask_N, *arrays_N):
  """The arrays gathered with the positions of ``mask_N`` first (in order), in chunks.

  Returns (chunked arrays [C, chunk, ...], order [N], live [C]): chunk c is live when it holds a
  masked position. The LM head and log-softmax then run on live chunks only: a prompt position
  carries no loss, and in an agent's packed nodes most positions are prompts and observations.
  Fixed shapes (C is N / chunk rounded up), so the step compiles once whatever the mask.
  """
  order_N = jnp.argsort(jnp.logical_not(mask_N), stable=True)
  chunked = _in_chunks(chunk, *(jnp.take(a, order_N, axis=0) for a in arrays_N))
  n_live = jnp.sum(mask_N.astype(jnp.int32))
  live_C = jnp.arange(chunked[0].shape[0]) * chunk < n_live
  return chunked, order_N, live_C


def _unsort(order_N, values_CxN, n: int):
  """Values computed in ``order_N`` put back at their positions, [N]."""
  return jnp.zeros((n,), values_CxN.dtype).at[order_N].set(values_CxN.reshape(-1)[:n])


def token_logprobs(model: Transformer, hidden_BxTxD, targets_BxT, temperature: float = 1.0,
                   chunk: int | None = None, mask_BxT=None):
  """log softmax(logits / temperature)[target] per position, float32 [B, T].

  The B*T positions are processed in chunks of ``chunk`` tokens (default cfg.logits_chunk);
  each chunk's [chunk, V] logits are recomputed in the backward pass instead of stored, so no
  full [B, T, V] float32 array is ever materialised. Differentiable w.r.t. hidden and weights.

  Args:
    model: the Transformer (its LM head is used).
    hidden_BxTxD: final-normed hidden states from ``model(...)`` or ``forward_cached``.
    targets_BxT: int target ids (any value at masked positions; they are still computed).
    temperature: softmax temperature (a float or a scalar array; > 0).
    chunk: tokens per chunk.
    mask_BxT: bool, the positions wanted (None: all). Only those run through the LM head;
      the others come back as 0.
  """
  B, T, D = hidden_BxTxD.shape
  n = B * T
  chunk = min(chunk or model.cfg.logits_chunk, n)
  w = model.head_weight().astype(model.cfg.jnp_dtype)
  h_NxD = hidden_BxTxD.reshape(n, D)
  t_N = targets_BxT.reshape(n).astype(jnp.int32)
  temperature = jnp.asarray(temperature, jnp.float32)
  kernels = model.cfg.kernels
  if mask_BxT is not None:
    (h, t), order_N, live_C = _loss_positions_first(chunk, mask_BxT.reshape(n), h_NxD, t_N)
    fn = jax.checkpoint(lambda hc, tc, live: jax.lax.cond(
        live, lambda: _chunk_logprobs(hc, tc, w, temperature, kernels),
        lambda: jnp.zeros(tc.shape, jnp.float32)))
    out = jax.lax.map(lambda a: fn(*a), (h, t, live_C))
    return jnp.where(mask_BxT, _unsort(order_N, out, n).reshape(B, T), 0.0)
  if chunk >= n:
    return _chunk_logprobs(h_NxD, t_N, w, temperature, kernels).reshape(B, T)
  h, t = _in_chunks(chunk, h_NxD, t_N)
  fn = jax.checkpoint(lambda hc, tc: _chunk_logprobs(hc, tc, w, temperature, kernels))
  out = jax.lax.map(lambda a: fn(*a), (h, t))
  return out.reshape(-1)[:n].reshape(B, T)


def token_logprob_sum(model: Transformer, hidden_BxTxD, targets_BxT, coef_BxT,
                      temperature: float = 1.0, chunk: int | None = None, mask_BxT=None):
  """``sum(coef * logp)`` and ``logp`` [B, T], for losses linear in the log-probs.

  ``logp`` equals ``token_logprobs(...)``; only the sum is differentiable (``logp`` comes back
  under ``stop_gradient``; ``coef`` and ``temperature`` are constants). Under differentiation
  the gradient of the sum is computed chunk by chunk during the forward pass (a fused linear
  cross-entropy): each chunk's [chunk, V] logits serve the value and both gradients, then are
  dropped. ``token_logprobs`` cannot know its cotangents that early and recomputes the logits
  in the backward pass instead: one LM-head product more (on SmolLM2, as many flops as 8 of
  its 30 blocks). Use this form when the coefficients are known before the forward pass (NLL,
  the RAO REINFORCE loss); a loss that weighs tokens by their own log-probs (PPO, CISPO) uses
  ``token_logprobs``.

  Args:
    model: the Transformer (its LM head is used).
    hidden_BxTxD: final-normed hidden states from ``model(...)``.
    targets_BxT: int target ids.
    coef_BxT: float coefficient of each position's log-prob (0 where it does not count).
    temperature: softmax temperature (> 0).
    chunk: tokens per chunk (default cfg.logits_chunk).
    mask_BxT: bool, the positions that carry a loss (None: all). Only those run through the LM
      head; the coefficients elsewhere must be 0, and their ``logp`` comes back as 0.

  Returns:
    (float32 scalar sum, float32 logp [B, T]).
  """
  B, T, D = hidden_BxTxD.shape
  n = B * T
  chunk = min(chunk or model.cfg.logits_chunk, n)
  arrays = (hidden_BxTxD.reshape(n, D), targets_BxT.reshape(n).astype(jnp.int32),
            jax.lax.stop_gradient(coef_BxT).reshape(n).astype(jnp.float32))
  if mask_BxT is None:
    # Padding positions get coefficient 0: they add nothing to the sum or the gradients.
    (h, t, c), live_C = _in_chunks(chunk, *arrays), None
  else:
    (h, t, c), order_N, live_C = _loss_positions_first(chunk, mask_BxT.reshape(n), *arrays)
  w = model.head_weight().astype(model.cfg.jnp_dtype)
  temperature = jax.lax.stop_gradient(jnp.asarray(temperature, jnp.float32))
  if live_C is None:
    live_C = jnp.ones((h.shape[0],), bool)
  total, logp = _fused_logprob_sum(h, w, t, c, live_C, temperature, model.cfg.kernels)
  if mask_BxT is None:
    logp_BxT = logp.reshape(-1)[:n].reshape(B, T)
  else:   # a live chunk's tail may hold unmasked positions: 0 there, as documented
    logp_BxT = jnp.where(mask_BxT, _unsort(order_N, logp, n).reshape(B, T), 0.0)
  return total, jax.lax.stop_gradient(logp_BxT)


def _when_live(live, fn, zeros, *args):
  """fn(*args) for a live chunk, else ``zeros`` (the LM head is skipped)."""
  return jax.lax.cond(live, lambda: fn(*args), lambda: zeros)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fused_logprob_sum(h_CxNxD, w_VxD, t_CxN, c_CxN, live_C, temperature, kernels):
  """(sum c * logp, logp [C, N]) over C chunks of N positions (chunks not ``live_C`` give 0);
  see token_logprob_sum."""
  logp = jax.lax.map(lambda a: _when_live(
      a[2], lambda: _chunk_logprobs(a[0], a[1], w_VxD, temperature, kernels),
      jnp.zeros(a[1].shape, jnp.float32)), (h_CxNxD, t_CxN, live_C))
  return jnp.sum(c_CxN * logp), logp


def _fused_logprob_sum_fwd(h_CxNxD, w_VxD, t_CxN, c_CxN, live_C, temperature, kernels):
  mm = functools.partial(dense, kernels=kernels)

  def live_chunk(dw_VxD, h_NxD, t_N, c_N):
    logits_NxV, lse_N, logp_N = _chunk_logits(h_NxD, t_N, w_VxD, temperature, kernels)
    # d(c logp)/d(h W^T) = k (onehot(t) - softmax) with k = c / temperature. The onehot part is
    # a row gather (for dh) and a row scatter-add (for dw), not a dense [N, V] term.
    k_N = c_N / temperature
    kp_NxV = (jnp.exp(logits_NxV - lse_N[:, None]) * k_N[:, None]).astype(w_VxD.dtype)
    k_Nx1 = k_N[:, None].astype(h_NxD.dtype)
    dh_NxD = (jnp.take(w_VxD, t_N, axis=0) * k_Nx1
              - mm(kp_NxV, w_VxD, preferred_element_type=jnp.float32).astype(h_NxD.dtype))
    dw_VxD = dw_VxD - mm(kp_NxV, h_NxD, trans_a=True, preferred_element_type=jnp.float32)
    dw_VxD = dw_VxD.at[t_N].add((h_NxD * k_Nx1).astype(jnp.float32))
    return dw_VxD, (logp_N, dh_NxD)

  def chunk(dw_VxD, xs):
    h_NxD, t_N, c_N, live = xs
    zeros = (dw_VxD, (jnp.zeros(t_N.shape, jnp.float32), jnp.zeros_like(h_NxD)))
    return _when_live(live, live_chunk, zeros, dw_VxD, h_NxD, t_N, c_N)

  dw, (logp, dh) = jax.lax.scan(chunk, jnp.zeros(w_VxD.shape, jnp.float32),
                                (h_CxNxD, t_CxN, c_CxN, live_C))
  return (jnp.sum(c_CxN * logp), logp), (dh, dw.astype(w_VxD.dtype), logp, temperature)


def _fused_logprob_sum_bwd(kernels, res, cts):
  dh, dw, logp, temperature = res
  ct = cts[0]   # logp leaves token_logprob_sum under stop_gradient: its cotangent is zero
  return (ct.astype(dh.dtype) * dh, ct.astype(dw.dtype) * dw, None, ct * logp, None,
          jnp.zeros_like(temperature))


_fused_logprob_sum.defvjp(_fused_logprob_sum_fwd, _fused_logprob_sum_bwd)
