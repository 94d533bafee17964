"""Trainer step time with and without overlapping the next step's rollouts with the update.

Runs the real trainer (engine, sandboxes, runner, learner, weight sync) on the demo's settings
(`textcraft_synth.py:recursive,demo`: SmolLM2-135M, 2 trees of 1 task per step, 256-token
turns) in alternating rounds inside one process, so both modes share the compiled programs and
see the same machine load: each round is a fresh run of `--steps` steps with
`config.rl.overlap` False, then True (the loss is ppo_clip in both: overlap needs an importance
ratio). A step's time is the trainer's `train/time/step_s`; the first step of every run (which
has nothing to overlap with, and compiles in the first round) is left out. The result is the
median over rounds of each mode's mean step time, and their ratio.

  python benchmarks/bench_overlap.py [--quick] [--rounds N] [--steps N]

`--quick` uses a random-weights ModelConfig.tiny() of SmolLM2 (same tokenizer) with 16-token
turns: it checks the script and the overlap path in a few minutes, not the demo's figure.
Progress goes to stderr; the last stdout line is one JSON object.
"""
import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _log(*a):
  print(*a, file=sys.stderr, flush=True)


def _tiny_model_dir(root: str) -> str:
  from flax import nnx
  from rao_jax.model import ModelConfig, Transformer, export_hf, resolve_model_path
  from rao_jax.model.tokenizer import Tokenizer
  gguf = resolve_model_path("smollm2-135m")
  cfg = ModelConfig.from_gguf(gguf).tiny()
  out = os.path.join(root, "tiny_hf")
  export_hf(Transformer(cfg, rngs=nnx.Rngs(0)), cfg, Tokenizer.from_gguf(gguf), out)
  return out


def _config(quick: bool, model_dir: str | None, steps: int, overlap: bool):
  from experiments.configs import textcraft_synth
  c = textcraft_synth.get_config("recursive,demo")
  c.total_steps = steps
  c.rl.loss = "ppo_clip"
  c.rl.overlap = overlap
  c.rl.kl_coef = 0.01          # every node stays in the batch: every step runs the learner
  c.eval.every = 0
  c.ckpt.every = 1000          # the trainer still saves at the end of each run
  c.log.progress = False
  c.log.tensorboard = False
  if quick:
    c.model.name = model_dir
    c.agent.max_new_tokens = 16
    c.agent.max_steps_per_agent = 2
    c.agent.context_window = 1024
    c.rollout.max_cache_len = 1024
    c.rollout.num_slots = 4
    c.learner.row_len = 1024
  return c


def _run(config, workdir: str) -> list[float]:
  from rao_jax import trainer
  trainer.train(config, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(l) for l in f if "train/time/step_s" in l]
  return [r["train/time/step_s"] for r in rows]


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--rounds", type=int, default=None)
  ap.add_argument("--steps", type=int, default=3)
  args = ap.parse_args()
  rounds = args.rounds or (1 if args.quick else 2)
  logging.basicConfig(level=logging.WARNING)
  from rao_jax.kernels import mkl
  root = tempfile.mkdtemp(prefix="bench_overlap_")
  model_dir = _tiny_model_dir(root) if args.quick else None
  per_mode = {False: [], True: []}
  for r in range(rounds):
    for overlap in (False, True):
      wd = os.path.join(root, f"r{r}_{'overlap' if overlap else 'sequential'}")
      t0 = time.perf_counter()
      steps = _run(_config(args.quick, model_dir, args.steps, overlap), wd)
      later = steps[1:] or steps
      per_mode[overlap].append(statistics.fmean(later))
      _log(f"round {r} overlap={overlap}: step_s {['%.1f' % s for s in steps]} "
           f"(run {time.perf_counter() - t0:.0f} s)")
  seq, ovl = statistics.median(per_mode[False]), statistics.median(per_mode[True])
  print(json.dumps({
      "bench": "overlap", "settings": "textcraft_synth recursive,demo" + (" --quick" if
                                                                         args.quick else ""),
      "steps_per_run": args.steps, "rounds": rounds,
      "step_s_sequential": round(seq, 3), "step_s_overlap": round(ovl, 3),
      "speedup": round(seq / max(ovl, 1e-9), 3),
      "per_round": {"sequential": [round(x, 3) for x in per_mode[False]],
                    "overlap": [round(x, 3) for x in per_mode[True]]},
      "cpu": mkl.cpuinfo("model name"), "cores": os.cpu_count(),
      "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
  main()
