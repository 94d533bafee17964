"""`make demo`: RAO teaching a tiny policy to delegate in minutes, then a real, short run of SmolLM2 on CPU.

  [1/4] The delegation micro-run (`experiments/configs/delegation.py`): a tiny policy on
        tasks of two parts where one agent can answer only one part, so a task is solved only
        by delegating to helpers. Through the real loop (engine, sandboxed REPL, verifiers,
        rewards, packing, jitted learner step, weight sync), RAO raises both the success and
        the share of trees that delegate within a few minutes. Its curves are the plot a new
        user should see rise.
  [2/4] SmolLM2-135M-Instruct on TextCraft-Synth easy tasks: a supervised warm start on the
        scripted policy's demonstrations (the starting model cannot use the tools at all).
  [3/4] Greedy evaluation of the warm start on held-out tasks.
  [4/4] Two RAO steps, a checkpoint, and the same evaluation reloaded from it.
It ends with a summary a newcomer reads in seconds: what the micro-run learned, that every
SmolLM2 stage ran, and the SmolLM2 held-out check as what it is (two tasks, counts with Wilson
intervals: too few to show a gain or a loss). The experiment that measures RL's effect on
SmolLM2 is `experiments/recursion_evidence.py` (docs/results/recursion.md).

  python -m experiments.demo [--workdir=demo_out]
"""
import json
import os
import time

from absl import app
from absl import flags
from absl import logging


def _define_flags() -> None:
  """The demo's flag, defined when it runs as a program only: importing the module (its tests
  read its summary functions) must not claim `--workdir`, which the experiments' own modules
  define in the same test process."""
  flags.DEFINE_string("workdir", "demo_out", "Where every output of the demo goes.")

CONFIG = "recursive,demo"
DONE_FILE = "demo_summary.json"   # written last: its presence means the demo finished
EVAL_TASKS = 2                    # held-out tasks of the SmolLM2 evaluations (greedy)


def _mean(xs):
  xs = [x for x in xs if x is not None]
  return sum(xs) / len(xs) if xs else float("nan")


def micro_run(root: str) -> dict:
  """The delegation micro-run; returns first/last success and delegating share, its plot."""
  from experiments.configs import delegation  # pylint: disable=g-import-not-at-top
  from rao_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  from rao_jax import trainer  # pylint: disable=g-import-not-at-top
  c = delegation.setup(root)
  c.eval.every = 0   # the training curves are what this stage shows
  # 20 of the test's 30 steps keep the demo within 10 minutes; delegation is near 1 by then
  # and success has risen several-fold (benchmarks/results/rao_ablations.json: the curves).
  c.total_steps = 20
  r = trainer.train(c, os.path.join(root, "rl"))
  rows = [m for m in metrics_lib.read_metrics(os.path.join(root, "rl", "metrics.jsonl"))
          if "train/success" in m]
  k = max(1, len(rows) // 6)
  out = {"steps": len(rows), "window": k, "plot": r["plot"]}
  for key, name in (("train/success", "success"), ("train/delegating_share", "delegating"),
                    ("train/rl/success/depth_1", "helpers")):
    vals = [m.get(key) for m in rows]
    out[f"{name}_first"], out[f"{name}_last"] = _mean(vals[:k]), _mean(vals[-k:])
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from experiments.configs import textcraft_synth  # pylint: disable=g-import-not-at-top
  from rao_jax import evaluation, sft, trainer  # pylint: disable=g-import-not-at-top
  root = os.path.abspath(flags.FLAGS.workdir)
  prepare_workdir(root)
  t0 = time.time()

  print(f"[1/4] The delegation micro-run: RAO teaches a tiny policy to delegate -> "
        f"{root}/delegation", flush=True)
  mic = micro_run(os.path.join(root, "delegation"))
  stages = {"delegation": _minutes_since(t0)}
  print(f"      sampled trees, first {mic['window']} -> last {mic['window']} of {mic['steps']} "
        f"steps: success {mic['success_first']:.2f} -> {mic['success_last']:.2f}, delegating "
        f"{mic['delegating_first']:.2f} -> {mic['delegating_last']:.2f}; curves: {mic['plot']} "
        f"({stages['delegation']:.1f} min)", flush=True)

  print(f"[2/4] SmolLM2-135M: supervised warm start on scripted demonstrations -> {root}/sft",
        flush=True)
  sft_cfg = textcraft_synth.get_config(CONFIG)
  t = time.time()
  sft_res = sft.run_sft(sft_cfg, os.path.join(root, "sft"))
  stages["sft"] = _minutes_since(t)
  if sft_res["steps_run"]:
    print(f"      {sft_res['num_demos']} demonstration trees, "
          f"final NLL {sft_res['final_nll']:.3f} ({stages['sft']:.1f} min)")
  else:
    print("      already complete in this workdir (resumed from its last checkpoint)")

  print(f"[3/4] Greedy evaluation of the warm start on {EVAL_TASKS} held-out tasks", flush=True)
  t = time.time()
  before = evaluation.evaluate_checkpoint(os.path.join(root, "sft"), num_tasks=EVAL_TASKS,
                                          modes=("recursive",))
  stages["eval_before"] = _minutes_since(t)
  print(f"      ({stages['eval_before']:.1f} min)", flush=True)

  print(f"[4/4] RAO training -> {root}/rl, then the same evaluation reloaded from its "
        "checkpoint", flush=True)
  rl_cfg = textcraft_synth.get_config(CONFIG)
  rl_cfg.ckpt.init_from = os.path.join(root, "sft")
  t = time.time()
  rl = trainer.train(rl_cfg, os.path.join(root, "rl"))
  stages["rl"] = _minutes_since(t)
  t = time.time()
  after = evaluation.evaluate_checkpoint(os.path.join(root, "rl"), num_tasks=EVAL_TASKS,
                                         modes=("recursive",))
  stages["eval_after"] = _minutes_since(t)
  print(f"      RL {stages['rl']:.1f} min, evaluation {stages['eval_after']:.1f} min", flush=True)

  smol = {"rl_steps": rl_summary(os.path.join(root, "rl", "metrics.jsonl"))}
  for diff, b in before["modes"]["recursive"].items():
    a = after["modes"]["recursive"][diff]
    n = a["num_tasks"]
    smol[diff] = {"num_tasks": n, "before_rl": round(b["success"], 3),
                  "after_rl": round(a["success"], 3),
                  "solved_before_rl": round(b["success"] * n), "solved_after_rl":
                  round(a["success"] * n),
                  "wilson95_before_rl": [round(x, 3) for x in wilson(round(b["success"] * n), n)],
                  "wilson95_after_rl": [round(x, 3) for x in wilson(round(a["success"] * n), n)]}
  outputs = {
      "delegation_plot": mic["plot"],
      "metrics": os.path.join(root, "rl", "metrics.jsonl"),
      "plot": rl["plot"],
      "checkpoints": os.path.join(root, "rl", "checkpoints"),
      "evaluation_before_rl": os.path.join(before["out_dir"], "trees.html"),
      "evaluation_after_rl": os.path.join(after["out_dir"], "trees.html"),
      "evaluation": os.path.join(after["out_dir"], "results.json"),
  }
  result = {"delegation": {k: mic[k] for k in mic if k != "plot"},
            "smollm2_recursive": smol, "minutes": _minutes_since(t0),
            "stage_minutes": stages}
  print(json.dumps(result))
  print_summary(mic, smol, outputs, sft_res)
  with open(os.path.join(root, DONE_FILE), "w", encoding="utf-8") as f:
    json.dump({**result, "outputs": outputs}, f, indent=1)


def rl_summary(path: str) -> list[dict]:
  """Per RL step: sampled success, whether the learner updated, its seconds and tokens/s."""
  from rao_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  out = []
  for m in metrics_lib.read_metrics(path):
    if "train/success" not in m:
      continue
    out.append({"step": m["step"], "sampled_success": m["train/success"],
                "updated": bool(m.get("train/learner/update_applied", 1.0)),
                "learner_s": round(m.get("train/time/learner_s", 0.0), 1),
                "learner_tokens_per_s": round(m.get("train/learner/tokens_per_s", 0.0), 1),
                "rollout_tokens_per_s": round(m.get("train/rollout/tokens_per_s", 0.0), 1)})
  return out


def _minutes_since(t: float) -> float:
  return round((time.time() - t) / 60, 1)


def wilson(k: int, n: int) -> tuple[float, float]:
  """Wilson score 95% interval of k successes in n; unlike the normal approximation (which
  gives [-0.48, 1.48] on two tasks) it stays inside [0, 1]."""
  from rao_jax import stats  # pylint: disable=g-import-not-at-top
  return stats.wilson_ci95(k, n) if n > 0 else (0.0, 1.0)


def print_summary(mic: dict, smol: dict, outputs: dict, sft_res: dict | None = None) -> None:
  """Three points in the order a newcomer needs them: what RL taught (the micro-run, whose
  curves mean something), that SmolLM2's real pipeline ran, and its held-out check led by its
  size, so two tasks never read as a gain or a loss."""
  print("\nSummary")
  print(f"  1. RAO taught a tiny policy to delegate ({mic['steps']} RL steps; mean of the first "
        f"and last {mic['window']}): success {mic['success_first']:.2f} -> "
        f"{mic['success_last']:.2f}, trees that delegate {mic['delegating_first']:.2f} -> "
        f"{mic['delegating_last']:.2f}, helpers right {mic['helpers_first']:.2f} -> "
        f"{mic['helpers_last']:.2f}. One agent alone solves no task here.")
  print(f"     plot: {outputs['delegation_plot']}")
  steps = []
  for r in smol["rl_steps"]:
    steps.append(f"step {r['step']} " + ("updated" if r["updated"] else
                                         "skipped: no group had a signal"))
  warm = ""
  if sft_res and sft_res.get("steps_run"):
    warm = (f"warm start on {sft_res['num_demos']} demonstrations (final NLL "
            f"{sft_res['final_nll']:.2f}), ")
  print(f"  2. SmolLM2-135M ran every stage on real weights: {warm}"
        f"{len(smol['rl_steps'])} RL steps ({'; '.join(steps) or 'none'}), a checkpoint saved "
        "and reloaded for evaluation.")
  for diff, r in smol.items():
    if diff == "rl_steps":
      continue
    n = r["num_tasks"]
    lo_b, hi_b = r["wilson95_before_rl"]
    lo_a, hi_a = r["wilson95_after_rl"]
    print(f"  3. Its held-out check is {n} {diff} task{'s' if n != 1 else ''}, far too few to "
          f"show a gain or a loss: {r['solved_before_rl']}/{n} solved before RL "
          f"[{lo_b:.2f}, {hi_b:.2f}], {r['solved_after_rl']}/{n} after "
          f"[{lo_a:.2f}, {hi_a:.2f}] (Wilson 95%). The experiment that measures RL on SmolLM2: "
          "docs/results/recursion.md.")
  print(f"     trees: {outputs['evaluation_before_rl']} (before), "
        f"{outputs['evaluation_after_rl']} (after)")
  print("Outputs:")
  for k, v in outputs.items():
    print(f"  {k:22s} {v}")


def prepare_workdir(root: str) -> None:
  """A finished demo is kept aside and a fresh one starts; an unfinished one is resumed.

  Without this, a second `make demo` would resume the first one's last checkpoints and train
  nothing. An interrupted demo (no DONE_FILE) resumes from its checkpoints: nothing is lost.
  """
  if os.path.exists(os.path.join(root, DONE_FILE)):
    kept = f"{root}.previous-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(root, kept)
    print(f"A finished demo was in {root}; it is kept as {kept}. Starting a fresh one.")
  elif os.path.isdir(root) and os.listdir(root):
    print(f"Resuming the unfinished demo in {root} from its checkpoints "
          f"(delete that folder to start over).")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
