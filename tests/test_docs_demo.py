"""`make demo`'s summary reads at a glance: what RL taught first, every SmolLM2 stage ran, and
the two-task held-out check led by its size, never as a gain or a loss, with intervals in [0, 1].

The summary is printed from the demo's own result dicts; these are built here as a finished
demo builds them (no model runs: the summary is what is under test).
"""
import re

import pytest

from experiments import demo


def _result(before, after, n=2, updated=(True, False)):
  mic = {"steps": 20, "window": 3, "success_first": 0.08, "success_last": 0.42,
         "delegating_first": 0.45, "delegating_last": 0.96, "helpers_first": 0.41,
         "helpers_last": 0.66}
  smol = {"rl_steps": [{"step": i + 1, "sampled_success": 0.5, "updated": u, "learner_s": 30.0,
                        "learner_tokens_per_s": 80.0, "rollout_tokens_per_s": 20.0}
                       for i, u in enumerate(updated)]}
  kb, ka = round(before * n), round(after * n)
  smol["easy"] = {"num_tasks": n, "before_rl": before, "after_rl": after,
                  "solved_before_rl": kb, "solved_after_rl": ka,
                  "wilson95_before_rl": list(demo.wilson(kb, n)),
                  "wilson95_after_rl": list(demo.wilson(ka, n))}
  outputs = {"delegation_plot": "demo_out/delegation/rl/plot.png",
             "evaluation_before_rl": "demo_out/sft/evaluation/step_6/trees.html",
             "evaluation_after_rl": "demo_out/rl/evaluation/step_2/trees.html"}
  sft_res = {"steps_run": 6, "num_demos": 16, "final_nll": 0.213}
  return mic, smol, outputs, sft_res


def _summary(capsys, *args):
  demo.print_summary(*_result(*args))
  out = capsys.readouterr().out
  return [ln for ln in out.splitlines() if ln.strip()]


def test_summary_leads_with_what_rl_taught(capsys):
  lines = _summary(capsys, 1.0, 0.5)
  first = lines[lines.index("Summary") + 1]
  assert first.lstrip().startswith("1. RAO taught a tiny policy to delegate")
  assert "0.08 -> 0.42" in first and "0.45 -> 0.96" in first


def test_two_task_held_out_check_leads_with_its_size_not_a_change(capsys):
  lines = _summary(capsys, 1.0, 0.5)
  held = next(ln for ln in lines if "held-out" in ln)
  # The sentence starts from how small the check is, before any figure.
  assert re.match(r"\s*3\. Its held-out check is 2 easy tasks, far too few to show a gain or a "
                  r"loss:", held), held
  assert "2/2 solved before RL" in held and "1/2 after" in held
  # No figure that reads as a rate change ("1.00 ... 0.50") anywhere in the summary.
  assert not any(re.search(r"1\.00 before RL|0\.50 after", ln) for ln in lines)


def test_every_smollm2_stage_is_reported(capsys):
  lines = _summary(capsys, 0.5, 0.5)
  stage = next(ln for ln in lines if ln.lstrip().startswith("2."))
  assert "warm start on 16 demonstrations" in stage
  assert "step 1 updated; step 2 skipped: no group had a signal" in stage
  assert "checkpoint saved and reloaded" in stage


@pytest.mark.parametrize("k,n", [(0, 2), (1, 2), (2, 2), (0, 1), (1, 1), (5, 16)])
def test_intervals_stay_inside_the_unit_interval(k, n):
  lo, hi = demo.wilson(k, n)
  assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_intervals_printed_are_wilson(capsys):
  lines = _summary(capsys, 0.5, 0.0)
  held = next(ln for ln in lines if "held-out" in ln)
  assert "1/2 solved before RL [0.09, 0.91]" in held
  assert "0/2 after [0.00, 0.66]" in held
