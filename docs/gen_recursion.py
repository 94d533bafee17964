"""The recursion experiment's generated blocks (docs/results/recursion.md and the README's
headline): the paper's-baseline runs, the recipe choice, the corrected method's seeds and their
held-out readings, the setup, training and tree pages, from `benchmarks/results/`.
"""
from __future__ import annotations

import glob
import json
import os

import gen_common as C
from gen_common import ROOT, count, delta_ci, frac, load_json, rel, signed


RECURSION_CMD = "python -m experiments.recursion_evidence --scale=cpu_lora --workdir=runs/recursion"
SEEDS_CMD = ("python -m experiments.recursion_evidence --scale=cpu_rao_seeds --rl_seed=0 "
             "--share_stages_from=runs/rao/warm --workdir=runs/rao/seed0")


def recursion_runs() -> list[dict]:
  """The completed single-seed recursion runs (the paper's baseline), seed 0 first."""
  runs = []
  for name in sorted(glob.glob(os.path.join(C.RESULTS, "recursion_evidence*.json"))):
    d = load_json(os.path.basename(name))
    if not d or "modes" not in d or not d.get("complete"):
      continue
    runs.append({"file": os.path.relpath(name, ROOT),
                 "seed": d["settings"].get("rl_seed", 0), "data": d})
  return sorted(runs, key=lambda r: r["seed"])


def n_of(v) -> int:
  """How many seeds: recursion_seeds.json lists them (improved: [0, 2]); a count is read too."""
  return len(v) if isinstance(v, list) else int(v)


def seeds_summary(seeds: dict) -> str:
  """One sentence over `recursion_seeds.json` (the five-seed replication)."""
  rows = seeds.get("seeds", [])
  a = seeds.get("across_seeds")
  text = f"{len(rows)} RL seed{'s' if len(rows) != 1 else ''} of the fixed recipe"
  if a:
    lo, hi = a["ci95"]
    text += (f": mean paired effect {signed(a['mean_delta'])} [{lo:.2f}, {hi:.2f}] "
             f"(IQM {signed(a['iqm_delta'])}), {n_of(a['improved'])} of {len(rows)} seeds "
             f"improved, {n_of(a['worse_significant'])} significantly worse")
  return text


def gen_recursion_headline(page: str) -> str:
  """The results' first line (README, results pages): the seeds, whatever they show."""
  runs = recursion_runs()
  parts = []
  for r in runs:
    m = r["data"]["modes"]["recursive"]
    parts.append(f"seed {r['seed']}: {count(m['before'], m['n'])}/{m['n']} -> "
                 f"{count(m['after'], m['n'])}/{m['n']}")
  seeds = load_json("recursion_seeds.json")
  page_link = rel("docs/results/recursion.md", page)
  details = "" if page == "docs/results/recursion.md" else f" ([details]({page_link}))"
  task = ("RAO on a recursion task one agent cannot finish (SmolLM2-135M, held-out "
          "TextCraft-Synth tasks)")
  first = "With the paper's baseline, " + ", ".join(parts) + " from the same warm start."
  a = (seeds or {}).get("across_seeds")
  if seeds and seeds.get("seeds"):
    rows = seeds["seeds"]
    if a and len(rows) >= 5:
      cleared = (a["ci95"][0] > 0 and n_of(a["improved"]) >= 4
                 and n_of(a["worse_significant"]) == 0)
      verdict = ("improves held-out success over five RL seeds" if cleared else
                 "does not clear its bar over five RL seeds")
    else:
      verdict = f"is being replicated ({len(rows)} of 5 RL seeds in)"
    return (f"**{task} {verdict}.** With the corrected credit assignment: "
            f"{seeds_summary(seeds)}. {first}{details}")
  warm = warm_start_reading("recursive")
  warm = (f". With today's prompts the warm start already solves {count(warm[0], warm[1])}/"
          f"{warm[1]} before RL" if warm else "")
  return (f"**{task} is not settled yet.** {first} The credit assignment has been corrected (a "
          "baseline on the reward's scale, no update from groups without signal), a recipe "
          "chosen on train tasks, and five RL seeds are running; until they land, read no gain "
          f"into it{warm}{details}.")


def gen_recursion_runs(page: str) -> str:
  """Per-run table of the recursion experiment's completed seeds."""
  out = ["| RL seed | warm start | after RL | paired effect | better / worse | delegating "
         "trees | vs. single agent | file |",
         "|---|---|---|---|---|---|---|---|"]
  for r in recursion_runs():
    m = r["data"]["modes"]["recursive"]
    n = m["n"]
    share = m["delegating_share"]
    p = m["paired"]
    out.append(f"| {r['seed']} | {frac(m['before'], n)} | {frac(m['after'], n)} | "
               f"{delta_ci(p)} | {p['improved']} / {p['worsened']} | "
               f"{count(share['before'], n)} -> {count(share['after'], n)} | "
               f"{delta_ci(r['data']['vs_single'])} | "
               f"[{os.path.basename(r['file'])}]({rel(r['file'], page)}) |")
  single = recursion_runs()[0]["data"]["modes"]["single"] if recursion_runs() else None
  if single:
    out.append("")
    out.append(f"The single agent at the same budget, after its own RL: "
               f"{frac(single['after'], single['n'])}.")
  return "\n".join(out)


def gen_recursion_recipe(page: str) -> str:
  """The recipe candidates on the validation split (train tasks), and the choice."""
  rec = load_json("recursion_recipe.json")
  if not rec or not rec.get("candidates"):
    return ("No recipe candidate has run yet: this table fills from "
            "`benchmarks/results/recursion_recipe.json`.")
  n = rec["val_tasks"]
  v0 = rec.get("val_before")
  out = [f"The warm start solves {'?' if v0 is None else frac(v0, n)} of the {n} validation "
         "tasks (step 0 of each curve).", "",
         "| candidate | recipe | validation success per step | best step | drifting | agents at "
         "the depth limit (mean) | minutes |", "|---|---|---|---|---|---|---|"]
  for name, c in rec["candidates"].items():
    recipe = ", ".join(f"{k}={v}" for k, v in c["recipe"].items())
    vals = [f"{count(v, n)}/{n}" if v is not None else "-" for v in c["curves"]["val"]]
    sc = c["score"]
    if not c["complete"]:
      total = c["recipe"].get("rl_steps", rec["scale"].get("rl_steps"))
      state = f"{len(vals)} of {total} steps done" if vals else "not run yet"
      out.append(f"| {name} | {recipe} | {', '.join(vals) or '-'} | {state} | | | |")
      continue
    drift = "yes" if sc["drifting"] else "no"
    out.append(f"| {name} | {recipe} | {', '.join(vals)} | {sc['best_step']} | {drift} | "
               f"{sc.get('at_depth_limit_mean', 0.0):.2f} | {c['minutes']:.0f} |")
  chosen = rec.get("chosen")
  out += ["", f"Chosen: **{chosen}**." if chosen else "No recipe is chosen yet.",
          "", f"The rule, fixed before any candidate ran: {rec['rule']}"]
  if rec.get("notes"):
    out += ["", "Notes from the run:", ""] + [f"- {n}" for n in rec["notes"]]
  return "\n".join(out)


def gen_recursion_seeds(page: str) -> str:
  """The five-seed replication's table, or what is missing."""
  seeds = load_json("recursion_seeds.json")
  if not seeds or not seeds.get("seeds"):
    return ("No seed of the corrected method has finished yet: this table fills from "
            "`benchmarks/results/recursion_seeds.json` when the first one lands."
            + warm_start_readings(page))
  # The warm start's weights by seed: its records per CPU kind differ (docs: Reproduce).
  weights = {src["rl_seed"]: src.get("warm_sha256") for src in seeds.get("sources", [])}
  out = ["| RL seed | warm start (weights) | after RL | paired effect | delegating trees | "
         "vs. single agent | minutes |", "|---|---|---|---|---|---|---|"]
  for s in seeds["seeds"]:
    n = s["paired"]["n"]
    share = s["delegating_share"]
    fp = weights.get(s["rl_seed"])
    warm = frac(s["before"], n) + (f" (`{fp[:8]}`)" if fp else "")
    out.append(f"| {s['rl_seed']} | {warm} | {frac(s['after'], n)} | "
               f"{delta_ci(s['paired'])} | {count(share['before'], n)} -> "
               f"{count(share['after'], n)} | {delta_ci(s['vs_single'])} | "
               f"{s['minutes']:.0f} |")
  out += ["", seeds_summary(seeds) + "."]
  return "\n".join(out)


def warm_start_reading(mode: str) -> tuple[float, int, str, str] | None:
  """(success, tasks, difficulty, stage path) of the seeds' shared warm start on the held-out
  tasks in `mode`, from its committed stage result; None when it is not there."""
  path = os.path.join(C.RESULTS, "recursion_runs", "warm", mode, "eval_before", "stage.json")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    (diff, r), = json.load(f)["result"].items()
  return r["success"], r["num_tasks"], diff, os.path.relpath(path, ROOT)


def warm_start_readings(page: str) -> str:
  """The seeds' shared warm start on the held-out tasks while no seed has landed ("" when its
  stage results are not committed)."""
  out = []
  for mode, who in (("recursive", "the recursive warm start"), ("single", "the single agent")):
    r = warm_start_reading(mode)
    if r is None:
      return ""
    out.append(f"{who} solves {frac(r[0], r[1])} of the held-out {r[2]} tasks "
               f"([stage]({rel(r[3], page)}))")
  return (" Before RL, with today's prompts (the task in the REPL, no helper offered at the "
          f"depth limit), {out[0]}, {out[1]}.")


def gen_recursion_readings(page: str) -> str:
  """The further held-out readings (another world, hard tasks) of each run."""
  out = ["| RL seed | reading | tasks | warm start | after RL | paired effect |",
         "|---|---|---|---|---|---|"]
  for r in recursion_runs():
    for name, rd in sorted(r["data"].get("readings", {}).items()):
      n = rd["tasks"]
      after = frac(rd["after"], n) if rd.get("after") is not None else "not run"
      paired = delta_ci(rd["paired"]) if rd.get("paired") else ""
      out.append(f"| {r['seed']} | {name.replace('_', ' ')} | {n} | {frac(rd['before'], n)} | "
                 f"{after} | {paired} |")
  return "\n".join(out)


def seed_results() -> list[tuple[int, str, dict]]:
  """(RL seed, result path, result) of each corrected-method seed whose report is committed
  (recursion_runs/seedK/result.json), by seed."""
  out = []
  for path in glob.glob(os.path.join(C.RESULTS, "recursion_runs", "seed*", "result.json")):
    with open(path, encoding="utf-8") as f:
      d = json.load(f)
    out.append((int(d["settings"].get("rl_seed", 0)), os.path.relpath(path, ROOT), d))
  return sorted(out, key=lambda x: x[0])


def gen_recursion_seed_readings(page: str) -> str:
  """The corrected method's seeds on the further held-out readings (hard tasks, another world),
  before and after RL, from each seed's report."""
  out = ["| RL seed | reading | tasks | warm start | after RL | paired effect |",
         "|---|---|---|---|---|---|"]
  for seed, path, d in seed_results():
    for name, rd in sorted(d.get("readings", {}).items()):
      n = rd["tasks"]
      after = frac(rd["after"], n) if rd.get("after") is not None else "not taken"
      paired = delta_ci(rd["paired"]) if rd.get("paired") else ""
      out.append(f"| [{seed}]({rel(path, page)}) | {name.replace('_', ' ')} | {n} | "
                 f"{frac(rd['before'], n)} | {after} | {paired} |")
  if len(out) == 2:
    return "No seed of the corrected method has taken its readings yet."
  return "\n".join(out)


def gen_recursion_setup(page: str) -> str:
  """The recipe of the completed runs and the scripted caps the results are read against."""
  runs = recursion_runs()
  if not runs:
    return "No completed recursion run is committed yet."
  st, caps = runs[0]["data"]["settings"], runs[0]["data"]["caps_success"]
  return (f"TextCraft-Synth {st['eval_diff']} tasks with a budget of {st['budget']} `craft` calls "
          f"per agent and a recursion depth limit of {st['max_depth']}. On {caps['tasks']} "
          f"held-out tasks the scripted recursive policy solves "
          f"{count(caps['recursive_program'], caps['tasks'])}, the best single agent "
          f"{count(caps['single_agent_upper_bound'], caps['tasks'])} (the tasks whose whole "
          f"recipe tree fits one budget). SmolLM2-135M-Instruct is warm-started for "
          f"{st['sft_steps']} supervised steps on scripted trees, then trained for "
          f"{st['rl_steps']} RL steps of {st['tasks_per_step']} tasks x {st['group']} trees "
          f"(a rank-{st['lora_rank']} LoRA adapter at lr {st['lr']:g}, temperature "
          f"{st['rl_temperature']}"
          + (f", lambda {st['lam']}" if "lam" in st else "")
          + (f", train tasks weighted `{st['task_weights']}`" if st.get("task_weights") else "")
          + "), and "
          f"evaluated greedy on the same {st['eval_tasks']} held-out tasks before and after, "
          f"in a {st['ctx']}-token window per agent.")


def gen_recursion_training(page: str) -> str:
  """Per RL step of each run: sampled success, and the share of groups with no signal."""
  out = ["| RL seed | sampled success per step | groups with all-equal rewards per step |",
         "|---|---|---|"]
  for r in recursion_runs():
    t = r["data"]["training"]["recursive"]
    out.append(f"| {r['seed']} | " + ", ".join(f"{x:.2f}" for x in t["success"]) + " | "
               + ", ".join(f"{x:.2f}" for x in t["rl/groups_all_equal_frac"]) + " |")
  return "\n".join(out)


def gen_recursion_trees(page: str) -> str:
  """The held-out trees' shape: agents per tree and success of the agents at each depth."""
  out = ["| RL seed | policy | agents a tree | success by depth (agents at that depth) |",
         "|---|---|---|---|"]
  first = True
  for r in recursion_runs():
    h = r["data"]["modes"]["recursive"].get("held_out_trees", {})
    for label, key in (("warm start", "eval_before"), ("after RL", "eval_after")):
      if key not in h or (key == "eval_before" and not first):
        continue
      t = h[key]
      depths = ", ".join(f"{d}: {v['success']:.2f} ({v['nodes']})"
                         for d, v in sorted(t["success_by_depth"].items(), key=lambda kv: int(kv[0])))
      seed = "-" if key == "eval_before" else str(r["seed"])
      out.append(f"| {seed} | {label} | {t['nodes_mean']:.1f} | {depths} |")
    first = False
  return "\n".join(out)
