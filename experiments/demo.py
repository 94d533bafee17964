"""`make demo`: a real, short RAO run on CPU with the embedded defaults.

SmolLM2-135M-Instruct on TextCraft-Synth easy tasks, the embedded JAX engine and the
bubblewrap sandbox: a supervised warm start on the scripted policy's demonstrations (the
starting model cannot use the tools at all), a few RL steps with the depth-weighted
leave-one-out gradient, checkpoints, an evaluation reloaded from the last checkpoint
(recursive and single-agent), the HTML tree view and the reward/success plot.

  python -m experiments.demo [--workdir=demo_out]
"""
import json
import os
import time

from absl import app
from absl import flags
from absl import logging

_WORKDIR = flags.DEFINE_string("workdir", "demo_out", "Where every output of the demo goes.")

CONFIG = "recursive,demo"


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from experiments.configs import textcraft_synth  # pylint: disable=g-import-not-at-top
  from rao_jax import evaluation, sft, trainer  # pylint: disable=g-import-not-at-top
  root = os.path.abspath(_WORKDIR.value)
  t0 = time.time()

  print(f"[1/3] Supervised warm start on scripted demonstrations -> {root}/sft", flush=True)
  sft_cfg = textcraft_synth.get_config(CONFIG)
  sft_res = sft.run_sft(sft_cfg, os.path.join(root, "sft"))
  print(f"      {sft_res['num_demos']} demonstration trees, final NLL {sft_res['final_nll']:.3f}")

  print(f"[2/3] RAO training -> {root}/rl", flush=True)
  rl_cfg = textcraft_synth.get_config(CONFIG)
  rl_cfg.ckpt.init_from = os.path.join(root, "sft")
  rl = trainer.train(rl_cfg, os.path.join(root, "rl"))

  print("[3/3] Evaluation reloaded from the last checkpoint (recursive and single-agent)",
        flush=True)
  ev = evaluation.evaluate_checkpoint(os.path.join(root, "rl"), num_tasks=1)
  summary = {m: {d: round(v["success"], 3) for d, v in per.items()}
             for m, per in ev["modes"].items()}
  outputs = {
      "metrics": os.path.join(root, "rl", "metrics.jsonl"),
      "tensorboard": os.path.join(root, "rl", "tensorboard"),
      "plot": rl["plot"],
      "checkpoints": os.path.join(root, "rl", "checkpoints"),
      "training_trees_html": os.path.join(root, "rl", "eval"),
      "evaluation": os.path.join(ev["out_dir"], "results.json"),
      "evaluation_trees_html": os.path.join(ev["out_dir"], "trees.html"),
  }
  print(json.dumps({"eval_success": summary, "minutes": round((time.time() - t0) / 60, 1)}))
  print("Outputs:")
  for k, v in outputs.items():
    print(f"  {k:22s} {v}")


if __name__ == "__main__":
  app.run(main)
