"""Writes the generated parts of the documentation from the code and the committed results.

  python docs/gen_docs.py           # rewrite docs/config.md, docs/api.md and every generated block
  python docs/gen_docs.py --check   # exit 1, naming the stale files, if anything would change

Generated, so that a page cannot drift from what it describes (the two reference pages are
rendered by `docs/gen_reference.py`, the recursion experiment's blocks by
`docs/gen_recursion.py`, the rest here; `docs/gen_common.py` holds what they share):
- `docs/config.md`: every field of `experiments/configs/base.py:base_config()` with its default,
  its valid values and the comment beside it in the source, the embedded engine's fields
  (`EngineConfig`'s docstring) and the shipped experiment configs.
- `docs/api.md`: the public entry points' signatures and docstrings, read with `ast` (no import
  of JAX, so it runs in a second).
- blocks between `<!-- gen:NAME -->` and `<!-- /gen:NAME -->` in any Markdown page: tables and
  sentences whose figures come from `benchmarks/results/*.json` (a rerun rewrites its JSON; this
  script then rewrites the pages that quote it).

Success rates of n tasks are shown as k/n with a Wilson 95% interval, which stays inside [0, 1]
however small n is (the normal approximation gives [-0.48, 1.48] on two tasks).
"""
from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import json
import os
import re
import sys
from typing import Any, Callable

# This script runs by path (and tests load it by path): its folder, with the shared helpers, the
# reference pages' renderer and the recursion experiment's blocks, is put on the path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=wrong-import-position
import gen_common as C  # noqa: E402
from gen_common import ROOT, count, delta_ci, load_json, rel, signed  # noqa: E402
from gen_recursion import (RECURSION_CMD, SEEDS_CMD, gen_recursion_headline,  # noqa: E402
                           gen_recursion_readings, gen_recursion_recipe, gen_recursion_runs,
                           gen_recursion_seed_readings, gen_recursion_seeds,
                           gen_recursion_setup, gen_recursion_training, gen_recursion_trees,
                           recursion_runs, seeds_summary)
from gen_reference import gen_api_md, gen_config_md, md_cell  # noqa: E402
# pylint: enable=wrong-import-position


# ------------------------------------------------------------------------- ablation results


def gen_ablation_main(page: str) -> str:
  """Full RAO against the lr=0 control on both micro-tasks, from both runs."""
  out = ["| run | task | seeds | RAO success | lr=0 control | RAO delegating | control "
         "delegating |", "|---|---|---|---|---|---|---|"]
  for label, name in (("first", "rao_ablations.json"), ("rerun", "rao_ablations_rerun.json")):
    d = load_json(name)
    if not d:
      continue
    for task, t in sorted(d["tasks"].items()):
      rao, ctl = t["variants"]["rao"], t["variants"]["control"]
      cell = lambda v, key: "{:.2f} [{:.2f}, {:.2f}]".format(v[key]["mean"], *v[key]["ci95"])
      out.append(f"| {label} | {task.replace('_', '-')} | {len(rao['seeds'])} | "
                 f"{cell(rao, 'success')} | {cell(ctl, 'success')} | "
                 f"{cell(rao, 'delegating')} | {cell(ctl, 'delegating')} |")
  return "\n".join(out)


def gen_ablation_claims(page: str) -> str:
  """Each ablation's claim, its source, and the verdict of each run (paired by seed)."""
  runs = [(label, load_json(name)) for label, name in
          (("first", "rao_ablations.json"), ("rerun", "rao_ablations_rerun.json"))]
  runs = [(label, d) for label, d in runs if d]
  out = ["| task | variant | claim (source) | " + " | ".join(
      f"{label}: effect vs. RAO, verdict" for label, _ in runs) + " |",
         "|---|---|---|" + "---|" * len(runs)]
  first = runs[0][1]
  for task, t in sorted(first["tasks"].items()):
    for variant, c in t["claims"].items():
      for metric in c["metrics"]:
        cells = []
        for _, d in runs:
          m = d["tasks"].get(task, {}).get("claims", {}).get(variant, {}).get("metrics", {})
          m = m.get(metric)
          cells.append(f"{metric} {delta_ci(m)}, {m['verdict']}" if m else "not run")
        out.append(f"| {task.replace('_', '-')} | {variant} | {c['claim']} ({c['source']}) | "
                   + " | ".join(cells) + " |")
  return "\n".join(out)


def gen_ablation_baseline_scale(page: str) -> str:
  """The paper's baseline against the library's default on the deep task, with the control."""
  d = load_json("rao_ablations_baseline_scale.json")
  if not d:
    return "Not run yet: `python benchmarks/bench_rao_ablations.py --only=baseline_scale`."
  if d.get("valid") is False:
    return f"The committed run is invalid: {d.get('invalid_because', '')}"
  ci = lambda v: "{:.2f} [{:.2f}, {:.2f}]".format(v["mean"], *v["ci95"])
  out = [f"Deep task, {d['seeds']} seeds, {d['steps']} RL steps, {d['cpu']}.", "",
         "| arm | baseline, equal groups | held-out (greedy) | train success (sampled) | "
         "delegating | steps without update |", "|---|---|---|---|---|---|"]
  for name, a in d["arms"].items():
    o = a["overrides"]
    credit = (f"{o.get('rl.baseline')}, {'dropped' if o.get('rl.drop_equal_groups') else 'kept'}"
              + (", lr 0" if o.get("optim.lr") == 0.0 else "")
              + (f", lambda {o['rl.lam']:g}" if "rl.lam" in o else ""))
    out.append(f"| {name} | {credit} | {ci(a['held_out'])} | {ci(a['train_success'])} | "
               f"{ci(a['delegating'])} | {a['steps_without_update']['mean']:.1f} |")
  out += ["", "| pair | held-out difference | significant |", "|---|---|---|"]
  for lam, p in d["paired"].items():
    h = p["held_out"]
    out.append(f"| {p['default_minus_paper']} ({lam}) | {delta_ci(h)} | "
               f"{'yes' if h['significant'] else 'no'} |")
  for pair, p in d["vs_reference"].items():
    h = p["held_out"]
    out.append(f"| {pair} | {delta_ci(h)} | {'yes' if h['significant'] else 'no'} |")
  out += ["", f"Reading: {d['notes'][-1]}", "", f"Machine: {d['note']}"]
  return "\n".join(out)


# ------------------------------------------------------------------- README's results table


def gen_results_table(page: str) -> str:
  """One row per claim: the figure, the command, the page."""
  rows = []
  runs = recursion_runs()
  if runs:
    figs = []
    for r in runs:
      m = r["data"]["modes"]["recursive"]
      figs.append(f"seed {r['seed']}: {count(m['before'], m['n'])}/{m['n']} -> "
                  f"{count(m['after'], m['n'])}/{m['n']}")
    seeds = load_json("recursion_seeds.json") or {}
    if seeds.get("seeds"):
      # The corrected method's seeds lead; the paper-baseline runs follow them.
      n = len(seeds["seeds"])
      status = "" if seeds.get("complete") else f"; {n} of 5 seeds in"
      fig = (f"{seeds_summary(seeds)}{status} (paper's baseline: {'; '.join(figs)})")
      rows.append(("RL improves a recursive SmolLM2-135M where one agent cannot finish", fig,
                   f"`{SEEDS_CMD}`", "docs/results/recursion.md"))
    else:
      rows.append(("RL improves a recursive SmolLM2-135M where one agent cannot finish",
                   "; ".join(figs) + " (not settled)", f"`{RECURSION_CMD}`",
                   "docs/results/recursion.md"))
  abl = load_json("rao_ablations.json")
  if abl:
    rao = abl["tasks"]["two_digit"]["variants"]
    rows.append(("RAO teaches delegation where one agent cannot answer",
                 "success {:.2f} vs. {:.2f} (lr=0), delegating {:.2f} vs. {:.2f}".format(
                     rao["rao"]["success"]["mean"], rao["control"]["success"]["mean"],
                     rao["rao"]["delegating"]["mean"], rao["control"]["delegating"]["mean"]),
                 "`python benchmarks/bench_rao_ablations.py`", "docs/results/ablations.md"))
    deep = abl["tasks"]["deep"]["vs_rao"]
    rows.append(("Dense per-node rewards and per-node advantages beat coarser credit",
                 "root-only rewards {}, per-tree advantages {} (success, deep task)".format(
                     signed(deep["root_reward"]["success"]["delta"]),
                     signed(deep["tree_advantage"]["success"]["delta"])),
                 "`python benchmarks/bench_rao_ablations.py`", "docs/results/ablations.md"))
  model = load_json("bench_model.json")
  learner = load_json("bench_learner.json")
  if model and learner:
    rows.append(("Training speed on CPU against transformers on PyTorch",
                 f"forward + backward {model['ratio']:.2f}x, RAO learner step "
                 f"{learner['ratio']:.2f}x",
                 "`python benchmarks/bench_model.py`", "docs/benchmarks.md"))
  out = ["| claim | figure | reproduce | page |", "|---|---|---|---|"]
  for claim, fig, cmd, target in rows:
    out.append(f"| {claim} | {fig} | {cmd} | [page]({rel(target, page)}) |")
  return "\n".join(out)


def gen_speed_table(page: str) -> str:
  """Ours against the strongest peer, and against the measured peak of the CPU each ran on."""
  peak, model = load_json("bench_peak.json"), load_json("bench_model.json")
  learner, rollout = load_json("bench_learner.json"), load_json("bench_rollout.json")
  sandbox = load_json("bench_sandbox.json")
  out = ["| benchmark | ours | peer (as its users run it) | ratio | ours, share of peak | CPU |",
         "|---|---|---|---|---|---|"]
  cpu = lambda d: d.get("cpu", "not recorded")  # noqa: E731
  if peak:
    out.append(f"| `bench_peak` | best float32 GEMM {peak['peak_gflops']:.1f} GFLOP/s "
               f"({peak['peak_gemm_by']}), memory {peak['peak_gbps']:.1f} GB/s "
               f"({peak['peak_bandwidth_by']}) | | | | {cpu(peak)} |")
  if model:
    out.append(f"| `bench_model` forward + backward, {model['batch']} x {model['seq']} | "
               f"{model['ours_tokens_per_s']:.0f} tokens/s | transformers on PyTorch: "
               f"{model['peer_tokens_per_s']:.0f} | **{model['ratio']:.2f}x** | "
               f"{model['share_of_peak_gemm']:.0%} of the GEMM peak | {cpu(model)} |")
  if learner:
    out.append(f"| `bench_learner` RAO step + AdamW, {learner['rows']} x {learner['row_len']} | "
               f"{learner['ours_tokens_per_s']:.0f} tokens/s | PyTorch, same rows: "
               f"{learner['peer_tokens_per_s']:.0f} | **{learner['ratio']:.2f}x** | "
               f"{learner['share_of_peak_gemm']:.0%} | {cpu(learner)} |")
  if rollout:
    bs = (1, 8, 32)
    out.append("| `bench_rollout` decode, batch " + " / ".join(map(str, bs)) + " | "
               + " / ".join(f"{rollout[f'embedded_tok_s_b{b}']:.0f}" for b in bs)
               + " tokens/s | `generate()`: "
               + " / ".join(f"{rollout[f'torch_tok_s_b{b}']:.0f}" for b in bs) + " | **"
               + " / ".join(f"{rollout[f'ratio_b{b}']:.2f}" for b in bs) + "x** | bandwidth "
               + " / ".join(f"{rollout[f'share_of_peak_bandwidth_b{b}']:.0%}" for b in bs)
               + f" | {cpu(rollout)} |")
  if sandbox:
    out.append(f"| `bench_sandbox` cold spawn / cell round trip (p50) | "
               f"{sandbox['spawn_ms_p50']:.1f} / {sandbox['exec_ms_p50']:.2f} ms | no jail "
               f"(`isolation=\"process\"`): {sandbox['peer_process_spawn_ms_p50']:.1f} / "
               f"{sandbox['peer_process_exec_ms_p50']:.2f} ms | "
               f"{sandbox['spawn_vs_process_mode']:.2f} / {sandbox['exec_vs_process_mode']:.2f} "
               f"(time) | | {cpu(sandbox)} |")
  out += ["", "Each row is the newest run of its benchmark, on the 2-core CPU it names, the peer in "
          "the same run in alternating rounds; a share of peak is against that CPU's own "
          "`bench_peak` line. Rows run before the vector instruction sets were recorded name the "
          "model only, and a VM names EPYC generations about 2x apart here alike (\"AMD EPYC\"): "
          "only ratios compare across rows."]
  return "\n".join(out)


def gen_memory_plan(page: str) -> str:
  """The train step's memory per device at real sizes, full fine-tuning beside LoRA."""
  d = load_json("bench_memory_plan.json")
  if not d:
    return "`benchmarks/results/bench_memory_plan.json` is missing: run `benchmarks/bench_memory_plan.py`."
  chips = list(d["chips_gb"])
  lora = {(r["model"], r["T"], r["remat"]): r for r in d["rows"] if r["lora_rank"]}
  mesh = " x ".join(f"{k}={v}" for k, v in d["mesh"].items())
  out = [f"GB per device on a {mesh} mesh, one row of T tokens per device, {d['dtype']}; "
         f"fits = within {d['headroom']:.0%} of the chip ("
         + ", ".join(f"{c} {g:.0f} GB" for c, g in d["chips_gb"].items()) + ").", "",
         "| model | T | remat | params + moments | grads | activations | total | LoRA total | "
         + " | ".join(f"fits {c}" for c in chips) + " |",
         "|---|---|---|---|---|---|---|---|" + "---|" * len(chips)]
  for r in d["rows"]:
    if r["lora_rank"]:
      continue
    twin = lora.get((r["model"], r["T"], r["remat"]))
    out.append(f"| {r['model']} ({r['params_b']:.2f} B) | {r['T']} | {r['remat']} | "
               f"{r['params_gb'] + r['optimizer_gb']:.1f} | {r['gradients_gb']:.1f} | "
               f"{r['activations_gb']:.1f} | {r['total_gb']:.1f} | "
               f"{twin['total_gb']:.1f} | " if twin else "| | ")
    out[-1] += " | ".join("yes" if r[f"fits_{c}"] else "no" for c in chips) + " |"
  return "\n".join(out)


def gen_engine_memory_plan(page: str) -> str:
  """Rows the embedded engine's KV cache holds on one chip: a fixed window against paged."""
  d = load_json("bench_memory_plan.engine.json")
  if not d:
    return ("`benchmarks/results/bench_memory_plan.engine.json` is missing: run "
            "`benchmarks/bench_memory_plan.py --engine`.")
  chips = list(d["chips_gb"])
  out = [f"Rows held at once, {d['dtype']}, the engine alone on the chip, {d['headroom']:.0%} "
         f"of it less the weights and a prefill call's gathered view; each cell: a fixed window "
         f"of the whole context / paged at the TextCraft evaluation's mean context / paged at "
         f"half the context (pages of {d['page_size']} slots). Arithmetic, not a measurement: "
         "`benchmarks/bench_memory_plan.py --engine`.", "",
         "| model | context | weights | " + " | ".join(c.replace("_", " ") for c in chips)
         + " |", "|---|---|---|" + "---|" * len(chips)]
  by = {(r["model"], r["context"], r["chip"]): r for r in d["rows"]}
  for model, ctx in dict.fromkeys((r["model"], r["context"]) for r in d["rows"]):
    cells = [f"{by[model, ctx, c]['fixed_window_rows']} / "
             f"{by[model, ctx, c]['paged_rows_textcraft']} / "
             f"{by[model, ctx, c]['paged_rows_half_context']}" for c in chips]
    out.append(f"| {model} | {ctx // 1024}K | {by[model, ctx, chips[0]]['weights_gb']:.1f} GB | "
               + " | ".join(cells) + " |")
  return "\n".join(out)


def gen_bench_list(page: str) -> str:
  """Every benchmark: what it measures (its docstring's first sentence) and its result file."""
  out = ["| benchmark | what it measures | result |", "|---|---|---|"]
  for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "bench_*.py"))):
    doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    first = re.split(r"(?<=[.?])\s", first, maxsplit=1)[0]
    first = first if first.endswith((".", "?")) else first + "."
    name = os.path.basename(path)[:-3]
    results = sorted(os.path.relpath(r, ROOT) for r in
                     glob.glob(os.path.join(C.RESULTS, name + ".*"))
                     + glob.glob(os.path.join(C.RESULTS, name[len("bench_"):] + ".*")))
    links = ", ".join(f"[{os.path.basename(r)}]({rel(r, page)})" for r in results) or "(not kept)"
    out.append(f"| [{name}]({rel(os.path.relpath(path, ROOT), page)}) | {md_cell(first)} | "
               f"{links} |")
  return "\n".join(out)


# ------------------------------------------------------------------------------- figures


def delegation_curves() -> dict | None:
  """The two-digit task's mean curves over seeds, full RAO and the lr = 0 control."""
  d = load_json("rao_ablations.json")
  if not d:
    return None
  v = d["tasks"]["two_digit"]["variants"]
  return {"seeds": len(v["rao"]["seeds"]),
          "rao": {k: v["rao"]["curves"][k] for k in ("success", "delegating", "child_success")},
          "control": {k: v["control"]["curves"][k] for k in ("success", "delegating",
                                                             "child_success")}}


def render_delegation_png(data: dict, out: str, source: str) -> None:
  """What `make demo`'s first stage plots, from the committed ablation run: success, trees
  that delegate and helpers' success against the RL step, RAO beside the lr = 0 control."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 3, figsize=(10, 3), sharex=True)
  names = (("success", "tasks solved"), ("delegating", "trees that delegate"),
           ("child_success", "helpers answering right"))
  for ax, (key, title) in zip(axes, names):
    for side, style, label in (("rao", "-", "RAO"), ("control", "--", "no learning (lr = 0)")):
      ys = data[side][key]
      ax.plot(range(1, len(ys) + 1), ys, style, label=label)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  axes[0].set_ylabel(f"share (mean of {data['seeds']} seeds)")
  axes[0].legend(fontsize=8, loc="upper left")
  fig.suptitle("Two-part tasks one agent cannot solve: RAO learns to delegate", fontsize=11)
  fig.tight_layout()
  fig.savefig(out, dpi=100, metadata={"Description": source})
  plt.close(fig)


def _digest(data) -> str:
  return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# path -> (data, renderer): a figure is current when the data digest it was drawn from, kept
# in the PNG's metadata, matches (pixels differ across matplotlib versions; the data do not).
FIGURES: dict[str, tuple[Callable[[], Any], Callable[[dict, str, str], None]]] = {
    "docs/img/delegation_micro_run.png": (delegation_curves, render_delegation_png),
}


def figure_digest_on_disk(path: str) -> str | None:
  from PIL import Image  # pylint: disable=g-import-not-at-top  (matplotlib's own dependency)
  full = os.path.join(ROOT, path)
  if not os.path.exists(full):
    return None
  desc = Image.open(full).info.get("Description", "")
  return desc.rsplit("data ", 1)[-1] if "data " in desc else None


def stale_figures() -> list[str]:
  return [path for path, (data_fn, _) in FIGURES.items()
          if (data := data_fn()) is not None and figure_digest_on_disk(path) != _digest(data)]


def write_figures() -> list[str]:
  written = []
  for path in stale_figures():
    data_fn, render = FIGURES[path]
    data = data_fn()
    os.makedirs(os.path.dirname(os.path.join(ROOT, path)), exist_ok=True)
    render(data, os.path.join(ROOT, path),
           f"Generated by docs/gen_docs.py from benchmarks/results; data {_digest(data)}")
    written.append(path)
  return written


# --------------------------------------------------------------------------- the driver

BLOCKS: dict[str, Callable[[str], str]] = {
    "recursion_headline": gen_recursion_headline,
    "recursion_runs": gen_recursion_runs,
    "recursion_seeds": gen_recursion_seeds,
    "recursion_recipe": gen_recursion_recipe,
    "recursion_readings": gen_recursion_readings,
    "recursion_seed_readings": gen_recursion_seed_readings,
    "recursion_setup": gen_recursion_setup,
    "recursion_training": gen_recursion_training,
    "recursion_trees": gen_recursion_trees,
    "ablation_main": gen_ablation_main,
    "ablation_claims": gen_ablation_claims,
    "ablation_baseline_scale": gen_ablation_baseline_scale,
    "results_table": gen_results_table,
    "speed_table": gen_speed_table,
    "memory_plan": gen_memory_plan,
    "engine_memory_plan": gen_engine_memory_plan,
    "bench_list": gen_bench_list,
}
WHOLE_FILES: dict[str, Callable[[], str]] = {
    "docs/config.md": gen_config_md,
    "docs/api.md": gen_api_md,
}
BLOCK_RE = re.compile(r"(<!-- gen:(\w+) -->\n)(.*?)(<!-- /gen:\2 -->)", re.S)


def markdown_pages() -> list[str]:
  """Every documentation page, repository-relative."""
  pages = ["README.md", "BUILD.md", "CONTRIBUTING.md"]
  pages += sorted(os.path.relpath(p, ROOT)
                  for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
  return [p for p in pages if os.path.exists(os.path.join(ROOT, p))]


RUNNABLE_RE = re.compile(r"^<!-- runnable -->\n```(?:sh|bash)\n(.*?)^```", re.S | re.M)


def runnable_blocks() -> list[tuple[str, list[str]]]:
  """(page, commands) of every fenced block a page marks `<!-- runnable -->`; a test runs them."""
  out = []
  for page in markdown_pages():
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
      text = f.read()
    for block in RUNNABLE_RE.findall(text):
      cmds = [ln.strip() for ln in re.sub(r"\\\n\s*", " ", block).splitlines()
              if ln.strip() and not ln.strip().startswith("#")]
      out.append((page, cmds))
  return out


def render_blocks(text: str, page: str) -> str:
  """`text` with every generated block rewritten; an unknown block name is an error."""
  def sub(m):
    name = m.group(2)
    if name not in BLOCKS:
      raise KeyError(f"{page}: unknown generated block {name!r}; known: {sorted(BLOCKS)}.")
    return m.group(1) + BLOCKS[name](page).rstrip("\n") + "\n" + m.group(4)
  return BLOCK_RE.sub(sub, text)


def expected() -> dict[str, str]:
  """Each generated page's text as it should be committed."""
  out = {path: fn() for path, fn in WHOLE_FILES.items()}
  for page in markdown_pages():
    if page in out:
      continue
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
      text = f.read()
    new = render_blocks(text, page)
    if new != text:
      out[page] = new
  return out


def stale() -> list[str]:
  """The pages (and figures) whose committed content differs from what this script writes."""
  bad = stale_figures()
  for page, text in expected().items():
    path = os.path.join(ROOT, page)
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
    if old != text:
      bad.append(page)
  return bad


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--check", action="store_true", help="report stale pages, write nothing")
  args = parser.parse_args()
  if args.check:
    bad = stale()
    if bad:
      print("stale generated docs: " + ", ".join(bad) + "; run `python docs/gen_docs.py`.",
            file=sys.stderr)
      return 1
    print("generated docs are up to date", file=sys.stderr)
    return 0
  for page, text in expected().items():
    path = os.path.join(ROOT, page)
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
    if old != text:
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
      print(f"wrote {page}", file=sys.stderr)
  for path in write_figures():
    print(f"drew {path}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
