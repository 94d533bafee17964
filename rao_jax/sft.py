"""Supervised warm start from demonstrations, through the same learner and batching as RL.

Demonstrations are trees grown by an environment's scripted policy (an `Engine` that writes
the code a good agent would) through the real runtime and sandbox, so their tokens are exactly
the chat format the policy sees in RL. Supervised learning is the RAO loss with every kept
node given A(v) = 1 and w = 1: -(1/N) sum_v (1/|M_v|) sum_{t in M_v} log pi(y_t | y_<t), the
per-node mean negative log-likelihood of the generated tokens.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Sequence

import numpy as np

from rao_jax import experiment as X
from rao_jax import metrics as metrics_lib
from rao_jax.agent import records as R
from rao_jax.learner import rewards as rewards_lib

log = logging.getLogger(__name__)


def scripted_engine(env_name: str, tokenizer, style: str = "plan"):
  """The scripted policy of an environment, as a rollout Engine (`style`: TextCraft's only)."""
  if env_name in ("textcraft", "textcraft_synth"):
    from rao_jax.agent.policies import ScriptedConfig, ScriptedTextCraftEngine  # pylint: disable=g-import-not-at-top
    return ScriptedTextCraftEngine(tokenizer, ScriptedConfig(style=style))
  if env_name == "longcontext":
    from rao_jax.envs import longcontext_scripted  # pylint: disable=g-import-not-at-top
    return longcontext_scripted.ScriptedLongContextEngine(tokenizer)
  if env_name == "search":
    from rao_jax.envs import search_scripted  # pylint: disable=g-import-not-at-top
    return search_scripted.ScriptedSearchEngine(tokenizer)
  raise ValueError(f"No scripted policy for environment {env_name!r}.")


async def collect_demonstrations(config, env, tokenizer, tasks, repls) -> list[R.TreeRecord]:
  """Scripted trees of `tasks` in the config's mode; only fully successful trees are kept."""
  engine = scripted_engine(env.name, tokenizer, style=str(config.sft.get("scripted_style", "plan")))
  runner = X.make_runner(config, env, engine, tokenizer, repls, greedy=True)
  trees = await runner.run_tasks(tasks, group_size=1)
  kept = [t for t in trees if (t.root.success or 0.0) >= 1.0]
  log.info("Demonstrations: %d of %d scripted trees succeeded.", len(kept), len(trees))
  return kept


def sft_advantages(trees: Sequence[R.TreeRecord]) -> rewards_lib.Advantages:
  """A(v) = 1, w = 1 for every node of every tree (the per-node mean NLL objective)."""
  tree_ids, node_ids, tidx, depth = [], [], [], []
  for i, t in enumerate(trees):
    for n in t.nodes:
      tree_ids.append(t.tree_id)
      node_ids.append(n.node_id)
      tidx.append(i)
      depth.append(n.depth)
  n = len(node_ids)
  ones = np.ones(n, np.float64)
  return rewards_lib.Advantages(
      tree_ids=tuple(tree_ids), node_ids=tuple(node_ids), tree_index_N=np.asarray(tidx),
      depth_N=np.asarray(depth), success_N=ones, source_N=("verifier",) * n, reward_N=ones,
      baseline_N=np.zeros(n), advantage_N=ones, weight_N=ones, stats={})


def demonstration_tasks(config, env) -> list:
  """The training tasks whose scripted trees become demonstrations (config.sft.num_demos of
  them, drawn without replacement from the seed; never the validation split)."""
  tasks = X.train_and_val_tasks(env, config)[0]
  rng = np.random.default_rng([int(config.seed), 7])
  pick = rng.choice(len(tasks), size=min(int(config.sft.num_demos), len(tasks)), replace=False)
  return [tasks[i] for i in pick]


def run_sft(config, workdir: str, demos_path: str | None = None) -> dict[str, Any]:
  """Collects (or loads) demonstrations and trains on them; saves a checkpoint at the end."""
  return asyncio.run(_run_sft(config, workdir, demos_path))


async def _run_sft(config, workdir: str, demos_path: str | None) -> dict[str, Any]:
  from rao_jax.learner import Learner, pack_trees  # pylint: disable=g-import-not-at-top
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  workdir = os.path.abspath(workdir)
  X.save_config(config, workdir)
  env = X.make_env(config)
  model, tokenizer = X.load_policy(config)
  demos_file = os.path.join(workdir, "demonstrations.jsonl")
  if demos_path:
    trees = R.load_trees_jsonl(demos_path)
  elif os.path.exists(demos_file):
    trees = R.load_trees_jsonl(demos_file)
  else:
    repls = X.sandbox_pool(config)
    await repls.start()
    try:
      trees = await collect_demonstrations(config, env, tokenizer,
                                           demonstration_tasks(config, env), repls)
    finally:
      await repls.close()
    R.save_trees_jsonl(demos_file, trees)
  if not trees:
    raise RuntimeError("No successful demonstration: the scripted policy solved no task; "
                       "check the environment and config.agent limits.")

  lcfg = X.learner_config(config, workdir, sft=True)
  learner = Learner(lcfg, model.cfg, mesh=X.make_mesh(config.learner.mesh), params=model)
  del model
  start = learner.latest_checkpoint_step() or 0
  if start:
    learner.restore(start)
  writer = metrics_lib.MetricsWriter(workdir, tensorboard=config.log.tensorboard,
                                     filename="sft_metrics.jsonl")
  per_step = max(1, int(config.sft.trees_per_step))
  steps = int(config.sft.steps)
  bar = tqdm(total=steps, initial=start, desc="SFT", unit="step", disable=not config.log.progress)
  loss = float("nan")
  try:
    for step in range(start, steps):
      rng = np.random.default_rng([int(config.seed), 11, step])
      chosen = [trees[i] for i in rng.choice(len(trees), size=min(per_step, len(trees)),
                                             replace=False)]
      batch = pack_trees(chosen, sft_advantages(chosen), lcfg.row_len, lcfg.bucket_rows,
                         loss="rao", share_prefix_min=lcfg.shared_prefix_tokens())
      t0 = time.perf_counter()
      m = learner.step(batch)
      m["time/step_s"] = time.perf_counter() - t0
      loss = m["loss"]
      writer.write(step + 1, m, prefix="sft/")
      learner.save(step + 1, extra={"data_position": step + 1}, force=step + 1 == steps)
      bar.update(1)
      bar.set_postfix(nll=f"{loss:.3f}")
  finally:
    bar.close()
    learner.close()
    writer.close()
  # steps_run is 0 when the workdir already held the last SFT checkpoint (final_nll is nan).
  return {"steps": steps, "steps_run": max(0, steps - start), "final_nll": loss,
          "num_demos": len(trees),
          "checkpoints": lcfg.ckpt_dir}
