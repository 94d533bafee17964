"""Evaluation of a checkpoint on held-out tasks, recursive and single-agent, on any device count.

Restores the newest (or a given) checkpoint of a training workdir onto the devices of THIS
process (a run saved on 8 devices evaluates on 1), runs greedy trees on held-out tasks, and
writes `results.json`, `trees.jsonl` and `trees.html` under `workdir/evaluation/step_N/`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any, Sequence

from rao_jax import experiment as X
from rao_jax import metrics as metrics_lib
from rao_jax.agent import records as R

log = logging.getLogger(__name__)


def evaluate_checkpoint(workdir: str, step: int | None = None, num_tasks: int | None = None,
                        modes: Sequence[str] = ("recursive", "single"),
                        difficulties: Sequence[str] | None = None,
                        out_dir: str | None = None) -> dict[str, Any]:
  """Evaluates `workdir`'s checkpoint `step` (default: newest). Returns the results dict."""
  return asyncio.run(_evaluate(workdir, step, num_tasks, modes, difficulties, out_dir))


async def _evaluate(workdir, step, num_tasks, modes, difficulties, out_dir) -> dict[str, Any]:
  from rao_jax.learner import Learner  # pylint: disable=g-import-not-at-top
  workdir = os.path.abspath(workdir)
  config = X.load_config(workdir)
  for m in modes:
    if m not in ("recursive", "single"):
      raise ValueError(f"modes={tuple(modes)}: each must be 'recursive' or 'single'.")
  env = X.make_env(config)
  model, tokenizer = X.load_policy(config)
  learner = Learner(X.learner_config(config, workdir), model.cfg, mesh=X.make_mesh("auto"),
                    params=model)
  del model
  steps = learner._checkpointer().all_steps()  # pylint: disable=protected-access
  if not steps:
    raise FileNotFoundError(f"No checkpoint in {learner.cfg.ckpt_dir}: train first "
                            "(python -m experiments.train --workdir=...).")
  if step is not None and step not in steps:
    raise ValueError(f"--step={step}: no such checkpoint in {learner.cfg.ckpt_dir}; "
                     f"available steps: {steps}.")
  step = steps[-1] if step is None else step
  learner.restore(step)
  engine = X.make_engine(config, learner.model, tokenizer)
  engine_version = f"ckpt{step}"
  if hasattr(engine, "update_weights"):
    engine.update_weights(learner.model, engine_version)
  learner.close()
  n = int(num_tasks or config.eval.num_tasks)
  diffs = tuple(difficulties or config.env.eval_difficulties)
  out_dir = out_dir or os.path.join(workdir, "evaluation", f"step_{step:06d}")
  os.makedirs(out_dir, exist_ok=True)
  repls = X.sandbox_pool(config)
  await repls.start()
  results: dict[str, Any] = {"workdir": workdir, "step": step, "num_tasks": n,
                             "env": config.env.name, "modes": {}}
  all_trees = []
  try:
    for mode in modes:
      runner = X.make_runner(config, env, engine, tokenizer, repls,
                             recursive=mode == "recursive", greedy=True)
      per_mode = {}
      for diff in diffs:
        tasks = X.eval_tasks(env, diff, n)
        t0 = time.perf_counter()
        trees = await runner.run_tasks(tasks, group_size=1)
        wall = time.perf_counter() - t0
        succ = [t.root.success or 0.0 for t in trees]
        lo, hi = X.binomial_ci95(succ)
        per_mode[diff] = {"success": X.success_rate(trees), "ci95": [lo, hi],
                          "num_tasks": len(trees), "wall_s": wall,
                          "per_task": {t.task_id: s for t, s in zip(trees, succ)},
                          **metrics_lib.tree_stats(trees)}
        log.info("eval step %d %s %s: success %.3f [%.3f, %.3f] over %d tasks", step, mode,
                 diff, per_mode[diff]["success"], lo, hi, len(trees))
        all_trees += trees
      results["modes"][mode] = per_mode
  finally:
    await repls.close()
    await engine.close()
  R.save_trees_jsonl(os.path.join(out_dir, "trees.jsonl"), all_trees)
  metrics_lib.write_html(all_trees, os.path.join(out_dir, "trees.html"),
                         title=f"Evaluation of step {step}")
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  results["out_dir"] = out_dir
  return results
