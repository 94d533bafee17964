"""The RAO training loop: `Trainer.rl_step` runs one step, hooks (`rao_jax.hooks`) run between.

    for step in range(start, total_steps):
      rl_step:
        tasks  <- train_tasks_for_step(seed, step)                 (data position = step)
        trees  <- K trees per task through the agent runtime        (rollout engine + sandboxes)
        batch  <- rewards, leave-one-out advantages, depth weights, packing  (learner, host side)
        state  <- learner step                                      (jitted, sharded, donated)
        engine <- new weights (in process, or SGLang over HTTP), version = step
      hooks, every n steps (`Trainer.hooks`): metrics, the divergence stop, evaluation on
        held-out tasks (trees as HTML), checkpoint, progress bar

A run is assembled in one place: `experiment.assemble(config, workdir)` reads the config once
into typed parts (`run_parts.RunParts`: tasks, policy, learner config and mesh, initial weights,
rollout specs), and `Trainer(parts)` takes them (`Trainer.from_config` does both); the Trainer
reads no config (tests/test_layers.py checks it).

Resume order: the newest complete checkpoint in `workdir/checkpoints` (params, optimizer,
step, RNG, data position) wins; else `config.ckpt.init_from` (parameters only, e.g. an SFT
warm start); else the pretrained model. Ctrl-C / SIGTERM stop after the current stage, save a
checkpoint and return; running the same command again resumes. A resumed run records each step
once: what a killed attempt wrote after the restored step moves aside (metrics.superseded.jsonl,
superseded/). A checkpoint save the filesystem refuses is logged and counted (`ckpt/` rows) and
training goes on; the next save tries again.

With `config.rl.overlap`, the rollouts of step s+1 run (on the engine's weights of step s)
while the learner updates step s: samples are one version stale, which the clipped-ratio
losses correct for; a batch staler than `config.rl.max_staleness` is re-collected. Every node
records its staleness (`extras["staleness"]`: the step minus the oldest weight version it was
sampled with). The engine holds its own copies of the weights, so the learner's donated state
is never read by a rollout in flight.

Several processes (`jax.distributed`): process p rolls out the groups p, p + P, p + 2P, ... of
the step's tasks on its own engine and sandboxes; the trees are then exchanged (a host
all-gather of their JSON), so every process prepares the same global batch from the union in
process order: depth weights and the normalizer count the whole batch, and each device reads its
own rows of it in the SPMD step. Every engine takes a process-local copy of the new weights;
every process joins Orbax's checkpoint save (Orbax writes each file once); metrics, tree files,
evaluation, HTML and the plot come from process 0. Overlap is single-process only.

Faults the loop survives (each counted in the `train/faults/*` metrics):
  * a non-finite update is refused by the learner (state unchanged), logged and skipped; the
    learning-rate schedule counts applied updates only (the learner's own step counter);
    `config.rl.max_nonfinite_steps` of them in a row stop the run with `TrainingDivergedError`
    after a checkpoint of the last finite state;
  * a tree whose infrastructure failed (engine error or abort, sandbox crash or setup failure:
    the runner's `extras["infra_error"]`) is re-run `config.rl.infra_retries` times, then left
    out of its group's baseline and of the loss (never scored as the agent's failure); a group
    left with fewer than 2 trees is dropped;
  * the embedded engine's device step failing (a device error, out of memory) ends the requests
    it held with `FinishReason.ERROR`; the engine rebuilds its KV cache and serves on, and the
    affected trees are infrastructure failures like those above (re-run; counted in
    `faults/engine_error_trees` and `faults/infra_retries`). An engine that fails
    `config.rollout.embedded.max_consecutive_faults` steps in a row stops serving: the run
    stops with `RolloutEngineFailedError` after a checkpoint of its newest state;
  * with `config.rl.rollout_deadline_s` > 0, trees still running that long after the step's
    rollouts began are cut (their nodes end with "timeout"); `config.rl.deadline_rule` then
    either scores them as they stand ("unfinished") or drops their groups ("drop_group");
  * a rollout server that fails is skipped until it is back and re-synced (the SGLang client's
    failover; `train/rollout/servers_*` count it); when every server has been gone for
    `config.rollout.retry_timeout` seconds, the step's trees are infrastructure failures (never
    trained on) and the run stops with a checkpoint and `RolloutUnavailableError` naming the
    URLs; running the same command once a server is back resumes from that checkpoint.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import signal
import time
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from rao_jax import experiment as X
from rao_jax import run_parts
from rao_jax.collection import (RolloutProgress, collect_group, engine_failure, exchange,
                                process_share)
from rao_jax import hooks as hooks_lib
from rao_jax import metrics as metrics_lib
from rao_jax.agent import records as R
from rao_jax.learner import Learner, NonFiniteUpdateError
from rao_jax.rollout import base as rollout_base
from rao_jax.rollout.base import EngineFailedError

log = logging.getLogger(__name__)
ROLLOUT_REPORT_S = 60.0   # seconds between two progress lines of one step's rollouts


class _StopRequested(Exception):
  pass


class FatalRunError(RuntimeError):
  """A fault the run cannot survive; its newest state was checkpointed before it propagated,
  and its message names the cause and the fix (the CLI prints it without a traceback)."""


class TrainingDivergedError(FatalRunError):
  """Too many non-finite updates in a row; the last finite state was checkpointed."""


class RolloutUnavailableError(FatalRunError):
  """Every rollout server was gone past the retry timeout; the run's state was checkpointed
  and the same command resumes once a server is back."""


class RolloutEngineFailedError(FatalRunError):
  """The rollout engine stopped serving (repeated device failures); the run stops."""


class _Stopper:
  """Turns SIGINT / SIGTERM into a flag the loop checks (and cancels rollouts in flight)."""

  def __init__(self):
    self.requested = False
    self.event: asyncio.Event | None = None
    self._old = {}

  def install(self, loop: asyncio.AbstractEventLoop) -> None:
    self.event = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
      with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(sig, self._on_signal, sig)
        self._old[sig] = True

  def _on_signal(self, sig):
    if self.requested:   # a second Ctrl-C: the user really wants out
      raise KeyboardInterrupt
    log.warning("Received %s: finishing the current stage, saving a checkpoint, then exiting "
                "(press again to abort without saving).", signal.Signals(sig).name)
    self.requested = True
    self.event.set()

  def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
    for sig in self._old:
      with contextlib.suppress(Exception):
        loop.remove_signal_handler(sig)

  async def guard(self, coro):
    """Awaits `coro` unless a stop is requested first (then cancels it)."""
    task = asyncio.ensure_future(coro)
    stop = asyncio.ensure_future(self.event.wait())
    done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
      stop.cancel()
      return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
      await task
    raise _StopRequested()


class Trainer:
  """One RL run, built from its parts (`experiment.assemble`); `run()` is the loop.

  The constructor hands the parts down: the policy to a `Learner` (`parts.learner` on
  `parts.mesh`), which then takes the run's newest checkpoint, or else the parameters of
  `parts.initial.init_from_dir`; the learner's weights to the rollout engine `parts.engine`
  builds. It reads no config: `Trainer.from_config(config, workdir)` assembles the parts first.

  Args:
    parts: the run's parts; their policy is handed to the learner (`RunParts.take_model`), so
      one assembly builds one Trainer.
  """

  def __init__(self, parts: run_parts.RunParts):
    self.parts, self.rl, self.workdir = parts, parts.rl, parts.workdir
    self.process, self.num_processes = jax.process_index(), jax.process_count()
    self.main = self.process == 0
    os.makedirs(self.workdir, exist_ok=True)
    self.env, self.tokenizer, self.model_cfg = parts.env, parts.tokenizer, parts.model_cfg
    self.train_tasks, self.eval_sets = parts.train_tasks, parts.eval_sets

    self.learner = Learner(parts.learner, self.model_cfg, mesh=parts.mesh,
                           params=parts.take_model())
    self.start_step = 0
    latest = self.learner.latest_checkpoint_step()
    if latest is not None:
      extra = self.learner.restore(latest)
      self.start_step = int(extra.get("data_position", latest))
      log.info("Resumed from %s at step %d.", self.learner.cfg.ckpt_dir, self.start_step)
    elif parts.initial.init_from_dir:
      self._init_params_from(parts.initial)
    self.engine = parts.engine.build(self._local_model(), self.tokenizer)
    self.trees_dir = os.path.join(self.workdir, "trees")
    if self.main:
      self._set_aside_superseded()
    self.metrics = (metrics_lib.MetricsWriter(self.workdir, tensorboard=parts.tensorboard,
                                              purge_step=self.start_step + 1)
                    if self.main else _NoMetrics())
    os.makedirs(self.trees_dir, exist_ok=True)
    self._failures_reported = 0   # checkpoint save failures written to the metrics

  @classmethod
  def from_config(cls, config, workdir: str) -> "Trainer":
    """The Trainer of the run `config` describes, in `workdir`:
    ``Trainer(experiment.assemble(config, workdir))``."""
    return cls(X.assemble(config, workdir))

  def _set_aside_superseded(self) -> None:
    """Each step is recorded once: what an attempt killed before its next checkpoint wrote for
    the steps this run redoes moves to metrics.superseded.jsonl and superseded/ (kept, never
    dropped). Tree files are numbered by step index (file i is written by step i + 1), metrics
    rows and evaluation folders by steps done."""
    moved = metrics_lib.set_aside_superseded(
        self.workdir, self.start_step, {"trees": self.start_step, "eval": self.start_step + 1})
    if any(moved.values()):
      log.warning("Resuming at step %d: records an earlier attempt wrote after it were moved "
                  "aside (%s), as this run does those steps again.", self.start_step,
                  ", ".join(f"{k}: {v}" for k, v in moved.items() if v))

  def report_save_failures(self, step: int) -> None:
    """A `ckpt/` metrics row for each checkpoint save the filesystem refused since the last
    report (the learner logged it with the directory and the cause)."""
    self.learner.poll_checkpoints()
    failures = self.learner.checkpoint_failures
    for i, f in enumerate(failures[self._failures_reported:], self._failures_reported + 1):
      self.metrics.write(step, {"save_failed": 1.0, "failed_step": f.step,
                                "errno": f.errno or 0, "save_failures": i}, prefix="ckpt/")
    self._failures_reported = len(failures)

  def _init_params_from(self, initial: run_parts.InitialWeights) -> None:
    """Starts from another run's newest parameters (optimizer and step start fresh)."""
    ckpt_dir = initial.init_from_dir
    donor = Learner(self.learner.cfg, self.model_cfg, mesh=self.learner.mesh)
    if donor.latest_checkpoint_step(ckpt_dir) is None:
      raise FileNotFoundError(f"config.ckpt.init_from={initial.init_from!r}: no checkpoint in "
                              f"{ckpt_dir}.")
    donor.restore(directory=ckpt_dir)
    fresh = Learner(self.learner.cfg, self.model_cfg, mesh=self.learner.mesh,
                    params=donor.params)
    donor.close()
    self.learner.close()
    self.learner = fresh
    log.info("Initialised parameters from %s.", ckpt_dir)

  # -- weight sync ---------------------------------------------------------------------------

  def _local_model(self):
    """The learner's model with this process's own full copy of the parameters (the learner's
    arrays span every process's devices; the engine runs on this process alone)."""
    if self.num_processes == 1:
      return self.learner.model
    gather = lambda t: jax.tree.map(
        lambda x: jax.numpy.asarray(multihost_utils.process_allgather(x, tiled=True)), t)
    if self.learner.lora:
      return nnx.merge(self.learner.graphdef, gather(self.learner.params),
                       gather(self.learner.frozen))
    return nnx.merge(self.learner.graphdef, gather(self.learner.params))

  async def sync_weights(self, version: int) -> float:
    """The engine serves the learner's current weights as `version` once this returns (it
    copies or exports them, see `Engine.update_weights`); returns the seconds it took. With
    LoRA only the adapter changes, and engines that can take it alone do
    (`Engine.update_adapter`)."""
    t0 = time.perf_counter()
    try:
      if self.learner.lora:   # the engines hold the base since they started
        await self.engine.update_adapter(self._local_model(), version)
      else:
        await self.engine.update_weights(self._local_model(), version)
    except EngineFailedError as e:   # e.g. it stopped while a judge used it
      raise self._engine_failed(str(e), version, f"the weight sync after step {version}") from e
    return time.perf_counter() - t0

  # -- rollouts --------------------------------------------------------------------------------

  async def collect(self, runner, step: int
                    ) -> tuple[list[R.TreeRecord], X.RolloutStats, list[R.TreeRecord], dict]:
    """(trees to train on, stats, every tree run, fault counters) of step `step`."""
    rl = self.rl
    tasks = X.train_tasks_for_step(self.train_tasks, step, rl.tasks_per_step,
                                   self.parts.train_seed, self.parts.task_weights)
    tasks = process_share(tasks, self.process, self.num_processes)
    t0 = time.perf_counter()
    deadline = t0 + rl.deadline_s if rl.deadline_s else None
    # Numbered from 1, as metrics.jsonl and the bar count steps.
    progress = RolloutProgress(runner, step + 1, len(tasks) * rl.group_size, ROLLOUT_REPORT_S)
    reporter = asyncio.ensure_future(progress.report())
    try:
      groups = await asyncio.gather(*(
          collect_group(progress, task, rl.group_size, deadline=deadline,
                        infra_retries=rl.infra_retries, deadline_rule=rl.deadline_rule)
          for task in tasks))
    finally:
      reporter.cancel()
    # Trees that failed because no server was left are infrastructure failures; a step made of
    # them must not train, so the run stops here (with a checkpoint) instead.
    self.engine.check_available()
    wall = time.perf_counter() - t0
    trees = [t for kept, _, _ in groups for t in kept]
    every = [t for _, run, _ in groups for t in run]
    faults = collections.Counter()
    for _, _, st in groups:
      faults.update(st)
    toks = sum(n.num_generated_tokens for t in every for n in t.nodes)
    if self.num_processes > 1:
      trees, every, faults, toks, wall = await asyncio.to_thread(
          exchange, trees, every, dict(faults), toks, wall)
    # A tree met an engine that stopped serving: re-runs cannot succeed, and every later step
    # would drop all its groups. Checked on the union: every process stops at the same point.
    if engine_failure(every) is not None:
      raise self._engine_failed(engine_failure(every), step, f"step {step + 1}'s rollouts")
    return (trees, X.RolloutStats(wall, toks, self.engine.health_metrics()), every,
            dict(faults))

  def _engine_failed(self, why: str, step: int, during: str) -> "RolloutEngineFailedError":
    """The error that stops the run; `step`: steps done (`_run` saves them on its way out)."""
    saved = (f"the newest state (after step {step}) is saved in {self.learner.cfg.ckpt_dir}"
             if step > self.start_step else
             "no step was done since the run started, so its starting state stands")
    return RolloutEngineFailedError(
        f"The rollout engine stopped serving during {during}, so the run stops; {saved}. "
        f"Cause: {why} In the run's config: --config.rollout.num_slots, "
        "--config.rollout.max_cache_len, --config.rollout.embedded.max_consecutive_faults. "
        "Running the same command again resumes.")

  async def evaluate(self, repls, step: int) -> dict[str, float]:
    """Greedy evaluation of each set (held-out tasks per difficulty, or the validation split:
    `config.eval.split`); writes trees and an HTML page."""
    runner = self.parts.runner(self.engine, repls, "eval")
    out, all_trees = {}, []
    for diff, tasks in self.eval_sets:
      trees = await runner.run_tasks(tasks, group_size=1)
      if engine_failure(trees) is not None:
        raise self._engine_failed(engine_failure(trees), step, f"the evaluation after step {step}")
      self.engine.check_available()     # no score from trees no server could run
      all_trees += trees
      out[f"success_{diff}"] = X.success_rate(trees)
    out.update(metrics_lib.tree_stats(all_trees))
    out.update(metrics_lib.drift_stats(all_trees, self.parts.eval_runner.max_depth))
    d = os.path.join(self.workdir, "eval", f"step_{step:06d}")
    os.makedirs(d, exist_ok=True)
    R.save_trees_jsonl(os.path.join(d, "trees.jsonl"), all_trees)
    metrics_lib.write_html(all_trees[: self.parts.num_html_trees],
                           os.path.join(d, "trees.html"), title=f"Evaluation at step {step}")
    return out

  # -- the loop ----------------------------------------------------------------------------------

  def run(self) -> dict[str, Any]:
    return asyncio.run(self._run())

  async def _run(self) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    stopper = _Stopper()
    stopper.install(loop)
    repls = self.parts.sandbox_pool()
    await repls.start()
    runner = self.parts.runner(self.engine, repls, "train")
    total = self.rl.total_steps
    state = RunState(step=self.start_step, guard=NonFiniteGuard(self.rl.max_nonfinite_steps))
    hooks = self.hooks(repls, stopper, state)
    stopped, unavailable = False, None
    try:
      await self.sync_weights(state.step)
      # After the first sync: the engine's programs are specialised to the synced weights'
      # arrays (warmed on the weights it was built with, step 1 compiled them all again).
      state.reached = self.success_reached_before(state.step)
      if self.parts.warmup and state.step < total and state.reached is None:
        state.warmup_s = await asyncio.to_thread(self.warmup)
      while state.step < total and state.reached is None:
        m = await self.rl_step(runner, state, stopper.guard)
        await hooks_lib.run_hooks(hooks, state.step, total, m)
    except _StopRequested:
      stopped = True
    except rollout_base.EngineUnavailableError as e:
      unavailable = e
    finally:
      hooks_lib.close_hooks(hooks)
      if state.next_batch is not None:
        state.next_batch.cancel()
        with contextlib.suppress(BaseException):
          await state.next_batch
      stopper.uninstall(loop)
      # Nothing the user had is lost: the newest state is saved whatever ended the loop (waited
      # for first: a save of this step that failed in the background is tried once more).
      self.learner.wait_for_checkpoints()
      if state.step > self.start_step and self.learner.latest_checkpoint_step() != state.step:
        self.learner.save(state.step, extra={"data_position": state.step})
        self.learner.wait_for_checkpoints()
      self.report_save_failures(state.step)
      await repls.close()
      await self.engine.close()
      self.metrics.close()
    if unavailable is not None:
      saved = self.learner.latest_checkpoint_step()
      raise RolloutUnavailableError(
          f"Training stopped at step {state.step}: {unavailable} (config.rollout.retry_timeout)."
          " The run is saved: " + (f"its newest checkpoint is step {saved} in "
                                  f"{self.learner.cfg.ckpt_dir}" if saved is not None else
                                  "no step had finished, so there is no checkpoint yet")
          + ". Start the rollout server(s) again and run the same command to resume from there."
      ) from unavailable
    plot = (metrics_lib.plot_metrics(self.metrics.path, os.path.join(self.workdir, "plot.png"))
            if self.main else None)
    if state.reached is not None:
      log.info("Training ended at step %d of %d: the evaluation after step %d reached "
               "config.eval.stop_at_success=%s, so no later step could be chosen.", state.step,
               total, state.reached, self.parts.stop_at_success)
    return {"step": state.step, "stopped": stopped, "eval": state.last_eval, "plot": plot,
            "stopped_at_success": state.reached,
            "workdir": self.workdir, "checkpoint": self.learner.latest_checkpoint_step(),
            "checkpoint_failures": len(self.learner.checkpoint_failures)}

  def reaches_stop_success(self, evaluation: Mapping[str, float], prefix: str = "") -> bool:
    """Whether an evaluation's metrics reach config.eval.stop_at_success on every set."""
    want = self.parts.stop_at_success
    keys = [f"{prefix}success_{name}" for name, _ in self.parts.eval_sets]
    return bool(want > 0 and keys and all(
        evaluation.get(k) is not None and evaluation[k] >= want for k in keys))

  def success_reached_before(self, step: int) -> int | None:
    """On resume: the first step <= `step` whose logged evaluation reached
    config.eval.stop_at_success (then this run trains no further), else None."""
    path = self.metrics.path
    if self.parts.stop_at_success <= 0 or step <= 0 or not path or not os.path.exists(path):
      return None
    hits = [int(r["step"]) for r in metrics_lib.read_metrics(path)
            if int(r.get("step", 0)) <= step and self.reaches_stop_success(r, "eval/")]
    return min(hits) if hits else None

  def warmup(self) -> float:
    """Compiles every shape of the rollout engine and of the learner's step (row buckets)
    before step 1, so that no step compiles (with the persistent compilation cache, a later
    run loads them); returns the seconds spent."""
    t0 = time.perf_counter()
    engine_s = self.parts.engine.warm(self.engine)
    learner_s = self.learner.warmup()
    log.info("warm-up: engine %.1f s, learner (%d row buckets) %.1f s", engine_s,
             len(self.learner.cfg.bucket_rows), learner_s)
    return time.perf_counter() - t0

  async def rl_step(self, runner, state: "RunState", guard=None) -> dict[str, float]:
    """One RL step: collect the trees of step `state.step`, prepare the batch, update the
    learner, give the engine the new weights; advances `state.step` and returns the step's
    metrics (what the "train/" rows hold).

    With overlap the trees may come from the collection the previous step started (re-collected
    when staler than `max_staleness`), and this step starts the next one before its update.
    `guard(coro)` wraps each wait for rollouts (the stop signal's cancellation).
    """
    guard = guard or (lambda coro: coro)
    step, t_step = state.step, time.perf_counter()
    clock = metrics_lib.compile_clock()
    trees, rstats, every, faults = await guard(self._batch_for(runner, state))
    rollout_compile_s = clock.between(t_step, time.perf_counter())
    staleness = record_staleness(every, step)
    if self.main:
      R.save_trees_jsonl(os.path.join(self.trees_dir, f"step_{step:06d}.jsonl"), every)
    state.fault_totals.update(faults)

    batch, adv = self.learner.prepare(trees) if trees else (None, None)
    if self.rl.overlap and step + 1 < self.rl.total_steps:
      state.next_batch = asyncio.ensure_future(self.collect(runner, step + 1))
    t_learn = time.perf_counter()
    if batch is not None and batch.stats.get("nodes_packed", 0) > 0 and (
        adv.has_signal or (self.rl.update_without_signal and adv.num_train_nodes > 0)):
      lmetrics = await asyncio.to_thread(state.guard.step, self.learner, batch, step)
      lmetrics["no_signal"] = float(not adv.has_signal)
    else:
      # No node carries w_d * A != 0 (every group's roots got equal rewards, or every group
      # was dropped). Adam normalises each coordinate, so even a near-zero gradient (a KL term
      # alone, or rounding) would move every weight by about the learning rate: no update.
      log.info("Step %d: no signal in the batch (every group's roots got equal rewards); no "
               "optimizer update.", step)
      lmetrics = {"update_applied": 0.0, "no_signal": 1.0}
    learn_s = time.perf_counter() - t_learn
    learner_compile_s = clock.between(t_learn, t_learn + learn_s)
    state.step = step + 1
    sync_s = await self.sync_weights(state.step)

    success = X.success_rate(trees)
    reward = (float(np.mean(adv.reward_N[[i for i, n in enumerate(adv.node_ids) if n == "0"]]))
              if adv is not None else 0.0)
    m = {"reward": reward,
         "success": success,
         "time/rollout_s": rstats.wall_s, "time/learner_s": learn_s,
         "time/sync_s": sync_s, "time/step_s": time.perf_counter() - t_step,
         # Compilation (none after warm-up) is reported apart, not inside the rates.
         "time/rollout_compile_s": rollout_compile_s,
         "time/learner_compile_s": learner_compile_s,
         "rollout/tokens_per_s": rstats.generated_tokens
                                 / max(rstats.wall_s - rollout_compile_s, 1e-9),
         "rollout/generated_tokens": rstats.generated_tokens,
         # The trajectories' tokens (prompts and observations too; a prefix shared in a row
         # counts once per node, as unshared packing would compute it).
         "learner/tokens_per_s": (batch.stats.get("real_tokens", 0.0) if batch else 0.0)
                                 / max(learn_s - learner_compile_s, 1e-9),
         # The learning-rate schedule's position: updates actually applied.
         "learner/applied_updates": float(self.learner.step_count),
         f"success_{self.parts.train_difficulty}": success}
    if state.warmup_s is not None:
      m["time/warmup_s"], state.warmup_s = state.warmup_s, None
    m.update(staleness)
    m.update({f"rollout/{k}": float(v) for k, v in rstats.engine.items()})
    m.update({f"faults/{k}": float(v) for k, v in faults.items()})
    m.update({f"faults/total_{k}": float(v) for k, v in state.fault_totals.items()})
    m["faults/nonfinite_steps"] = float(state.guard.total)
    m["faults/nonfinite_in_row"] = float(state.guard.in_row)
    if adv is not None:
      m.update({f"rl/{k}": v for k, v in adv.stats.items()})
    m.update({f"learner/{k}": v for k, v in lmetrics.items()})
    if trees:
      m.update(metrics_lib.tree_stats(trees))
      m.update(metrics_lib.drift_stats(trees, self.parts.train_runner.max_depth))
    if adv is not None:
      m["drift/groups_all_equal"] = adv.stats["groups_all_equal_frac"]
    m["drift/update_applied"] = float(lmetrics.get("update_applied", 1.0))
    return m

  async def _batch_for(self, runner, state: "RunState"):
    """The trees of step `state.step`: collected now, or the overlapped collection of the
    previous step unless it is staler than `max_staleness`."""
    step = state.step
    if state.next_batch is None:
      return await self.collect(runner, step)
    pending, state.next_batch = state.next_batch, None
    trees, rstats, every, faults = await pending
    versions = [int(n.weight_version or 0) for t in trees for n in t.nodes]
    stale = step - min(versions) if versions else 0
    if stale <= self.rl.max_staleness:
      return trees, rstats, every, faults
    log.warning("Step %d: batch %d versions stale (> max_staleness=%d); re-collecting.",
                step, stale, self.rl.max_staleness)
    return await self.collect(runner, step)

  def hooks(self, repls, stopper: "_Stopper", state: "RunState") -> list[hooks_lib.Hook]:
    """What runs between steps, in order: metrics, the divergence stop, evaluation (process 0),
    the checkpoint, the progress bar."""
    total = self.rl.total_steps

    def write_metrics(step, m):
      self.metrics.write(step, m, prefix="train/")

    def stop_if_diverged(step, m):
      del m
      guard = state.guard
      if guard.diverged:
        raise TrainingDivergedError(
            f"{guard.in_row} non-finite updates in a row (steps {step - guard.in_row} to "
            f"{step - 1}, config.rl.max_nonfinite_steps={self.rl.max_nonfinite_steps}); each was "
            "refused, so the parameters are those of the last finite update "
            f"({self.learner.step_count} applied), saved in {self.learner.cfg.ckpt_dir} at "
            f"step {step}. Lower --config.optim.lr, check the rollout log-probs and rewards "
            "of the trees in " + self.trees_dir + ", or raise config.rl.max_nonfinite_steps.")

    async def evaluate(step, m):
      del m
      t_eval = time.perf_counter()
      state.last_eval = await stopper.guard(self.evaluate(repls, step))
      state.last_eval["time/eval_s"] = time.perf_counter() - t_eval
      self.metrics.write(step, state.last_eval, prefix="eval/")
      if self.reaches_stop_success(state.last_eval):
        state.reached = step   # the loop ends after this step's checkpoint

    def checkpoint(step, m):
      del m
      # A save waits for the previous one: an asynchronous save's failure is reported here, at
      # the next save, which tries again (a failure never stops the run).
      self.learner.save(step, extra={"data_position": step})
      self.report_save_failures(step)

    def postfix(m):
      # The drift shares beside success: a drifting policy shows here before held-out success.
      out = {"reward": f"{m['reward']:.3f}", "success": f"{m['success']:.2f}",
             "updated": "yes" if m.get("drift/update_applied", 1.0) else "no"}
      for key, short in (("at_depth_limit", "at_limit"), ("helpers_outside_root", "off_task"),
                         ("task_retyped", "retyped")):
        if f"drift/{key}" in m:
          out[short] = f"{m[f'drift/{key}']:.2f}"
      out["tok_s"] = f"{m['rollout/tokens_per_s']:.0f}"
      return out

    hooks = [hooks_lib.Hook("metrics", 1, write_metrics),
             hooks_lib.Hook("divergence", 1, stop_if_diverged)]
    if self.main:   # <= 0: no evaluation inside the loop
      hooks.append(hooks_lib.Hook("evaluation", self.parts.eval_every, evaluate))
    hooks.append(hooks_lib.Hook("checkpoint", self.learner.cfg.ckpt_every, checkpoint))
    hooks.append(hooks_lib.progress_hook(total, state.step, self.parts.progress, postfix))
    return hooks


@dataclasses.dataclass
class RunState:
  """What the loop carries from one step to the next.

  Attributes:
    step: the next step to run (= steps done, the data position).
    guard: the non-finite update counter.
    fault_totals: fault counters summed over the run.
    next_batch: with overlap, the collection of `step`'s trees started during the last update.
    last_eval: the newest evaluation's metrics.
    warmup_s: seconds of the warm-up before the first step, reported with that step.
    reached: the step whose evaluation reached config.eval.stop_at_success (the loop ends).
  """
  step: int
  guard: "NonFiniteGuard"
  fault_totals: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  next_batch: asyncio.Future | None = None
  last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
  warmup_s: float | None = None
  reached: int | None = None


class _NoMetrics:
  """The metrics writer of processes other than 0 (process 0 writes for the run)."""
  path = None

  def write(self, *args, **kwargs) -> None:
    pass

  def close(self) -> None:
    pass


class NonFiniteGuard:
  """Runs learner steps; a refused (non-finite) update is logged, counted and skipped.

  The learner refuses such an update on device (parameters, optimizer state and its step
  counter unchanged), so the learning-rate schedule, which reads that counter, counts applied
  updates only. `diverged` turns True after `max_in_row` refusals in a row.
  """

  def __init__(self, max_in_row: int):
    self.max_in_row = max_in_row
    self.total = 0
    self.in_row = 0

  @property
  def diverged(self) -> bool:
    return self.in_row >= self.max_in_row

  def step(self, learner, batch, step: int) -> dict[str, float]:
    try:
      out = learner.step(batch)
    except NonFiniteUpdateError as e:
      self.total += 1
      self.in_row += 1
      log.warning("Step %d: update skipped (%d in a row, %d in all): %s", step, self.in_row,
                  self.total, e)
      return {"update_applied": 0.0, "nonfinite": 1.0}
    self.in_row = 0
    return out


def record_staleness(trees, step: int) -> dict[str, float]:
  """Writes each node's staleness (`step` minus the oldest weight version it was sampled with)
  into `extras["staleness"]`; returns its mean and max over the nodes."""
  vals = []
  for t in trees:
    for n in t.nodes:
      versions = [n.weight_version] + list(n.extras.get("weight_versions", []))
      versions = [int(v) for v in versions if isinstance(v, (int, np.integer))
                  or (isinstance(v, str) and v.isdigit())]
      if versions:
        n.extras["staleness"] = step - min(versions)
        vals.append(n.extras["staleness"])
  if not vals:
    return {}
  return {"rollout/staleness_mean": float(np.mean(vals)),
          "rollout/staleness_max": float(np.max(vals))}


def train(config, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) RAO training described by `config` in `workdir`."""
  logging.basicConfig(level=logging.INFO)
  trainer = Trainer.from_config(config, workdir)
  try:
    return trainer.run()
  finally:
    trainer.learner.close()
