"""The report logic of benchmarks/bench_rao_ablations.py: which credit assignment each arm
runs, and the statistics of its --only comparisons (no training: hand-built runs)."""
import importlib.util
import os

import numpy as np

from experiments.configs import base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "bench_rao_ablations", os.path.join(ROOT, "benchmarks", "bench_rao_ablations.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_paper_arms_pin_the_papers_credit_and_default_arms_the_librarys():
  c = base.base_config()
  default = {"rl.baseline": c.rl.baseline, "rl.drop_equal_groups": c.rl.drop_equal_groups}
  # The arms named "default" must be what a user gets; if the default moves, this says so.
  assert bench.DEFAULT_CREDIT == default
  for name, overrides in bench.VARIANTS.items():
    if name.startswith("default"):
      assert overrides["rl.baseline"] == "loo_success" and overrides["rl.drop_equal_groups"]
    else:
      assert overrides["rl.drop_equal_groups"] is False, name
      assert overrides["rl.baseline"] == ("group_mean" if name == "group_mean" else "loo"), name
  for pair in bench.COMPARISONS["baseline_scale"][1].values():
    paper, new = (bench.VARIANTS[v] for v in pair)
    # Each pair differs in the credit assignment only.
    assert ({k: v for k, v in paper.items() if not k.startswith("rl.baseline")
             and k != "rl.drop_equal_groups"}
            == {k: v for k, v in new.items() if not k.startswith("rl.baseline")
                and k != "rl.drop_equal_groups"})


def _run(solved: dict[str, float], groups_equal: float) -> dict:
  steps = 30
  return {"success": [0.5] * steps, "delegating": [0.6] * steps, "eval_by_task": solved,
          "drift": {"at_depth_limit": [0.0] * steps, "helpers_outside_root": [0.0] * steps,
                    "helpers_outside_parent": [0.0] * steps,
                    "groups_all_equal": [groups_equal] * steps,
                    "update_applied": [1.0] * (steps - 1) + [0.0]},
          "last": {"pass_through": 0.1, "helpers_per_agent": 0.8}, "minutes": 1.0}


def test_comparison_pairs_seeds_and_held_out_tasks():
  tasks = [f"t{i}" for i in range(16)]
  results = {v: {} for v in ("rao", "default", "lambda0", "default_lambda0", "control")}
  for s in range(3):
    # The paper's arm fails a quarter of every seed's tasks; the default solves every task.
    # Stored in another order: the pairs must match tasks by id.
    results["rao"][s] = _run({t: float(t not in tasks[:4]) for t in tasks}, 0.25)
    results["default"][s] = _run({t: 1.0 for t in reversed(tasks)}, 0.5)
    results["lambda0"][s] = _run({t: 1.0 for t in tasks}, 0.5)
    results["default_lambda0"][s] = _run({t: 1.0 for t in tasks}, 0.5)
    results["control"][s] = _run({t: float(t not in tasks[:8]) for t in tasks}, 0.5)
  out = bench._comparison_result("baseline_scale", results)
  assert out["arms"]["rao"]["held_out"]["mean"] == 0.75
  assert out["arms"]["rao"]["held_out"]["solved"] == "36/48"
  assert out["arms"]["default"]["held_out"]["ci95"] == [1.0, 1.0]
  assert out["arms"]["rao"]["steps_without_update"]["mean"] == 1.0
  held = out["paired"]["lambda 0.5"]["held_out"]
  assert held["delta"] == 0.25 and held["seeds_up_down_tied"] == [3, 0, 0]
  assert held["significant"] and held["ci95"][0] > 0
  assert out["paired"]["lambda 0.5"]["drift/groups_all_equal"]["delta"] == 0.25
  tie = out["paired"]["lambda 0"]["held_out"]
  assert tie["delta"] == 0.0 and not tie["significant"] and tie["p_sign_flip"] == 1.0
  out |= {"benchmark": "rao_ablations", "cpu": "test", "seeds": 3, "steps": 30, "note": "",
          "minutes_total": 0.0}
  notes = bench._comparison_notes("baseline_scale", out)
  assert any("same baseline" in n for n in notes)
  assert any("at_depth_limit is 0 in every arm" in n for n in notes)
  assert any("outside_root and _parent are 0 in every arm" in n for n in notes)
  assert out["vs_reference"]["rao - control"]["held_out"]["delta"] == 0.25
  assert out["vs_reference"]["default - control"]["held_out"]["delta"] == 0.5
  line = bench._comparison_line(out)
  assert line["paired"]["lambda 0.5"]["held_out"]["delta"] == 0.25
  assert set(line["vs_reference"]) == {f"{v} - control" for v in
                                       ("rao", "default", "lambda0", "default_lambda0")}
