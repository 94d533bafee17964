r"""The recursion workload's RL step, step by step, against its floor.

Runs `experiments/recursion_evidence.py`'s CPU settings (SmolLM2-135M, TextCraft-Synth medium
at 8 crafts per agent, 2 tasks x 4 trees a step, temperature 0.4) from its recursive warm
start, with the trainer the experiment uses. The warm start (demonstrations + SFT) is built
once into `--workdir` (the experiment's own layout, so an existing `runs/recursion` is reused)
and every invocation trains a fresh copy of it for `--steps` RL steps.

For each step it prints one JSON line (stdout):
  rollout: wall seconds; generated and prefilled tokens (real and padded); decode rows per call
    against active requests (occupancy); seconds the engine spent in device calls, of which
    compiling; seconds it had nothing to do (every agent in a sandbox cell or in host code);
    the union of the seconds leaf agents ran cells;
  learner: real tokens, padded tokens (rows with loss x row length), wall and compile seconds;
  floor: the step at the rates measured in the same run (below): each decode call priced at
    the bucket of its active requests, every prefilled token at the prefill rate, and the
    learner's rows at its compiled seconds per row.
After the steps it measures those rates: engine decode at every batch bucket (cache length
2,048, the run's window), prefill of 4 x 256 chunks, and one more learner step on the last
batch (already compiled). The final line (stdout) is the run's summary; the run is added to
`--out` (benchmarks/results/bench_rl_step.json, one entry per `--label`, with its commit) and
`--plot` draws each run's timeline of one step: agents by tree and depth, generation and cells,
the learner after the rollouts.

  python benchmarks/bench_rl_step.py --label=before    # ~40 min on 2 cores, warm start built
  python benchmarks/bench_rl_step.py --steps=3 --label=after
"""
import asyncio
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_WORKDIR = flags.DEFINE_string("bench_workdir", "runs/recursion",
                               "The recursion experiment's workdir (warm start built/reused).")
_STEPS = flags.DEFINE_integer("steps", 3, "RL steps to measure (at least 3).")
_LABEL = flags.DEFINE_string("label", "run", "Name of this run in --out (e.g. before, after).")
_BENCH_OUT = flags.DEFINE_string("bench_out", "benchmarks/results/bench_rl_step.json",
                                 "Result JSON (runs by label).")
_PLOT = flags.DEFINE_string("plot", "benchmarks/results/bench_rl_step.png", "Timeline plot.")
_SCALE = flags.DEFINE_enum("bench_scale", "cpu", ["cpu", "tiny"],
                           "The experiment's scale (`tiny`: a smoke run of this benchmark).")
_PLOT_STEP = flags.DEFINE_integer("plot_step", 2, "The step each run's timeline shows.")

COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                  "/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/compilation_cache/cache_retrieval_time_sec")


def log(msg):
  print(f"[bench_rl_step] {msg}", file=sys.stderr, flush=True)


def cpu_name() -> str:
  """The CPU with its vector instruction sets (two EPYC generations a VM names alike differ 2x)."""
  from rao_jax.kernels import mkl  # pylint: disable=g-import-not-at-top
  return mkl.cpu_name()


def commit() -> str:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                        text=True).stdout.strip()
  dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                         capture_output=True, text=True).stdout.strip()
  return head + ("+uncommitted" if dirty else "")


class CompileClock:
  """Every compilation's seconds (tracing, lowering, XLA, cache retrieval) with its end time."""

  def __init__(self):
    import jax  # pylint: disable=g-import-not-at-top
    self.events = []
    jax.monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, event, duration, **kwargs):
    del kwargs
    if event in COMPILE_EVENTS:
      self.events.append((time.perf_counter(), float(duration)))

  def between(self, a: float, b: float) -> float:
    return sum(d for t, d in self.events if a <= t <= b)


def union_s(spans) -> float:
  """Length of the union of [a, b] intervals."""
  total, end = 0.0, None
  for a, b in sorted(spans):
    if end is None or a > end:
      total += b - a
      end = b
    elif b > end:
      total += b - end
      end = b
  return total


def timeline(trees, t_step_unix: float) -> list[dict]:
  """Each agent's generations and cells on the step's clock (seconds from the step start)."""
  out = []
  for t in trees:
    off = float(t.meta.get("started_unix", t_step_unix)) - t_step_unix
    for n in t.nodes:
      gen, cells = [], []
      for turn in n.extras.get("turns", []):
        sp = turn.get("span_s") or {}
        if "generate" in sp:
          gen.append([off + x for x in sp["generate"]])
        if "execute" in sp:
          cells.append([off + x for x in sp["execute"]])
      out.append({"tree": t.tree_id, "node": n.node_id, "depth": n.depth,
                  "leaf": not n.children, "start": off + n.timings.get("start", 0.0),
                  "end": off + n.timings.get("end", 0.0), "generate": gen, "cells": cells,
                  "generated": n.num_generated_tokens})
  return out


def warm_start(root: str, s: dict) -> str:
  """The recursive warm start (demos + SFT) in the experiment's layout; built once."""
  from experiments import learning_evidence as le  # pylint: disable=g-import-not-at-top
  from experiments import recursion_evidence as rec  # pylint: disable=g-import-not-at-top
  from rao_jax import sft  # pylint: disable=g-import-not-at-top
  from rao_jax.agent import records as R  # pylint: disable=g-import-not-at-top
  stages = le._Stages(os.path.join(root, "recursive"))  # pylint: disable=protected-access
  demos_file = os.path.join(root, "recursive", "demos", "demonstrations.jsonl")

  def do_demos(d):
    c = rec.config_for("recursive", s)
    trees = asyncio.run(rec._collect_demos(c, s, "recursive", rec.tokenizer_for(c.model.name)))  # pylint: disable=protected-access
    R.save_trees_jsonl(os.path.join(d, "demonstrations.jsonl"), trees)
    return {"trees": len(trees), "nodes": sum(len(t.nodes) for t in trees)}

  def do_sft(d):
    r = sft.run_sft(rec.config_for("recursive", s), d, demos_path=demos_file)
    return {k: r[k] for k in ("steps", "num_demos", "final_nll")}

  stages.run("demos", do_demos)
  stages.run("sft", do_sft)
  return os.path.join(root, "recursive", "sft")


def make_trainer_class():
  from rao_jax import experiment as X  # pylint: disable=g-import-not-at-top
  from rao_jax import trainer  # pylint: disable=g-import-not-at-top
  from rao_jax.agent import records as R  # pylint: disable=g-import-not-at-top

  class Measured(trainer.Trainer):
    """The experiment's trainer, with each step's engine counters and compilations taken."""

    def __init__(self, config, workdir, clock: CompileClock):
      self.clock, self.steps, self.last_batch = clock, [], None
      t0 = time.perf_counter()
      super().__init__(X.assemble(config, workdir))
      self.init_s = time.perf_counter() - t0

    async def rl_step(self, runner, state, guard=None):
      step = state.step
      before = collections.Counter(self.engine.stats)
      t0, unix0 = time.perf_counter(), time.time()
      m = await super().rl_step(runner, state, guard)
      t1 = time.perf_counter()
      eng = collections.Counter(self.engine.stats)
      eng.subtract(before)
      trees = R.load_trees_jsonl(os.path.join(self.trees_dir, f"step_{step:06d}.jsonl"))
      rollout_s, learn_s, sync_s = (m["time/rollout_s"], m["time/learner_s"], m["time/sync_s"])
      t_learn0 = t1 - sync_s - learn_s
      self.steps.append({"step": step + 1, "m": m, "engine": dict(eng), "trees": trees,
                         "t0": t0, "t1": t1, "unix0": unix0,
                         "rollout_compile_s": self.clock.between(t0, t0 + rollout_s),
                         "learner_compile_s": self.clock.between(t_learn0, t_learn0 + learn_s),
                         "learner_window": [t_learn0 - t0, t_learn0 - t0 + learn_s]})
      return m

  return Measured


def step_line(st: dict, row_len: int) -> dict:
  m, e, trees = st["m"], st["engine"], st["trees"]
  from rao_jax.rollout.engine import scheduler  # pylint: disable=g-import-not-at-top
  tl = timeline(trees, st["unix0"])
  leaf_cells = [c for a in tl if a["leaf"] for c in a["cells"]]
  rows_used = m.get("learner/batch/rows_used", 0.0)
  return {
      "step": st["step"],
      "rollout": {
          "wall_s": m["time/rollout_s"],
          "generated_tokens": m["rollout/generated_tokens"],
          "generated_tokens_per_s": m["rollout/generated_tokens"] / max(m["time/rollout_s"],
                                                                         1e-9),
          **scheduler.time_split(e, m["time/rollout_s"]),
          "compile_s": st["rollout_compile_s"],
          "leaf_cells_s": union_s(leaf_cells),
          "trees": len(trees), "agents": sum(len(t.nodes) for t in trees),
          "success": m.get("success"),
          "end_reasons": dict(collections.Counter(n.end_reason for t in trees for n in t.nodes)),
      },
      "learner": {
          "wall_s": m["time/learner_s"], "compile_s": st["learner_compile_s"],
          "real_tokens": m.get("learner/batch/real_tokens", 0.0),
          "packed_tokens": m.get("learner/batch/packed_tokens", 0.0),
          "shared_prefix_saved": m.get("learner/batch/shared_prefix_saved", 0.0),
          "padded_tokens": rows_used * row_len,
          "rows": m.get("learner/batch/rows", 0.0), "rows_used": rows_used,
          "real_tokens_per_s": m.get("learner/batch/real_tokens", 0.0) / max(
              m["time/learner_s"], 1e-9),
          "skipped": not m.get("learner/update_applied", 1.0),
      },
      "sync_s": m["time/sync_s"], "step_s": m["time/step_s"],
      # Compilation before step 1 (the trainer's warm-up), reported with step 1.
      "warmup_s": m.get("time/warmup_s", 0.0),
      "_decode_hist": {int(k.rsplit("_", 1)[1]): v for k, v in e.items()
                       if k.startswith("decode_calls_active_")},
      "_timeline": tl, "_learner_window": st["learner_window"],
  }


def measure_rates(tr, batch, cache_len: int, reps: int = 4) -> dict:
  """Engine decode per batch bucket and prefill at `cache_len`; the learner's s per row."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rao_jax.rollout.engine import EmbeddedEngine  # pylint: disable=g-import-not-at-top
  from rao_jax.rollout.engine import programs as P  # pylint: disable=g-import-not-at-top
  eng = EmbeddedEngine(tr.learner.model, tr.engine.config)
  sched, c = eng._sched, eng.config  # pylint: disable=protected-access
  params = sched.state.params
  # num_slots rows of cache_len slots each: a pool of one page of cache_len slots per row
  # (each row's page table names its page), the engine's programs over the same reads.
  cache = sched._init_cache(batch_size=c.num_slots, max_len=cache_len)  # pylint: disable=protected-access
  out = {"cache_len": cache_len, "decode_steps": c.decode_steps, "decode_call_s": {},
         "decode_tokens_per_s": {}}
  for R in c.decode_rows:
    b = P.DecodeBatch.zeros(R, 1)
    b.pages_RxW[:, 0] = np.arange(R)
    b.lengths_R[:] = cache_len // 2
    b.active_R[:] = True
    times = []
    for i in range(reps + 1):
      t0 = time.perf_counter()
      cache, toks, _ = sched._decode(params, cache, b, P.sampling_arrays(R))  # pylint: disable=protected-access
      jax.block_until_ready(toks)
      if i:
        times.append(time.perf_counter() - t0)
    out["decode_call_s"][R] = statistics.median(times)
    out["decode_tokens_per_s"][R] = R * c.decode_steps / out["decode_call_s"][R]
    log(f"decode R={R}: {out['decode_tokens_per_s'][R]:.0f} tokens/s")
  rows, C = c.prefill_rows[-1], c.chunk_sizes[-1]
  pb = P.PrefillBatch.zeros(rows, C, 1)
  pb.pages_PxV[:, 0] = np.arange(rows)
  pb.n_valid_P[:] = C
  times = []
  for i in range(reps + 1):
    pb.start_P[:] = i * C
    t0 = time.perf_counter()
    cache, logits = sched._prefill(params, cache, pb)  # pylint: disable=protected-access
    jax.block_until_ready(logits)
    if i:
      times.append(time.perf_counter() - t0)
  out["prefill_tokens_per_s"] = rows * C / statistics.median(times)
  log(f"prefill {rows}x{C}: {out['prefill_tokens_per_s']:.0f} tokens/s")
  del cache
  if batch is not None:
    t0 = time.perf_counter()
    tr.learner.step(batch)
    wall = time.perf_counter() - t0
    out["learner_s_per_row"] = wall / max(batch.stats["rows_used"], 1.0)
    out["learner_tokens_per_s"] = batch.stats["real_tokens"] / wall
    log(f"learner: {out['learner_s_per_row']:.1f} s per row")
  return out


def learner_work(batch, query_block: int = 64) -> dict:
  """What the learner computes on a packed batch and what each saving cuts.

  lm_head_share: loss positions / packed tokens (the LM head runs on those only).
  attention_key_share: keys the segment-aware attention reads / keys a causal-only kernel reads
  (per query block of ``query_block``, from the first position of the segments it sees, a
  shared prefix included).
  shared_prefix_saved: the trajectories' tokens that shared prefixes did not put in the rows
  (the system prompt, a group's root prompt), and its share of the real tokens.
  """
  from rao_jax.kernels.segments import SUFFIX_BASE  # pylint: disable=g-import-not-at-top
  seg, mask = batch.segment_ids_BxT, batch.loss_mask_BxT
  real = int(batch.stats["real_tokens"])
  packed = int((seg != 0).sum())
  causal = segment_aware = 0
  for b in range(seg.shape[0]):
    row = seg[b]
    if not row.any():
      continue
    first = {}
    for i, v in enumerate(row):
      first.setdefault(int(v), i)
    for a in range(0, len(row), query_block):
      stop = min(len(row), a + query_block)
      k0 = a
      for v in map(int, row[a:stop]):
        k0 = min(k0, first[v], first.get(-(v // SUFFIX_BASE), k0) if v >= SUFFIX_BASE else k0)
      causal += sum(i + 1 for i in range(a, stop))
      segment_aware += sum(i + 1 - k0 for i in range(a, stop))
  saved = real - packed
  return {"real_tokens": real, "packed_tokens": packed, "loss_tokens": int(mask.sum()),
          "lm_head_share": float(mask.sum()) / max(packed, 1),
          "attention_key_share": segment_aware / max(causal, 1),
          "shared_prefix_saved": saved, "shared_prefix_share": saved / max(real, 1),
          "shared_prefix_units": int(batch.stats.get("shared_prefix_units", 0))}


def floor_of(line: dict, rates: dict) -> dict:
  from rao_jax.rollout.engine.config import bucket  # pylint: disable=g-import-not-at-top
  buckets = sorted(rates["decode_call_s"])
  decode = sum(v * rates["decode_call_s"][bucket(buckets, n)]
               for n, v in line["_decode_hist"].items())
  prefill = line["rollout"]["prefilled_tokens"] / rates["prefill_tokens_per_s"]
  learner = line["learner"]["rows_used"] * rates.get("learner_s_per_row", 0.0)
  rollout = decode + prefill
  return {"rollout_s": rollout, "decode_s": decode, "prefill_s": prefill, "learner_s": learner,
          "step_s": rollout + learner,
          "generated_tokens_per_s": line["rollout"]["generated_tokens"] / max(rollout, 1e-9),
          "rollout_vs_floor": line["rollout"]["wall_s"] / max(rollout, 1e-9)}


def plot(runs: dict, path: str, step: int) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  shown = [(k, r) for k, r in runs.items()
           if any(s["step"] == step and s.get("timeline") for s in r["steps"])]
  if not shown:
    return
  fig, axes = plt.subplots(len(shown), 1, figsize=(13, 4.5 * len(shown)), squeeze=False)
  span = 0.0
  for ax, (label, r) in zip(axes[:, 0], shown):
    s = next(s for s in r["steps"] if s["step"] == step)
    agents = sorted(s["timeline"], key=lambda a: (a["tree"], a["start"]))
    for y, a in enumerate(agents):
      color = f"C{a['depth']}"
      ax.plot([a["start"], a["end"]], [y, y], color=color, lw=1, alpha=0.4)
      for g0, g1 in a["generate"]:
        ax.plot([g0, g1], [y, y], color=color, lw=5, solid_capstyle="butt")
      for c0, c1 in a["cells"]:
        ax.plot([c0, c1], [y, y], color="0.25", lw=2, solid_capstyle="butt")
    l0, l1 = s["learner_window"]
    ax.barh(len(agents) + 1, l1 - l0, left=l0, height=1.5, color="C7")
    ax.text(l0, len(agents) + 2.5, f"learner {l1 - l0:.0f} s ({s['learner']['rows_used']:.0f} "
            f"rows)", fontsize=8)
    span = max(span, l1)
    for d in sorted({a["depth"] for a in agents}):
      ax.plot([], [], color=f"C{d}", lw=5, label=f"depth {d}: generating")
    ax.plot([], [], color="0.25", lw=2, label="in a sandbox cell")
    ax.plot([], [], color="0.5", lw=1, alpha=0.4, label="alive (waiting)")
    ax.set_ylabel("agents, by tree")
    ax.set_title(f"{label} ({r['commit']}): step {step}, rollouts {s['rollout']['wall_s']:.0f} s "
                 f"({s['rollout']['generated_tokens_per_s']:.0f} generated tokens/s), learner "
                 f"{s['learner']['wall_s']:.0f} s", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
  for ax in axes[:, 0]:
    ax.set_xlim(0, span * 1.02)
  axes[-1, 0].set_xlabel("seconds from the step's start")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv):
  del argv
  from experiments import recursion_evidence as rec  # pylint: disable=g-import-not-at-top
  if _STEPS.value < 1:
    raise app.UsageError(f"--steps={_STEPS.value}: must be >= 1 (the issue asks for 3).")
  s = dict(rec._SCALES[_SCALE.value])  # pylint: disable=protected-access
  root = os.path.abspath(_WORKDIR.value)
  t_all = time.time()
  sft_dir = warm_start(root, s)
  clock = CompileClock()
  config = rec.config_for("recursive", s)
  config.total_steps = _STEPS.value
  config.ckpt.init_from = sft_dir
  rl_dir = os.path.join(root, "bench_rl_step", _LABEL.value)
  if os.path.exists(rl_dir):
    shutil.rmtree(rl_dir)
  tr = make_trainer_class()(config, rl_dir, clock)
  t0 = time.perf_counter()
  result = tr.run()
  run_s = time.perf_counter() - t0
  row_len = int(config.learner.row_len)
  lines = [step_line(st, row_len) for st in tr.steps]
  last = next((st["trees"] for st in reversed(tr.steps)
               if st["m"].get("learner/update_applied", 1.0)), None)
  batch = tr.learner.prepare(last)[0] if last else None
  rates = measure_rates(tr, batch, int(config.rollout.max_cache_len))
  work = learner_work(batch) if batch is not None else {}
  log(f"learner work on the last batch: {json.dumps(work)}")
  steps_out = []
  for line in lines:
    line["floor"] = floor_of(line, rates)
    line["timeline"], line["learner_window"] = line.pop("_timeline"), line.pop("_learner_window")
    line["decode_calls_by_active"] = line.pop("_decode_hist")
    print(json.dumps({k: v for k, v in line.items() if k != "timeline"}), flush=True)
    steps_out.append(line)
  run = {"label": _LABEL.value, "commit": commit(), "cpu": cpu_name(),
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "settings": {k: s[k] for k in ("tasks_per_step", "group", "ctx", "slots", "budget",
                                        "max_depth", "max_new_tokens", "rl_temperature", "lr")},
         "trainer_init_s": tr.init_s, "run_s": run_s, "steps_done": result["step"],
         "remat": tr.learner.model_cfg.remat, "learner_work": work,
         "rates": rates, "steps": steps_out,
         "minutes": (time.time() - t_all) / 60}
  out = os.path.abspath(_BENCH_OUT.value)
  runs = {}
  if os.path.exists(out):
    with open(out) as f:
      runs = json.load(f).get("runs", {})
  runs[_LABEL.value] = run
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump({"benchmark": "bench_rl_step", "runs": runs}, f, indent=1)
  plot(runs, os.path.abspath(_PLOT.value), _PLOT_STEP.value)
  summary = {"benchmark": "bench_rl_step", "label": run["label"], "commit": run["commit"],
             "cpu": run["cpu"],
             "step_s": [x["step_s"] for x in steps_out],
             "rollout_s": [x["rollout"]["wall_s"] for x in steps_out],
             "learner_s": [x["learner"]["wall_s"] for x in steps_out],
             "generated_tokens_per_s": [x["rollout"]["generated_tokens_per_s"]
                                        for x in steps_out],
             "floor_generated_tokens_per_s": [x["floor"]["generated_tokens_per_s"]
                                              for x in steps_out],
             "occupancy": [x["rollout"]["occupancy"] for x in steps_out],
             "compile_s": [x["rollout"]["compile_s"] + x["learner"]["compile_s"]
                           for x in steps_out],
             "learner_real_tokens_per_s": [x["learner"]["real_tokens_per_s"] for x in steps_out],
             "floor_step_s": [x["floor"]["step_s"] for x in steps_out],
             "remat": run["remat"], "learner_work": work}
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  app.run(main)
