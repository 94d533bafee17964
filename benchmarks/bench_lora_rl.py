r"""RL with a LoRA adapter on the recursion workload: the learning rate picked on train trees,
then RL steps from the recursive warm start, against full fine-tuning.

Two stages, each resumable (a finished stage is read back, not run again):

1. `pick`: one update from the recursive warm start on a batch of TRAIN trees (the first RL
   step's trees of `bench_rl_step`, sampled by the warm start on train tasks; no held-out task
   is read), for full fine-tuning at the two learning rates the recursion run tried (2e-6
   changed nothing in 3 steps; 2e-5 broke the program in one) and for the adapter at each
   candidate rate. For each: the mean absolute change of the batch's sampled tokens'
   log-probabilities after the update, and the learner's seconds for the update (compiled
   beforehand). The rule, fixed before any figure was seen: the adapter's rate is the candidate
   whose change is closest, in log scale, to the geometric mean of the two full fine-tuning
   changes (between "nothing moved" and "the program broke").
2. `run`: `--steps` RL steps of the recursion experiment's CPU settings (bench_rl_step's) from
   the warm start with the adapter at the picked rate: per step the sampled trees' success,
   delegating share and tree depth, and the learner's seconds, against full fine-tuning's
   seconds on the same batch (the pick stage's figures).

    python benchmarks/bench_lora_rl.py [--lora_stages=pick,run] [--lora_steps=3]

Writes benchmarks/results/bench_lora_rl.json (both stages) and prints its summary as one JSON
line.
"""
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_WORKDIR = flags.DEFINE_string("lora_workdir", "runs/recursion",
                               "The recursion experiment's workdir (warm start reused).")
_TREES = flags.DEFINE_string(
    "lora_train_trees", "runs/recursion/bench_rl_step/after/trees/step_000000.jsonl",
    "Train trees sampled by the warm start (bench_rl_step's first step).")
_STAGES = flags.DEFINE_list("lora_stages", ["pick", "run"], "Stages to run: pick, run.")
_RANK = flags.DEFINE_integer("lora_rank", 8, "Adapter rank (every projection).")
_ALPHA = flags.DEFINE_float("lora_alpha", 16.0, "Adapter alpha.")
_LORA_LRS = flags.DEFINE_list("lora_lrs", ["3e-5", "1e-4", "3e-4", "1e-3"],
                              "Candidate adapter learning rates.")
_FULL_LRS = flags.DEFINE_list("lora_full_lrs", ["2e-6", "2e-5"],
                              "Full fine-tuning references: changed nothing, broke the program.")
_STEPS = flags.DEFINE_integer("lora_steps", 3, "RL steps of the run stage.")
_LR = flags.DEFINE_float("lora_lr", 0.0, "Override the picked adapter rate (0: the pick's).")
_OUT = flags.DEFINE_string("lora_out", "benchmarks/results/bench_lora_rl.json", "Result JSON.")


def log(msg):
  print(f"[bench_lora_rl] {msg}", file=sys.stderr, flush=True)


def _commit() -> str:
  try:
    return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def _config(lr: float, rank: int):
  from experiments import recursion_evidence as rec  # pylint: disable=g-import-not-at-top
  import bench_rl_step  # pylint: disable=g-import-not-at-top
  s = dict(rec._SCALES["cpu"])  # pylint: disable=protected-access
  root = os.path.abspath(_WORKDIR.value)
  config = rec.config_for("recursive", s)
  config.ckpt.init_from = bench_rl_step.warm_start(root, s)
  config.optim.lr = lr
  config.model.lora.rank = rank
  config.model.lora.alpha = _ALPHA.value
  return config, s


def _update_change(kind: str, lr: float, trees, workdir: str) -> dict:
  """One update of a fresh learner from the warm start on `trees`: the log-prob change of the
  batch's sampled tokens and the update's seconds."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from rao_jax import experiment as X  # pylint: disable=g-import-not-at-top
  from rao_jax.learner import Learner  # pylint: disable=g-import-not-at-top
  from rao_jax.learner import checkpoint  # pylint: disable=g-import-not-at-top
  from rao_jax.model.logprobs import token_logprobs  # pylint: disable=g-import-not-at-top
  config, _ = _config(lr, _RANK.value if kind == "lora" else 0)
  model, _ = X.load_policy(config)
  if kind == "full":   # (a LoRA policy's base is init_from's already: load_policy)
    checkpoint.load_params_into(model, config.ckpt.init_from)
  learner = Learner(X.learner_config(config, workdir), model.cfg,
                    mesh=X.make_mesh(config.learner.mesh), params=model)
  del model
  batch, _ = learner.prepare(trees)
  arrays = batch.arrays()
  mask = np.asarray(arrays["loss_mask_BxT"])
  graphdef = nnx.graphdef(learner.model)

  shared = learner.cfg.shared_prefix_tokens() > 0

  @jax.jit
  def row_logp(state, tokens, positions, segments, targets):
    m = nnx.merge(graphdef, state)
    return token_logprobs(m, m(tokens, positions, segments, shared_prefix=shared), targets)

  def logps():
    m = learner.model
    out = []
    for r in range(mask.shape[0]):
      if mask[r].any():
        sl = {k: jnp.asarray(np.asarray(arrays[k])[r:r + 1]) for k in
              ("tokens_BxT", "positions_BxT", "segment_ids_BxT", "targets_BxT")}
        out.append(np.asarray(row_logp(nnx.state(m), sl["tokens_BxT"], sl["positions_BxT"],
                                       sl["segment_ids_BxT"], sl["targets_BxT"]))[0][mask[r]])
    return np.concatenate(out)

  before = logps()
  compile_s = learner.warmup([int(mask.shape[0])])
  t0 = time.perf_counter()
  metrics = learner.step(batch)
  step_s = time.perf_counter() - t0
  after = logps()
  delta = np.abs(after - before)
  learner.close()
  jax.clear_caches()
  return {"kind": kind, "lr": lr, "step_s": step_s, "compile_s": compile_s,
          "mean_abs_logp_change": float(delta.mean()),
          "max_abs_logp_change": float(delta.max()),
          "mean_logp_before": float(before.mean()), "mean_logp_after": float(after.mean()),
          "loss_tokens": int(mask.sum()), "rows": int(mask.shape[0]),
          "trained_params": int(sum(x.size for x in jax.tree.leaves(learner.params))),
          "grad_norm": metrics["grad_norm"]}


def pick_stage(result: dict) -> None:
  from rao_jax.agent import records as R  # pylint: disable=g-import-not-at-top
  trees = R.load_trees_jsonl(_TREES.value)
  if any(".train." not in t.task_id for t in trees):
    raise ValueError(f"{_TREES.value}: the pick reads train trees only.")
  log(f"pick: {len(trees)} train trees ({sorted({t.task_id for t in trees})})")
  rows = result.setdefault("pick", {}).setdefault("updates", [])
  done = {(r["kind"], r["lr"]) for r in rows}
  todo = [("full", float(x)) for x in _FULL_LRS.value] + [("lora", float(x))
                                                            for x in _LORA_LRS.value]
  scratch = os.path.join(os.path.abspath(_WORKDIR.value), "bench_lora_rl", "pick_scratch")
  for kind, lr in todo:
    if (kind, lr) in done:
      continue
    log(f"pick: {kind} at lr {lr:g} ...")
    row = _update_change(kind, lr, trees, scratch)
    log(f"pick: {kind} lr {lr:g}: mean |d logp| {row['mean_abs_logp_change']:.3g}, "
        f"update {row['step_s']:.1f}s")
    rows.append(row)
    _save(result)
  full = {r["lr"]: r["mean_abs_logp_change"] for r in rows if r["kind"] == "full"}
  lo, hi = (full[float(x)] for x in _FULL_LRS.value)
  target = math.sqrt(lo * hi)
  lora = [r for r in rows if r["kind"] == "lora"]
  best = min(lora, key=lambda r: abs(math.log(max(r["mean_abs_logp_change"], 1e-12) / target)))
  step_full = statistics.median(r["step_s"] for r in rows if r["kind"] == "full")
  step_lora = statistics.median(r["step_s"] for r in lora)
  result["pick"].update(
      rule="the adapter rate whose one-update change of the train batch's log-probs is closest "
           "(log scale) to the geometric mean of full fine-tuning's at 2e-6 and 2e-5",
      target_change=target, picked_lr=best["lr"],
      learner_step_s={"full": step_full, "lora": step_lora, "lora_over_full":
                      step_lora / step_full})
  _save(result)


def run_stage(result: dict) -> None:
  from rao_jax import trainer  # pylint: disable=g-import-not-at-top
  lr = _LR.value or result.get("pick", {}).get("picked_lr")
  if not lr:
    raise app.UsageError("run: no picked rate; run --lora_stages=pick first or pass --lora_lr.")
  config, s = _config(float(lr), _RANK.value)
  config.total_steps = _STEPS.value
  wd = os.path.join(os.path.abspath(_WORKDIR.value), "bench_lora_rl", f"run_lr{lr:g}")
  log(f"run: {_STEPS.value} RL steps with a rank-{_RANK.value} adapter at lr {lr:g} in {wd} "
      "(resumes from its checkpoints)")
  t0 = time.perf_counter()
  trainer.train(config, wd)
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    rows = [json.loads(l) for l in f]
  steps = [r for r in rows if "train/success" in r]
  keys = ("success", "delegating_share", "tree_depth", "tree_nodes", "time/learner_s",
          "time/rollout_s", "time/sync_s", "learner/tokens_per_s", "learner/grad_norm",
          "rl/groups_all_equal_frac")
  result["run"] = {
      "lr": float(lr), "rank": _RANK.value, "alpha": _ALPHA.value, "workdir": wd,
      "settings": {k: s[k] for k in ("tasks_per_step", "group", "ctx", "budget", "max_depth",
                                     "rl_temperature")},
      "steps": [{"step": r["step"], **{k: r.get(f"train/{k}") for k in keys}} for r in steps],
      "minutes_this_invocation": (time.perf_counter() - t0) / 60,
      "full_fine_tuning_2e-5_reference": (
          "experiments/recursion_evidence.py, scale cpu: one full fine-tuning update at 2e-5 "
          "took the warm start off its program; the next step's 8 sampled trees all ran to "
          "the context limit, none delegating"),
  }
  _save(result)


def _save(result: dict) -> None:
  out = os.path.abspath(_OUT.value)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)


def main(argv):
  del argv
  import bench_peak  # pylint: disable=g-import-not-at-top
  from rao_jax import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.keep_freed_memory()
  out = os.path.abspath(_OUT.value)
  result = {}
  if os.path.exists(out):
    with open(out) as f:
      result = json.load(f)
  result.update(benchmark="bench_lora_rl", commit=_commit(), cpu=bench_peak.cpu_model(),
                load_avg_1m=round(os.getloadavg()[0], 2))
  if "pick" in _STAGES.value and "picked_lr" not in result.get("pick", {}):
    pick_stage(result)
  if "run" in _STAGES.value:
    run_stage(result)
  summary = {"benchmark": "bench_lora_rl", "commit": result["commit"], "cpu": result["cpu"],
             "picked_lr": result.get("pick", {}).get("picked_lr"),
             "pick_changes": {f"{r['kind']}@{r['lr']:g}": round(r["mean_abs_logp_change"], 5)
                              for r in result.get("pick", {}).get("updates", [])},
             "learner_step_s": result.get("pick", {}).get("learner_step_s"),
             "run_success": [x["success"] for x in result.get("run", {}).get("steps", [])],
             "run_delegating": [x["delegating_share"]
                                for x in result.get("run", {}).get("steps", [])]}
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  app.run(main)
