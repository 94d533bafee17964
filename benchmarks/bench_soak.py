"""Soak: does a long run hold its memory, file descriptors, processes and threads flat?

    python benchmarks/bench_soak.py [--steps 40] [--workdir /tmp/soak]

Runs the main job's RL loop (the delegation micro-run of `make demo`: the real trainer, embedded
engine, sandboxed REPLs, verifiers, learner, weight sync) for `--steps` short steps with a
held-out evaluation every 10 steps and a checkpoint every 5, in a child process. The parent
reads the child's /proc every half second and records, for each step, the peak of:
  rss_mb     resident memory of the trainer process
  fds        its open file descriptors
  processes  live processes under it (the sandboxes' REPL processes, servers, ...)
  threads    its threads
(peaks, because sandboxes come and go within a step: a value read at one instant is noise).
It fits each against the step number (least squares, over the steps after the first `--skip`
warm-up steps) and reports the slope per step and per 100 steps. Goal: flat, judged as a
fitted change over 100 steps within 10% of the figure's mean level (sandboxes coming and going
make single peaks noisy; a leak shows as a steady slope).

Progress goes to stderr; the last stdout line is one JSON object. Results go to
benchmarks/results/bench_soak.{json,png}. No timing here: figures are counts and bytes, so a
busy machine changes how long it takes, not what it measures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("rss_mb", "fds", "processes", "threads")


def say(*a):
  print("[bench_soak]", *a, file=sys.stderr, flush=True)


def child(workdir: str, steps: int) -> None:
  """The soaked run: the delegation micro-run with evaluation and checkpoints."""
  sys.path.insert(0, ROOT)
  from experiments.configs import delegation  # pylint: disable=g-import-not-at-top
  from rao_jax import trainer  # pylint: disable=g-import-not-at-top
  c = delegation.setup(workdir)
  c.total_steps = steps
  c.eval.every = 10
  c.eval.num_tasks = 8
  c.ckpt.every = 5
  c.ckpt.keep = 2
  trainer.train(c, os.path.join(workdir, "rl"))


def _status(pid: int) -> dict[str, str]:
  with open(f"/proc/{pid}/status") as f:
    return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _descendants(pid: int) -> int:
  children: dict[int, list[int]] = {}
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue   # gone meanwhile
    children.setdefault(ppid, []).append(int(name))
  count, todo = 0, list(children.get(pid, []))
  while todo:
    p = todo.pop()
    count += 1
    todo += children.get(p, [])
  return count


def sample(pid: int) -> dict[str, float]:
  st = _status(pid)
  return {"rss_mb": int(st["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
          "processes": _descendants(pid), "threads": int(st["Threads"])}


def slope(xs, ys) -> float:
  n = len(xs)
  mx, my = sum(xs) / n, sum(ys) / n
  var = sum((x - mx) ** 2 for x in xs)
  return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def train_steps(metrics_path: str) -> int:
  if not os.path.exists(metrics_path):
    return 0
  with open(metrics_path) as f:
    return sum(1 for line in f if '"train/success"' in line)


def plot(rows, skip: int, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  titles = {"rss_mb": "resident memory (MB)", "fds": "open file descriptors",
            "processes": "live child processes", "threads": "threads"}
  fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
  steps = [r["step"] for r in rows]
  for ax, key in zip(axes, FIELDS):
    ax.plot(steps, [r[key] for r in rows], marker=".", color="tab:blue")
    ax.axvspan(0, skip + 0.5, color="0.9", label="warm-up (not fitted)")
    ax.set_title(titles[key] + ", peak per step")
    ax.set_xlabel("RL step")
    ax.set_ylim(bottom=0)
  axes[0].legend(loc="lower right", fontsize=8)
  fig.suptitle("Soak: the delegation micro-run with evaluation every 10 steps and checkpoints "
               "every 5 (the peak of each step, read every half second)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the fit")
  ap.add_argument("--workdir", default="/tmp/rao_soak")
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/bench_soak.json"))
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--refit", action="store_true",
                  help="fit and plot the rows stored in --out again (no run)")
  args = ap.parse_args()
  if args.child:
    child(args.workdir, args.steps)
    return
  if args.steps < args.skip + 10:
    ap.error(f"--steps={args.steps}: need at least --skip + 10 = {args.skip + 10} to fit a slope")
  subprocess.run(["rm", "-rf", os.path.join(args.workdir, "rl")], check=True)
  metrics = os.path.join(args.workdir, "rl", "metrics.jsonl")
  t0 = time.time()
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "--steps",
                           str(args.steps), "--workdir", args.workdir], cwd=ROOT,
                          stdout=subprocess.DEVNULL)
  if args.refit:
    with open(args.out) as f:
      stored = json.load(f)
    minutes = stored.get("minutes")
    return report(stored["rows"], stored["rows"][-1]["step"], args,
                  None if minutes is None else 60 * minutes)
  rows, seen, peak = [], 0, {}
  while proc.poll() is None:
    try:
      now = sample(proc.pid)
    except (OSError, KeyError):
      break   # it ended between two reads
    peak = {k: max(peak.get(k, 0), v) for k, v in now.items()}
    n = train_steps(metrics)
    if n > seen:
      seen = n
      rows.append({"step": n, "t_s": round(time.time() - t0, 1), **peak})
      say(f"step {n}: peak rss {peak['rss_mb']:.0f} MB, {peak['fds']} fds, "
          f"{peak['processes']} processes, {peak['threads']} threads")
      peak = {}
    time.sleep(0.5)
  if proc.wait() != 0:
    raise SystemExit(f"bench_soak: the soaked run failed (exit {proc.returncode}); see "
                     f"{args.workdir}/rl")
  return report(rows, seen, args, time.time() - t0)


def report(rows, seen: int, args, wall_s) -> None:
  fit = [r for r in rows if r["step"] > args.skip]
  if len(fit) < 10:
    raise SystemExit(f"bench_soak: only {len(fit)} steps after the warm-up were sampled")
  xs = [r["step"] for r in fit]
  result = {"bench": "soak", "job": "delegation micro-run (make demo's first stage)",
            "steps": seen, "skip": args.skip, "eval_every": 10, "ckpt_every": 5,
            "minutes": round(wall_s / 60, 2) if wall_s is not None else None}
  for key in FIELDS:
    ys = [r[key] for r in fit]
    k = slope(xs, ys)
    result[key] = {"first": fit[0][key], "last": fit[-1][key], "min": min(ys), "max": max(ys),
                   "slope_per_step": round(k, 4), "per_100_steps": round(100 * k, 2)}
  result["flat"] = {k: abs(result[k]["per_100_steps"]) <= 0.10 * sum(r[k] for r in fit) / len(fit)
                    for k in FIELDS}
  with open("/proc/cpuinfo") as f:
    result["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")),
                         "unknown")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({**result, "rows": rows}, f, indent=1)
  plot(rows, args.skip, os.path.splitext(args.out)[0] + ".png")
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
