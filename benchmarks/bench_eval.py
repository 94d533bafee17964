"""Held-out greedy evaluation of the recursion experiment's warm start: its minutes, and its
trees against another run's.

    python benchmarks/bench_eval.py --eval_label=after [--num_tasks=64] [--compare=before]
    python benchmarks/bench_eval.py --eval_label=after --compare=before --compare_only
    python benchmarks/bench_eval.py --eval_workdir=runs/rao/warm --eval_label=paged \
        --from_stage=runs/rao/warm/recursive/eval_before --compare=unpaged --keep_trees=64

It evaluates the recursive warm start that `bench_rl_step.py` builds (`<workdir>/recursive/sft`)
greedily on the run config's held-out tasks, recursive mode, and records the wall minutes,
success per task and the generated turns of the first `--keep_trees` trees. With `--compare`,
it sets them beside that label's run (made by another commit, e.g. before a change):
success per task on the tasks both evaluated, and for the kept trees whether each agent's turns
are token-identical, identical up to a turn that now stops earlier (at its cell's close), or
where they first differ (node, turn, token index and the two tokens).

With `--from_stage` the run is read from the recursion experiment's own held-out evaluation of
the same warm start (the same `evaluate_checkpoint` call, timed by its stage), run at this
commit: the hour-long evaluation is not paid twice.

Results go to `--eval_out` (runs by label) and one JSON line on stdout. Progress on stderr.
"""
from __future__ import annotations

import json
import os
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_WORKDIR = flags.DEFINE_string("eval_workdir", "runs/recursion",
                               "The recursion experiment's workdir (its recursive warm start).")
_NUM_TASKS = flags.DEFINE_integer("num_tasks", 64, "Held-out tasks per difficulty.")
_LABEL = flags.DEFINE_string("eval_label", "run", "Name of this run in --eval_out.")
_COMPARE = flags.DEFINE_string("compare", "", "Label of a stored run to compare with.")
_KEEP = flags.DEFINE_integer("keep_trees", 8, "Trees whose turns are kept for comparisons.")
_BENCH_OUT = flags.DEFINE_string("eval_out", "benchmarks/results/bench_eval.json",
                                 "Result JSON (runs by label).")
_FROM_STAGE = flags.DEFINE_string(
    "from_stage", "", "Evaluate nothing: record the run from a recursion_evidence evaluation "
    "stage of the same warm start (e.g. <eval_workdir>/recursive/eval_before, made by the "
    "same greedy evaluation), its minutes from the stage's wall time: the experiment's own "
    "evaluation is not paid twice.")
_COMPARE_ONLY = flags.DEFINE_bool("compare_only", False,
                                  "Evaluate nothing: set the stored run --eval_label beside "
                                  "--compare (when the runs were made in the other order).")


def log(msg):
  print(f"[bench_eval] {msg}", file=sys.stderr, flush=True)


def turns_of(node) -> list[list[int]]:
  """The node's generated turns: each run of generated tokens in its token ids."""
  runs, cur = [], []
  for tok, gen in zip(node.token_ids, node.gen_mask):
    if gen:
      cur.append(int(tok))
    elif cur:
      runs.append(cur)
      cur = []
  if cur:
    runs.append(cur)
  return runs


def compare_turns(before: dict, after: dict) -> dict:
  """{task: verdict} for the trees both runs kept (see the module doc)."""
  out = {}
  for task in sorted(set(before) & set(after)):
    b_nodes, a_nodes = before[task], after[task]
    verdict = "identical"
    for node in sorted(set(b_nodes) | set(a_nodes)):
      b, a = b_nodes.get(node), a_nodes.get(node)
      if b is None or a is None:
        verdict = {"differs": f"node {node} only in {'after' if b is None else 'before'}"}
        break
      for t, (bt, at) in enumerate(zip(b, a)):
        n = min(len(bt), len(at))
        diff = next((i for i in range(n) if bt[i] != at[i]), None)
        if diff is not None:
          verdict = {"differs": {"node": node, "turn": t, "token": diff,
                                 "before": bt[diff], "after": at[diff]}}
          break
        if len(at) < len(bt):
          verdict = "identical up to earlier stops"
      if isinstance(verdict, dict):
        break
      if len(a) != len(b) and verdict == "identical":
        verdict = {"differs": f"node {node}: {len(b)} turns before, {len(a)} after"}
        break
    out[task] = verdict
  return out


def versus(other: dict, run: dict, label: str) -> dict:
  """`run` beside `other`: success per common task, minutes and the kept trees' turns."""
  common = sorted(set(other["per_task"]) & set(run["per_task"]))
  return {"label": label, "common_tasks": len(common),
          "success_changed": [t for t in common if other["per_task"][t] != run["per_task"][t]],
          "success_other": sum(other["per_task"][t] for t in common),
          "success_this": sum(run["per_task"][t] for t in common),
          "minutes_ratio": run["minutes"] / other["minutes"] if other["minutes"] else None,
          "turns": compare_turns(other["kept_turns"], run["kept_turns"])}


def compare_stored(out: str) -> None:
  with open(out) as f:
    runs = json.load(f).get("runs", {})
  for name in (_LABEL.value, _COMPARE.value):
    if name not in runs:
      raise app.UsageError(f"no run {name!r} in {out} (runs: {sorted(runs)}).")
  run = runs[_LABEL.value]
  run["vs"] = versus(runs[_COMPARE.value], run, _COMPARE.value)
  with open(out, "w") as f:
    json.dump({"benchmark": "bench_eval", "runs": runs}, f, indent=1)
  print(json.dumps({"benchmark": "bench_eval", "label": run["label"], "commit": run["commit"],
                    "cpu": run["cpu"], "minutes": round(run["minutes"], 2),
                    "success": run["success"], "vs": run["vs"]}), flush=True)


def read_stage(stage_dir: str, ckpt: str, num_tasks: int) -> tuple[dict, float]:
  """(evaluate_checkpoint's results, minutes) of a complete evaluation stage of `ckpt`."""
  try:
    with open(os.path.join(stage_dir, "stage.json")) as f:
      minutes = float(json.load(f)["minutes"])
    with open(os.path.join(stage_dir, "results.json")) as f:
      res = json.load(f)
  except FileNotFoundError as e:
    raise app.UsageError(f"--from_stage={stage_dir}: not a complete evaluation stage "
                         f"({e.filename} is missing).") from e
  if os.path.realpath(res.get("workdir", "")) != os.path.realpath(ckpt):
    raise app.UsageError(f"--from_stage={stage_dir} evaluated {res.get('workdir')!r}, not this "
                         f"warm start {ckpt!r}.")
  if res.get("num_tasks") != num_tasks or "recursive" not in res.get("modes", {}):
    raise app.UsageError(f"--from_stage={stage_dir}: {res.get('num_tasks')} tasks, modes "
                         f"{sorted(res.get('modes', {}))}; --num_tasks={num_tasks} "
                         "recursive is what this benchmark compares.")
  return res, minutes


def main(argv):
  del argv
  if _COMPARE_ONLY.value:
    if not _COMPARE.value:
      raise app.UsageError("--compare_only needs --compare=<label>.")
    compare_stored(os.path.abspath(_BENCH_OUT.value))
    return
  from rao_jax import evaluation  # pylint: disable=g-import-not-at-top
  from rao_jax.agent import records as R  # pylint: disable=g-import-not-at-top
  # The commit and CPU name as bench_rl_step records them (its flags have other names).
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
  from bench_rl_step import commit, cpu_name  # pylint: disable=g-import-not-at-top
  ckpt = os.path.join(os.path.abspath(_WORKDIR.value), "recursive", "sft")
  if not os.path.isdir(os.path.join(ckpt, "checkpoints")):
    raise app.UsageError(f"No warm start in {ckpt}: run benchmarks/bench_rl_step.py first "
                         "(it builds it) or pass --eval_workdir.")
  if _FROM_STAGE.value:
    out_dir = os.path.abspath(_FROM_STAGE.value)
    res, minutes = read_stage(out_dir, ckpt, _NUM_TASKS.value)
  else:
    out_dir = os.path.join(os.path.abspath(_WORKDIR.value), "bench_eval", _LABEL.value)
    log(f"evaluating {ckpt} on {_NUM_TASKS.value} held-out tasks per difficulty -> {out_dir}")
    t0 = time.time()
    res = evaluation.evaluate_checkpoint(ckpt, num_tasks=_NUM_TASKS.value,
                                         modes=("recursive",), out_dir=out_dir)
    minutes = (time.time() - t0) / 60
  trees = R.load_trees_jsonl(os.path.join(out_dir, "trees.jsonl"))
  by_diff = res["modes"]["recursive"]
  per_task = {f"{d}/{t}": s for d, r in by_diff.items() for t, s in r["per_task"].items()}
  kept = {}
  for tree in trees[:_KEEP.value]:
    kept[tree.task_id] = {n.node_id: turns_of(n) for n in tree.nodes}
  run = {"label": _LABEL.value, "commit": commit(), "cpu": cpu_name(),
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "minutes": minutes, "trees": len(trees), "warmup_s": res.get("warmup_s"),
         "success": {d: r["success"] for d, r in by_diff.items()},
         "num_tasks": {d: r["num_tasks"] for d, r in by_diff.items()},
         "generated_tokens": sum(n.num_generated_tokens for t in trees for n in t.nodes),
         "agents": sum(len(t.nodes) for t in trees),
         "per_task": per_task, "kept_turns": kept}
  out = os.path.abspath(_BENCH_OUT.value)
  runs = {}
  if os.path.exists(out):
    with open(out) as f:
      runs = json.load(f).get("runs", {})
  summary = {"benchmark": "bench_eval", "label": run["label"], "commit": run["commit"],
             "cpu": run["cpu"], "minutes": round(minutes, 2), "trees": len(trees),
             "success": run["success"], "generated_tokens": run["generated_tokens"]}
  if _COMPARE.value:
    other = runs.get(_COMPARE.value)
    if other is None:
      raise app.UsageError(f"--compare={_COMPARE.value!r}: no such run in {out} "
                           f"(runs: {sorted(runs)}).")
    run["vs"] = versus(other, run, _COMPARE.value)
    summary["vs"] = run["vs"]
  runs[_LABEL.value] = run
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump({"benchmark": "bench_eval", "runs": runs}, f, indent=1)
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  app.run(main)
