r"""Evaluate a training run's checkpoint on held-out tasks (recursive and single-agent).

  python -m experiments.evaluate --workdir=DIR [--step=N] [--num_tasks=100] \
      [--modes=recursive,single] [--difficulties=medium,hard]

Works on any device count: a checkpoint saved on 8 devices restores onto this process's.
Writes DIR/evaluation/step_N/{results.json,trees.jsonl,trees.html} and prints the JSON.
"""
import json

from absl import app
from absl import flags

from experiments import common

_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (has config.json).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_NUM_TASKS = flags.DEFINE_integer("num_tasks", None, "Held-out tasks per difficulty.")
_MODES = flags.DEFINE_list("modes", ["recursive", "single"], "Agent modes to evaluate.")
_DIFFS = flags.DEFINE_list("difficulties", None, "Difficulties (default: the config's).")
flags.mark_flag_as_required("workdir")


def main(argv):
  del argv
  common.init_distributed()
  from rao_jax import evaluation  # pylint: disable=g-import-not-at-top
  res = evaluation.evaluate_checkpoint(_WORKDIR.value, _STEP.value, _NUM_TASKS.value,
                                       _MODES.value, _DIFFS.value)
  summary = {m: {d: {"success": v["success"], "ci95": v["ci95"]} for d, v in per.items()}
             for m, per in res["modes"].items()}
  print(json.dumps({"step": res["step"], "out_dir": res["out_dir"], "success": summary}))


if __name__ == "__main__":
  app.run(main)
