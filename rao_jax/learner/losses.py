"""Registered policy-gradient losses over packed rows (float32, pure jnp).

Every loss returns the SUM of its per-token terms over a (micro-)batch; the step divides by the
batch's `normalizer` (N nodes for the per-node token mean, the constant C for "token_sum"), so a
sum over micro-batches equals the full-batch loss exactly. The per-token coefficient `coef_BxT`
that `pack_trees` writes already carries w_d * A(v) / |M_v| (or w_d * A(v) for "token_sum"),
which is positive exactly when A(v) is, so the PPO min/max logic can use its sign.

RAO_SPEC default (on-policy REINFORCE with the leave-one-out baseline and depth weights):

    L = -(1/N) sum_v w_d(v) A(v) (1/|M_v|) sum_{t in M_v} log pi(y_t | y_<t)

Rollout correction (``LearnerConfig.tis_cap`` > 0; verl's token-level ``rollout_corr``, slime's
TIS): the rollout engine samples from its own numerics (bf16 on SGLang, a bf16 embedded engine)
while the learner's gradient assumes its own float32 policy drew the tokens. Each REINFORCE term
is then weighted by the truncated importance weight min(pi_learner / pi_rollout, tis_cap) of its
token, held constant in the gradient (``truncated_is_weight``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

LossFn = Callable[[jax.Array, Mapping[str, jax.Array], Any], tuple[jax.Array, dict]]


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """A registered loss.

  Attributes:
    name: registry key.
    fn: (logp_BxT float32, batch, LearnerConfig) -> (sum of per-token loss terms, dict of
      summed diagnostics). Diagnostics are sums over loss tokens (divided by the loss-token
      count by the step).
    normalization: "node_mean" (coef = w_d A / |M_v|, normalizer N) or "token_sum"
      (coef = w_d A, normalizer = LearnerConfig.token_sum_normalizer).
    uses_rollout_logp: True when the loss needs the rollout logprobs (ratio-based losses).
    linear: True when the loss is exactly -sum(coef * logp) over loss tokens with no
      diagnostics (rollout correction off); the step then computes it with the LM head's
      gradient fused into the forward pass (``rao_jax.model.token_logprob_sum``) instead of
      calling ``fn``.
  """
  name: str
  fn: LossFn
  normalization: str
  uses_rollout_logp: bool
  linear: bool = False


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, normalization: str = "node_mean", uses_rollout_logp: bool = False,
                  linear: bool = False) -> Callable[[LossFn], LossFn]:
  """Decorator registering a loss function under `name`."""
  if normalization not in ("node_mean", "token_sum"):
    raise ValueError(f"register_loss({name!r}): normalization={normalization!r}, expected "
                     "'node_mean' or 'token_sum'.")

  def wrap(fn: LossFn) -> LossFn:
    if name in LOSSES:
      raise ValueError(f"Loss {name!r} is registered twice.")
    LOSSES[name] = LossSpec(name, fn, normalization, uses_rollout_logp, linear)
    return fn
  return wrap


def get_loss(name: str) -> LossSpec:
  """The registered LossSpec called `name` (ValueError listing the known names otherwise)."""
  try:
    return LOSSES[name]
  except KeyError:
    raise ValueError(f"Unknown loss {name!r}; registered losses: {sorted(LOSSES)}.") from None


def _masked_ratio(logp_BxT, batch):
  """exp(logp - logp_rollout) on loss tokens, 1 elsewhere (no overflow from padding)."""
  mask = batch["loss_mask_BxT"]
  log_ratio = jnp.where(mask, logp_BxT - batch["rollout_logp_BxT"], 0.0)
  return jnp.exp(log_ratio), log_ratio


# |log(pi_learner / pi_rollout)| above this is clipped inside the KL diagnostic only: exp of a
# larger value overflows float32 and would log inf for one pathological token.
_KL_LOG_RATIO_MAX = 20.0


def truncated_is_weight(logp_BxT, batch, cap):
  """Token-level truncated importance weight of the learner's policy over the rollout's.

  w = min(exp(logp - logp_rollout), cap) on loss tokens (1 elsewhere), with no gradient: the
  weight rescales each token's REINFORCE term as if the learner's own policy had sampled it,
  and the cap bounds the variance a token the rollout engine under-rated would add.

  Args:
    logp_BxT: the learner's float32 log-probs of the targets.
    batch: the micro-batch (``loss_mask_BxT``, ``rollout_logp_BxT``).
    cap: the truncation, >= 1.

  Returns:
    (w_BxT, sums over loss tokens): ``tis_weight_mean`` (of w), ``tis_clip_frac`` (tokens whose
    ratio exceeded the cap) and ``rollout_kl`` (the k3 estimate of KL(rollout || learner), the
    gap the weights correct).
  """
  mask = batch["loss_mask_BxT"]
  log_ratio = jnp.where(mask, jax.lax.stop_gradient(logp_BxT) - batch["rollout_logp_BxT"], 0.0)
  ratio = jnp.exp(log_ratio)
  w = jnp.minimum(ratio, cap)
  # Sampled from the rollout: KL(q || p) = E_q[r - 1 - log r] with r = p / q, each term >= 0.
  lr = jnp.clip(log_ratio, -_KL_LOG_RATIO_MAX, _KL_LOG_RATIO_MAX)
  k3 = jnp.exp(lr) - 1.0 - lr
  return w, {"tis_weight_mean": jnp.sum(jnp.where(mask, w, 0.0)),
             "tis_clip_frac": jnp.sum((mask & (ratio > cap)).astype(jnp.float32)),
             "rollout_kl": jnp.sum(jnp.where(mask, k3, 0.0))}


def _reinforce(logp_BxT, batch, cfg):
  """-sum(coef * logp) over loss tokens, each term weighted by its truncated importance weight
  when rollout correction is on (``cfg.tis_cap`` > 0)."""
  mask = batch["loss_mask_BxT"]
  coef = batch["coef_BxT"]
  diag = {}
  if cfg.tis_cap > 0:
    w, diag = truncated_is_weight(logp_BxT, batch, cfg.tis_cap)
    coef = coef * w
  return -jnp.sum(jnp.where(mask, coef * logp_BxT, 0.0)), diag


@register_loss("rao", linear=True)
def rao_loss(logp_BxT, batch, cfg):
  """RAO_SPEC default: depth-weighted leave-one-out REINFORCE, per-node token mean.

  Recursive Agent Optimization (RAO_SPEC, "Policy-gradient loss"). coef = w_d A / |M_v|.
  """
  return _reinforce(logp_BxT, batch, cfg)


@register_loss("token_sum", normalization="token_sum", linear=True)
def token_sum_loss(logp_BxT, batch, cfg):
  """The RAO gradient with a token sum over each node and a constant normalizer C.

  Long trajectories weigh proportionally more (no 1/|M_v|), as in Dr. GRPO (Liu et al. 2025,
  "Understanding R1-Zero-Like Training"). coef = w_d A; the step divides by C.
  """
  return _reinforce(logp_BxT, batch, cfg)


@register_loss("ppo_clip", uses_rollout_logp=True)
def ppo_clip_loss(logp_BxT, batch, cfg):
  """PPO clipped surrogate (Schulman et al. 2017) with RAO's per-node weights.

  term = -min(r * c, clip(r, 1 - eps, 1 + eps) * c), r = exp(logp - logp_rollout), c = coef.
  At r = 1 (one on-policy epoch) its gradient is c * grad(logp): the default's.
  """
  mask = batch["loss_mask_BxT"]
  coef = batch["coef_BxT"]
  ratio, _ = _masked_ratio(logp_BxT, batch)
  clipped = jnp.clip(ratio, 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
  surrogate = jnp.minimum(ratio * coef, clipped * coef)
  is_clipped = mask & (surrogate != ratio * coef)
  return -jnp.sum(jnp.where(mask, surrogate, 0.0)), {
      "clip_frac": jnp.sum(is_clipped.astype(jnp.float32)),
      "ratio_mean": jnp.sum(jnp.where(mask, ratio, 0.0)),
  }


@register_loss("cispo", uses_rollout_logp=True)
def cispo_loss(logp_BxT, batch, cfg):
  """CISPO (MiniMax-M1, Chen et al. 2025) as the RAO authors' code uses it.

  term = -stopgrad(clip(r, 0, ratio_max)) * c * logp: the clipped importance weight scales the
  REINFORCE term, so every token keeps a gradient. At r = 1 it equals the default's gradient.
  """
  mask = batch["loss_mask_BxT"]
  ratio, _ = _masked_ratio(logp_BxT, batch)
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 0.0, cfg.cispo_ratio_max))
  term = weight * batch["coef_BxT"] * logp_BxT
  return -jnp.sum(jnp.where(mask, term, 0.0)), {
      "clip_frac": jnp.sum((mask & (ratio > cfg.cispo_ratio_max)).astype(jnp.float32)),
      "ratio_mean": jnp.sum(jnp.where(mask, ratio, 0.0)),
  }


def kl_penalty(logp_BxT, ref_logp_BxT, batch):
  """Sum of the k3 KL estimator to the reference policy, weighted like the policy term.

  k3 = exp(ref - logp) - (ref - logp) - 1 >= 0 (Schulman, "Approximating KL divergence"), an
  unbiased, low-variance estimate of KL(pi || pi_ref) from samples of pi. Each token is weighted
  by `kl_weight_BxT` (w_d / |M_v|, or w_d for "token_sum").
  """
  mask = batch["loss_mask_BxT"]
  delta = jnp.where(mask, ref_logp_BxT - logp_BxT, 0.0)
  k3 = jnp.exp(delta) - delta - 1.0
  return jnp.sum(jnp.where(mask, batch["kl_weight_BxT"] * k3, 0.0))
