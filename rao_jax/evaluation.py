"""Evaluation of a checkpoint on held-out tasks, recursive and single-agent, on any device count.

Restores the newest (or a given) checkpoint of a training workdir onto the devices of THIS
process (a run saved on 8 devices evaluates on 1), runs greedy trees on held-out tasks (the
environment's "test" split, or ``config.env.task_files.test``), and writes `results.json`,
`trees.jsonl` and `trees.html` under `workdir/evaluation/step_N/`. With ``samples=K`` it also
runs K sampled trees per task (the config's agent temperature; saved to
`sampled_trees.jsonl`) and reports the unbiased pass@k for k = 1..K next to greedy success.
``evaluate_model`` does the same for a model with no run directory (a registry name, HF
folder or GGUF file, or an SGLang- or OpenAI-compatible server), so there is a baseline
before training.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
import time
from typing import Any, Sequence

from rao_jax import experiment as X
from rao_jax.collection import RolloutProgress
from rao_jax import metrics as metrics_lib
from rao_jax import stats
from rao_jax.agent import records as R

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 60.0   # seconds between two progress lines of one evaluation (minutes long)


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k estimate from n samples of which c passed (Chen et al., 2021):
  1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without replacement
  include a pass."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): need 0 <= c <= n and 1 <= k <= n.")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sampled_stats(trees, samples: int) -> dict[str, Any]:
  """pass@k (k = 1..samples, averaged over tasks) of `samples` sampled trees per task.

  A sample passes when its root succeeded fully (success >= 1; partial credit, as long-context
  answers get, counts in ``sampled_success`` only).
  """
  by_task: dict[str, list[float]] = collections.defaultdict(list)
  for t in trees:
    by_task[t.task_id].append(float(t.root.success or 0.0))
  for tid, s in by_task.items():
    if len(s) != samples:
      raise ValueError(f"sampled_stats: task {tid} has {len(s)} samples, expected {samples}.")
  passes = {tid: sum(x >= 1.0 - 1e-9 for x in s) for tid, s in by_task.items()}
  n_tasks = max(len(by_task), 1)
  return {
      "samples": samples,
      "pass_at_k": {str(k): sum(pass_at_k(samples, c, k) for c in passes.values()) / n_tasks
                    for k in range(1, samples + 1)},
      "sampled_success": sum(sum(s) for s in by_task.values()) / max(len(trees), 1),
      "per_task_passes": passes,
  }


def evaluate_checkpoint(workdir: str, step: int | None = None, num_tasks: int | None = None,
                        modes: Sequence[str] = ("recursive", "single"),
                        difficulties: Sequence[str] | None = None,
                        out_dir: str | None = None, samples: int = 0,
                        task_files: dict[str, str] | None = None,
                        overrides: dict[str, Any] | None = None,
                        adapter: str | None = None) -> dict[str, Any]:
  """Evaluates `workdir`'s checkpoint `step` (default: newest). Returns the results dict.

  ``results["modes"][mode][difficulty]`` holds greedy ``success``, ``ci95``, ``num_tasks``,
  ``per_task`` and tree statistics; with ``samples=K > 0`` also ``pass_at_k`` ({"1": ...,
  "K": ...}), ``sampled_success`` and ``per_task_passes`` from K sampled trees per task.
  ``task_files`` ({split: path}) adds to / overrides the run config's ``env.task_files``.
  ``overrides`` ({"env.kwargs.seed": 1, "agent.max_depth": 8}) changes the run's config for
  this evaluation only: another world, a deeper tree limit; the checkpoint is unchanged.
  ``adapter``: a PEFT LoRA adapter folder (``rao-export`` writes one) applied on top of the
  checkpoint's weights, e.g. an adapter trained from this run as its base; the checkpoint
  must be a full-parameter one (the adapter takes the place of any other).
  """
  return asyncio.run(_evaluate(workdir, step, num_tasks, modes, difficulties, out_dir,
                               samples, task_files, overrides, adapter))


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
  """["KEY=VALUE", ...] -> {KEY: VALUE}: a VALUE that parses as JSON is that value, else the
  text itself (rao-evaluate's --set)."""
  out = {}
  for item in items:
    key, sep, raw = item.partition("=")
    if not sep or not key:
      raise ValueError(f"{item!r}: use KEY=VALUE, e.g. agent.max_depth=8.")
    try:
      out[key] = json.loads(raw)
    except json.JSONDecodeError:
      out[key] = raw   # a bare string
  return out


def apply_overrides(config, overrides: dict[str, Any] | None) -> None:
  """Sets dotted keys of `config` in place; an unknown key is an error naming it."""
  for key, value in (overrides or {}).items():
    *path, leaf = key.split(".")
    node = config
    for i, part in enumerate(path):
      if part not in node:
        raise ValueError(f"override {key!r}: the config has no {'.'.join(path[:i + 1])!r}.")
      node = node[part]
    # env.kwargs is the environment's own free-form section: a new key is a new argument there.
    if leaf not in node and ".".join(path) != "env.kwargs":
      raise ValueError(f"override {key!r}: the config has no {key!r} (known under "
                       f"{'.'.join(path) or 'the root'}: {sorted(node.keys())}).")
    node[leaf] = value


def evaluate_model(config, model: str | None = None, server_urls: Sequence[str] | None = None,
                   num_tasks: int | None = None, modes: Sequence[str] = ("recursive", "single"),
                   difficulties: Sequence[str] | None = None, out_dir: str | None = None,
                   samples: int = 0, task_files: dict[str, str] | None = None,
                   server_api: str = "sglang") -> dict[str, Any]:
  """Evaluates a model that has no run directory, under `config` (an experiments config).

  Args:
    config: the experiment config (environment, agent, sandbox and eval settings).
    model: a registry name, HF folder or GGUF file (default: ``config.model.name``); served by
      the embedded engine. Ignored when ``server_urls`` is given.
    server_urls: servers to generate with; the tokenizer comes from ``model`` or
      ``config.model.name``.
    server_api: "sglang": SGLang-native /generate (SGLang, ``rao_jax.rollout.serve``; several
      URLs share the load); "openai": one OpenAI-compatible /v1/completions server (vLLM, ...;
      see ``openai_client.OpenAIEngine``).
    num_tasks, modes, difficulties, samples, task_files: as in ``evaluate_checkpoint``.
    out_dir: where results.json, trees.jsonl and trees.html go (default
      ``./evaluation/<model or server>``).

  Returns:
    The results dict, shaped as ``evaluate_checkpoint``'s (``step`` None, ``model`` set).
  """
  if server_api not in ("sglang", "openai"):
    raise ValueError(f"server_api={server_api!r}: use 'sglang' or 'openai'.")
  if server_api == "openai" and server_urls and len(server_urls) != 1:
    raise ValueError(f"server_api='openai' takes one server URL, got {list(server_urls)}.")
  return asyncio.run(_evaluate_model(config, model, server_urls, num_tasks, modes,
                                     difficulties, out_dir, samples, task_files, server_api))


def make_env(config, task_files: dict[str, str] | None = None):
  """The config's environment, with ``config.env.task_files`` and then ``task_files`` (split
  -> JSONL path; empty paths ignored) applied."""
  from rao_jax.envs import registry  # pylint: disable=g-import-not-at-top
  files = config.env.get("task_files") if hasattr(config.env, "get") else None
  files = {k: v for k, v in {**dict(files or {}), **dict(task_files or {})}.items() if v}
  return registry.make_env(config.env.name, X._to_plain(config.env.kwargs),  # pylint: disable=protected-access
                           task_files=files or None)


def _check(modes, samples):
  for m in modes:
    if m not in ("recursive", "single"):
      raise ValueError(f"modes={tuple(modes)}: each must be 'recursive' or 'single'.")
  if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
    raise ValueError(f"samples={samples!r}: give 0 (greedy only) or the number of sampled "
                     "trees per task (pass@k for k up to it).")


async def _evaluate_model(config, model, server_urls, num_tasks, modes, difficulties, out_dir,
                          samples, task_files=None, server_api="sglang") -> dict[str, Any]:
  _check(modes, samples)
  name = model or config.model.name
  env = make_env(config, task_files)
  if server_urls:
    from rao_jax.model.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
    from rao_jax.model.weights import resolve_model_path  # pylint: disable=g-import-not-at-top
    from rao_jax.rollout import openai_client, sglang_client  # pylint: disable=g-import-not-at-top
    path = resolve_model_path(name)
    tokenizer = (Tokenizer.from_hf_folder(path) if os.path.isdir(path)
                 else Tokenizer.from_gguf(path))
    if server_api == "openai":
      engine = openai_client.OpenAIEngine(server_urls[0], tokenizer,
                                          api_key=X.rollout_api_key(config))
    else:
      engine = sglang_client.SGLangEngine(list(server_urls), api_key=X.rollout_api_key(config))
    label = ",".join(server_urls)
  else:
    from rao_jax.model import load_pretrained  # pylint: disable=g-import-not-at-top
    policy, tokenizer = load_pretrained(name, dtype=X._dtype(config.model.dtype),  # pylint: disable=protected-access
                                        kernels=config.model.get("kernels", "auto"))
    engine = X.make_engine(config, policy, tokenizer)
    label = name
  safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)[:80]
  out_dir = out_dir or os.path.join("evaluation", safe)
  results = {"workdir": None, "step": None, "model": label}
  return await _run_eval(config, env, engine, tokenizer, results, num_tasks, modes,
                         difficulties, out_dir, samples, f"Evaluation of {label}")


async def _run_eval(config, env, engine, tokenizer, results, num_tasks, modes, difficulties,
                    out_dir, samples, title) -> dict[str, Any]:
  """Greedy (and, with samples > 0, sampled) trees on held-out tasks; writes the outputs."""
  n = int(num_tasks or config.eval.num_tasks)
  diffs = tuple(difficulties or config.env.eval_difficulties)
  os.makedirs(out_dir, exist_ok=True)
  results.update({"num_tasks": n, "env": config.env.name, "modes": {}})
  results["warmup_s"] = await asyncio.to_thread(X.warm_engine, config, engine)
  repls = X.sandbox_pool(config)
  await repls.start()
  all_trees, sampled_trees = [], []
  # The in-loop evaluation's judge (config.judge.eval) scores nodes no verifier covers here too.
  judge = X.make_judge(config, "eval", engine, tokenizer)
  try:
    for mode in modes:
      runner = X.make_runner(config, env, engine, tokenizer, repls, judge=judge,
                             recursive=mode == "recursive", greedy=True)
      per_mode = {}
      for diff in diffs:
        # "val": the run's validation split of train tasks (config.env.val_tasks), where a
        # recipe or a checkpoint is chosen without consulting the held-out tasks.
        tasks = (X.train_and_val_tasks(env, config)[1][:n] if diff == "val"
                 else X.eval_tasks(env, diff, n))
        if not tasks:
          raise ValueError(f"No tasks to evaluate for {diff!r}" + (
              ": the run has no validation split (config.env.val_tasks = 0)."
              if diff == "val" else "."))
        t0 = time.perf_counter()
        counters0 = collections.Counter(getattr(engine, "stats", {}))
        progress = RolloutProgress(runner, 0, len(tasks), PROGRESS_EVERY_S,
                                   label=f"eval {title} {mode} {diff}")
        reporter = asyncio.ensure_future(progress.report())
        try:
          trees = await runner.run_tasks(tasks, group_size=1, on_tree=progress.count)
        finally:
          reporter.cancel()
        wall = time.perf_counter() - t0
        succ = [t.root.success or 0.0 for t in trees]
        lo, hi = stats.binomial_ci95(succ)
        per_mode[diff] = {"success": X.success_rate(trees), "ci95": [lo, hi],
                          "num_tasks": len(trees), "wall_s": wall,
                          "per_task": {t.task_id: s for t, s in zip(trees, succ)},
                          **metrics_lib.tree_stats(trees)}
        if hasattr(engine, "stats"):
          # The embedded engine's time split (device calls, idle, batch occupancy): where an
          # evaluation's minutes went, recorded with every evaluation.
          from rao_jax.rollout.engine import scheduler  # pylint: disable=g-import-not-at-top
          delta = collections.Counter(engine.stats)
          delta.subtract(counters0)
          per_mode[diff]["engine"] = scheduler.time_split(delta, wall)
        log.info("eval %s %s %s: success %.3f [%.3f, %.3f] over %d tasks", title, mode,
                 diff, per_mode[diff]["success"], lo, hi, len(trees))
        all_trees += trees
        if samples:
          # No fixed seed: the runner gives every generation the config's seed, which would
          # make the K samples of a task identical; the engine draws one per request instead.
          sampler = X.make_runner(config, env, engine, tokenizer, repls, judge=judge,
                                  recursive=mode == "recursive", greedy=False)
          t0 = time.perf_counter()
          sampled = await sampler.run_tasks(tasks, group_size=samples)
          sampled_trees += sampled
          per_mode[diff].update(sampled_stats(sampled, samples),
                                sampled_wall_s=time.perf_counter() - t0)
          log.info("eval %s %s %s: pass@%d %.3f over %d tasks x %d samples", title, mode,
                   diff, samples, per_mode[diff]["pass_at_k"][str(samples)], len(tasks),
                   samples)
      results["modes"][mode] = per_mode
  finally:
    await repls.close()
    await engine.close()
  R.save_trees_jsonl(os.path.join(out_dir, "trees.jsonl"), all_trees)
  if sampled_trees:
    R.save_trees_jsonl(os.path.join(out_dir, "sampled_trees.jsonl"), sampled_trees)
  metrics_lib.write_html(all_trees, os.path.join(out_dir, "trees.html"), title=title)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  results["out_dir"] = out_dir
  return results


def load_checkpoint(workdir: str, step: int | None = None):
  """(model, tokenizer, step, config) of a training run's checkpoint `step` (default: newest).

  The run's policy (``experiment.load_policy``) with the checkpoint's parameters, read by
  ``rao_jax.learner.checkpoint.restore_params`` (the one checkpoint loader; serve uses it too).
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from rao_jax.learner.checkpoint import restore_params  # pylint: disable=g-import-not-at-top
  workdir = os.path.abspath(workdir)
  config = X.load_config(workdir)
  model, tokenizer = X.load_policy(config)
  from rao_jax.model import lora as lora_lib  # pylint: disable=g-import-not-at-top
  # With LoRA the checkpoint holds the adapter; the base comes from config.model.name.
  params, step = restore_params(X.learner_config(config, workdir).ckpt_dir,
                                nnx.state(model, lora_lib.trainable(model.cfg)), step)
  nnx.update(model, params)
  return model, tokenizer, step, config


async def _evaluate(workdir, step, num_tasks, modes, difficulties, out_dir,
                    samples=0, task_files=None, overrides=None, adapter=None) -> dict[str, Any]:
  _check(modes, samples)
  workdir = os.path.abspath(workdir)
  model, tokenizer, step, config = load_checkpoint(workdir, step)
  apply_overrides(config, overrides)
  if adapter:
    if model.cfg.lora.enabled:
      raise ValueError(f"adapter={adapter!r}: {workdir} is a LoRA run (its checkpoint is an "
                       "adapter); give a full-parameter run as the base, e.g. the run the "
                       "adapter was trained from (its ckpt.init_from).")
    from rao_jax.model import peft  # pylint: disable=g-import-not-at-top
    peft.load_adapter(adapter, model)
  env = make_env(config, task_files)
  engine = X.make_engine(config, model, tokenizer, weight_version=f"ckpt{step}")
  del model
  out_dir = out_dir or os.path.join(workdir, "evaluation", f"step_{step:06d}")
  results: dict[str, Any] = {"workdir": workdir, "step": step, "adapter": adapter}
  return await _run_eval(config, env, engine, tokenizer, results, num_tasks, modes,
                         difficulties, out_dir, samples, f"Evaluation of step {step}")
