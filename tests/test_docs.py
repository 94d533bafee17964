"""The documentation is current, its links resolve, and the commands it shows name real configs.

Fast (a few seconds, no JAX): `docs/gen_docs.py` is imported by path and run in check mode;
links and commands are parsed from the Markdown. `tests/test_docs_commands.py` runs the blocks
marked runnable.
"""
import importlib.util
import json
import os
import re
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_gen():
  spec = importlib.util.spec_from_file_location("gen_docs", os.path.join(ROOT, "docs",
                                                                         "gen_docs.py"))
  mod = importlib.util.module_from_spec(spec)
  sys.modules["gen_docs"] = mod   # its dataclasses look their module up by name
  spec.loader.exec_module(mod)
  return mod


gen = _load_gen()
ref = sys.modules["gen_reference"]   # the reference pages' renderer, imported by gen_docs


def _read(page):
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    return f.read()


def _strip_code(text):
  """Markdown without fenced blocks, indented blocks and inline code (links there are text)."""
  text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  text = re.sub(r"^(?: {4}|\t).*$", "", text, flags=re.M)
  return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading):
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"`", "", heading.strip().lower())
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def _anchors(page):
  return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", _strip_fences(_read(page)),
                                                  re.M)}


def _strip_fences(text):
  return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_generated_parts_are_current():
  stale = gen.stale()
  assert not stale, (f"generated docs are stale: {stale}; run `python docs/gen_docs.py` "
                     "and commit the pages with the change that moved them.")


def test_readme_is_short():
  n = len(_read("README.md").splitlines())
  assert n <= 150, f"README.md has {n} lines; keep it under 150 and move detail into docs/."


def test_every_page_is_reachable_from_the_docs_index():
  index = _read("docs/README.md")
  for page in gen.markdown_pages():
    if not page.startswith("docs/") or page == "docs/README.md":
      continue
    name = os.path.relpath(page, "docs")
    target = "results/README.md" if name.startswith("results/") else name
    assert f"]({target})" in index or name.startswith("results/"), (
        f"{page} is not linked from docs/README.md")


LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", gen.markdown_pages())
def test_links_resolve(page):
  bad = []
  for target in LINK_RE.findall(_strip_code(_read(page))):
    if re.match(r"^[a-z]+:", target):
      continue   # web links are not fetched: CI has no network
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
        os.path.join(ROOT, page)
    if not os.path.exists(full):
      bad.append(f"{target} (no such file)")
    elif anchor and full.endswith(".md"):
      if anchor not in _anchors(os.path.relpath(full, ROOT)):
        bad.append(f"{target} (no heading with that anchor)")
  assert not bad, f"{page}: broken links: {bad}"


def _commands(text):
  """Shell commands of a page: fenced sh/bash blocks and indented blocks, continuations joined."""
  blocks = re.findall(r"^```(?:sh|bash|shell)[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
  blocks += re.findall(r"((?:^ {4}.*\n)+)", text, flags=re.M)
  out = []
  for block in blocks:
    joined = re.sub(r"\\\n\s*", " ", block)
    for line in joined.splitlines():
      line = line.split("  #")[0].strip()
      if re.search(r"(python -m (experiments|rao_jax)\.|rao-(train|sft|evaluate))", line):
        out.append(line)
  return out


def _config_checks():
  """(page, command) for every command that names a config file by path."""
  out = []
  for page in gen.markdown_pages():
    for cmd in _commands(_read(page)):
      if re.search(r"--config=experiments/configs/\w+\.py", cmd):
        out.append((page, cmd))
  return out


def test_pages_show_commands_with_configs():
  # The check below must have something to check: the quickstart and the training page show
  # training commands with configs.
  pages = {p for p, _ in _config_checks()}
  assert {"docs/quickstart.md", "docs/training.md"} <= pages, pages


@pytest.mark.parametrize("page,cmd", _config_checks())
def test_commands_name_configs_and_fields_that_exist(page, cmd):
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  from experiments.configs import base  # pylint: disable=g-import-not-at-top
  args = shlex.split(cmd.replace("[", "").replace("]", ""))
  spec = next(a for a in args if a.startswith("--config="))[len("--config="):]
  path, _, arg = spec.partition(":")
  mod = ref._import_path(os.path.join(ROOT, path), "cfg_" + os.path.basename(path)[:-3])
  cfg = mod.get_config(arg or None)
  base.check_keys(cfg)
  for a in args:
    m = re.match(r"--config\.([\w.]+)=(.*)$", a)
    if not m:
      continue
    node = cfg
    *parents, leaf = m.group(1).split(".")
    for key in parents:
      assert key in node, f"{page}: `{cmd}` sets config.{m.group(1)}: no section {key!r}"
      node = node[key]
    assert leaf in node, (f"{page}: `{cmd}` sets config.{m.group(1)}, which is not a field; "
                          f"valid: {sorted(node.keys())}")


def test_runnable_blocks_are_found():
  blocks = gen.runnable_blocks()
  assert any(page == "docs/quickstart.md" and any("experiments.train" in c for c in cmds)
             for page, cmds in blocks), blocks


# ---------------------------------------------------------------------------- the generator


def test_count_refuses_a_rate_that_is_not_whole_tasks():
  assert gen.count(0.625, 64) == 40
  with pytest.raises(ValueError, match="not a whole number"):
    gen.count(0.6, 64)


def _copy_results(tmp_path, monkeypatch):
  res = tmp_path / "results"
  res.mkdir()
  for name in ("recursion_evidence.json", "recursion_evidence_rlseed1.json"):
    (res / name).write_text(_read(f"benchmarks/results/{name}"))
  monkeypatch.setattr(sys.modules["gen_common"], "RESULTS", str(res))   # read by every block
  return res


def test_results_follow_the_json(tmp_path, monkeypatch):
  res = _copy_results(tmp_path, monkeypatch)
  before = gen.gen_recursion_headline("README.md")
  assert "seed 0: 40/64 -> 62/64" in before and "seed 1: 40/64 -> 33/64" in before
  d = json.loads((res / "recursion_evidence_rlseed1.json").read_text())
  d["modes"]["recursive"]["after"] = 45 / 64
  (res / "recursion_evidence_rlseed1.json").write_text(json.dumps(d))
  after = gen.gen_recursion_headline("README.md")
  assert "seed 1: 40/64 -> 45/64" in after
  assert "45/64" in gen.gen_recursion_runs("docs/results/recursion.md")


def test_seed_readings_follow_each_seeds_report(tmp_path, monkeypatch):
  res = _copy_results(tmp_path, monkeypatch)
  page = "docs/results/recursion.md"
  assert "No seed of the corrected method has taken its readings" in (
      gen.gen_recursion_seed_readings(page))
  reading = {"tasks": 8, "before": 1 / 8, "after": 3 / 8,
             "paired": {"delta": 0.25, "ci95": [0.0, 0.5]}}
  for seed, readings in ((3, {"hard": reading}), (1, {"hard": {**reading, "after": None,
                                                                  "paired": None}})):
    d = res / "recursion_runs" / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "result.json").write_text(json.dumps({"settings": {"rl_seed": seed},
                                               "readings": readings}))
  rows = gen.gen_recursion_seed_readings(page).splitlines()[2:]
  assert rows[0].startswith("| [1](") and "recursion_runs/seed1/result.json) |" in rows[0]
  assert "| hard | 8 | 1/8 [0.02, 0.47] | not taken |" in rows[0]
  assert rows[1].endswith("| 1/8 [0.02, 0.47] | 3/8 [0.14, 0.69] | +0.25 [0.00, 0.50] |")


def test_five_seed_results_replace_the_placeholder(tmp_path, monkeypatch):
  res = _copy_results(tmp_path, monkeypatch)
  placeholder = gen.gen_recursion_seeds("docs/results/recursion.md")
  assert "No seed of the corrected method" in placeholder and "Before RL" not in placeholder
  assert "already solves" not in gen.gen_recursion_headline("README.md")
  # The shared warm start's held-out readings, once their stage results are committed.
  for mode, k in (("recursive", 50), ("single", 2)):
    d = res / "recursion_runs" / "warm" / mode / "eval_before"
    d.mkdir(parents=True)
    (d / "stage.json").write_text(json.dumps(
        {"minutes": 30.0, "result": {"medium": {"success": k / 64, "num_tasks": 64}}}))
  placeholder = gen.gen_recursion_seeds("docs/results/recursion.md")
  assert "the recursive warm start solves 50/64 [0.67, 0.86]" in placeholder
  assert "the single agent solves 2/64 [0.01, 0.11]" in placeholder
  assert "the warm start already solves 50/64 before RL" in gen.gen_recursion_headline("README.md")
  seeds = {"seeds": [{"rl_seed": s, "before": 40 / 64, "after": (44 + s) / 64,
                      "paired": {"delta": (4 + s) / 64, "ci95": [0.01, 0.2], "n": 64},
                      "delegating_share": {"before": 60 / 64, "after": 59 / 64},
                      "vs_single": {"delta": 0.6, "ci95": [0.5, 0.7]}, "minutes": 150.0}
                     for s in range(5)],
           "across_seeds": {"mean_delta": 0.094, "ci95": [0.05, 0.14], "iqm_delta": 0.09,
                            "improved": 5, "worse_significant": 0}}
  (res / "recursion_seeds.json").write_text(json.dumps(seeds))
  table = gen.gen_recursion_seeds("docs/results/recursion.md")
  assert "| 4 | 40/64" in table and "48/64" in table
  assert "5 of 5 seeds improved, 0 significantly worse" in table
  head = gen.gen_recursion_headline("README.md")
  assert "improves held-out success over five RL seeds" in head
  assert "With the corrected credit assignment: 5 RL seeds" in head
  assert "being rerun" not in head and "seed 1: 40/64 -> 33/64" in head
  row = gen.gen_results_table("README.md").splitlines()[2]
  assert "5 RL seeds of the fixed recipe" in row and "--scale=cpu_rao_seeds" in row
  assert "paper's baseline: seed 0: 40/64 -> 62/64" in row
  seeds["across_seeds"]["ci95"] = [-0.02, 0.14]
  (res / "recursion_seeds.json").write_text(json.dumps(seeds))
  assert "does not clear its bar" in gen.gen_recursion_headline("README.md")
  # recursion_seeds.json lists the seeds that improved and that are significantly worse.
  seeds["across_seeds"].update(improved=[0, 1, 2, 3], worse_significant=[4], ci95=[0.05, 0.14])
  (res / "recursion_seeds.json").write_text(json.dumps(seeds))
  head = gen.gen_recursion_headline("README.md")
  assert "4 of 5 seeds improved, 1 significantly worse" in head and "does not clear" in head
  seeds["seeds"] = seeds["seeds"][:2]
  del seeds["across_seeds"]
  (res / "recursion_seeds.json").write_text(json.dumps(seeds))
  assert "2 of 5 RL seeds in" in gen.gen_recursion_headline("README.md")


def test_a_figure_is_stale_when_its_data_change(monkeypatch):
  path = "docs/img/delegation_micro_run.png"
  assert path not in gen.stale_figures()
  data_fn, render = gen.FIGURES[path]
  changed = lambda: {**data_fn(), "seeds": data_fn()["seeds"] + 1}
  monkeypatch.setitem(gen.FIGURES, path, (changed, render))
  assert path in gen.stale_figures()


def test_an_unknown_generated_block_is_an_error():
  with pytest.raises(KeyError, match="unknown generated block"):
    gen.render_blocks("<!-- gen:nope -->\nx\n<!-- /gen:nope -->\n", "README.md")


def test_config_reference_lists_every_field_with_a_meaning():
  fields = ref.config_fields()
  text = ref.gen_config_md()
  missing = [f.path for f in fields if not f.comment]
  assert not missing, f"config fields without a comment in base.py: {missing}"
  for f in fields:
    assert f"| `{f.path}` |" in text


def test_options_are_read_from_the_comment_only_when_the_default_is_one():
  assert ref._options('"node": A(v) = R(v) - b_k | "tree": root\'s A', "node") == ["node", "tree"]
  assert ref._options("activation checkpointing: auto (x) | none | dots | full", "auto") == [
      "auto", "none", "dots", "full"]
  assert ref._options("embedded | sglang", "other") == []


def test_recipe_table_follows_the_json(tmp_path, monkeypatch):
  res = _copy_results(tmp_path, monkeypatch)
  assert "No recipe candidate has run yet" in gen.gen_recursion_recipe("docs/results/recursion.md")
  rec = json.loads(_read("benchmarks/results/recursion_recipe.json"))
  curves = {"steps": [1, 2, 3, 4], "val": [1.0, 0.9375, None, 0.875],
            "at_depth_limit": [0.0, 0.05, 0.1, 0.2], "helpers_outside_root": [0.0] * 4}
  rec["candidates"]["lam0_lr1e-4"].update(
      complete=True, minutes=95.0, curves=curves,
      score={"best_step": 1, "best_val": 1.0, "drifting": False, "at_depth_limit_mean": 0.0875})
  rec["candidates"]["lam05_lr1e-4"]["curves"] = dict(curves, steps=[1], val=[0.8125])
  rec["chosen"] = "lam0_lr1e-4"
  (res / "recursion_recipe.json").write_text(json.dumps(rec))
  table = gen.gen_recursion_recipe("docs/results/recursion.md")
  assert "The warm start solves 15/16 [0.72, 0.99]" in table
  assert "| lam0_lr1e-4 | lr=0.0001, lam=0 | 16/16, 15/16, -, 14/16 | 1 | no | 0.09 | 95 |" in table
  assert "| lam05_lr1e-4 | lr=0.0001, lam=0.5 | 13/16 | 1 of 4 steps done |" in table
  assert "| lam0_lr3e-4 | lr=0.0003, lam=0 | - | not run yet |" in table
  assert "Chosen: **lam0_lr1e-4**." in table and "fixed before any candidate ran" in table
  assert rec["notes"] and all(f"- {n}" in table for n in rec["notes"])


def test_baseline_scale_table_follows_the_json(tmp_path, monkeypatch):
  res = tmp_path / "results"
  res.mkdir()
  monkeypatch.setattr(sys.modules["gen_common"], "RESULTS", str(res))   # read by every block
  assert "Not run yet" in gen.gen_ablation_baseline_scale("docs/results/ablations.md")
  d = json.loads(_read("benchmarks/results/rao_ablations_baseline_scale.json"))
  d["arms"]["default"]["held_out"].update(mean=0.8125, ci95=[0.7, 0.9])
  (res / "rao_ablations_baseline_scale.json").write_text(json.dumps(d))
  table = gen.gen_ablation_baseline_scale("docs/results/ablations.md")
  assert "| default | loo_success, dropped | 0.81 [0.70, 0.90] |" in table
  assert f"Reading: {d['notes'][-1]}" in table
  d["valid"], d["invalid_because"] = False, "a defective warm start"
  (res / "rao_ablations_baseline_scale.json").write_text(json.dumps(d))
  assert "invalid: a defective warm start" in gen.gen_ablation_baseline_scale("x.md")
