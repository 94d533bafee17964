"""Causal attention of packed rows over themselves on x86 CPUs: MKL kernels through XLA FFI.

``causal_attention(q, k, v, segment_ids)`` is what ``attention.xla_causal_attention`` computes
(query i sees key j iff j <= i in the same segment; grouped-query heads), for float32 on CPU,
by the handlers of ``csrc/mkl_attention.cc``: q, k, v and the output stay in the model's
[B, T, heads, h] layout, the mask comes from the segment ids inside the softmax loop, and the
backward pass recomputes the probabilities from the saved log-sum-exp (flash attention's
scheme: nothing of size T x T is stored). In place of XLA's masked, blocked attention it made the
4 x 512 SmolLM2 training step 3.5% faster (MKL's products in both; in-process A/B on an AMD
EPYC with ModelConfig.kernels="mkl"). ``usable``
says when it applies; ``attention.causal_attention`` calls it in the CPU lowering only (bfloat16
or no MKL kernels: XLA's version; GPU and TPU: their Pallas kernels).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rao_jax.kernels import mkl


def usable(dtype, mode: str) -> bool:
  """Whether kernel choice ``mode`` runs ``causal_attention`` here for activations of ``dtype``."""
  return jnp.dtype(dtype) == jnp.float32 and mkl.active(mode)


def _scale(h: int) -> np.float32:
  return np.float32(h ** -0.5)


def _forward(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segment_ids_BxT):
  B, T, H, h = q_BxTxHxh.shape
  out = (jax.ShapeDtypeStruct((B, T, H, h), jnp.float32),
         jax.ShapeDtypeStruct((B, H, T), jnp.float32))        # output, log-sum-exp
  return jax.ffi.ffi_call(mkl.ATTENTION_FWD, out, vmap_method="sequential")(
      q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segment_ids_BxT, scale=_scale(h))


@jax.custom_vjp
def _attention(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segment_ids_BxT):
  return _forward(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segment_ids_BxT)[0]


def _attention_fwd(q, k, v, segment_ids):
  out, lse = _forward(q, k, v, segment_ids)
  return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(res, d_out_BxTxHxh):
  q, k, v, segment_ids, out, lse = res
  B, T, H, h = q.shape
  K = k.shape[2]
  grads = (jax.ShapeDtypeStruct((B, T, H, h), jnp.float32),) * 3
  dq, dk_heads, dv_heads = jax.ffi.ffi_call(mkl.ATTENTION_BWD, grads,
                                            vmap_method="sequential")(
      q, k, v, segment_ids, out, lse, d_out_BxTxHxh.astype(jnp.float32), scale=_scale(h))
  # The kernel gives k and v one gradient per query head (each of its tasks then owns what it
  # writes); the g query heads of a key/value head add up here.
  dk = dk_heads.reshape(B, T, K, H // K, h).sum(3)
  dv = dv_heads.reshape(B, T, K, H // K, h).sum(3)
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def causal_attention(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segment_ids_BxT):
  """softmax(q k^T / sqrt(h) + causal segment mask) v, float32 [B, T, H, h]; differentiable.

  Args:
    q_BxTxHxh: queries (after RoPE), float32.
    k_BxTxKxh, v_BxTxKxh: keys (after RoPE) and values; H must be a multiple of K.
    segment_ids_BxT: int; a query sees earlier keys of its own segment id only.
  """
  B, T, H, h = q_BxTxHxh.shape
  if k_BxTxKxh.shape != v_BxTxKxh.shape or k_BxTxKxh.shape[:2] != (B, T) \
      or k_BxTxKxh.shape[3] != h or H % k_BxTxKxh.shape[2]:
    raise ValueError(f"causal_attention: q {q_BxTxHxh.shape}, k {k_BxTxKxh.shape} and "
                     f"v {v_BxTxKxh.shape} do not fit [B, T, H, h] / [B, T, K, h], K | H")
  if segment_ids_BxT.shape != (B, T):
    raise ValueError(f"causal_attention: segment ids {segment_ids_BxT.shape}, expected {(B, T)}")
  try:
    mkl.registered()
  except mkl.CpuKernelsUnavailable as e:
    raise mkl.CpuKernelsUnavailable(
        f"causal_attention needs the MKL kernels, which cannot be used here ({e}); call it "
        "where usable(dtype, mode) is True") from e
  return _attention(q_BxTxHxh.astype(jnp.float32), k_BxTxKxh.astype(jnp.float32),
                    v_BxTxKxh.astype(jnp.float32), segment_ids_BxT.astype(jnp.int32))
