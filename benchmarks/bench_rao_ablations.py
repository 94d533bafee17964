"""The paper's credit-assignment ablations on the delegation micro-environment, over seeds.

    python benchmarks/bench_rao_ablations.py [--seeds=5] [--variants=rao,...] [--workdir=DIR]

Variants (config overrides of `experiments/configs/delegation.py`, each a real Trainer run of
30 steps from the same warm start per seed, seeds run in rounds: every variant of seed 0, then
of seed 1, ...):
  rao                full RAO (lambda 0.5, leave-one-out from root rewards, depth weights)
  no_depth_weights   w_d = 1 for every node
  lambda0            no delegation bonus (R(v) = s(v))
  tree_advantage     every node gets its root's advantage (plain per-tree GRPO)
  root_only          children leave the learner batch (rewards unchanged)
  control            lr = 0: the warm start sampled for 30 steps
and, for `tests/test_learns_to_delegate.py`'s figures, two deliberate breakages (not options
of the library; patched into this process only):
  shuffled_baselines every child takes the leave-one-out baseline of a tree of another group
  flipped_sign       every advantage negated

Reported per variant: final success and delegating share, each as the mean over seeds of the
run's last 10 training steps (sampled at temperature 1) and of a greedy held-out evaluation
(the test split's 32 tasks, never trained on), with 95% t-intervals over seeds; the mean
curves; and how many seeds pass the delegation test's verdict against that seed's control.
Differences against `rao` are paired by seed (same warm start, same tasks per step): a t
interval over the seeds' differences; "significant" when it excludes 0.

Every run writes its metrics under --workdir; a finished run is not run again, so an
interrupted benchmark resumes. Progress goes to stderr, one JSON line to stdout, and with
--out the JSON and a plot are written.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

VARIANTS = {
    "rao": {},
    "no_depth_weights": {"rl.depth_weights": False},
    "lambda0": {"rl.lam": 0.0},
    "tree_advantage": {"rl.advantage": "tree"},
    "root_only": {"rl.train_nodes": "root"},
    "control": {"optim.lr": 0.0},
}
BREAKAGES = ("shuffled_baselines", "flipped_sign")
LAST = 10   # training steps averaged for "final" figures


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def _patch_breakage(name: str) -> None:
  """Installs a deliberate credit-assignment bug in this process's learner."""
  from rao_jax.learner import rewards, step as step_lib
  real = rewards.compute_rewards_and_advantages

  def broken(trees, *args, **kwargs):
    import dataclasses
    adv = real(trees, *args, **kwargs)
    a = adv.advantage_N.copy()
    if name == "flipped_sign":
      a = -a
    else:   # shuffled_baselines: each child's b_k from a tree of another group
      rng = np.random.default_rng(len(adv.node_ids))
      groups = np.asarray([trees[k].group_id for k in adv.tree_index_N])
      tree_baseline = {int(k): adv.baseline_N[i] for i, k in enumerate(adv.tree_index_N)}
      for i in np.flatnonzero(adv.depth_N > 0):
        others = [k for k in tree_baseline if trees[k].group_id != groups[i]]
        if others:
          a[i] = adv.reward_N[i] - tree_baseline[int(rng.choice(others))]
    return dataclasses.replace(adv, advantage_N=a)

  step_lib.compute_rewards_and_advantages = broken


def run_one(variant: str, seed: int, workdir: str) -> None:
  """One training run (in its own process: a breakage patch never leaks into another run)."""
  from experiments.configs import delegation as cfg_lib
  from rao_jax import trainer
  # Up to 256 supervised steps: the copying circuit forms at a seed-dependent step (44 on
  # seed 0; seed 1 had helpers at 0.25 after 96).
  c = cfg_lib.setup(os.path.join(workdir, f"seed{seed}"), f"seed={seed}", max_steps=256)
  for key, value in VARIANTS.get(variant, {}).items():
    section, field = key.split(".")
    c[section][field] = value
  if variant in BREAKAGES:
    _patch_breakage(variant)
  c.eval.every = c.total_steps   # one greedy held-out evaluation, at the end
  trainer.train(c, os.path.join(workdir, f"seed{seed}", variant))


def _read(run_dir: str) -> dict | None:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  rows = [json.loads(line) for line in open(path)]
  train = [r for r in rows if "train/success" in r]
  evals = [r for r in rows if "eval/success_all" in r]
  if len(train) < 30 or not evals:
    return None
  return {"success": [r["train/success"] for r in train],
          "delegating": [r.get("train/delegating_share", 0.0) for r in train],
          "child_success": [r.get("train/rl/success/depth_1", np.nan) for r in train],
          "eval_success": evals[-1]["eval/success_all"],
          "eval_delegating": evals[-1].get("eval/delegating_share", 0.0),
          "minutes": sum(r.get("train/time/step_s", 0.0) for r in train) / 60}


def _ci95(x) -> list[float]:
  from scipy import stats
  x = np.asarray(x, float)
  if len(x) < 2:
    return [float(x.mean()), float(x.mean())]
  half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
  return [float(x.mean() - half), float(x.mean() + half)]


def _summary(runs: dict[int, dict], controls: dict[int, dict]) -> dict:
  from experiments.configs import delegation as cfg_lib
  seeds = sorted(runs)
  out = {"seeds": seeds}
  for key, final in (("success", lambda r: np.mean(r["success"][-LAST:])),
                     ("delegating", lambda r: np.mean(r["delegating"][-LAST:])),
                     ("eval_success", lambda r: r["eval_success"]),
                     ("eval_delegating", lambda r: r["eval_delegating"])):
    vals = [float(final(runs[s])) for s in seeds]
    out[key] = {"mean": float(np.mean(vals)), "ci95": _ci95(vals), "per_seed": vals}
  out["curves"] = {k: np.nanmean([runs[s][k] for s in seeds], axis=0).round(4).tolist()
                   for k in ("success", "delegating", "child_success")}
  verdicts = [cfg_lib.learning_verdict(runs[s], controls[s]) for s in seeds if s in controls]
  out["test_passes"] = f"{sum(v['passes'] for v in verdicts)}/{len(verdicts)}"
  out["test_figures"] = [{k: round(v[k], 3) for k in v if k not in ("report", "passes")}
                         | {"passes": v["passes"]} for v in verdicts]
  out["minutes_per_run"] = float(np.mean([runs[s]["minutes"] for s in seeds]))
  return out


def _paired(a: dict[int, dict], b: dict[int, dict], key: str) -> dict:
  seeds = sorted(set(a) & set(b))
  d = [np.mean(a[s][key][-LAST:]) - np.mean(b[s][key][-LAST:]) for s in seeds]
  ci = _ci95(d)
  return {"delta": float(np.mean(d)), "ci95": ci, "n": len(seeds),
          "significant": bool(ci[0] > 0 or ci[1] < 0)}


# What the paper reports or implies about each ablation, to compare directions with.
CLAIMS = {
    "no_depth_weights": "the paper's depth weights keep deep, numerous nodes from dominating "
                        "the update; without them it expects worse or equal results",
    "lambda0": "the delegation bonus rewards productive delegation; without it the paper "
               "expects less (or slower) delegation",
    "tree_advantage": "per-node credit is the paper's point: crediting every node with its "
                      "tree's outcome should learn slower",
    "root_only": "children must be trained (the policy is shared across depths): root-only "
                 "training should not teach the helpers their parts",
}


def _plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for name, v in result["variants"].items():
    for ax, key in zip(axes, ("success", "delegating", "child_success")):
      ax.plot(np.arange(1, len(v["curves"][key]) + 1), v["curves"][key], label=name,
              ls="--" if name in BREAKAGES or name == "control" else "-")
  for ax, title in zip(axes, ("root success (train, sampled)", "share of trees that delegate",
                              "helpers' success (depth 1)")):
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  n = len(result["variants"].get("rao", {}).get("seeds", []))
  fig.suptitle(f"RAO ablations on the delegation micro-environment (means over {n} seeds)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seeds", type=int, default=5)
  p.add_argument("--variants", default=",".join(list(VARIANTS) + list(BREAKAGES)))
  p.add_argument("--workdir", default=os.path.join(ROOT, "runs", "rao_ablations"))
  p.add_argument("--out", default="", help="path prefix for .json and .png (e.g. "
                 "benchmarks/results/rao_ablations)")
  p.add_argument("--report_only", action="store_true", help="run nothing: summarise the runs "
                 "finished under --workdir (each variant over the seeds it has)")
  p.add_argument("--one", default="", help=argparse.SUPPRESS)
  p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.one:
    run_one(args.one, args.seed, args.workdir)
    return
  names = [v.strip() for v in args.variants.split(",") if v.strip()]
  unknown = [v for v in names if v not in VARIANTS and v not in BREAKAGES]
  if unknown:
    sys.exit(f"--variants: unknown {unknown}; choose from {list(VARIANTS) + list(BREAKAGES)}.")
  if "control" not in names:
    names.append("control")   # every verdict needs its seed's control
  t0 = time.time()
  results: dict[str, dict[int, dict]] = {v: {} for v in names}
  for seed in range(args.seeds):
    for v in names:
      run_dir = os.path.join(args.workdir, f"seed{seed}", v)
      got = _read(run_dir)
      if got is None and args.report_only:
        continue
      if got is None:
        print(f"[{time.time() - t0:7.0f}s] seed {seed} {v}: running", file=sys.stderr,
              flush=True)
        if os.path.isdir(run_dir):   # a run cut short: start it again
          subprocess.run(["rm", "-rf", run_dir], check=True)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # Every run compiles the same programs: XLA's persistent cache compiles them once.
        env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(args.workdir, "jax_cache"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
        subprocess.run([sys.executable, os.path.abspath(__file__), f"--one={v}",
                        f"--seed={seed}", f"--workdir={args.workdir}"], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        got = _read(run_dir)
        if got is None:
          sys.exit(f"{run_dir}: the run ended without 30 steps and an evaluation.")
      results[v][seed] = got
      print(f"[{time.time() - t0:7.0f}s] seed {seed} {v}: final success "
            f"{np.mean(got['success'][-LAST:]):.2f}, delegating "
            f"{np.mean(got['delegating'][-LAST:]):.2f}, held-out {got['eval_success']:.2f}",
            file=sys.stderr, flush=True)
  names = [v for v in names if results[v]]
  out = {"benchmark": "rao_ablations", "cpu": _cpu_name(), "seeds": args.seeds,
         "steps": 30, "final": f"mean of the last {LAST} training steps",
         "variants": {v: _summary(results[v], results["control"]) for v in names
                      if v not in BREAKAGES},
         "breakages": {v: _summary(results[v], results["control"]) for v in names
                       if v in BREAKAGES},
         "vs_rao": {}, "claims": {}}
  if "rao" in names:
    for v in names:
      if v == "rao":
        continue
      out["vs_rao"][v] = {key: _paired(results[v], results["rao"], key)
                          for key in ("success", "delegating")}
      if v in CLAIMS:
        d = out["vs_rao"][v]
        sign = lambda x: ("lower" if x["delta"] < 0 else "higher") + (
            " (significant)" if x["significant"] else " (not significant)")
        out["claims"][v] = {"paper": CLAIMS[v],
                            "measured": f"success {sign(d['success'])}, delegating "
                                        f"{sign(d['delegating'])} than full RAO"}
  out["minutes"] = round((time.time() - t0) / 60, 1)   # this invocation
  # The training runs' own minutes (every variant and seed; warm starts not included).
  out["run_minutes_total"] = round(sum(r["minutes"] for v in names
                                       for r in results[v].values()), 1)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
      json.dump(out | {"plot": os.path.basename(args.out) + ".png"}, f, indent=1)
    _plot(out | {"variants": out["variants"] | out["breakages"]}, args.out + ".png")
  print(json.dumps({k: v for k, v in out.items() if k != "variants" and k != "breakages"}
                   | {"variants": {v: {"success": s["success"]["mean"],
                                       "delegating": s["delegating"]["mean"],
                                       "test_passes": s["test_passes"]}
                                   for v, s in (out["variants"] | out["breakages"]).items()}}))


if __name__ == "__main__":
  main()
