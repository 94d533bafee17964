"""The RAO training loop.

    for step in range(start, total_steps):
      tasks  <- train_tasks_for_step(seed, step)                  (data position = step)
      trees  <- K trees per task through the agent runtime         (rollout engine + sandboxes)
      batch  <- rewards, leave-one-out advantages, depth weights, packing   (learner, host side)
      state  <- learner step                                       (jitted, sharded, donated)
      engine <- new weights (in process, or SGLang over HTTP), version = step
      metrics, periodic evaluation on held-out tasks (trees as HTML), checkpoint

Resume order: the newest complete checkpoint in `workdir/checkpoints` (params, optimizer,
step, RNG, data position) wins; else `config.ckpt.init_from` (parameters only, e.g. an SFT
warm start); else the pretrained model. Ctrl-C / SIGTERM stop after the current stage, save a
checkpoint and return; running the same command again resumes.

With `config.rl.overlap`, the rollouts of step s+1 run (on the engine's weights of step s)
while the learner updates step s: samples are one version stale, which the clipped-ratio
losses correct for; a batch staler than `config.rl.max_staleness` is re-collected.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Any

import numpy as np

from rao_jax import experiment as X
from rao_jax import metrics as metrics_lib
from rao_jax.agent import records as R

log = logging.getLogger(__name__)


class _StopRequested(Exception):
  pass


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


def _validate(config) -> None:
  if int(config.rl.group_size) < 2:
    raise ValueError(
        f"config.rl.group_size={config.rl.group_size}: the leave-one-out baseline needs K >= 2 "
        "trees per task; set --config.rl.group_size=2 or more.")
  if config.rl.overlap and config.rl.loss not in ("ppo_clip", "cispo"):
    raise ValueError(
        f"config.rl.overlap=True samples one step off-policy; config.rl.loss={config.rl.loss!r} "
        "has no importance ratio. Use --config.rl.loss=ppo_clip or cispo.")


class Trainer:
  """Holds the parts of one run; `run()` is the loop."""

  def __init__(self, config, workdir: str):
    _validate(config)
    self.config, self.workdir = config, os.path.abspath(workdir)
    os.makedirs(self.workdir, exist_ok=True)
    X.save_config(config, self.workdir)
    self.env = X.make_env(config)
    self.train_tasks = X.task_split(self.env, "train", config.env.train_difficulty)
    model, self.tokenizer = X.load_policy(config)
    self.model_cfg = model.cfg

    from rao_jax.learner import Learner  # pylint: disable=g-import-not-at-top
    self.learner = Learner(X.learner_config(config, self.workdir), self.model_cfg,
                           mesh=X.make_mesh(config.learner.mesh), params=model)
    del model
    self.start_step = 0
    latest = self.learner.latest_checkpoint_step()
    if latest is not None:
      extra = self.learner.restore(latest)
      self.start_step = int(extra.get("data_position", latest))
      log.info("Resumed from %s at step %d.", self.learner.cfg.ckpt_dir, self.start_step)
    elif config.ckpt.init_from:
      self._init_params_from(config.ckpt.init_from)
    self.engine = X.make_engine(config, self.learner.model, self.tokenizer)
    self.metrics = metrics_lib.MetricsWriter(self.workdir, tensorboard=config.log.tensorboard)
    self.trees_dir = os.path.join(self.workdir, "trees")
    os.makedirs(self.trees_dir, exist_ok=True)

  def _init_params_from(self, path: str) -> None:
    """Starts from another run's newest parameters (optimizer and step start fresh)."""
    from rao_jax.learner import Learner  # pylint: disable=g-import-not-at-top
    ckpt_dir = path if os.path.basename(path.rstrip("/")) == "checkpoints" else os.path.join(
        path, "checkpoints")
    donor = Learner(self.learner.cfg, self.model_cfg, mesh=self.learner.mesh)
    if donor.latest_checkpoint_step(ckpt_dir) is None:
      raise FileNotFoundError(f"config.ckpt.init_from={path!r}: no checkpoint in {ckpt_dir}.")
    donor.restore(directory=ckpt_dir)
    fresh = Learner(self.learner.cfg, self.model_cfg, mesh=self.learner.mesh,
                    params=donor.params)
    donor.close()
    self.learner.close()
    self.learner = fresh
    log.info("Initialised parameters from %s.", ckpt_dir)

  # -- weight sync ---------------------------------------------------------------------------

  def sync_weights(self, version: int) -> float:
    t0 = time.perf_counter()
    from rao_jax.rollout.embedded import EmbeddedEngine  # pylint: disable=g-import-not-at-top
    if isinstance(self.engine, EmbeddedEngine):
      self.engine.update_weights(self.learner.model, version)
    else:
      export_dir = os.path.join(self.workdir, "weights", f"v{version:06d}")
      from rao_jax.model import export_hf  # pylint: disable=g-import-not-at-top
      export_hf(self.learner.model, self.model_cfg, self.tokenizer, export_dir)
      asyncio.get_event_loop()  # the SGLang client's sync runs on the loop (see run())
      self._pending_http_sync = (export_dir, version)
    return time.perf_counter() - t0

  async def _finish_sync(self) -> None:
    pending = getattr(self, "_pending_http_sync", None)
    if pending is not None:
      await self.engine.update_weights_from_disk(*pending)
      self._pending_http_sync = None

  # -- rollouts --------------------------------------------------------------------------------

  async def collect(self, runner, step: int) -> tuple[list[R.TreeRecord], X.RolloutStats]:
    c = self.config
    tasks = X.train_tasks_for_step(self.train_tasks, step, int(c.rl.tasks_per_step),
                                   int(c.env.train_seed))
    t0 = time.perf_counter()
    trees = await runner.run_tasks(tasks, group_size=int(c.rl.group_size))
    wall = time.perf_counter() - t0
    toks = sum(n.num_generated_tokens for t in trees for n in t.nodes)
    return trees, X.RolloutStats(wall, toks)

  async def evaluate(self, repls, step: int) -> dict[str, float]:
    """Greedy held-out evaluation per difficulty; writes trees and an HTML page."""
    c = self.config
    runner = X.make_runner(c, self.env, self.engine, self.tokenizer, repls, greedy=True)
    out, all_trees = {}, []
    for diff in c.env.eval_difficulties:
      tasks = X.eval_tasks(self.env, diff, int(c.eval.num_tasks))
      trees = await runner.run_tasks(tasks, group_size=1)
      all_trees += trees
      out[f"success_{diff}"] = X.success_rate(trees)
    out.update(metrics_lib.tree_stats(all_trees))
    d = os.path.join(self.workdir, "eval", f"step_{step:06d}")
    os.makedirs(d, exist_ok=True)
    R.save_trees_jsonl(os.path.join(d, "trees.jsonl"), all_trees)
    metrics_lib.write_html(all_trees[: int(c.eval.num_html_trees)],
                           os.path.join(d, "trees.html"), title=f"Evaluation at step {step}")
    return out

  # -- the loop ----------------------------------------------------------------------------------

  def run(self) -> dict[str, Any]:
    return asyncio.run(self._run())

  async def _run(self) -> dict[str, Any]:
    c = self.config
    loop = asyncio.get_running_loop()
    stopper = _Stopper()
    stopper.install(loop)
    repls = X.sandbox_pool(c)
    await repls.start()
    runner = X.make_runner(c, self.env, self.engine, self.tokenizer, repls)
    total = int(c.total_steps)
    step = self.start_step
    last_eval: dict[str, float] = {}
    self.sync_weights(step)
    await self._finish_sync()
    bar = _progress(total, step, enabled=c.log.progress)
    next_batch = None
    stopped = False
    try:
      while step < total:
        t_step = time.perf_counter()
        if next_batch is None:
          trees, rstats = await stopper.guard(self.collect(runner, step))
        else:
          trees, rstats = await stopper.guard(next_batch)
          next_batch = None
          stale = step - min(int(n.weight_version or 0) for t in trees for n in t.nodes)
          if stale > int(c.rl.max_staleness):
            log.warning("Step %d: batch %d versions stale (> max_staleness=%d); re-collecting.",
                        step, stale, c.rl.max_staleness)
            trees, rstats = await stopper.guard(self.collect(runner, step))
        R.save_trees_jsonl(os.path.join(self.trees_dir, f"step_{step:06d}.jsonl"), trees)

        batch, adv = self.learner.prepare(trees)
        if c.rl.overlap and step + 1 < total:
          next_batch = asyncio.ensure_future(self.collect(runner, step + 1))
        t_learn = time.perf_counter()
        if batch.stats.get("nodes_packed", 0) > 0:
          lmetrics = await asyncio.to_thread(self.learner.step, batch)
        else:
          # Every group had equal rewards: no gradient signal. An Adam step on zeros would
          # still move the weights along its momentum, so the update is skipped.
          lmetrics = {"skipped": 1.0}
        learn_s = time.perf_counter() - t_learn
        step += 1
        sync_s = self.sync_weights(step)
        await self._finish_sync()

        m = {"reward": float(np.mean(adv.reward_N[[i for i, n in enumerate(adv.node_ids)
                                                   if n == "0"]])),
             "success": X.success_rate(trees),
             "time/rollout_s": rstats.wall_s, "time/learner_s": learn_s,
             "time/sync_s": sync_s, "time/step_s": time.perf_counter() - t_step,
             "rollout/tokens_per_s": rstats.tokens_per_s,
             "rollout/generated_tokens": rstats.generated_tokens,
             # Every token of a packed row costs the learner (prompts and observations too).
             "learner/tokens_per_s": batch.stats.get("real_tokens", 0.0) / max(learn_s, 1e-9),
             f"success_{c.env.train_difficulty}": X.success_rate(trees)}
        m.update({f"rl/{k}": v for k, v in adv.stats.items()})
        m.update({f"learner/{k}": v for k, v in lmetrics.items()})
        m.update(metrics_lib.tree_stats(trees))
        self.metrics.write(step, m, prefix="train/")

        every = int(c.eval.every)   # <= 0: no evaluation inside the loop
        if every > 0 and (step % every == 0 or step == total):
          t_eval = time.perf_counter()
          last_eval = await stopper.guard(self.evaluate(repls, step))
          last_eval["time/eval_s"] = time.perf_counter() - t_eval
          self.metrics.write(step, last_eval, prefix="eval/")
        self.learner.save(step, extra={"data_position": step}, force=step == total)
        bar.update(1)
        bar.set_postfix(reward=f"{m['reward']:.3f}", success=f"{m['success']:.2f}",
                        tok_s=f"{rstats.tokens_per_s:.0f}")
    except _StopRequested:
      stopped = True
    finally:
      bar.close()
      if next_batch is not None:
        next_batch.cancel()
        with contextlib.suppress(BaseException):
          await next_batch
      stopper.uninstall(loop)
      # Nothing the user had is lost: the newest state is saved whatever ended the loop.
      if step > self.start_step and self.learner.latest_checkpoint_step() != step:
        self.learner.save(step, extra={"data_position": step})
      self.learner.wait_for_checkpoints()
      await repls.close()
      await self.engine.close()
      self.metrics.close()
    plot = metrics_lib.plot_metrics(self.metrics.path, os.path.join(self.workdir, "plot.png"))
    return {"step": step, "stopped": stopped, "eval": last_eval, "plot": plot,
            "workdir": self.workdir}


def _progress(total: int, initial: int, enabled: bool):
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm(total=total, initial=initial, desc="RAO", unit="step", disable=not enabled,
              dynamic_ncols=True)


def train(config, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) RAO training described by `config` in `workdir`."""
  logging.basicConfig(level=logging.INFO)
  trainer = Trainer(config, workdir)
  try:
    return trainer.run()
  finally:
    trainer.learner.close()
