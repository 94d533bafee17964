"""The jitted, sharded RAO train step and the `Learner` that owns the train state.

The step is ONE pure module-level function `train_step(state, batch) -> (state, metrics)`,
jitted once per Learner with explicit in/out shardings over a ("data", "fsdp", "tensor") mesh
and the state donated. Inside it, the batch's B rows run as B / micro_batch_rows micro-batches
under `lax.scan` (gradient accumulation); each loss is a SUM over tokens divided by the batch's
normalizer, so the accumulated gradient is the full-batch gradient. Optax AdamW with global-norm
clipping and a warm-up schedule updates the parameters; a non-finite loss or gradient selects
the old state instead (`jnp.where` over the state), and the host raises NonFiniteUpdateError.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from rao_jax.learner import losses as losses_lib
from rao_jax.learner.config import LearnerConfig
from rao_jax.learner.packing import PackedBatch, pack_trees
from rao_jax.learner.rewards import Advantages, compute_rewards_and_advantages
from rao_jax.model import lora as lora_lib
from rao_jax.model import sharding as sharding_lib
from rao_jax.model.logprobs import token_logprob_sum, token_logprobs
from rao_jax.model.transformer import Transformer

log = logging.getLogger(__name__)

BATCH_KEYS_2D = ("tokens_BxT", "targets_BxT", "positions_BxT", "segment_ids_BxT",
                 "loss_mask_BxT", "coef_BxT", "kl_weight_BxT", "rollout_logp_BxT")
_FLOAT_KEYS = ("coef_BxT", "kl_weight_BxT", "rollout_logp_BxT")

# Incremented each time `train_step` is TRACED (every trace is one compilation); tests read it
# to prove a run never recompiles after warm-up.
TRACE_COUNT = 0


_JITTED_STEPS: dict = {}


class NonFiniteUpdateError(FloatingPointError):
  """The step's loss or gradient was NaN/Inf; the update was refused and the state kept."""


@struct.dataclass
class TrainState:
  """Everything the step updates and a checkpoint stores.

  Attributes:
    step: int32 scalar, number of applied updates.
    params: the policy's nnx.Param state.
    opt_state: the Optax state.
    rng: uint32[2] base key; the step key is fold_in(rng, step).
    ref_params: the reference policy's parameters for the KL penalty (None when it is off).
    frozen: with LoRA (``model_cfg.lora.rank > 0``) the base model's parameters, which the step
      reads and never updates (``params`` is then the adapter alone); None without LoRA.
      Checkpoints leave it out: they keep the adapter and a fingerprint of this base.
  """
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  ref_params: Any = None
  frozen: Any = None


@dataclasses.dataclass(frozen=True)
class StepStatics:
  """Compile-time constants of the step (hashable, bound with functools.partial)."""
  graphdef: Any
  cfg: LearnerConfig
  micro_sharding: Any   # NamedSharding of a [M, m, T] micro-batched array (None: no constraint)


def _schedule(cfg: LearnerConfig) -> optax.Schedule:
  decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
  if cfg.schedule == "constant":
    after = optax.constant_schedule(cfg.lr)
  elif cfg.schedule == "cosine":
    after = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.final_lr_frac)
  else:
    after = optax.linear_schedule(cfg.lr, cfg.lr * cfg.final_lr_frac, decay_steps)
  if cfg.warmup_steps == 0:
    return after
  # Update i (counted from 0) of the warm-up uses lr * (i + 1) / warmup_steps: every update
  # moves the weights. optax.linear_schedule(0, lr, n) would give the first update lr 0 (with
  # warmup_steps=1, a one-step RL run would not train at all).
  n = cfg.warmup_steps

  def warm(count):
    return cfg.lr * jnp.minimum((count + 1) / n, 1.0)

  return optax.join_schedules([warm, after], [n])


def _decay_mask(params):
  # Decay weight matrices only; norms and biases stay undecayed (their scale is meaningful).
  def keep(path, _):
    name = next((str(getattr(k, "key")) for k in reversed(path) if hasattr(k, "key")), "")
    return not (name.endswith("norm") or name in ("bq", "bk", "bv", "bo"))
  return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: LearnerConfig) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and the configured learning-rate schedule."""
  parts = []
  if cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip))
  parts.append(optax.adamw(_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=_decay_mask))
  return optax.chain(*parts)


def _forward(graphdef, params, mb, cfg: LearnerConfig, frozen=None, dropout=True):
  # With LoRA the trained adapter and the frozen base make the model together (the split's
  # order: nnx.LoRAParam, then nnx.Param).
  model = nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)
  return model, model(mb["tokens_BxT"], mb["positions_BxT"], mb["segment_ids_BxT"],
                      shared_prefix=cfg.shared_prefix_tokens() > 0,
                      lora_key=mb.get("rng") if dropout else None)


def _logprobs(graphdef, params, mb, cfg: LearnerConfig, frozen=None, dropout=True):
  # Log-probs of the loss positions only (0 elsewhere): the LM head skips the prompts.
  temperature = cfg.temperature
  model, hidden_BxTxD = _forward(graphdef, params, mb, cfg, frozen, dropout)
  return token_logprobs(model, hidden_BxTxD, mb["targets_BxT"], temperature=temperature,
                        mask_BxT=mb["loss_mask_BxT"])


def micro_batch_loss(params, ref_params, mb: Mapping[str, jax.Array], normalizer, graphdef,
                     cfg: LearnerConfig, frozen=None):
  """The loss of one micro-batch (its share of the full-batch loss) and summed diagnostics.

  Args:
    params: policy nnx.Param state.
    ref_params: reference parameters (used only when cfg.kl_coef > 0).
    mb: micro-batch arrays [m, T] (keys of PackedBatch.arrays()).
    normalizer: the full batch's normalizer (N nodes or the constant C).
    graphdef: the model's nnx GraphDef.
    cfg: the LearnerConfig.
    frozen: the frozen base parameters with LoRA (``params`` is then the adapter), else None.

  Returns:
    (loss, aux): loss = (sum of per-token terms) / normalizer; aux holds sums over the
    micro-batch's loss tokens.
  """
  spec = losses_lib.get_loss(cfg.loss)
  mask = mb["loss_mask_BxT"]
  if spec.linear and cfg.kl_coef <= 0 and not cfg.tis_cap:
    # -sum(coef * logp) with the LM head's gradient computed in the forward pass (no logits
    # recomputed in the backward). The KL term needs logp's own gradient: generic path then.
    model, hidden_BxTxD = _forward(graphdef, params, mb, cfg, frozen)
    pg_sum, logp_BxT = token_logprob_sum(
        model, hidden_BxTxD, mb["targets_BxT"], jnp.where(mask, -mb["coef_BxT"], 0.0),
        temperature=cfg.temperature, mask_BxT=mask)
    aux = {}
  else:
    logp_BxT = _logprobs(graphdef, params, mb, cfg, frozen)
    pg_sum, aux = spec.fn(logp_BxT, mb, cfg)
  aux = dict(aux)
  aux["pg_loss"] = pg_sum / normalizer
  aux["logp_sum"] = jnp.sum(jnp.where(mask, logp_BxT, 0.0))
  aux["rollout_abs_diff_sum"] = jnp.sum(
      jnp.where(mask, jnp.abs(logp_BxT - mb["rollout_logp_BxT"]), 0.0))
  aux["loss_tokens"] = jnp.sum(mask.astype(jnp.float32))
  total = pg_sum
  if cfg.kl_coef > 0:
    ref_logp = jax.lax.stop_gradient(_logprobs(graphdef, ref_params, mb, cfg, frozen,
                                                 dropout=False))
    kl_sum = losses_lib.kl_penalty(logp_BxT, ref_logp, mb)
    aux["kl"] = kl_sum / normalizer
    total = total + cfg.kl_coef * kl_sum
  return total / normalizer, aux


def loss_and_grads(params, ref_params, batch: Mapping[str, jax.Array], statics: StepStatics,
                   frozen=None):
  """Loss, gradient and diagnostics of a full batch, accumulated over micro-batches.

  The B rows are split into M = B / cfg.micro_batch_rows micro-batches (row r goes to micro-batch
  r mod M, so with rows sharded in contiguous blocks over the data axes every device keeps its
  own rows: no resharding). `lax.scan` sums the per-micro-batch gradients in float32.
  With LoRA, ``params`` is the adapter and ``frozen`` the base: only the adapter is
  differentiated.
  """
  cfg = statics.cfg
  M = batch["tokens_BxT"].shape[0] // cfg.micro_batch_rows
  normalizer = batch["normalizer"]
  grad_fn = jax.value_and_grad(micro_batch_loss, has_aux=True)

  def split(x_BxT):
    B, T = x_BxT.shape
    x = x_BxT.reshape(B // M, M, T).swapaxes(0, 1)
    if statics.micro_sharding is None:
      return x
    return jax.lax.with_sharding_constraint(x, statics.micro_sharding)

  micro = {k: split(batch[k]) for k in BATCH_KEYS_2D}
  if "rng" in batch:
    micro["rng"] = jax.vmap(lambda i: jax.random.fold_in(batch["rng"], i))(jnp.arange(M))
  zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

  # The aux structure depends on the loss; get it abstractly, then start from zeros.
  first = jax.tree.map(lambda x: x[0], micro)
  aux_shape = jax.eval_shape(lambda: micro_batch_loss(
      params, ref_params, first, normalizer, statics.graphdef, cfg, frozen)[1])
  zero_aux = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shape)

  def compute(carry, mb):
    g_acc, l_acc, a_acc = carry
    (loss, aux), g = grad_fn(params, ref_params, mb, normalizer, statics.graphdef, cfg, frozen)
    g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
    return g_acc, l_acc + loss, jax.tree.map(jnp.add, a_acc, aux)

  def skip(carry, mb):
    del mb
    return carry

  def body(carry, mb):
    # A micro-batch of padding rows (the batch was padded up to a bucket_rows count) has no
    # loss tokens and contributes exactly zero: skip its forward and backward passes, and the
    # accumulation too (adding a zero gradient still reads and writes every parameter's sum).
    return jax.lax.cond(jnp.any(mb["loss_mask_BxT"]), compute, skip, carry, mb), None

  (grads, loss, aux), _ = jax.lax.scan(body, (zero_grads, jnp.float32(0.0), zero_aux), micro)
  return loss, grads, aux


def train_step(state: TrainState, batch: Mapping[str, jax.Array], statics: StepStatics
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One RAO update: (state, batch) -> (state, metrics). Pure; jitted once by the Learner."""
  global TRACE_COUNT
  TRACE_COUNT += 1
  cfg = statics.cfg
  optimizer = make_optimizer(cfg)
  # Per-step key, reproducible across resumes; each micro-batch gets its own fold (losses may
  # read batch["rng"]; the registered ones are deterministic).
  batch = dict(batch)
  batch["rng"] = jax.random.fold_in(state.rng, state.step)
  loss, grads, aux = loss_and_grads(state.params, state.ref_params, batch, statics, state.frozen)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
  grad_norm = optax.global_norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.step + 1, params=new_params, opt_state=new_opt,
                            frozen=None)
  # Refuse a non-finite update on device: the outputs are the inputs, bit for bit. (The frozen
  # base passes through untouched: a select over it would copy the whole model each step.)
  new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state,
                           state.replace(frozen=None)).replace(frozen=state.frozen)
  n_tok = jnp.maximum(aux["loss_tokens"], 1.0)
  metrics = {
      "loss": loss,
      "pg_loss": aux["pg_loss"],
      "grad_norm": grad_norm,
      "lr": _schedule(cfg)(state.step),
      "update_applied": ok.astype(jnp.float32),
      "loss_tokens": aux["loss_tokens"],
      "logp_mean": aux["logp_sum"] / n_tok,
      "rollout_logp_abs_diff": aux["rollout_abs_diff_sum"] / n_tok,
  }
  if "kl" in aux:
    metrics["kl"] = aux["kl"]
  for k in ("clip_frac", "ratio_mean", "tis_weight_mean", "tis_clip_frac", "rollout_kl"):
    if k in aux:
      metrics[k] = aux[k] / n_tok
  return new_state, metrics


class _UnderMesh:
  """A jitted step called, traced and lowered with ``mesh`` set by ``jax.set_mesh``.

  The platform kernels of the step (MKL's FFI attention on CPU, Pallas splash or flash
  attention on TPU and GPU) are opaque to XLA's partitioner, which would gather their operands
  onto every device; traced under the mesh, ``rao_jax.kernels.attention`` runs them per device
  under ``shard_map`` on the device's rows and kv heads. Every call sets it, as the mesh is part
  of the jit cache key: a call without it would trace the step again. Other attributes are the
  jitted function's.
  """

  def __init__(self, fn, mesh):
    self._fn, self._mesh = fn, mesh

  def __call__(self, *args):
    with jax.set_mesh(self._mesh):
      return self._fn(*args)

  def lower(self, *args):
    with jax.set_mesh(self._mesh):
      return self._fn.lower(*args)

  def __getattr__(self, name):
    return getattr(self._fn, name)


def _model_config_dict(model_cfg) -> dict:
  if dataclasses.is_dataclass(model_cfg):
    return json_safe(dataclasses.asdict(model_cfg))
  return json_safe(dict(model_cfg))


def json_safe(x):
  """Tuples -> lists, numpy scalars -> Python numbers, recursively (for JSON metadata)."""
  if isinstance(x, Mapping):
    return {str(k): json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_safe(v) for v in x]
  if isinstance(x, np.generic):
    return x.item()
  return x


class Learner:
  """Owns the sharded train state, the jitted step and the checkpoints.

  Args:
    cfg: LearnerConfig.
    model_cfg: the policy's ModelConfig; the learner keeps its own copy with
      ``param_dtype = cfg.master_dtype`` (``self.model_cfg``), computing in ``model_cfg.dtype``.
    mesh: a ("data", "fsdp", "tensor") mesh (`rao_jax.model.sharding.make_mesh`); None = one
      device.
    params: initial weights: an nnx Transformer or its nnx.Param state (e.g. from
      `load_pretrained`), cast to cfg.master_dtype; None = random init from cfg.seed.

  Attributes:
    state: the TrainState (sharded on `mesh`; donated to each step, so never keep references to
      its arrays across `step` calls: read `learner.params` / `learner.model` again).
  """

  def __init__(self, cfg: LearnerConfig, model_cfg, mesh=None, params=None):
    if not isinstance(cfg, LearnerConfig):
      raise TypeError(f"Learner: cfg must be a LearnerConfig, got {type(cfg).__name__}.")
    self.cfg = cfg
    # Mixed precision: the parameters (masters) and AdamW's moments are kept in
    # cfg.master_dtype; the model still computes in model_cfg.dtype, casting at each use.
    if dataclasses.is_dataclass(model_cfg) and hasattr(model_cfg, "param_dtype") \
        and model_cfg.param_dtype != cfg.master_dtype:
      model_cfg = dataclasses.replace(model_cfg, param_dtype=cfg.master_dtype)
    self.model_cfg = model_cfg
    self.mesh = mesh if mesh is not None else sharding_lib.make_mesh(1, 1, 1)
    missing = [a for a in sharding_lib.MESH_AXES if a not in self.mesh.shape]
    if missing:
      raise ValueError(f"Learner: mesh axes {tuple(self.mesh.shape)} lack {missing}; build it with "
                       "rao_jax.model.sharding.make_mesh(data, fsdp, tensor).")
    n_data = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    if cfg.micro_batch_rows % n_data:
      raise ValueError(
          f"LearnerConfig.micro_batch_rows={cfg.micro_batch_rows} must be a multiple of the mesh's "
          f"data x fsdp = {n_data} devices (each device holds whole rows of every micro-batch).")
    self._spec = losses_lib.get_loss(cfg.loss)

    self.lora = bool(getattr(model_cfg, "lora", None) and model_cfg.lora.enabled)
    abstract_model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed)))
    # With LoRA the adapter (nnx.LoRAParam) is trained and the rest (nnx.Param) is frozen.
    filters = (nnx.LoRAParam, nnx.Param) if self.lora else (nnx.Param,)
    self.graphdef, *abstract_parts, rest = nnx.split(abstract_model, *filters, ...)
    abstract_params = abstract_parts[0]
    if jax.tree.leaves(rest):
      raise ValueError("Learner: the model holds non-parameter state "
                       f"({list(rest.flat_state())[:3]}...); the learner trains nnx.Param only.")
    optimizer = make_optimizer(cfg)

    def make_state(p, frozen=None):
      return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p),
                        rng=jax.random.PRNGKey(cfg.seed),
                        ref_params=p if cfg.kl_coef > 0 else None, frozen=frozen)

    def init_random():
      model = Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed))
      return make_state(*nnx.split(model, *filters, ...)[1:-1])

    # State is created already sharded: abstract shapes -> shardings -> jit(init, out_shardings).
    abstract_state = jax.eval_shape(init_random)
    self._state_shardings = sharding_lib.state_shardings(abstract_state, self.mesh)
    if params is None:
      self.state = jax.jit(init_random, out_shardings=self._state_shardings)()
    else:
      if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
      # Weights loaded in another dtype (e.g. bfloat16 from a checkpoint) become the masters.
      master = jnp.dtype(cfg.master_dtype)
      params = jax.tree.map(
          lambda x: x.astype(master) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
      parts = self._split_params(params, abstract_parts)
      sig = lambda t: [(tuple(x.shape), jnp.dtype(x.dtype)) for x in jax.tree.leaves(t)]
      for part, abstract in zip(parts, abstract_parts):
        if (jax.tree.structure(part) != jax.tree.structure(abstract)
            or sig(part) != sig(abstract)):
          raise ValueError(
              "Learner: `params` do not match model_cfg (structure, shapes or dtypes differ); "
              "pass the nnx.Param state of a Transformer built from the same ModelConfig.")
      targets = (self._state_shardings.params, self._state_shardings.frozen)[:len(parts)]
      parts = [jax.device_put(p, t) for p, t in zip(parts, targets)]
      self.state = jax.jit(make_state, out_shardings=self._state_shardings)(*parts)
    # The reference an adapter checkpoint keeps to the base it was trained on.
    self._base_fingerprint = lora_lib.fingerprint(self.state.frozen) if self.lora else None

    self._batch_shardings = {k: sharding_lib.batch_sharding(self.mesh, 2) for k in BATCH_KEYS_2D}
    self._batch_shardings["normalizer"] = sharding_lib.replicated(self.mesh)
    # Learners with the same model, step-relevant config and mesh share one jitted step (and
    # its compilations), e.g. when the trainer swaps in a Learner with other initial weights.
    key = (model_cfg, dataclasses.replace(cfg, ckpt_dir="", ckpt_every=1, ckpt_keep=1, seed=0),
           self.mesh)
    if key not in _JITTED_STEPS:
      micro_spec = sharding_lib.logical_to_spec((None, "batch", None), mesh=self.mesh)
      statics = StepStatics(self.graphdef, cfg,
                            jax.sharding.NamedSharding(self.mesh, micro_spec))
      _JITTED_STEPS[key] = jax.jit(
          functools.partial(train_step, statics=statics),
          in_shardings=(self._state_shardings, self._batch_shardings),
          out_shardings=(self._state_shardings, sharding_lib.replicated(self.mesh)),
          donate_argnums=(0,))
    self._step_fn = _UnderMesh(_JITTED_STEPS[key], self.mesh)
    self._ckpt = None
    self._old_ckpt_failures = []

  def _split_params(self, params, abstract_parts) -> list:
    """[params] without LoRA; [adapter, base] with it. A state without adapter leaves (a base
    model's) gets the fresh adapter a Transformer of this config starts with (B = 0)."""
    if not self.lora:
      return [params]
    if not isinstance(params, nnx.State):
      raise TypeError("Learner: with LoRA pass `params` as an nnx Module or nnx.State.")
    adapter, base = nnx.split_state(params, nnx.LoRAParam, ...)
    if not jax.tree.leaves(adapter):
      adapter = nnx.State({"lora": nnx.state(lora_lib.LoraAdapters(self.model_cfg),
                                             nnx.LoRAParam)})
    return [adapter, base]

  # ---- data -----------------------------------------------------------------------------------
  @staticmethod
  def advantages(trees, cfg: LearnerConfig) -> Advantages:
    """RAO rewards, advantages and depth weights of `trees` under `cfg`'s settings."""
    return compute_rewards_and_advantages(
        trees, lam=cfg.lam, advantage=cfg.advantage, train_nodes=cfg.train_nodes,
        depth_weights=cfg.depth_weights, bonus=cfg.bonus, baseline=cfg.baseline,
        drop_equal_groups=cfg.drop_equal_groups, node_rewards=cfg.node_rewards,
        pass_through_gate=cfg.pass_through_gate,
        child_keep_prob=cfg.child_keep_prob, seed=cfg.seed)

  def prepare(self, trees) -> tuple[PackedBatch, Advantages]:
    """RAO rewards/advantages and the packed batch for `trees`, with this learner's settings.

    Nodes with zero advantage are left out when no KL penalty is on (they add nothing).
    """
    adv = self.advantages(trees, self.cfg)
    batch = pack_trees(trees, adv, self.cfg.row_len, self.cfg.bucket_rows, loss=self.cfg.loss,
                       token_sum_normalizer=self.cfg.token_sum_normalizer,
                       drop_zero_advantage=self.cfg.kl_coef == 0,
                       share_prefix_min=self.cfg.shared_prefix_tokens())
    return batch, adv

  def _check_batch(self, arrays: Mapping[str, np.ndarray]) -> None:
    missing = [k for k in BATCH_KEYS_2D + ("normalizer",) if k not in arrays]
    if missing:
      raise ValueError(f"Learner.step: batch lacks {missing}; pass a PackedBatch from pack_trees.")
    B, T = np.shape(arrays["tokens_BxT"])
    if T != self.cfg.row_len:
      raise ValueError(f"Learner.step: rows have T={T} tokens but LearnerConfig.row_len="
                       f"{self.cfg.row_len}; pack with row_len={self.cfg.row_len}.")
    if B not in self.cfg.bucket_rows:
      raise ValueError(
          f"Learner.step: the batch has B={B} rows, not one of LearnerConfig.bucket_rows="
          f"{self.cfg.bucket_rows}; a new row count would recompile the step. Pack with "
          "bucket_rows=cfg.bucket_rows (Learner.prepare does).")
    for k in BATCH_KEYS_2D:
      if np.shape(arrays[k]) != (B, T):
        raise ValueError(f"Learner.step: {k} has shape {np.shape(arrays[k])}, expected {(B, T)}.")
    tokens = np.asarray(arrays["tokens_BxT"])
    if tokens.size and (tokens.min() < 0 or tokens.max() >= self.model_cfg.vocab_size):
      raise ValueError(f"Learner.step: token ids span [{tokens.min()}, {tokens.max()}], outside "
                       f"the model's vocabulary [0, {self.model_cfg.vocab_size}).")
    if not np.isfinite(arrays["normalizer"]) or float(arrays["normalizer"]) <= 0:
      raise ValueError(f"Learner.step: normalizer={arrays['normalizer']!r} must be > 0.")

  # ---- the step -------------------------------------------------------------------------------
  def step(self, batch: PackedBatch | Mapping[str, np.ndarray]) -> dict[str, float]:
    """Applies one update; returns float metrics (plus the batch's packing stats).

    Raises:
      NonFiniteUpdateError: loss or gradient NaN/Inf; the update was refused and the state
        (parameters, optimizer, step) is exactly as before.
      ValueError: a batch of the wrong shape, an unbucketed row count, bad token ids.
    """
    if isinstance(batch, PackedBatch):
      if batch.normalization != self._spec.normalization:
        raise ValueError(
            f"Learner.step: the batch was packed for {batch.normalization!r} coefficients but "
            f"LearnerConfig.loss={self.cfg.loss!r} needs {self._spec.normalization!r}; pack with "
            f"loss={self.cfg.loss!r} (Learner.prepare does).")
      arrays, stats = batch.arrays(), batch.stats
    else:
      arrays, stats = dict(batch), {}
    self._check_batch(arrays)
    arrays = {k: np.asarray(arrays[k]) for k in self._batch_shardings}
    arrays["normalizer"] = arrays["normalizer"].astype(np.float32)
    step_before = int(self.state.step)
    dev_batch = jax.device_put(arrays, self._batch_shardings)
    self.state, metrics = self._step_fn(self.state, dev_batch)
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if out["update_applied"] != 1.0:
      raise NonFiniteUpdateError(
          f"Learner.step at step {step_before}: loss={out['loss']} grad_norm={out['grad_norm']} "
          "is not finite; the update was refused and the state is unchanged. Check the batch "
          "(coefficients, rollout logprobs) and the learning rate, or skip this batch.")
    out["step"] = float(step_before + 1)
    out.update({f"batch/{k}": float(v) for k, v in stats.items()})
    return out

  def warmup(self, rows: Sequence[int] | None = None) -> float:
    """Compiles the step for each row count (default every `cfg.bucket_rows`) before training,
    so no step compiles; returns the seconds spent.

    Each compilation runs once on a batch of padding rows (no loss token, so every micro-batch
    is skipped) and a copy of the state: the parameters, optimizer and step are untouched.
    """
    t0 = time.perf_counter()
    T = self.cfg.row_len
    for B in rows or self.cfg.bucket_rows:
      if B not in self.cfg.bucket_rows:
        raise ValueError(f"Learner.warmup: {B} rows is not one of LearnerConfig.bucket_rows="
                         f"{self.cfg.bucket_rows}.")
      arrays = {k: np.zeros((B, T), np.float32 if k in _FLOAT_KEYS else
                            bool if k == "loss_mask_BxT" else np.int32) for k in BATCH_KEYS_2D}
      arrays["normalizer"] = np.float32(1.0)
      scratch = jax.tree.map(jnp.copy, self.state)    # donated by the step
      out = self._step_fn(scratch, jax.device_put(arrays, self._batch_shardings))
      jax.block_until_ready(out)
      del out, scratch
    return time.perf_counter() - t0

  # ---- weights for the rollout engine ---------------------------------------------------------
  @property
  def params(self):
    """The trained nnx.Param state (sharded; with LoRA the adapter alone, its nnx.LoRAParam
    leaves); valid until the next `step`."""
    return self.state.params

  @property
  def frozen(self):
    """With LoRA the frozen base parameters, else None."""
    return self.state.frozen

  @property
  def model(self) -> Transformer:
    """An nnx Transformer over the current parameters; valid until the next `step`."""
    if self.lora:
      return nnx.merge(self.graphdef, self.state.params, self.state.frozen)
    return nnx.merge(self.graphdef, self.state.params)

  @property
  def step_count(self) -> int:
    return int(self.state.step)

  def config_json(self) -> dict:
    """The learner and model configs as JSON-safe dicts (stored beside each checkpoint)."""
    return {"learner_config": json_safe(self.cfg.to_dict()),
            "model_config": _model_config_dict(self.model_cfg)}

  # ---- checkpoints ----------------------------------------------------------------------------
  def _checkpointer(self, directory: str | None = None):
    from rao_jax.learner.checkpoint import Checkpointer
    directory = directory or self.cfg.ckpt_dir
    if not directory:
      raise ValueError("Learner: no checkpoint directory; set LearnerConfig.ckpt_dir.")
    if self._ckpt is None or self._ckpt.directory != directory:
      if self._ckpt is not None:
        self._ckpt.close()
        self._old_ckpt_failures += self._ckpt.failures
      self._ckpt = Checkpointer(directory, keep=self.cfg.ckpt_keep, use_async=self.cfg.ckpt_async)
    return self._ckpt

  @property
  def checkpoint_failures(self) -> list:
    """Every save the filesystem refused in this process (`checkpoint.SaveFailure`s), oldest
    first. A failed save does not raise: training goes on and the next save tries again."""
    return self._old_ckpt_failures + (self._ckpt.failures if self._ckpt is not None else [])

  def poll_checkpoints(self) -> None:
    """Notes the failure of a background save that has ended (never waits)."""
    if self._ckpt is not None:
      self._ckpt.poll()

  def save(self, step: int | None = None, extra: Mapping[str, Any] | None = None,
           force: bool = True) -> bool:
    """Saves params, optimizer state, step, RNG, `extra` (e.g. the data position) and configs.

    Asynchronous when cfg.ckpt_async: returns once the arrays are copied off the devices.
    With force=False only every cfg.ckpt_every steps. Returns whether a save started (False
    too when the filesystem refused it: see `checkpoint_failures`).
    """
    step = self.step_count if step is None else int(step)
    if not force and step % self.cfg.ckpt_every:
      return False
    meta = dict(self.config_json(), extra=json_safe(dict(extra or {})))
    if self.lora:   # the adapter and its optimizer; the base is referenced, not stored
      meta["base_fingerprint"] = self._base_fingerprint
    return self._checkpointer().save(step, self.state.replace(frozen=None), meta)

  def maybe_save(self, step: int | None = None, extra: Mapping[str, Any] | None = None) -> bool:
    """`save` every cfg.ckpt_every steps."""
    return self.save(step, extra, force=False)

  def restore(self, step: int | None = None, directory: str | None = None) -> dict[str, Any]:
    """Restores the state (onto THIS learner's mesh) from `step` or the latest complete save.

    Returns the saved `extra` dict. Raises FileNotFoundError when there is no checkpoint.
    """
    ckpt = self._checkpointer(directory)
    state, meta = ckpt.restore(step, self.state.replace(frozen=None))
    saved_base = meta.get("base_fingerprint")
    if self.lora and saved_base is not None and saved_base != self._base_fingerprint:
      raise ValueError(
          f"Learner.restore: the adapter in {ckpt.directory!r} was trained on another base model "
          f"(fingerprint {saved_base}, this learner's base is {self._base_fingerprint}); load "
          "the base model the run used (config.model.name) before restoring.")
    self.state = state.replace(frozen=self.state.frozen)
    return dict(meta.get("extra", {}))

  def latest_checkpoint_step(self, directory: str | None = None) -> int | None:
    return self._checkpointer(directory).latest_step()

  def wait_for_checkpoints(self) -> None:
    if self._ckpt is not None:
      self._ckpt.wait()

  def close(self) -> None:
    """Waits for pending saves and releases the checkpoint manager."""
    if self._ckpt is not None:
      self._ckpt.close()
      self._old_ckpt_failures += self._ckpt.failures
      self._ckpt = None
