r"""Evidence that RAO learns: SFT warm start on easy tasks, RL on medium, held-out evaluation.

For each agent mode (recursive and single-agent, the same small context window):
  1. supervised warm start on the scripted policy's easy-task demonstrations;
  2. evaluation of that starting checkpoint on held-out tasks (greedy);
  3. RAO training on medium tasks from the starting checkpoint;
  4. evaluation of the trained checkpoint on the same held-out tasks.
Writes `benchmarks/results/learning_evidence.json` (success before/after per mode and
difficulty, the paired difference with its 95% interval over tasks) and a plot beside it.

  python -m experiments.learning_evidence --scale=cpu --workdir=runs/evidence
  python -m experiments.learning_evidence --scale=gpu --workdir=runs/evidence_gpu   # an H200
"""
import json
import os
import time

from absl import app
from absl import flags

_WORKDIR = flags.DEFINE_string("workdir", "runs/evidence", "Where the runs go.")
_SCALE = flags.DEFINE_enum("scale", "cpu", ["tiny", "cpu", "gpu"], "Experiment size.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/learning_evidence.json", "Result JSON.")
_MODES = flags.DEFINE_list("modes", ["recursive", "single"], "Agent modes to compare.")

# (eval tasks per difficulty, SFT steps, SFT demos, RL steps, tasks/step, group size)
_SCALES = {
    "tiny": dict(eval_tasks=4, sft_steps=4, demos=8, rl_steps=2, tasks_per_step=1, group=2,
                 ctx=2048, eval_diffs=("medium",)),
    "cpu": dict(eval_tasks=100, sft_steps=40, demos=64, rl_steps=20, tasks_per_step=2, group=4,
                ctx=4096, eval_diffs=("medium",)),
    "gpu": dict(eval_tasks=200, sft_steps=150, demos=256, rl_steps=40, tasks_per_step=8,
                group=8, ctx=4096, eval_diffs=("medium", "hard")),
}


def _config(mode: str, s: dict, train: str):
  from experiments.configs import textcraft_synth  # pylint: disable=g-import-not-at-top
  c = textcraft_synth.get_config(f"{mode},ctx=4096")
  c.agent.context_window = s["ctx"]
  c.rollout.max_cache_len = s["ctx"]
  c.learner.row_len = s["ctx"]
  c.env.train_difficulty = train
  c.env.eval_difficulties = s["eval_diffs"]
  c.agent.max_new_tokens = 384
  c.agent.max_steps_per_agent = 6
  c.total_steps = s["rl_steps"]
  c.rl.tasks_per_step = s["tasks_per_step"]
  c.rl.group_size = s["group"]
  c.eval.every = 10**9         # evaluation happens below, on the full held-out set
  c.eval.num_tasks = s["eval_tasks"]
  c.ckpt.every = 10
  c.sft.steps = s["sft_steps"]
  c.sft.num_demos = s["demos"]
  c.sft.trees_per_step = 2
  c.sft.lr = 1e-4
  c.optim.lr = 2e-6
  return c


def _paired(before: dict, after: dict) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rao_jax import experiment as X  # pylint: disable=g-import-not-at-top
  ids = sorted(before)
  d = np.asarray([after[i] - before[i] for i in ids])
  lo, hi = X.binomial_ci95(d) if len(d) > 1 else (0.0, 0.0)
  # binomial_ci95 is a normal interval of a mean; differences live in [-1, 1], the same formula.
  return {"delta": float(d.mean()), "ci95": [lo, hi], "n": len(ids),
          "excludes_zero": bool(lo > 0 or hi < 0)}


def main(argv):
  del argv
  from rao_jax import evaluation, sft, trainer  # pylint: disable=g-import-not-at-top
  s = _SCALES[_SCALE.value]
  root = os.path.abspath(_WORKDIR.value)
  t0 = time.time()
  result = {"scale": _SCALE.value, "settings": {k: list(v) if isinstance(v, tuple) else v
                                                for k, v in s.items()}, "modes": {}}
  for mode in _MODES.value:
    sft_dir, rl_dir = os.path.join(root, mode, "sft"), os.path.join(root, mode, "rl")
    sft.run_sft(_config(mode, s, "easy"), sft_dir)
    before = evaluation.evaluate_checkpoint(sft_dir, num_tasks=s["eval_tasks"], modes=(mode,),
                                            difficulties=s["eval_diffs"])
    c = _config(mode, s, "medium")
    c.ckpt.init_from = sft_dir
    trainer.train(c, rl_dir)
    after = evaluation.evaluate_checkpoint(rl_dir, num_tasks=s["eval_tasks"], modes=(mode,),
                                           difficulties=s["eval_diffs"])
    per = {}
    for diff in s["eval_diffs"]:
      b, a = before["modes"][mode][diff], after["modes"][mode][diff]
      per[diff] = {"before": b["success"], "before_ci95": b["ci95"], "after": a["success"],
                   "after_ci95": a["ci95"], "paired": _paired(b["per_task"], a["per_task"])}
    result["modes"][mode] = per
    print(json.dumps({mode: per}), flush=True)
  result["minutes"] = (time.time() - t0) / 60
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(result, f, indent=2)
  _plot(result, os.path.splitext(_OUT.value)[0] + ".png")
  print(json.dumps(result))


def _plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  labels, before, after = [], [], []
  for mode, per in result["modes"].items():
    for diff, r in per.items():
      labels.append(f"{mode}\n{diff}")
      before.append(r["before"])
      after.append(r["after"])
  xs = range(len(labels))
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.bar([x - 0.2 for x in xs], before, 0.4, label="start (SFT)")
  ax.bar([x + 0.2 for x in xs], after, 0.4, label="after RAO")
  ax.set_xticks(list(xs), labels)
  ax.set_ylabel("held-out success")
  ax.set_ylim(0, 1)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  app.run(main)
