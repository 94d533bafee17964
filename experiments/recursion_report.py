"""The recursion experiment's result, written from the stages on disk (see recursion_evidence).

`report_from_disk` reads each stage's `stage.json` under the workdir and builds the result JSON:
held-out success before and after RL per mode, the paired difference per task, the comparison
with the single agent, the further held-out readings (`READINGS`), the RL runs set aside, and
where the time went. `report_plot` and `report_trees_page` draw it.
"""
import collections
import json
import os

from experiments import learning_evidence as le

STAGES = ("demos", "sft", "eval_before", "rl", "eval_after")

# Two further held-out readings of the recursive policy, before and after RL, never trained or
# tuned on: the paper's trained-on-medium, evaluated-on-hard claim at the same craft budget (hard
# trees need up to 6 levels below the root, so the tree limit is raised for them), and a world
# built from another seed (other recipes and items). Few tasks: a hard tree is ~37 agents, about
# 8x a medium tree's cost on this CPU.
READINGS = {
    "hard": dict(difficulty="hard", tasks=8,
                 overrides={"agent.max_depth": 8, "agent.max_live_agents": 128}),
    "other_world": dict(difficulty="medium", tasks=32, overrides={"env.kwargs.seed": 1}),
}


def _num_targets(tree) -> int | None:
  targets = (tree.root.task_fields or {}).get("target_items")
  return len(targets) if targets else None


def train_by_num_targets(rl_dir: str) -> list[dict]:
  """Per RL step, the sampled train trees' success by the number of their task's targets
  (the task mix's aim: the two-target tasks the warm start fails)."""
  from rao_jax.agent import records as R  # pylint: disable=g-import-not-at-top
  d = os.path.join(rl_dir, "trees")
  out = []
  for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
    if not name.endswith(".jsonl"):
      continue
    by = collections.defaultdict(list)
    for t in R.load_trees_jsonl(os.path.join(d, name)):
      by[str(_num_targets(t))].append(float((t.root.success or 0.0) >= 1.0))
    out.append({k: {"trees": len(v), "success": sum(v) / len(v)} for k, v in sorted(by.items())})
  return out


def summarize(raw: dict, root: str) -> dict:
  """The result's `modes` and `vs_single` from each mode's held-out evaluations.

  raw: {mode: {"before": eval result, "after": eval result or None (not run)}} where an eval
    result has `success`, `ci95` and `per_task` ({task_id: success}). Where the recursive
    `after` is None, `vs_single` compares its warm start and says so (`recursive_side`); where
    the single agent's `after` is None, its warm start (`single_side`).
  """
  modes = {}
  for mode, r in raw.items():
    b, a = r["before"], r["after"]
    m = {"before": b["success"], "before_ci95": b["ci95"], "after": a and a["success"],
         "after_ci95": a and a["ci95"], "n": len(b["per_task"])}
    if mode == "recursive":
      m["paired"] = a and le._paired(b["per_task"], a["per_task"])  # pylint: disable=protected-access
      shapes = {st: le.tree_shapes(os.path.join(root, mode, st, "trees.jsonl"))
                for st in ("eval_before", "eval_after")}
      # From the trees where they are on disk, else from the stage's own result (a warm start
      # restored from its committed records has no trees).
      m["delegating_share"] = {
          "before": (shapes["eval_before"] or b).get("delegating_share"),
          "after": (shapes["eval_after"] or a or {}).get("delegating_share")}
      m["success_by_num_targets"] = {
          "before": (shapes["eval_before"] or {}).get("success_by_num_targets"),
          "after": (shapes["eval_after"] or {}).get("success_by_num_targets")}
      m["delegation_by_outcome"] = {
          "before": (shapes["eval_before"] or {}).get("delegation_by_outcome"),
          "after": (shapes["eval_after"] or {}).get("delegation_by_outcome")}
      m["held_out_trees"] = shapes
    modes[mode] = m
  out = {"modes": modes}
  single = raw.get("single") or {}
  if "recursive" in raw and (single.get("after") or single.get("before")):
    rec = raw["recursive"]["after"] or raw["recursive"]["before"]
    sing = (single.get("after") or single["before"])["per_task"]
    common = sorted(set(rec["per_task"]) & set(sing))
    # Same held-out tasks, two policies: recursive minus single, paired per task.
    out["vs_single"] = {
        **le._paired({t: sing[t] for t in common},  # pylint: disable=protected-access
                      {t: rec["per_task"][t] for t in common}),
        "recursive_side": "after RL" if raw["recursive"]["after"] else
                          "warm start (the RL stage applied no update)",
        "single_side": "after RL" if single.get("after") else "warm start (its RL not run)"}
  return out


def plot(result: dict, root: str, difficulty: str, path: str) -> None:
  """learning_evidence's plot (training curves, held-out success before and after per mode)."""
  le.plot({"modes": {m: {difficulty: {
      "before": r["before"], "after": r["after"], "before_ci95": r["before_ci95"],
      "after_ci95": r["after_ci95"], "paired": r.get("paired") or {"n": r.get("n")}}}
      for m, r in result["modes"].items()}, "training": result.get("training", {})}, root, path)


def rl_attempts(root: str, mode: str) -> list[dict]:
  """RL runs of `mode` that were stopped and set aside (`rl_<why>_aborted` folders): what their
  steps measured, so a null result keeps its diagnosis."""
  out = []
  base = os.path.join(root, mode)
  for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
    if name.startswith("rl_") and name.endswith("_aborted"):
      with open(os.path.join(base, name, "config.json")) as f:
        temperature = json.load(f)["agent"]["temperature"]
      out.append({"folder": name, "why": name[len("rl_"):-len("_aborted")].replace("_", " "),
                  "temperature": temperature,
                  "steps": le.training_summary(os.path.join(base, name))})
  return out


def rl_minutes(rl_dir: str) -> float:
  """Minutes an RL run's steps took (their recorded step times plus warm-ups), from its
  metrics: a stopped and resumed run counted once."""
  from rao_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  path = os.path.join(rl_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0.0
  rows = [r for r in metrics_lib.read_metrics(path) if "train/time/step_s" in r]
  return sum(r["train/time/step_s"] + r.get("train/time/warmup_s", 0.0) for r in rows) / 60


def _marker(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def readings_from_disk(root: str, minutes: dict) -> dict:
  """Each reading's success before and after RL, paired per task (READINGS); adds the stages'
  minutes to `minutes`."""
  out = {}
  for name, r in READINGS.items():
    got = {}
    for which in ("before", "after"):
      stage = f"reading_{name}_{which}"
      m = _marker(os.path.join(root, "recursive", stage, "stage.json"))
      if m is not None:
        got[which] = m["result"]
        minutes[stage] = m.get("minutes", 0.0)
    if not got:
      continue
    shapes = {w: le.tree_shapes(os.path.join(root, "recursive", f"reading_{name}_{w}",
                                             "trees.jsonl")) for w in ("before", "after")}
    b, a = got.get("before"), got.get("after")
    out[name] = {
        "difficulty": r["difficulty"], "tasks": r["tasks"], "overrides": r["overrides"],
        "before": b and b["success"], "before_ci95": b and b["ci95"],
        "after": a and a["success"], "after_ci95": a and a["ci95"],
        "paired": (a and b) and le._paired(b["per_task"], a["per_task"]),  # pylint: disable=protected-access
        "delegating_share": {w: (shapes[w] or {}).get("delegating_share") for w in shapes},
        "nodes_mean": {w: (shapes[w] or {}).get("nodes_mean") for w in shapes},
        "success_by_num_targets": {w: (shapes[w] or {}).get("success_by_num_targets")
                                   for w in shapes}}
  return out


def report_from_disk(s: dict, root: str, modes, previous: dict | None = None) -> dict:
  """The result from the stages complete on disk (`--report_only`): `complete: false` and the
  missing stages when a mode has not finished. Where the recursive RL stage applied no update
  (every sampled tree failed, so no group had a signal), its policy after RL is the warm start:
  `vs_single` then compares the warm start with the single agent, and says so.

  previous: an earlier result JSON of this experiment: its set-aside RL attempts whose folders
  are gone are kept (marked `folder_kept: false`), so no attempt leaves the record.
  """
  raw, missing, minutes = {}, {}, {}
  for mode in modes:
    done = {}
    for stage in STAGES:
      out = _marker(os.path.join(root, mode, stage, "stage.json"))
      if out is not None:
        done[stage] = out["result"]
        minutes.setdefault(mode, {})[stage] = out.get("minutes", 0.0)
    if "rl" in done:
      # A stopped and resumed RL stage's marker times only its last invocation; the steps'
      # own times (and the engine's warm-up) are the stage's cost.
      spent = rl_minutes(os.path.join(root, mode, "rl"))
      minutes[mode]["rl"] = max(minutes[mode]["rl"], spent)
    missing[mode] = [x for x in STAGES if x not in done]
    if "eval_before" in done:
      raw[mode] = {"before": done["eval_before"][s["eval_diff"]],
                   "after": done.get("eval_after", {}).get(s["eval_diff"])}
  result = summarize(raw, root)
  if "recursive" in modes:
    result["readings"] = readings_from_disk(root, minutes.setdefault("recursive", {}))
  result.update({"complete": not any(missing.values()), "missing": missing,
                 "stage_minutes": minutes,
                 "minutes": sum(sum(v.values()) for v in minutes.values())})
  result["training"] = {m: le.training_summary(os.path.join(root, m, "rl")) for m in modes
                        if os.path.exists(os.path.join(root, m, "rl", "metrics.jsonl"))}
  result["training_by_num_targets"] = {m: train_by_num_targets(os.path.join(root, m, "rl"))
                                       for m in result["training"]}
  if "recursive" in result["modes"]:
    attempts = rl_attempts(root, "recursive")
    on_disk = {a["folder"] for a in attempts}
    prev_rec = (previous or {}).get("modes", {}).get("recursive", {})
    for a in prev_rec.get("rl_attempts") or []:
      if a.get("folder") not in on_disk:
        attempts.append({**a, "folder_kept": a.get("folder_kept", False)})
    # An earlier complete run under other settings is an attempt too: what it changed.
    if previous and previous.get("settings") not in (None, s) and prev_rec.get("after"):
      p = previous["settings"]
      name = f"rl_{previous.get('scale', 'earlier')}_lr{p.get('lr')}_{p.get('rl_steps')}_steps"
      if name not in {a.get("folder") for a in attempts}:
        attempts.append({
            "folder": name, "folder_kept": False,
            "why": (f"earlier run: {'LoRA' if p.get('lora_rank') else 'full'} lr {p.get('lr')}, "
                    f"{p.get('tasks_per_step', 0) * p.get('group', 0)} trees a step"),
            "temperature": p.get("rl_temperature"), "settings": p,
            "held_out": {k: prev_rec.get(k) for k in ("before", "after", "paired")},
            "steps": (previous.get("training") or {}).get("recursive", {})})
    result["modes"]["recursive"]["rl_attempts"] = attempts
  return result


def report_plot(result: dict, root: str, path: str) -> None:
  """Left: success and delegating share of each RL step's sampled (train) trees, per RL run
  (set-aside attempts included, labelled by temperature). Right: held-out greedy success, with
  95% intervals, of every stage that ran (a missing stage has no bar)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(14, 6.2),
                                 gridspec_kw={"width_ratios": [1, 1.6]})
  runs = [(f"{a['why']} (set aside)", a["steps"])
          for a in result["modes"].get("recursive", {}).get("rl_attempts", [])]
  for mode in result["modes"]:
    rl = os.path.join(root, mode, "rl")
    if os.path.exists(os.path.join(rl, "metrics.jsonl")):
      st = result.get("settings") or {}
      how = (f" ({'LoRA' if st.get('lora_rank') else 'full'} lr {st.get('lr')}, "
             f"{st.get('tasks_per_step', 0) * st.get('group', 0)} trees a step"
             f"{'' if st.get('rl_seed') is None else ', RL seed %d' % st['rl_seed']})"
             if mode == "recursive" and st else "")
      runs.append((f"{mode} RL{how}", le.training_summary(rl)))
  for label, tr in runs:
    ys = [y for y in tr.get("success", []) if y is not None]
    line, = ax0.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{label}: success")
    ds = [y for y in tr.get("delegating_share", []) if y is not None]
    if ds:
      ax0.plot(range(1, len(ds) + 1), ds, marker="x", ls="--", color=line.get_color(),
               label=f"{label}: delegating")
  ax0.set_xlabel("RL step")
  ax0.set_ylabel("sampled train trees")
  ax0.set_ylim(-0.02, 1.02)
  # Below both panels: the curves stay visible and the axes keep their width.
  fig.legend(*ax0.get_legend_handles_labels(), fontsize=7, loc="lower center", ncol=2)
  bars = []
  for mode, r in result["modes"].items():
    for stage in ("before", "after"):
      if r.get(stage) is not None:
        bars.append((f"{mode}\n{'warm start' if stage == 'before' else 'after RL'}",
                     r[stage], r.get(f"{stage}_ci95")))
  for name, r in (result.get("readings") or {}).items():
    for stage in ("before", "after"):
      if r.get(stage) is not None:
        bars.append((f"{name.replace('_', ' ')} ({r['tasks']})\n"
                     f"{'warm start' if stage == 'before' else 'after RL'}",
                     r[stage], r.get(f"{stage}_ci95")))
  caps = result.get("caps_success") or {}
  for key, label in (("recursive_program", "scripted\nrecursive"),
                     ("single_program", "scripted\nsingle")):
    if key in caps:
      bars.append((label, caps[key], None))
  for i, (label, y, ci) in enumerate(bars):
    err = [[y - ci[0]], [ci[1] - y]] if ci else None
    ax1.bar(i, y, 0.6, yerr=err, capsize=4, color="C0" if ci else "0.7")
    ax1.text(i, y + 0.03, f"{y:.2f}", ha="center")
  ax1.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
  n = next(iter(result["modes"].values()))["n"]
  ax1.set_ylabel(f"held-out greedy success, 95% CI\n({n} medium tasks unless named; grey: "
                 f"scripted, {caps.get('tasks', '?')} tasks)", fontsize=9)
  ax1.set_ylim(0, 1.05)
  fig.suptitle("TextCraft-Synth medium, 8 crafts per agent: SmolLM2-135M, recursive vs single")
  fig.tight_layout(rect=(0, 0.2, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def report_trees_page(root: str, modes, path: str, per_kind: int = 4) -> None:
  """Held-out trees of each mode's evaluations (before and, where it ran, after RL): solved
  and failed ones side by side."""
  from rao_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  from rao_jax.agent import records as R  # pylint: disable=g-import-not-at-top
  shown = []
  pages = [(mode, stage, f"{mode}, {label}") for mode in modes
           for stage, label in (("eval_before", "warm start"), ("eval_after", "after RL"))]
  if "recursive" in modes:
    pages += [("recursive", f"reading_{n}_{w}", f"{n.replace('_', ' ')}, "
               f"{'warm start' if w == 'before' else 'after RL'}")
              for n in READINGS for w in ("before", "after")]
  for mode, stage, label in pages:
    f = os.path.join(root, mode, stage, "trees.jsonl")
    if not os.path.exists(f):
      continue
    trees = R.load_trees_jsonl(f)
    for kind, keep in (("solved", True), ("failed", False)):
      for t in [t for t in trees if bool(t.root.success) == keep][:per_kind]:
        t.tree_id = f"[{label}, {kind}] {t.tree_id}"
        shown.append(t)
  metrics_lib.write_html(shown, path, title="Held-out trees: TextCraft-Synth at a craft budget "
                         "of 8 per agent (medium, then the further readings)")


def bar(result: dict) -> dict | None:
  """The bar a run is held to, item by item (None until the recursive evaluations are done):
  recursive after RL beats its warm start and the single agent (paired 95% intervals above 0),
  delegates on at least the warm start's share of held-out tasks, all within 3 hours."""
  rec = result["modes"].get("recursive") or {}
  paired, vs = rec.get("paired"), result.get("vs_single")
  share = rec.get("delegating_share") or {}
  if not paired or share.get("after") is None:
    return None
  above = lambda p: bool(p) and bool(p["ci95"][0] > 0)  # noqa: E731  (numpy floats in)
  return {"beats_warm_start": above(paired),
          "beats_single": above(vs) and (vs or {}).get("recursive_side") == "after RL",
          "delegating_share_kept": bool(share["after"] >= share["before"]),
          "within_3_hours": bool(result["minutes"] <= 180)}


def replication(path: str) -> dict:
  """The held-out figures of another run of this experiment from the same warm start with
  another `--rl_seed` (its result JSON at `path`), for the main result's `replications`."""
  r = _marker(path)
  if r is None:
    raise FileNotFoundError(f"{path}: no result JSON of a replication run (run the experiment "
                            "with --rl_seed and --out first)")
  rec = r["modes"]["recursive"]
  return {"file": os.path.relpath(path), "rl_seed": (r.get("settings") or {}).get("rl_seed"),
          "complete": r.get("complete"), "minutes": r.get("minutes"),
          "after": rec.get("after"), "after_ci95": rec.get("after_ci95"),
          "paired": rec.get("paired"), "vs_single": r.get("vs_single"),
          "delegating_share": rec.get("delegating_share"),
          "success_by_num_targets": (rec.get("success_by_num_targets") or {}).get("after"),
          "delegation_by_outcome": (rec.get("delegation_by_outcome") or {}).get("after"),
          "readings_after": {k: v.get("after") for k, v in (r.get("readings") or {}).items()},
          "bar": r.get("bar")}


def write_report(scale: str, s: dict, root: str, modes, out: str, replications=()) -> dict:
  """The result JSON at `out` from the stages on disk, with its plot and trees page beside it.
  Set-aside attempts recorded in an earlier `out` are carried over; `replications` are result
  JSONs of runs with another `--rl_seed` from the same warm start (see `replication`)."""
  previous = _marker(out)
  result = {"scale": scale, "settings": s, **report_from_disk(s, root, modes, previous)}
  caps = _marker(os.path.join(root, "caps", "stage.json"))
  if caps is not None:
    result["caps"] = caps["result"]["verdict"]
    result["caps_success"] = {
        "tasks": caps["result"]["tasks"],
        **{k: v["success"] for k, v in caps["result"]["policies"].items()},
        "single_agent_upper_bound": caps["result"]["single_agent_upper_bound"]["success"]}
    result["minutes"] += caps["minutes"]
  result["bar"] = bar(result)
  if replications:
    result["replications"] = [replication(p) for p in replications]
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out + ".tmp", "w") as f:
    json.dump(result, f, indent=2)
  os.replace(out + ".tmp", out)
  stem = os.path.splitext(out)[0]
  report_plot(result, root, stem + ".png")
  report_trees_page(root, list(result["modes"]), stem + "_trees.html")
  return result
