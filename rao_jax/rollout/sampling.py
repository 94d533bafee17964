"""Device-side sampling for the embedded engine: pure, jittable, one set of parameters per row.

Every per-request value (temperature, top-p, top-k, seed, position) is an array, so a batch
mixing greedy and sampled rows, or changing its mix between steps, reuses one compiled program.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _mix32(x):
  """A 32-bit integer finaliser (murmur3-style avalanche); uint32 in, uint32 out."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def gumbel_noise(seeds_B, positions_B, V: int):
  """Gumbel(0, 1) noise [B, V], a pure function of (seed, position, token id).

  A counter-based hash instead of jax.random: keyed by the token's absolute position (not the
  engine step), a seeded request samples the same tokens whatever else shares its batch and
  however its prompt was chunked; and on CPU the hash compiles in a fraction of a second and
  runs several times faster than threefry over a [B, V] block, which matters every step.
  """
  row_B = _mix32(seeds_B.astype(jnp.uint32) * jnp.uint32(0x9E3779B1)
                 + _mix32(positions_B.astype(jnp.uint32) + jnp.uint32(0x632BE5AB)))
  idx_V = jnp.arange(V, dtype=jnp.uint32) * jnp.uint32(0x85EBCA77)
  bits_BxV = _mix32(_mix32(row_B[:, None] ^ idx_V[None, :]) + row_B[:, None])
  # 23 high bits -> a uniform strictly inside (0, 1): (k + 0.5) / 2^23 is exact in float32 for
  # every k < 2^23. With 24 bits, (2^24 - 1) + 0.5 rounded to 2^24, u to 1.0 and the noise to
  # +inf: one token in 2^24 won whatever its probability (a garbage word every ~3 steps at a
  # 49k vocabulary).
  u_BxV = ((bits_BxV >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
  return -jnp.log(-jnp.log(u_BxV))


def _cumsum_last(x_BxV, block: int = 256):
  """Inclusive cumulative sum over the last axis as two small triangular matmuls.

  XLA:CPU lowers jnp.cumsum over a 50k vocabulary to a reduce-window that takes over a second
  to compile (per shape); two matmuls compile in milliseconds and cost ~B*V*block flops.
  """
  B, V = x_BxV.shape
  nb = -(-V // block)
  x_BxNxK = jnp.pad(x_BxV, ((0, 0), (0, nb * block - V))).reshape(B, nb, block)
  tri_KxK = jnp.triu(jnp.ones((block, block), x_BxV.dtype))            # [j, i]: j <= i
  within_BxNxK = jnp.einsum("BNj,ji->BNi", x_BxNxK, tri_KxK,
                            precision=jax.lax.Precision.HIGHEST)
  strict_NxN = jnp.triu(jnp.ones((nb, nb), x_BxV.dtype), k=1)          # [m, n]: m < n
  before_BxN = jnp.einsum("BM,MN->BN", within_BxNxK[:, :, -1], strict_NxN,
                          precision=jax.lax.Precision.HIGHEST)
  return (within_BxNxK + before_BxN[:, :, None]).reshape(B, nb * block)[:, :V]


def _filter_top_k_top_p(scaled_BxV, top_k_B, top_p_B):
  """Masks (to -inf) the tokens outside each row's top-k and top-p (nucleus) sets."""
  V = scaled_BxV.shape[-1]
  sorted_BxV = jnp.flip(jax.lax.sort(scaled_BxV, dimension=-1), axis=-1)   # descending
  k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
  kth_B = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], axis=-1)[:, 0]
  # Nucleus: keep the smallest prefix whose probability mass reaches top_p (the token that
  # crosses the threshold is kept), computed on the top-k-truncated distribution as SGLang does.
  in_k_BxV = jnp.arange(V)[None, :] < k_B[:, None]
  probs_BxV = jax.nn.softmax(jnp.where(in_k_BxV, sorted_BxV, -jnp.inf), axis=-1)
  mass_before_BxV = _cumsum_last(probs_BxV) - probs_BxV
  keep_BxV = in_k_BxV & (mass_before_BxV < top_p_B[:, None])
  n_keep_B = jnp.maximum(jnp.sum(keep_BxV, axis=-1), 1)
  thresh_B = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=-1)[:, 0]
  thresh_B = jnp.maximum(thresh_B, kth_B)
  return jnp.where(scaled_BxV >= thresh_B[:, None], scaled_BxV, -jnp.inf)


def apply_penalties(logits_BxV, counts_BxV, frequency_B, presence_B, repetition_B):
  """SGLang's frequency, presence and repetition penalties over the generated tokens.

  Args:
    logits_BxV: float32 logits (before temperature).
    counts_BxV: how often each token was generated so far by the row (any numeric dtype).
    frequency_B: subtracted once per occurrence (0 = off).
    presence_B: subtracted once for any occurrence (0 = off).
    repetition_B: positive logits of seen tokens are divided by it, negative ones multiplied
      (1 = off).

  Returns:
    The penalised float32 logits.
  """
  counts_BxV = counts_BxV.astype(jnp.float32)
  seen_BxV = counts_BxV > 0
  logits_BxV = (logits_BxV - frequency_B[:, None] * counts_BxV
                - presence_B[:, None] * seen_BxV.astype(jnp.float32))
  rep_BxV = jnp.where(seen_BxV, repetition_B[:, None], 1.0)
  return jnp.where(logits_BxV > 0, logits_BxV / rep_BxV, logits_BxV * rep_BxV)


def _filter_min_p(scaled_BxV, min_p_B):
  """Masks tokens whose probability is below min_p times the row's most likely token's
  (a difference of logits, so no softmax is needed); min_p 0 keeps everything."""
  top_B = jnp.max(scaled_BxV, axis=-1)
  thresh_B = jnp.where(min_p_B > 0, top_B + jnp.log(jnp.maximum(min_p_B, 1e-30)), -jnp.inf)
  return jnp.where(scaled_BxV >= thresh_B[:, None], scaled_BxV, -jnp.inf)


def sample(logits_BxV, temperature_B, top_p_B, top_k_B, seeds_B, positions_B, min_p_B=None):
  """Samples one token per row.

  Args:
    logits_BxV: float32 logits (penalties, if any, already applied: ``apply_penalties``).
    temperature_B: float32; 0 means greedy (argmax).
    top_p_B: float32 in (0, 1]; 1 disables nucleus filtering.
    top_k_B: int32; -1 (or any value <= 0) disables top-k filtering.
    seeds_B: uint32/int32 per-request seeds.
    positions_B: int32 absolute position of the token being sampled (for the key).
    min_p_B: optional float32 in [0, 1]; 0 (or None) disables min-p filtering. Applied after
      top-k/top-p like SGLang (relative to the most likely token, so the order does not
      change which tokens survive).

  Returns:
    (token_B int32, logprob_B float32) where logprob is log_softmax(logits / temperature) of
    the chosen token before top-k/top-p/min-p filtering (temperature 1 for greedy rows), the
    quantity SGLang reports and the learner recomputes.
  """
  logits_BxV = logits_BxV.astype(jnp.float32)
  greedy_B = temperature_B <= 0
  temp_B = jnp.where(greedy_B, 1.0, temperature_B).astype(jnp.float32)
  scaled_BxV = logits_BxV / temp_B[:, None]
  logp_BxV = jax.nn.log_softmax(scaled_BxV, axis=-1)
  argmax_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)

  def draw(_):
    needs_filter = jnp.any(~greedy_B & ((top_k_B > 0) | (top_p_B < 1.0)))
    # The sort behind top-k/top-p costs more than a decode step's sampling otherwise; skip it
    # when no row asks for filtering.
    filtered_BxV = jax.lax.cond(needs_filter,
                                lambda x: _filter_top_k_top_p(x, top_k_B, top_p_B),
                                lambda x: x, scaled_BxV)
    if min_p_B is not None:
      filtered_BxV = _filter_min_p(filtered_BxV, min_p_B.astype(jnp.float32))
    # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits).
    noise_BxV = gumbel_noise(seeds_B, positions_B, filtered_BxV.shape[-1])
    drawn_B = jnp.argmax(filtered_BxV + noise_BxV, axis=-1).astype(jnp.int32)
    return jnp.where(greedy_B, argmax_B, drawn_B)

  token_B = jax.lax.cond(jnp.all(greedy_B), lambda _: argmax_B, draw, None)
  logprob_B = jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]
  return token_B, logprob_B


def score_chunk(logits_CxV, targets_C, temperature, top_k: int):
  """Log-probs of the next tokens and the top-k alternatives at C positions (float32).

  Args:
    logits_CxV: logits at C positions.
    targets_C: the token that follows each position.
    temperature: scalar; <= 0 is treated as 1 (greedy requests report unscaled logprobs).
    top_k: static number of alternatives (0: none).

  Returns:
    (logprob_C, top_logprob_CxK, top_id_CxK).
  """
  t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
  logp_CxV = jax.nn.log_softmax(logits_CxV.astype(jnp.float32) / t, axis=-1)
  lp_C = jnp.take_along_axis(logp_CxV, targets_C[:, None], axis=-1)[:, 0]
  if top_k <= 0:
    C = logits_CxV.shape[0]
    return lp_C, jnp.zeros((C, 0), jnp.float32), jnp.zeros((C, 0), jnp.int32)
  top_lp_CxK, top_id_CxK = jax.lax.top_k(logp_CxV, top_k)
  return lp_C, top_lp_CxK, top_id_CxK.astype(jnp.int32)
