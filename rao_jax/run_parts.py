"""The typed parts of one RL run: what `experiment.assemble` makes of a config, and all that
`trainer.Trainer` reads.

    parts = experiment.assemble(config, workdir)   # the one place a run reads its ConfigDict
    trainer.Trainer(parts).run()                   # reads the parts only

Nothing here reads a ConfigDict. Each part is a frozen, validated dataclass of this module
(`RLConfig`, `EngineSpec`, `JudgeSpec`, `InitialWeights`) or an object of a lower layer (the
environment and its tasks, the policy and its tokenizer, `LearnerConfig`, the mesh,
`RunnerConfig`, `SandboxConfig`), and the builders here (`EngineSpec.build`, `JudgeSpec.build`,
`RunParts.runner`, `RunParts.sandbox_pool`) call only the layers beneath: followed from the
Trainer, a run's settings go down the layers only.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from rao_jax.agent import runner as runner_lib
from rao_jax.envs import base as env_base

log = logging.getLogger(__name__)


# -- the loop --------------------------------------------------------------------------------------

DEADLINE_RULES = ("unfinished", "drop_group")
RATIO_LOSSES = ("ppo_clip", "cispo")   # the losses that correct one-step-stale samples


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """What the RL loop (`rao_jax.trainer`) reads of `config.rl` and `config.total_steps`.

  The learner's part of `config.rl` (loss coefficients, advantages) is
  `experiment.learner_config`'s.
  Errors name the config key, its value and the fix.

  Attributes:
    total_steps: RL steps of the run (one learner update each).
    group_size: K trees per task; the leave-one-out baseline needs K >= 2.
    tasks_per_step: root tasks per step.
    loss: the learner's loss (overlap needs one with an importance ratio).
    overlap: roll out step s+1 on the weights of step s while step s trains.
    max_staleness: weight versions a sample may lag before its batch is re-collected.
    max_nonfinite_steps: non-finite updates in a row (each skipped) that stop the run.
    infra_retries: re-runs of a tree whose engine or sandbox failed.
    rollout_deadline_s: seconds per step's rollouts before trees are cut; 0 = no deadline.
    deadline_rule: cut trees are scored as they stand ("unfinished") or drop their group
      ("drop_group").
    update_without_signal: False (default): a step whose batch has no node with w_d * A != 0
      applies no optimizer update (Adam would move every weight by about lr on any gradient);
      True: it still steps when nodes are packed (a KL term alone; tests that exercise the
      learner on a policy too weak to succeed).
    task_weights: "" (uniform) or "FIELD:VALUE=WEIGHT,...": train tasks some rule matches are
      drawn WEIGHT times as often (`parse_task_weights`), e.g. to weight a task mix towards
      the tasks the policy still fails.
  """
  total_steps: int
  group_size: int = 8
  tasks_per_step: int = 4
  loss: str = "rao"
  overlap: bool = False
  max_staleness: int = 1
  max_nonfinite_steps: int = 3
  infra_retries: int = 1
  rollout_deadline_s: float = 0.0
  deadline_rule: str = "unfinished"
  task_weights: str = ""
  update_without_signal: bool = False

  def __post_init__(self):
    def key(name):
      return "config.total_steps" if name == "total_steps" else f"config.rl.{name}"
    for name, low in (("total_steps", 0), ("group_size", 2), ("tasks_per_step", 1),
                      ("max_staleness", 0), ("max_nonfinite_steps", 1), ("infra_retries", 0)):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise ValueError(f"{key(name)}={value!r} must be an integer >= {low}.")
      object.__setattr__(self, name, int(value))
    if self.group_size < 2:
      raise ValueError(f"config.rl.group_size={self.group_size}: the leave-one-out baseline "
                       "needs K >= 2 trees per task; set --config.rl.group_size=2 or more.")
    for name, low, why in (
        ("total_steps", 0, "RL steps of the run"),
        ("tasks_per_step", 1, "root tasks per step"),
        ("max_staleness", 0, "weight versions a sample may lag"),
        ("max_nonfinite_steps", 1, "non-finite updates in a row that stop the run"),
        ("infra_retries", 0, "re-runs of a tree whose infrastructure failed")):
      if getattr(self, name) < low:
        raise ValueError(f"{key(name)}={getattr(self, name)}: must be >= {low} ({why}).")
    if not isinstance(self.overlap, (bool, np.bool_)):
      raise ValueError(f"config.rl.overlap={self.overlap!r}: use True or False.")
    object.__setattr__(self, "overlap", bool(self.overlap))
    if self.overlap and self.loss not in RATIO_LOSSES:
      raise ValueError(
          f"config.rl.overlap=True samples one step off-policy; config.rl.loss={self.loss!r} "
          "has no importance ratio. Use --config.rl.loss=ppo_clip or cispo.")
    if isinstance(self.rollout_deadline_s, bool) or not isinstance(
        self.rollout_deadline_s, (int, float, np.integer, np.floating)) \
        or not self.rollout_deadline_s >= 0:
      raise ValueError(f"config.rl.rollout_deadline_s={self.rollout_deadline_s!r}: use a number "
                       "of seconds > 0, or 0 for no deadline.")
    object.__setattr__(self, "rollout_deadline_s", float(self.rollout_deadline_s))
    if self.deadline_rule not in DEADLINE_RULES:
      raise ValueError(f"config.rl.deadline_rule={self.deadline_rule!r}: use one of "
                       f"{DEADLINE_RULES}.")
    parse_task_weights(self.task_weights)

  @property
  def deadline_s(self) -> float | None:
    """Seconds per step's rollouts, None for no deadline."""
    return self.rollout_deadline_s if self.rollout_deadline_s > 0 else None

  def check_processes(self, num_processes: int) -> None:
    """What these settings cannot know alone: the run's processes. (Unknown keys are the entry
    point's check, experiments.configs.base.check_keys: the schema lives with the configs.)"""
    if self.overlap and num_processes > 1:
      raise ValueError("config.rl.overlap=True with several processes: the next step's "
                       "rollouts would exchange trees while the learner step runs its "
                       "collectives; use --config.rl.overlap=False for multi-host runs.")


def parse_task_weights(spec: str) -> list[tuple[str, str, float]]:
  """`"FIELD:VALUE=WEIGHT,..."` -> [(field, value, weight)].

  A task whose `fields[FIELD]` equals VALUE (compared as text; for a mapping or a list, its
  number of entries) weighs WEIGHT; a task no rule matches weighs 1. E.g.
  `"target_items:2=3"`: TextCraft tasks with two target items are drawn three times as often.
  """
  rules = []
  for part in filter(None, (x.strip() for x in spec.split(","))):
    head, eq, weight = part.rpartition("=")
    field, colon, value = head.partition(":")
    try:
      w = float(weight)
    except ValueError:
      w = -1.0
    if not (eq and colon and field and value) or not w >= 0:
      raise ValueError(f"config.rl.task_weights={spec!r}: {part!r} is not FIELD:VALUE=WEIGHT "
                       "with WEIGHT >= 0, e.g. 'target_items:2=3'.")
    rules.append((field, value, w))
  return rules


# -- rollouts --------------------------------------------------------------------------------------

ENGINES = ("embedded", "sglang")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """The rollout engine of `config.rollout` (`experiment.engine_spec`); `build` starts one.

  Attributes:
    kind: "embedded" (the JAX engine, in this process) or "sglang" (SGLang-native servers).
    embedded: kind "embedded": its `EngineConfig`.
    urls: kind "sglang": the servers' base URLs.
    retry_timeout, health_interval: kind "sglang": the client's seconds, where the config
      sets them (None: the client's defaults).
    api_key: kind "sglang": the servers' key (`experiment.rollout_api_key`), kept out
      of the repr.
    export_dir: kind "sglang": where the client writes the weights of each sync (a folder its
      servers can read); None where nothing is synced.
    max_cache_len: the cache length the embedded engine's warm-up compiles up to.
  """
  kind: str
  embedded: Any = None
  urls: tuple[str, ...] = ()
  retry_timeout: float | None = None
  health_interval: float | None = None
  api_key: str | None = dataclasses.field(default=None, repr=False)
  export_dir: str | None = None
  max_cache_len: int = 0

  def __post_init__(self):
    if self.kind not in ENGINES:
      raise ValueError(f"config.rollout.engine={self.kind!r}: use 'embedded' or 'sglang'.")

  def build(self, model, tokenizer, *, weight_version: int | str = 0):
    """The engine, serving `model`'s current weights as `weight_version`."""
    if self.kind == "embedded":
      from rao_jax.rollout.engine import EmbeddedEngine  # pylint: disable=g-import-not-at-top
      return EmbeddedEngine(model, self.embedded, weight_version=weight_version,
                            tokenizer=tokenizer)
    from rao_jax.rollout.sglang_client import SGLangEngine  # pylint: disable=g-import-not-at-top
    timing = {k: v for k, v in (("retry_timeout", self.retry_timeout),
                                ("health_interval", self.health_interval)) if v is not None}
    return SGLangEngine(list(self.urls), weight_version=weight_version,
                        export_root=self.export_dir, tokenizer=tokenizer, api_key=self.api_key,
                        **timing)

  def warm(self, engine) -> float:
    """Compiles `engine`'s shapes up to `max_cache_len` before any request; seconds spent (0
    for engines that compile elsewhere, e.g. SGLang)."""
    return warm_up(engine, self.max_cache_len)


def warm_up(engine, max_cache_len: int) -> float:
  """Compiles `engine`'s shapes up to `max_cache_len` before any request; seconds spent (0 for
  engines that compile elsewhere, e.g. SGLang)."""
  if not hasattr(engine, "warmup"):
    return 0.0
  t0 = time.perf_counter()
  engine.warmup(max_cache_len=max_cache_len)
  s = time.perf_counter() - t0
  log.info("engine warm-up: every rollout shape compiled (or loaded from the compilation "
           "cache) in %.1f s", s)
  return s


JUDGES = ("none", "rule", "model")


@dataclasses.dataclass(frozen=True)
class JudgeSpec:
  """The judge of one phase (`experiment.judge_spec`): who scores the nodes no verifier
  covers.

  Attributes:
    kind: "none": they take the root's success (the proxy); "rule": `judge.RuleJudge`
      (finished with a non-empty answer); "model": `judge.LLMJudge`.
    url, api: kind "model": the judge's endpoint and its API; None: the policy's own engine.
  """
  kind: str = "none"
  url: str | None = None
  api: str | None = None

  def __post_init__(self):
    if self.kind not in JUDGES:
      raise ValueError(f"JudgeSpec.kind={self.kind!r}: use one of {JUDGES}.")

  def build(self, engine, tokenizer):
    """The judge (None for "none"); "model" judges with `engine` unless `url` is set."""
    from rao_jax.envs import judge as judge_lib  # pylint: disable=g-import-not-at-top
    if self.kind == "none":
      return None
    if self.kind == "rule":
      return judge_lib.RuleJudge()
    return judge_lib.LLMJudge.for_policy(engine, tokenizer, url=self.url, api=self.api)


# -- the run -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InitialWeights:
  """Where a run's first parameters come from, tried in this order (the Trainer's resume order).

  Attributes:
    checkpoints: the run's own checkpoint folder; its newest complete checkpoint (parameters,
      optimizer, step, RNG, data position) resumes the run.
    init_from: ``config.ckpt.init_from`` as given ("" when unset).
    init_from_dir: with nothing to resume, the checkpoint folder whose newest parameters start
      the run (optimizer and step start fresh); None when ``init_from`` is unset, or when the
      policy holds those parameters already (a LoRA run adapts them: its frozen base).
    pretrained: otherwise the policy's loaded weights: this model (``config.model.name``: a
      registry name, GGUF file or HF folder), with fresh adapters on a LoRA run.
  """
  checkpoints: str
  init_from: str = ""
  init_from_dir: str | None = None
  pretrained: str = ""


@dataclasses.dataclass(eq=False)
class RunParts:
  """The parts of one RL run (`experiment.assemble`): all that `trainer.Trainer` reads.

  Attributes:
    workdir: the run's folder (absolute): config.json, checkpoints/, trees/, eval/, metrics.
    rl: the loop's settings.
    env: the environment.
    train_tasks: the tasks RL draws from (the validation split, ``config.env.val_tasks``, left
      out).
    task_weights: each train task's draw weight (``config.rl.task_weights``); None: uniform.
    train_seed: the seed of each step's draw (``experiment.train_tasks_for_step``).
    train_difficulty: the train tasks' difficulty (the ``success_<difficulty>`` metric).
    eval_sets: (name, tasks) of each in-loop evaluation set (``config.eval.split``: held-out
      tasks per difficulty, or the validation split).
    model: the policy: float32 master weights computing in ``config.model.dtype``, LoRA
      adapters where ``config.model.lora.rank`` > 0; handed to the learner once
      (`take_model`).
    model_cfg: the policy's ModelConfig; its ``remat`` is the plan (`remat`).
    tokenizer: the policy's tokenizer.
    learner: the learner's LearnerConfig (checkpoints in ``workdir/checkpoints``).
    mesh: the learner's ("data", "fsdp", "tensor") device mesh.
    initial: where the first parameters come from.
    engine: the rollout engine (an SGLang client exports to ``workdir/weights``).
    sandbox: each sandbox's SandboxConfig; sandbox_pool_size: sandboxes kept started.
    train_runner, eval_runner: the trees RL samples, and greedy evaluation's (its seed).
    train_judge, eval_judge: who scores the nodes no verifier covers, in each phase.
    warmup: compile the engine's and the learner's shapes before step 1.
    eval_every: steps between in-loop evaluations (<= 0: none); num_html_trees: trees each
      evaluation's HTML page shows; stop_at_success: end training once an evaluation reaches
      this success on every set (0: never).
    tensorboard: also write TensorBoard events; progress: show the progress bar.
  """
  workdir: str
  rl: RLConfig
  env: env_base.Environment = dataclasses.field(repr=False)
  train_tasks: tuple[env_base.Task, ...] = dataclasses.field(repr=False)
  task_weights: np.ndarray | None = dataclasses.field(repr=False)
  train_seed: int
  train_difficulty: str
  eval_sets: tuple[tuple[str, tuple[env_base.Task, ...]], ...] = dataclasses.field(repr=False)
  model: Any = dataclasses.field(repr=False)
  model_cfg: Any
  tokenizer: Any = dataclasses.field(repr=False)
  learner: Any
  mesh: Any
  initial: InitialWeights
  engine: EngineSpec
  sandbox: Any
  sandbox_pool_size: int
  train_runner: runner_lib.RunnerConfig
  eval_runner: runner_lib.RunnerConfig
  train_judge: JudgeSpec
  eval_judge: JudgeSpec
  warmup: bool
  eval_every: int
  num_html_trees: int
  tensorboard: bool
  progress: bool
  stop_at_success: float = 0.0

  @property
  def remat(self) -> str:
    """The learner's remat ("none", "dots" or "full"; ``config.model.remat="auto"`` planned
    for this device and mesh)."""
    return self.model_cfg.remat

  def take_model(self):
    """The policy, handed over once: the parts drop it, so that its weights are freed as soon
    as the learner holds its own (sharded) copy."""
    if self.model is None:
      raise RuntimeError("RunParts.take_model: the policy was taken already (one Trainer per "
                         "assembled run); call experiment.assemble again for another.")
    model, self.model = self.model, None
    return model

  def sandbox_pool(self):
    """A new pool of the run's sandboxes (not started)."""
    from rao_jax.sandbox_host import SandboxPool  # pylint: disable=g-import-not-at-top
    return SandboxPool(self.sandbox, size=self.sandbox_pool_size)

  def runner(self, engine, repls, phase: str) -> runner_lib.TreeRunner:
    """The tree runner of phase "train" (`train_runner`) or "eval" (`eval_runner`) on
    `engine` and the sandboxes `repls`, with that phase's judge."""
    if phase not in ("train", "eval"):
      raise ValueError(f"RunParts.runner: phase={phase!r}, use 'train' or 'eval'.")
    cfg, judge = ((self.train_runner, self.train_judge) if phase == "train"
                  else (self.eval_runner, self.eval_judge))
    return runner_lib.TreeRunner(self.env, engine, self.tokenizer, repls, cfg,
                                 judge=judge.build(engine, self.tokenizer))
