"""A step's rollouts as the trainer collects them: the K trees of a task under its fault rules,
progress lines while they run, and the exchange of trees between processes.

  collect_group   K trees of one task; trees whose infrastructure failed (engine, sandbox,
                  rollout server: the runner's ``extras["infra_error"]``) are re-run, then left
                  out, never scored as the agent's failure; deadline rules; a group left with
                  fewer than 2 trees is dropped (no leave-one-out baseline)
  RolloutProgress wraps the runner, counts finished trees, logs a line every minute
  process_share / exchange   each process's share of the step's tasks, and the union of all
                  processes' trees (a host all-gather of their JSON), in process order
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid

import numpy as np
from jax.experimental import multihost_utils

from rao_jax.agent import records as R
from rao_jax.run_parts import DEADLINE_RULES

log = logging.getLogger(__name__)


def infra_error(tree: R.TreeRecord) -> str | None:
  """The first infrastructure failure of `tree` (engine, sandbox), or None."""
  for n in tree.nodes:
    if n.extras.get(R.INFRA_ERROR):
      return str(n.extras[R.INFRA_ERROR])
  return None


def engine_failure(trees) -> str | None:
  """Why the engine stopped serving for good, if a node of `trees` met it, else None."""
  for t in trees:
    for n in t.nodes:
      if n.extras.get(R.ENGINE_FAILED):
        return str(n.extras[R.ENGINE_FAILED])
  return None


def deadline_cut(tree: R.TreeRecord) -> bool:
  return bool(tree.meta.get("deadline_cut")) or any("deadline" in n.extras for n in tree.nodes)


class RolloutProgress:
  """Rollouts as they finish: wraps the runner (`run_tree`; or pass `count` as run_tasks'
  `on_tree`), counts finished trees, their agents and generated tokens, and logs a line every
  `every_s` seconds while they run (a step of SmolLM2 on two CPU cores is minutes of rollouts,
  a held-out evaluation of 64 trees a quarter of an hour; the bar ticks once a step).
  """

  def __init__(self, runner, step: int, total_trees: int, every_s: float = 60.0,
               label: str | None = None):
    self.runner, self.step, self.total, self.every_s = runner, step, total_trees, every_s
    self.label = label if label is not None else f"step {step} rollouts"
    self.trees = self.agents = self.tokens = self.succeeded = 0
    self.t0 = time.perf_counter()

  def count(self, tree: R.TreeRecord) -> None:
    self.trees += 1
    self.agents += len(tree.nodes)
    self.tokens += sum(n.num_generated_tokens for n in tree.nodes)
    self.succeeded += int(bool(tree.nodes) and tree.nodes[0].success == 1.0)

  async def run_tree(self, *args, **kwargs) -> R.TreeRecord:
    tree = await self.runner.run_tree(*args, **kwargs)
    self.count(tree)
    return tree

  def line(self) -> str:
    return (f"{self.label}: {self.trees}/{self.total} trees done "
            f"({self.succeeded} solved), {self.agents} agents, {self.tokens} generated tokens, "
            f"{(time.perf_counter() - self.t0) / 60:.1f} min")

  async def report(self) -> None:
    """Logs `line()` every `every_s` seconds until cancelled."""
    while True:
      await asyncio.sleep(self.every_s)
      log.info("%s", self.line())


async def collect_group(runner, task, group_size: int, *, deadline: float | None = None,
                        infra_retries: int = 1, deadline_rule: str = "unfinished"
                        ) -> tuple[list[R.TreeRecord], list[R.TreeRecord], dict[str, float]]:
  """The K trees of one task with the trainer's fault rules.

  Trees whose infrastructure failed are re-run (same group, a new tree id) up to
  `infra_retries` times; still failing, they are excluded. Trees cut by `deadline` are kept
  (rule "unfinished") or take their whole group out (rule "drop_group"). A group left with
  fewer than 2 trees has no leave-one-out baseline and is dropped.

  Returns:
    (kept trees, every tree run including the excluded ones (their `meta["excluded"]` says
    why), counters: infra_failed_trees, infra_retries (trees re-run), infra_excluded_trees,
    engine_error_trees (runs whose engine's device step failed), deadline_cut_trees,
    groups_dropped).
  """
  if deadline_rule not in DEADLINE_RULES:
    raise ValueError(f"deadline_rule={deadline_rule!r}: use one of {DEADLINE_RULES}.")
  gid = f"{task.task_id}/{uuid.uuid4().hex[:8]}"
  trees = list(await asyncio.gather(*(
      runner.run_tree(task, tree_id=f"{gid}/{k}", group_id=gid, deadline=deadline)
      for k in range(group_size))))
  stats = {"infra_failed_trees": 0.0, "infra_retries": 0.0, "infra_excluded_trees": 0.0,
           "engine_error_trees": 0.0, "deadline_cut_trees": 0.0, "groups_dropped": 0.0}
  every = list(trees)
  stats["infra_failed_trees"] = float(sum(infra_error(t) is not None for t in trees))
  for attempt in range(1, infra_retries + 1):
    bad = [k for k, t in enumerate(trees) if infra_error(t) is not None]
    if not bad:
      break
    stats["infra_retries"] += len(bad)
    for k in bad:
      trees[k].meta["excluded"] = f"infrastructure failure, retried: {infra_error(trees[k])}"
    redo = await asyncio.gather(*(
        runner.run_tree(task, tree_id=f"{gid}/{k}.retry{attempt}", group_id=gid,
                        deadline=deadline) for k in bad))
    for k, t in zip(bad, redo):
      trees[k] = t
      every.append(t)
  stats["engine_error_trees"] = float(sum(
      any(n.extras.get(R.ENGINE_ERROR) for n in t.nodes) for t in every))
  kept = []
  for t in trees:
    err = infra_error(t)
    if err is not None:
      t.meta["excluded"] = f"infrastructure failure: {err}"
      stats["infra_excluded_trees"] += 1
    else:
      kept.append(t)
  cut = [t for t in kept if deadline_cut(t)]
  stats["deadline_cut_trees"] = float(len(cut))
  if (cut and deadline_rule == "drop_group") or len(kept) < 2:
    why = ("a tree passed the rollout deadline (deadline_rule='drop_group')" if
           cut and deadline_rule == "drop_group" else
           f"{len(kept)} usable tree(s) left: the leave-one-out baseline needs 2")
    for t in kept:
      t.meta["excluded"] = f"group dropped: {why}"
    stats["groups_dropped"] = 1.0
    kept = []
  return kept, every, stats


def process_share(tasks, process: int, num_processes: int):
  """Process `process`'s disjoint share of a step's tasks: whole groups, round robin."""
  return list(tasks)[process::num_processes]


def _allgather_bytes(data: bytes) -> list[bytes]:
  """Every process's `data`, in process order (a host all-gather over jax.distributed)."""
  lens = np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int32)))
  buf = np.zeros(max(int(lens.max()), 1), np.uint8)
  buf[:len(data)] = np.frombuffer(data, np.uint8)
  every = np.asarray(multihost_utils.process_allgather(buf))
  return [every[i, :int(n)].tobytes() for i, n in enumerate(lens.reshape(-1))]


def exchange(trees, every, faults, tokens, wall):
  """The union of all processes' trees (process order), summed fault counters and tokens, the
  slowest process's rollout wall time."""
  mine = json.dumps({"every": [t.to_dict() for t in every], "kept": [t.tree_id for t in trees],
                     "faults": faults, "tokens": tokens, "wall": wall}).encode()
  all_trees, all_every, all_faults, all_tokens, all_wall = [], [], collections.Counter(), 0, 0.0
  for part in _allgather_bytes(mine):
    d = json.loads(part.decode())
    run = [R.TreeRecord.from_json(t) for t in d["every"]]
    by_id = {t.tree_id: t for t in run}
    all_every += run
    all_trees += [by_id[i] for i in d["kept"]]   # the order the process trained them in
    all_faults.update(d["faults"])
    all_tokens += int(d["tokens"])
    all_wall = max(all_wall, float(d["wall"]))
  return all_trees, all_every, dict(all_faults), all_tokens, all_wall
