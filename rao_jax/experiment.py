"""From an experiment ConfigDict to the typed parts of a run.

The loose ConfigDict of `experiments/configs/` is turned into each module's frozen, validated
dataclass here and nowhere else, so an entry point (train, evaluate, sft, demo) builds the same
environment, engine, sandbox pool, runner and learner from the same config. A training run is
assembled in one call, `assemble(config, workdir)`: its parts (`run_parts.RunParts`) are all
that `trainer.Trainer` reads.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Sequence

import numpy as np

from rao_jax import run_parts
from rao_jax.agent import runner as runner_lib
from rao_jax.envs import base as env_base
from rao_jax.envs import registry
# The typed parts this module makes, under the names its callers have used (X.RLConfig, ...).
from rao_jax.run_parts import (DEADLINE_RULES, JUDGES, RATIO_LOSSES, EngineSpec,  # noqa: F401
                               InitialWeights, JudgeSpec, RLConfig, RunParts,
                               parse_task_weights)

log = logging.getLogger(__name__)


def _to_plain(x):
  """ConfigDict / FrozenConfigDict / tuples -> plain JSON-able Python."""
  if hasattr(x, "to_dict"):
    x = x.to_dict()
  if isinstance(x, dict):
    return {k: _to_plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_to_plain(v) for v in x]
  return x


def config_to_json(config) -> str:
  return json.dumps(_to_plain(config), indent=2, sort_keys=True)


def save_config(config, workdir: str) -> str:
  """Writes the run's config beside its checkpoints (`workdir/config.json`)."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "config.json")
  with open(path + ".tmp", "w") as f:
    f.write(config_to_json(config))
  os.replace(path + ".tmp", path)
  return path


def load_config(workdir: str):
  """Reads `workdir/config.json` back into a ConfigDict (for evaluation)."""
  from ml_collections import config_dict  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist: is {workdir!r} a training workdir "
                            "(python -m experiments.train --workdir=...)?")
  with open(path) as f:
    return config_dict.ConfigDict(json.load(f))


# -- environment and tasks ---------------------------------------------------------------------


def make_env(config) -> env_base.Environment:
  """The environment of `config.env`, with any split read from `config.env.task_files`."""
  files = {k: v for k, v in _to_plain(config.env.get("task_files", {})).items() if v}
  return registry.make_env(config.env.name, _to_plain(config.env.kwargs), task_files=files or None)


def task_split(env: env_base.Environment, split: str, difficulty: str | None) -> list[env_base.Task]:
  name = registry.split_name(env, split, difficulty)
  tasks = list(env.tasks(name))
  if not tasks:
    raise ValueError(f"Environment {env.name!r} has no tasks in split {name!r}.")
  return tasks


def train_and_val_tasks(env: env_base.Environment, config
                        ) -> tuple[list[env_base.Task], list[env_base.Task]]:
  """The tasks RL and the supervised demonstrations draw from, and the validation split a
  recipe or a checkpoint is chosen on, so that the held-out test tasks are never consulted.

  `config.env.val_tasks` = N (0: no validation split) takes the last N train tasks of
  `config.env.val_difficulty` (default: the train difficulty). Of the train difficulty, they
  leave the RL and demonstration pool; of another difficulty (e.g. hard train tasks, where a
  policy trained on medium shows whether it transfers) the pool keeps every task.
  """
  tasks = task_split(env, "train", config.env.train_difficulty)
  n_val = int(config.env.get("val_tasks", 0))
  val_diff = str(config.env.get("val_difficulty", "") or config.env.train_difficulty)
  pool = tasks if val_diff == config.env.train_difficulty else task_split(env, "train", val_diff)
  # Of the train difficulty, RL needs at least one task left.
  most = len(pool) - (val_diff == config.env.train_difficulty)
  if not 0 <= n_val <= most:
    raise ValueError(f"config.env.val_tasks={n_val}: must be in [0, {most}] (the train split "
                     f"of {val_diff!r} has {len(pool)} tasks"
                     + (" and RL needs some of them)." if most < len(pool) else ")."))
  val = pool[len(pool) - n_val:] if n_val else []
  if val_diff != config.env.train_difficulty:
    return tasks, val
  return tasks[:len(tasks) - n_val], val


def evaluation_sets(env: env_base.Environment, config) -> list[tuple[str, list[env_base.Task]]]:
  """(name, tasks) of each in-loop evaluation set: `config.eval.split` "test" gives the first
  `eval.num_tasks` held-out tasks of each of `env.eval_difficulties` (named by difficulty),
  "val" the first `eval.num_tasks` tasks of the validation split (named "val")."""
  split, n = str(config.eval.get("split", "test")), int(config.eval.num_tasks)
  if split == "val":
    val = train_and_val_tasks(env, config)[1]
    if not val:
      raise ValueError("config.eval.split='val' needs a validation split: set "
                       "config.env.val_tasks > 0 (train tasks held out of RL and demos).")
    return [("val", val[:n])]
  if split != "test":
    raise ValueError(f"config.eval.split={split!r}: use 'test' (held-out tasks) or 'val' (the "
                     "validation split of train tasks, config.env.val_tasks).")
  return [(diff, eval_tasks(env, diff, n)) for diff in config.env.eval_difficulties]


def train_tasks_for_step(tasks: Sequence[env_base.Task], step: int, n: int, seed: int,
                         weights: str | np.ndarray | None = "") -> list[env_base.Task]:
  """The root tasks of RL step `step`: a pure function of (seed, step), so a resumed run
  draws exactly the tasks the uninterrupted run would have (the data position is the step).
  `weights` makes some tasks likelier: a rule (`parse_task_weights`) or each task's weight
  (`task_weights`' result); drawn without replacement."""
  rng = np.random.default_rng([seed, step])
  p = None
  if weights is not None and len(weights):
    w = task_weights(tasks, weights) if isinstance(weights, str) else np.asarray(weights, float)
    p = w / w.sum()
    n = min(n, int((w > 0).sum()))
  idx = rng.choice(len(tasks), size=min(n, len(tasks)), replace=False, p=p)
  return [tasks[i] for i in idx]


def task_weights(tasks: Sequence[env_base.Task], spec: str) -> np.ndarray:
  """Each task's draw weight under `spec` (`parse_task_weights`)."""
  rules = parse_task_weights(spec)
  fields = {f for f, _, _ in rules}
  missing = [f for f in fields if not any(f in t.fields for t in tasks)]
  if missing:
    known = sorted({k for t in tasks for k in t.fields})
    raise ValueError(f"config.rl.task_weights: no train task has the field(s) {missing}; "
                     f"the tasks' fields are {known}.")
  out = np.ones(len(tasks))
  for i, t in enumerate(tasks):
    for field, value, w in rules:
      if field in t.fields:
        v = t.fields[field]
        text = str(len(v)) if isinstance(v, (dict, list, tuple)) else str(v)
        if text == value:
          out[i] = w
  if not out.sum() > 0:
    raise ValueError(f"config.rl.task_weights={spec!r} gives every train task weight 0.")
  return out


def eval_tasks(env: env_base.Environment, difficulty: str, n: int) -> list[env_base.Task]:
  """The first `n` held-out tasks of a difficulty (a fixed set, comparable across steps)."""
  return task_split(env, "test", difficulty)[:n]


# -- agent runtime -----------------------------------------------------------------------------


def runner_config(config, *, recursive: bool | None = None, greedy: bool = False,
                  seed: int | None = None) -> runner_lib.RunnerConfig:
  a = config.agent
  if a.mode not in ("recursive", "single"):
    raise ValueError(f"config.agent.mode={a.mode!r}: use 'recursive' or 'single'.")
  return runner_lib.RunnerConfig(
      recursive=(a.mode == "recursive") if recursive is None else recursive,
      max_depth=int(a.max_depth),
      max_steps_per_agent=int(a.max_steps_per_agent),
      max_live_agents=int(a.max_live_agents),
      context_window=int(a.context_window),
      max_new_tokens=int(a.max_new_tokens),
      temperature=float(a.eval_temperature if greedy else a.temperature),
      top_p=1.0 if greedy else float(a.top_p),
      seed=seed,
      tree_step_budget=int(a.tree_step_budget) or None,
      stop_at_cell_close=bool(a.stop_at_cell_close))


def sandbox_config(config):
  """Each sandbox's `SandboxConfig` of `config.sandbox` (a pool keeps `pool_size` started)."""
  from rao_jax.sandbox_host import SandboxConfig  # pylint: disable=g-import-not-at-top
  return SandboxConfig(isolation=config.sandbox.isolation,
                       cell_timeout_s=float(config.sandbox.cell_timeout_s))


def sandbox_pool(config):
  from rao_jax.sandbox_host import SandboxPool  # pylint: disable=g-import-not-at-top
  return SandboxPool(sandbox_config(config), size=int(config.sandbox.pool_size))


# -- model, engine, learner ----------------------------------------------------------------------


def _dtype(name: str):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if name == "auto":
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  try:
    return jnp.dtype(name)
  except TypeError as e:
    raise ValueError(f"config.model.dtype={name!r}: use 'auto', 'float32' or 'bfloat16'.") from e


def compile_cache_dir(config) -> str | None:
  """The persistent compilation cache folder of `config.compile_cache`, or None (off).

  "auto": `$XDG_CACHE_HOME/rao_jax/xla` (default ~/.cache/rao_jax/xla), shared by every run of
  this user: a run, its resume, its evaluation and the next experiment load the programs the
  first one compiled (minutes on 2 CPU cores) instead of compiling them again.
  """
  value = str(config.get("compile_cache", "auto") if hasattr(config, "get") else "auto")
  if not value:
    return None
  if value == "auto":
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rao_jax", "xla")
  return os.path.abspath(os.path.expanduser(value))


def use_compile_cache(config) -> str | None:
  """Turns on JAX's persistent compilation cache at `compile_cache_dir(config)`; returns the
  folder in use. A cache the environment already chose (JAX_COMPILATION_CACHE_DIR, or an
  earlier call) is kept. Call it before the first compilation: JAX reads the setting once."""
  import jax  # pylint: disable=g-import-not-at-top
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  path = compile_cache_dir(config)
  if path is None:
    return None
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    log.warning("config.compile_cache=%r: cannot create %s (%s); compiling without a "
                "persistent cache.", config.get("compile_cache"), path, e)
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  # Programs that compile in under a second are not worth a file each.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  return path


def warm_engine(config, engine) -> float:
  """Compiles the embedded engine's shapes up to the run's cache length before any request
  (`config.warmup`); seconds spent (0 for engines that compile elsewhere, e.g. SGLang)."""
  if not config.get("warmup", True):
    return 0.0
  return run_parts.warm_up(engine, int(config.rollout.max_cache_len))


def load_policy(config, mesh=None):
  """(model, tokenizer) of `config.model.name` (registry name, GGUF file or HF folder).

  Mixed precision: the weights load in float32 (the learner's master weights; it keeps AdamW's
  moments in float32 too) and the model computes in `config.model.dtype` ("auto": bfloat16 on
  GPU/TPU). The rollout engine takes its own copies in the compute dtype. `mesh`: the
  learner's (`make_mesh(config.learner.mesh)`, made here when None), which
  `config.model.remat="auto"` plans for.
  """
  from rao_jax import host_memory  # pylint: disable=g-import-not-at-top
  # The first call that starts JAX's backends in every entry point: malloc is set before it,
  # and only where the CPU computes (see rao_jax/host_memory.py).
  host_memory.keep_freed_memory()
  use_compile_cache(config)
  from rao_jax.model import load_pretrained  # pylint: disable=g-import-not-at-top
  from rao_jax.model import lora as lora_lib  # pylint: disable=g-import-not-at-top
  remat = str(config.model.remat)
  if remat not in ("auto", "none", "dots", "full"):
    raise ValueError(f"config.model.remat={remat!r}: use auto (the memory plan chooses), none, "
                     "dots or full.")
  # A run's config.json written before config.model.kernels existed reads as "auto".
  model, tokenizer = load_pretrained(config.model.name, dtype=_dtype(config.model.dtype),
                                     param_dtype="float32",
                                     remat="none" if remat == "auto" else remat,
                                     kernels=config.model.get("kernels", "auto"))
  lora = lora_lib.from_dict(lora_section(config))
  if lora.enabled and config.ckpt.get("init_from"):
    # A LoRA run adapts the model it starts from: that run's weights are the frozen base, at
    # the start, at every resume and in evaluation (the adapter checkpoints name it by
    # fingerprint). A full fine-tuning run reads init_from once, into its first state.
    from rao_jax.learner import checkpoint  # pylint: disable=g-import-not-at-top
    checkpoint.load_params_into(model, config.ckpt.init_from)
  # Fresh adapters (B = 0: the loaded model's outputs are unchanged) when model.lora.rank > 0.
  lora_lib.add_adapters(model, lora)
  if remat == "auto":
    # The model's shapes are known now; remat is read when the step is traced, later.
    model.cfg = dataclasses.replace(model.cfg, remat=planned_remat(config, model.cfg, mesh))
  return model, tokenizer


def lora_section(config) -> dict | None:
  """``config.model.lora`` as a dict (None in a run's config.json written before it existed)."""
  section = config.model.get("lora")
  if section is None:
    return None
  return section.to_dict() if hasattr(section, "to_dict") else dict(section)


def planned_remat(config, model_cfg, mesh=None) -> str:
  """The learner's remat for ``config.model.remat="auto"``: the least recomputation whose
  step fits this device's memory (``rao_jax.learner.memory``), for the run's row length and
  micro-batch rows per device of `mesh` (default: ``make_mesh(config.learner.mesh)``)."""
  from rao_jax.learner import memory  # pylint: disable=g-import-not-at-top
  mesh = make_mesh(str(config.learner.mesh)) if mesh is None else mesh
  mesh_rows = mesh.shape["data"] * mesh.shape["fsdp"]
  shards, tensor = mesh.shape["fsdp"] * mesh.shape["tensor"], mesh.shape["tensor"]
  micro = max(int(config.learner.micro_batch_rows), 1)
  rows = -(-micro // mesh_rows)
  return memory.plan_remat(model_cfg, _row_len(config), rows, shards=shards, tensor=tensor)


def make_mesh(spec: str):
  """A ("data", "fsdp", "tensor") mesh: "auto" puts every device on "data"."""
  import jax  # pylint: disable=g-import-not-at-top
  from rao_jax.model import sharding  # pylint: disable=g-import-not-at-top
  if spec == "auto":
    return sharding.make_mesh(jax.device_count(), 1, 1)
  sizes = {"data": 1, "fsdp": 1, "tensor": 1}
  for part in spec.split(","):
    k, _, v = part.partition("=")
    if k.strip() not in sizes or not v.strip().isdigit():
      raise ValueError(f"config.learner.mesh={spec!r}: expected 'auto' or e.g. "
                       "'data=2,fsdp=4,tensor=1'.")
    sizes[k.strip()] = int(v)
  return sharding.make_mesh(sizes["data"], sizes["fsdp"], sizes["tensor"])


def _row_len(config) -> int:
  row = int(config.learner.row_len) or int(config.agent.context_window)
  if row < int(config.agent.context_window):
    raise ValueError(
        f"config.learner.row_len={row} is shorter than config.agent.context_window="
        f"{config.agent.context_window}: a full-window node would not fit a row. Set "
        "--config.learner.row_len=0 (= the context window) or at least the window.")
  return row


def learner_config(config, workdir: str, *, sft: bool = False, mesh=None):
  """The learner's `LearnerConfig` (RL, or supervised with `sft`), checkpoints under
  `workdir`; micro-batches of whole rows per device of `mesh` (default:
  ``make_mesh(config.learner.mesh)``)."""
  from rao_jax.learner import LearnerConfig  # pylint: disable=g-import-not-at-top
  mesh = make_mesh(str(config.learner.mesh)) if mesh is None else mesh
  mesh_rows = mesh.shape["data"] * mesh.shape["fsdp"]   # devices holding different rows
  micro = max(int(config.learner.micro_batch_rows), 1)
  micro = -(-micro // mesh_rows) * mesh_rows   # every device holds whole rows
  # Row-count buckets 4x apart: the step skips micro-batches of padding rows (no forward, no
  # backward, no accumulation), so a coarse ladder costs almost nothing, and each bucket is one
  # compilation at warm-up. Explicit buckets are rounded up to whole micro-batches (the mesh
  # may force a larger one).
  buckets = tuple(sorted({-(-int(b) // micro) * micro for b in config.learner.bucket_rows})
                  ) or tuple(micro * m for m in (1, 4, 16, 64))
  return LearnerConfig(
      loss="rao" if sft else config.rl.loss,
      lam=float(config.rl.lam),
      advantage=str(config.rl.get("advantage", "node")),
      train_nodes="all" if sft else str(config.rl.get("train_nodes", "all")),
      depth_weights=bool(config.rl.get("depth_weights", True)),
      bonus="rate" if sft else str(config.rl.get("bonus", "rate")),
      baseline="loo" if sft else str(config.rl.get("baseline", "loo_success")),
      drop_equal_groups=False if sft else bool(config.rl.get("drop_equal_groups", True)),
      node_rewards="dense" if sft else str(config.rl.get("node_rewards", "dense")),
      pass_through_gate=False if sft else bool(config.rl.get("pass_through_gate", False)),
      child_keep_prob=1.0 if sft else float(config.rl.get("child_keep_prob", 1.0)),
      clip_eps=float(config.rl.clip_eps),
      cispo_ratio_max=float(config.rl.cispo_ratio_max),
      tis_cap=0.0 if sft else float(config.rl.get("tis_cap", 0.0)),
      kl_coef=0.0 if sft else float(config.rl.kl_coef),
      temperature=1.0 if sft else max(float(config.agent.temperature), 1e-6),
      lr=float(config.sft.lr if sft else config.optim.lr),
      warmup_steps=int(config.sft.warmup_steps if sft else config.optim.warmup_steps),
      total_steps=max(int(config.sft.steps if sft else config.total_steps), 1),
      weight_decay=float(config.optim.weight_decay),
      b1=float(config.optim.b1), b2=float(config.optim.b2),
      grad_clip=float(config.optim.grad_clip),
      row_len=_row_len(config),
      micro_batch_rows=micro,
      bucket_rows=buckets,
      share_prefix_min=int(config.learner.get("share_prefix_min", -1)),
      seed=int(config.seed),
      ckpt_dir=os.path.join(os.path.abspath(workdir), "checkpoints"),
      ckpt_every=int(config.ckpt.every),
      ckpt_keep=int(config.ckpt.keep))


# -- the RL loop and its rollouts --------------------------------------------------------------

def rl_config(config) -> RLConfig:
  """The RL loop's typed settings from `config.rl` and `config.total_steps`."""
  rl = config.rl
  return RLConfig(
      total_steps=config.total_steps, group_size=rl.group_size,
      tasks_per_step=rl.tasks_per_step, loss=rl.loss, overlap=rl.overlap,
      max_staleness=rl.max_staleness, max_nonfinite_steps=rl.max_nonfinite_steps,
      infra_retries=rl.infra_retries, rollout_deadline_s=rl.rollout_deadline_s,
      deadline_rule=rl.deadline_rule, task_weights=rl.get("task_weights", ""),
      update_without_signal=bool(rl.get("update_without_signal", False)))


def engine_config(config):
  """The embedded engine's `EngineConfig` of a run: EngineConfig's defaults, then
  `config.rollout.{num_slots, max_cache_len, share_prefix_min}` and any field set in
  `config.rollout.embedded`; the sampling seed is the run's, one stream per process.

  Raises:
    ValueError: a key of `config.rollout.embedded` that is not an EngineConfig field.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from rao_jax.rollout.engine import EngineConfig  # pylint: disable=g-import-not-at-top
  fields = {f.name for f in dataclasses.fields(EngineConfig)}
  extra = _to_plain(config.rollout.get("embedded", {})) or {}
  unknown = sorted(set(extra) - fields)
  if unknown:
    raise ValueError(f"config.rollout.embedded has {unknown}, which are not fields of the "
                     f"embedded engine's EngineConfig; valid: {sorted(fields)}.")
  kw = {k: tuple(v) if isinstance(v, list) else v for k, v in extra.items()}
  kw.setdefault("num_slots", int(config.rollout.num_slots))
  kw.setdefault("max_len", int(config.rollout.max_cache_len))
  kw.setdefault("share_prefix_min", int(config.rollout.get("share_prefix_min",
                                                          EngineConfig.share_prefix_min)))
  # Each process of a multi-host run samples its own share of trees with its own stream.
  kw.setdefault("seed", int(config.seed) + jax.process_index())
  return EngineConfig(**kw)


def rollout_api_key(config) -> str | None:
  """The rollout servers' API key, from the environment variable `config.rollout.api_key_env`
  names (default RAO_JAX_API_KEY); None when it is unset. The config holds only the variable's
  name, so the key never reaches config.json, logs or tree records."""
  from rao_jax.rollout.sglang_client import API_KEY_ENV, api_key_from_env  # pylint: disable=g-import-not-at-top
  rollout = config.get("rollout") if hasattr(config, "get") else None
  name = (rollout.get("api_key_env") if rollout is not None else None) or API_KEY_ENV
  return api_key_from_env(str(name))


def engine_spec(config, export_dir: str | None = None) -> EngineSpec:
  """The `EngineSpec` of `config.rollout.engine`; an SGLang client writes the checkpoints of
  `update_weights` under `export_dir` (a folder its servers can read)."""
  kind = config.rollout.engine
  max_cache_len = int(config.rollout.get("max_cache_len", 0) or 0)
  if kind == "embedded":
    return EngineSpec(kind, embedded=engine_config(config), max_cache_len=max_cache_len)
  if kind != "sglang":
    return EngineSpec(kind)   # its check names the choices
  urls = tuple(config.rollout.urls)
  if not urls:
    raise ValueError("config.rollout.engine='sglang' needs --config.rollout.urls="
                     "http://host:30000[,http://host2:30000].")
  # Configs saved before these settings existed keep the client's defaults.
  timing = {}
  for name in ("retry_timeout", "health_interval"):
    v = config.rollout.get(name, None)
    if v is None:
      continue
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
      raise ValueError(f"config.rollout.{name}={v!r}: give a number of seconds > 0, e.g. "
                       f"--config.rollout.{name}=" + ("120" if name == "retry_timeout"
                                                      else "1") + ".")
    timing[name] = float(v)
  return EngineSpec(kind, urls=urls, api_key=rollout_api_key(config), export_dir=export_dir,
                    max_cache_len=max_cache_len, **timing)


def make_engine(config, model, tokenizer, *, weight_version: int | str = 0,
                export_dir: str | None = None):
  """The rollout engine of `config.rollout.engine` (`engine_spec`), serving `model`'s current
  weights as `weight_version`."""
  return engine_spec(config, export_dir).build(model, tokenizer, weight_version=weight_version)


def make_runner(config, env, engine, tokenizer, repls, judge=None,
                **kw) -> runner_lib.TreeRunner:
  return runner_lib.TreeRunner(env, engine, tokenizer, repls, runner_config(config, **kw),
                               judge=judge)


def judge_spec(config, phase: str) -> JudgeSpec:
  """The judge of `config.judge.train` / `config.judge.eval` (phase "train" / "eval"); "model"
  judges on the policy's own engine, or on the endpoint `config.judge.url`
  (`config.judge.api`). The source of every success is kept in the tree records
  (`success_source`, `extras["judge"]`)."""
  if phase not in ("train", "eval"):
    raise ValueError(f"judge_spec: phase={phase!r}, use 'train' or 'eval'.")
  j = config.get("judge") if hasattr(config, "get") else None
  kind = str(j[phase]) if j is not None else "none"
  if kind not in JUDGES:
    raise ValueError(f"config.judge.{phase}={kind!r}: use one of {JUDGES}.")
  if kind != "model":
    return JudgeSpec(kind)
  return JudgeSpec(kind, url=str(j.url) or None, api=str(j.api) or None)


def make_judge(config, phase: str, engine, tokenizer):
  """The judge of phase "train" / "eval" (`judge_spec`) for the policy's `engine`."""
  return judge_spec(config, phase).build(engine, tokenizer)


# -- a run, assembled ----------------------------------------------------------------------------


def assemble(config, workdir: str) -> RunParts:
  """The typed parts of the RL run `config` describes, in `workdir`: the one place a training
  run reads its config (`trainer.Trainer` takes the parts; `Trainer.from_config` calls this).

  Writes ``workdir/config.json`` (process 0) first, then builds each part once, so that a bad
  value fails here, before any rollout: the loop's settings, the environment and its tasks
  (train tasks, their draw weights, the evaluation sets), the policy and tokenizer (its remat
  planned for the learner's mesh), the learner's config and mesh, where the first parameters
  come from, and the settings of the engine, sandboxes, runners and judges (which the Trainer
  starts). Loads the policy's weights; starts no engine, sandbox or learner.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from rao_jax import host_memory  # pylint: disable=g-import-not-at-top
  # Before anything starts JAX's backends (jax.process_count below does), as load_policy asks.
  host_memory.keep_freed_memory()
  rl = rl_config(config)
  rl.check_processes(jax.process_count())
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    save_config(config, workdir)
  env = make_env(config)
  train_tasks = train_and_val_tasks(env, config)[0]
  eval_sets = evaluation_sets(env, config)   # a bad split fails here
  # A bad rule fails here, not at the first step's rollouts.
  weights = task_weights(train_tasks, rl.task_weights) if rl.task_weights else None
  mesh = make_mesh(str(config.learner.mesh))
  model, tokenizer = load_policy(config, mesh)
  learner = learner_config(config, workdir, mesh=mesh)
  from rao_jax.learner import checkpoint  # pylint: disable=g-import-not-at-top
  init_from = str(config.ckpt.get("init_from") or "")
  lora = getattr(model.cfg, "lora", None)
  # With LoRA, load_policy made init_from's weights the frozen base already.
  read_init_from = bool(init_from) and not (lora and lora.enabled)
  initial = InitialWeights(
      checkpoints=learner.ckpt_dir, init_from=init_from,
      init_from_dir=checkpoint.init_from_dir(init_from) if read_init_from else None,
      pretrained=str(config.model.name))
  return RunParts(
      workdir=workdir, rl=rl, env=env, train_tasks=tuple(train_tasks), task_weights=weights,
      train_seed=int(config.env.train_seed), train_difficulty=str(config.env.train_difficulty),
      eval_sets=tuple((name, tuple(tasks)) for name, tasks in eval_sets),
      model=model, model_cfg=model.cfg, tokenizer=tokenizer, learner=learner, mesh=mesh,
      initial=initial, engine=engine_spec(config, export_dir=os.path.join(workdir, "weights")),
      sandbox=sandbox_config(config), sandbox_pool_size=int(config.sandbox.pool_size),
      train_runner=runner_config(config),
      eval_runner=runner_config(config, greedy=True, seed=int(config.env.eval_seed)),
      train_judge=judge_spec(config, "train"), eval_judge=judge_spec(config, "eval"),
      warmup=bool(config.get("warmup", True)), eval_every=int(config.eval.every),
      num_html_trees=int(config.eval.num_html_trees),
      stop_at_success=_stop_at_success(config),
      tensorboard=bool(config.log.tensorboard), progress=bool(config.log.progress))


def _stop_at_success(config) -> float:
  """config.eval.stop_at_success, checked: a success in [0, 1] (0: never stop early)."""
  v = float(config.eval.get("stop_at_success", 0.0))
  if not 0.0 <= v <= 1.0:
    raise ValueError(f"config.eval.stop_at_success={v}: a success in [0, 1] (0 = never stop "
                     "early; 1.0 = stop once an evaluation solves every task).")
  if v > 0 and int(config.eval.every) <= 0:
    raise ValueError(f"config.eval.stop_at_success={v} needs in-loop evaluations: set "
                     "config.eval.every >= 1 (or stop_at_success = 0).")
  return v


@dataclasses.dataclass
class RolloutStats:
  """What the trainer logs about one batch of trees (`engine`: the engine's server counters,
  `Engine.health_metrics`, read when the rollouts ended)."""
  wall_s: float
  generated_tokens: int
  engine: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def tokens_per_s(self) -> float:
    return self.generated_tokens / max(self.wall_s, 1e-9)


def success_rate(trees) -> float:
  return float(np.mean([t.root.success or 0.0 for t in trees])) if trees else 0.0

