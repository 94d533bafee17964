"""LearnerConfig: the validated, frozen description of the learner (loss, optimizer, shapes)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

_SCHEDULES = ("constant", "cosine", "linear")
_MASTER_DTYPES = ("float32", "bfloat16")


def _bad(field: str, value: Any, fix: str) -> ValueError:
  return ValueError(f"LearnerConfig.{field}={value!r} is invalid: {fix}")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """Everything the learner needs besides the model config.

  Attributes:
    loss: registered loss name (`rao_jax.learner.losses.LOSSES`): "rao" (RAO_SPEC per-node
      token mean, the default), "token_sum" (constant normalizer), "ppo_clip", "cispo".
    lam: delegation bonus lambda >= 0 (RAO_SPEC), used by `Learner.prepare`.
    advantage: "node" (RAO's A(v) = R(v) - b_k) or "tree" (every node gets its root's
      advantage; an ablation), used by `Learner.prepare`.
    train_nodes: "all" (RAO) or "root" (children leave the learner batch; an ablation).
    depth_weights: RAO's inverse-frequency depth weights (True) or w = 1 (an ablation).
    bonus: the delegation bonus over a node's children: "rate" (RAO: lambda * mean s(c)) or
      "count" (lambda * sum s(c); an ablation the paper found the policy hacks).
    baseline: "loo_success" (default: the leave-one-out mean of the other roots' success
      s(r_j), on the scale of what a leaf can earn, so a successful leaf is never charged the
      bonus other roots earned; see rao_jax/learner/rewards.py), "loo" (the paper's
      leave-one-out mean of the other roots' R) or "group_mean" (the mean of all K roots' R;
      an ablation). At lam = 0 "loo_success" and "loo" are the same.
    drop_equal_groups: a group whose roots all got the same reward contributes no term (the
      RAO authors' filter); a batch left without signal applies no update (the trainer).
    node_rewards: "dense" (RAO: each node's own s(v)) or "root" (every node takes s(root); the
      paper's root-only rewards, an ablation).
    pass_through_gate: a node that only forwarded its own goal to one child gets R(v) = 0 (as
      the RAO authors' code gates it); False is RAO as specified.
    child_keep_prob: each non-root node stays in the learner batch with this probability (roots
      always; no 1/p reweighting); 1.0 is RAO, the RAO authors' code uses 0.25.
    clip_eps: PPO clip epsilon: the ratio is clipped to [1 - clip_eps, 1 + clip_eps].
    cispo_ratio_max: CISPO clips the importance ratio to [0, cispo_ratio_max] (absolute bound;
      the RAO authors' code uses 5.0).
    tis_cap: rollout correction (verl's token-level ``rollout_corr``, slime's TIS): each token's
      term of the "rao" / "token_sum" loss is weighted by min(pi_learner / pi_rollout, tis_cap),
      held constant in the gradient, for rollouts whose engine computes in other numerics
      (bf16 SGLang servers or embedded engine) than the learner. 0 (default) = off; on, >= 1
      (2.0 is usual). The ratio losses already weight by that ratio and refuse it.
    kl_coef: weight of a k3 KL penalty to the reference policy (the initial parameters);
      0 turns it off and keeps no reference copy.
    token_sum_normalizer: the constant C of the "token_sum" loss, in tokens.
    temperature: the rollout sampling temperature; logprobs are taken under softmax(logits / T).
    lr: peak learning rate of AdamW (0: the weights never change; a control run).
    warmup_steps: linear warm-up steps from 0 to `lr`.
    schedule: after warm-up: "constant", "cosine" (to `lr * final_lr_frac` at `total_steps`)
      or "linear" (likewise).
    total_steps: steps of the schedule (cosine/linear decay horizon).
    final_lr_frac: final learning rate as a fraction of `lr` for cosine/linear.
    weight_decay: AdamW decoupled weight decay.
    b1, b2, eps: AdamW moments and epsilon.
    grad_clip: global-norm gradient clipping threshold (0 = off).
    row_len: T, tokens per packed row.
    micro_batch_rows: rows per micro-batch; a batch of B rows runs B / micro_batch_rows
      micro-batches with gradient accumulation (lax.scan).
    bucket_rows: the fixed set of row counts a packed batch is padded to; each row count the
      run actually meets compiles once. Every entry must be a multiple of `micro_batch_rows`.
      Fine spacing keeps padding rows few (every multiple of 4: ~0.96 real tokens per slot
      on RAO-like trees, vs ~0.87 with powers of two) at the price of a few more compilations.
    share_prefix_min: nodes packed into one row whose trajectories start with the same prompt
      tokens (every node's system prompt; a group's whole root prompt) share one copy of that
      prefix when it is at least this long: it is computed once, and each node's suffix keeps
      its own positions and sees the prefix and itself only. Loss and gradients are those of
      unshared packing. -1 (default) = 64 when the learner runs on CPU; off on GPU and TPU,
      whose flash kernels compare segment ids for equality only (shared rows would take XLA's
      blocked attention there). 0 = off.
    master_dtype: dtype of the learner's parameters (the master weights) and of AdamW's
      moments. The forward and backward passes compute in the model config's ``dtype``
      (bfloat16 on accelerators), casting these masters at each use; the update is applied to
      the masters. "float32" (default) keeps updates far below a weight's bfloat16 spacing:
      with "bfloat16" masters, 20 AdamW steps at lr 1e-5 leave most weights of magnitude 0.02
      bit-for-bit unchanged (each step's ~1e-5 change rounds away against a spacing of 1.2e-4;
      tests/test_learner_step.py), which RL learning rates of 1e-6 to 3e-6 make worse.
    seed: seed of parameter init (when no params are given) and of the step RNG.
    ckpt_dir: Orbax checkpoint directory ("" = no checkpoints).
    ckpt_every: save every N steps (`Learner.maybe_save`); the trainer also saves at the end.
    ckpt_keep: checkpoints kept (older ones are deleted).
    ckpt_async: save in a background thread (the step goes on while the files are written).
  """
  loss: str = "rao"
  lam: float = 0.5
  advantage: str = "node"
  train_nodes: str = "all"
  depth_weights: bool = True
  bonus: str = "rate"
  baseline: str = "loo_success"
  drop_equal_groups: bool = True
  node_rewards: str = "dense"
  pass_through_gate: bool = False
  child_keep_prob: float = 1.0
  clip_eps: float = 0.2
  cispo_ratio_max: float = 5.0
  tis_cap: float = 0.0
  kl_coef: float = 0.0
  token_sum_normalizer: float = 1024.0
  temperature: float = 1.0
  lr: float = 1e-5
  warmup_steps: int = 0
  schedule: str = "constant"
  total_steps: int = 1000
  final_lr_frac: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip: float = 1.0
  row_len: int = 2048
  micro_batch_rows: int = 4
  bucket_rows: tuple[int, ...] = tuple(range(4, 129, 4))
  share_prefix_min: int = -1
  master_dtype: str = "float32"
  seed: int = 0
  ckpt_dir: str = ""
  ckpt_every: int = 10
  ckpt_keep: int = 3
  ckpt_async: bool = True

  def __post_init__(self):
    from rao_jax.learner import losses  # local: losses imports jax, config stays light
    if self.loss not in losses.LOSSES:
      raise _bad("loss", self.loss, f"choose one of {sorted(losses.LOSSES)}.")
    for name in ("lam", "kl_coef", "weight_decay", "grad_clip"):
      v = getattr(self, name)
      if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
        raise _bad(name, v, "must be a finite number >= 0.")
    from rao_jax.learner import rewards  # local like losses above
    if self.advantage not in rewards.ADVANTAGES:
      raise _bad("advantage", self.advantage, f"choose one of {rewards.ADVANTAGES} (\"node\" "
                 "is RAO).")
    if self.train_nodes not in rewards.TRAIN_NODES:
      raise _bad("train_nodes", self.train_nodes, f"choose one of {rewards.TRAIN_NODES} (\"all\" "
                 "is RAO).")
    for name in ("depth_weights", "pass_through_gate", "drop_equal_groups"):
      if not isinstance(getattr(self, name), bool):
        raise _bad(name, getattr(self, name), "must be True or False.")
    for name, allowed in (("bonus", rewards.BONUSES), ("baseline", rewards.BASELINES),
                          ("node_rewards", rewards.NODE_REWARDS)):
      if getattr(self, name) not in allowed:
        raise _bad(name, getattr(self, name), f"choose one of {allowed} ({allowed[0]!r} is the "
                   "default).")
    if not (isinstance(self.child_keep_prob, (int, float))
            and 0 < self.child_keep_prob <= 1):
      raise _bad("child_keep_prob", self.child_keep_prob, "must be in (0, 1] (1.0 keeps every "
                 "node; the RAO authors' code keeps children with 0.25).")
    if not 0 < self.clip_eps < 1:
      raise _bad("clip_eps", self.clip_eps, "must be in (0, 1), e.g. 0.2.")
    if not self.cispo_ratio_max > 0:
      raise _bad("cispo_ratio_max", self.cispo_ratio_max, "must be > 0 (the authors use 5.0).")
    if not (isinstance(self.tis_cap, (int, float)) and math.isfinite(self.tis_cap)
            and (self.tis_cap == 0 or self.tis_cap >= 1)):
      raise _bad("tis_cap", self.tis_cap, "must be 0 (off) or a finite cap >= 1, e.g. 2.0 (a cap "
                 "below 1 would shrink every on-policy token's weight).")
    if self.tis_cap and losses.LOSSES[self.loss].uses_rollout_logp:
      raise _bad("tis_cap", self.tis_cap, f"loss {self.loss!r} already weights each token by its "
                 "ratio to the rollout's log-prob; set tis_cap=0, or use loss 'rao' or "
                 "'token_sum' with it.")
    if not self.token_sum_normalizer > 0:
      raise _bad("token_sum_normalizer", self.token_sum_normalizer,
                 "must be > 0 (e.g. the longest trajectory length in tokens).")
    if not self.temperature > 0:
      raise _bad("temperature", self.temperature,
                 "must be > 0 and equal the rollout sampling temperature.")
    if not (self.lr >= 0 and math.isfinite(self.lr)):
      # 0 is allowed: a control run with frozen weights (tests/test_learns.py).
      raise _bad("lr", self.lr, "must be a finite number >= 0.")
    if self.schedule not in _SCHEDULES:
      raise _bad("schedule", self.schedule, f"choose one of {_SCHEDULES}.")
    if self.warmup_steps < 0:
      raise _bad("warmup_steps", self.warmup_steps, "must be >= 0.")
    if self.total_steps < 1:
      raise _bad("total_steps", self.total_steps, "must be >= 1.")
    if not 0 <= self.final_lr_frac <= 1:
      raise _bad("final_lr_frac", self.final_lr_frac, "must be in [0, 1].")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
      raise _bad("b1/b2", (self.b1, self.b2), "AdamW moments must be in [0, 1).")
    if not self.eps > 0:
      raise _bad("eps", self.eps, "must be > 0.")
    if self.row_len < 2:
      raise _bad("row_len", self.row_len, "a row needs at least 2 tokens (input and target).")
    if self.micro_batch_rows < 1:
      raise _bad("micro_batch_rows", self.micro_batch_rows, "must be >= 1.")
    buckets = tuple(int(b) for b in self.bucket_rows)
    object.__setattr__(self, "bucket_rows", buckets)
    if not buckets or list(buckets) != sorted(set(buckets)):
      raise _bad("bucket_rows", self.bucket_rows,
                 "must be a non-empty, strictly increasing tuple of row counts.")
    for b in buckets:
      if b < 1 or b % self.micro_batch_rows:
        raise _bad("bucket_rows", self.bucket_rows,
                   f"every bucket must be a positive multiple of micro_batch_rows="
                   f"{self.micro_batch_rows} ({b} is not).")
    if not (isinstance(self.share_prefix_min, int) and self.share_prefix_min >= -1):
      raise _bad("share_prefix_min", self.share_prefix_min,
                 "must be an int >= -1 (-1 = automatic, 0 = off, n = share prefixes of >= n "
                 "tokens).")
    if self.master_dtype not in _MASTER_DTYPES:
      raise _bad("master_dtype", self.master_dtype,
                 f"choose one of {_MASTER_DTYPES} (float32 unless memory forbids it).")
    if self.ckpt_every < 1:
      raise _bad("ckpt_every", self.ckpt_every, "must be >= 1.")
    if self.ckpt_keep < 1:
      raise _bad("ckpt_keep", self.ckpt_keep, "must be >= 1.")

  def shared_prefix_tokens(self) -> int:
    """The shortest prefix packing shares (0 = off), ``share_prefix_min`` resolved for the
    platform the learner runs on."""
    if self.share_prefix_min >= 0:
      return self.share_prefix_min
    import jax  # local: config stays light until a learner exists
    return 64 if jax.default_backend() == "cpu" else 0

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["bucket_rows"] = list(self.bucket_rows)
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "LearnerConfig":
    """Builds a config from a (possibly larger) mapping; unknown keys raise with their names."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"LearnerConfig: unknown fields {unknown}; known: {sorted(names)}.")
    kw = dict(d)
    if "bucket_rows" in kw:
      kw["bucket_rows"] = tuple(kw["bucket_rows"])
    return cls(**kw)
