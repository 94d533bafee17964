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
DONE_FILE = "demo_summary.json"   # written last: its presence means the demo finished


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from experiments.configs import textcraft_synth  # pylint: disable=g-import-not-at-top
  from rao_jax import evaluation, sft, trainer  # pylint: disable=g-import-not-at-top
  root = os.path.abspath(_WORKDIR.value)
  prepare_workdir(root)
  t0 = time.time()

  print(f"[1/3] Supervised warm start on scripted demonstrations -> {root}/sft", flush=True)
  sft_cfg = textcraft_synth.get_config(CONFIG)
  sft_res = sft.run_sft(sft_cfg, os.path.join(root, "sft"))
  if sft_res["steps_run"]:
    print(f"      {sft_res['num_demos']} demonstration trees, "
          f"final NLL {sft_res['final_nll']:.3f}")
  else:
    print("      already complete in this workdir (resumed from its last checkpoint)")

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
  result = {"eval_success": summary, "minutes": round((time.time() - t0) / 60, 1)}
  print(json.dumps(result))
  print("Outputs:")
  for k, v in outputs.items():
    print(f"  {k:22s} {v}")
  with open(os.path.join(root, DONE_FILE), "w", encoding="utf-8") as f:
    json.dump({**result, "outputs": outputs}, f, indent=1)


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
  app.run(main)
