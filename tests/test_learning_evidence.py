"""The learning-evidence script's statistics, plot and configs (the runs themselves are long)."""
import json
import os

import numpy as np
import pytest

from experiments import learning_evidence as le


def test_paired_difference_and_interval():
  before = {f"t{i}": 0.0 for i in range(100)}
  after = {f"t{i}": 1.0 if i < 30 else 0.0 for i in range(100)}
  r = le._paired(before, after)
  assert r["n"] == 100
  assert r["delta"] == pytest.approx(0.30)
  lo, hi = r["ci95"]
  half = 1.96 * np.std([1.0] * 30 + [0.0] * 70, ddof=1) / 10
  assert (lo, hi) == pytest.approx((0.30 - half, 0.30 + half))
  assert r["excludes_zero"]
  # Gains on some tasks and equal losses on others: no evidence either way.
  mixed = {f"t{i}": (1.0 if i < 10 else 0.0) for i in range(100)}
  lost = {f"t{i}": (1.0 if 10 <= i < 20 else 0.0) for i in range(100)}
  r = le._paired(mixed, lost)
  assert r["delta"] == pytest.approx(0.0) and not r["excludes_zero"]


def _per(before, after, n=64):
  return {"before": before, "after": after, "before_ci95": [before - 0.1, before + 0.1],
          "after_ci95": [after - 0.1, after + 0.1], "paired": {"n": n}}


def test_plot_writes_png(tmp_path):
  result = {"modes": {"recursive": {"easy": _per(0.1, 0.3)}, "single": {"easy": _per(0.2, 0.25)}},
            "training": {"recursive": {"success": [0.1, 0.2, None, 0.4]}}}
  path = str(tmp_path / "evidence.png")
  le.plot(result, str(tmp_path), path)
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.getsize(path) > 1000


@pytest.mark.parametrize("scale", sorted(le._SCALES))
@pytest.mark.parametrize("mode", ["recursive", "single"])
def test_configs_build_for_every_scale(scale, mode):
  s = le._SCALES[scale]
  c = le.config_for(mode, s)
  assert c.agent.mode == mode and c.env.train_difficulty == s["train"]
  assert c.env.eval_difficulties == s["eval_diffs"] and c.eval.every == 0
  assert c.eval.num_tasks == s["eval_tasks"] and c.total_steps == s["rl_steps"]
  assert c.agent.context_window == s["ctx"] == c.learner.row_len


def test_stages_run_once_and_resume(tmp_path):
  """A complete stage is skipped on a rerun (its result read back); a failed one runs again."""
  calls = []

  def ok(d):
    calls.append(d)
    return {"x": 1}

  def boom(d):
    raise RuntimeError("killed")

  st = le._Stages(str(tmp_path))
  assert st.run("a", ok) == {"x": 1}
  with pytest.raises(RuntimeError):
    st.run("b", boom)
  st2 = le._Stages(str(tmp_path))
  assert st2.run("a", ok) == {"x": 1} and len(calls) == 1
  assert st2.run("b", ok) == {"x": 1} and len(calls) == 2
  assert set(st2.minutes) == {"a", "b"}


def test_report_from_disk_marks_missing_stages(tmp_path):
  """An unfinished run still reports what its complete stages measured, and what is missing."""
  s = dict(le._SCALES["tiny"])
  per_task = {"a": 1.0, "b": 0.0}
  d = tmp_path / "recursive" / "eval_before"
  d.mkdir(parents=True)
  (d / "stage.json").write_text(json.dumps(
      {"minutes": 2.5, "result": {"easy": {"success": 0.5, "ci95": [0.0, 1.0],
                                           "per_task": per_task}}}))
  per, minutes, missing = le.report_from_disk("recursive", s, str(tmp_path))
  assert missing == ["sft", "rl", "eval_after"] and minutes == {"eval_before": 2.5}
  assert per["easy"]["before"] == 0.5 and per["easy"]["after"] is None
  assert per["easy"]["paired"] is None
  le.plot({"modes": {"recursive": per}}, str(tmp_path), str(tmp_path / "p.png"))
  d2 = tmp_path / "recursive" / "eval_after"
  d2.mkdir()
  (d2 / "stage.json").write_text(json.dumps(
      {"minutes": 3.0, "result": {"easy": {"success": 1.0, "ci95": [1.0, 1.0],
                                           "per_task": {"a": 1.0, "b": 1.0}}}}))
  per, _, missing = le.report_from_disk("recursive", s, str(tmp_path))
  assert missing == ["sft", "rl"] and per["easy"]["paired"]["delta"] == 0.5


def test_tree_shapes_count_delegation_and_success_by_depth_and_targets(tmp_path):
  from rao_jax.agent import records as R
  from rao_jax.learner import testing as lt

  def node(nid, parent, depth, success, children=(), targets=None):
    n = lt.make_node(nid, parent, depth, children, success, token_ids=[1, 2, 3],
                     gen_mask=[0, 1, 1])
    if targets is not None:
      n.task_fields = {"target_items": targets}
    return n
  trees = [
      lt.make_tree("a", "g", [node("0", None, 0, 1.0, ["0.0"], {"x": 1, "y": 2}),
                              node("0.0", "0", 1, 0.0)]),
      lt.make_tree("b", "g", [node("0", None, 0, 0.0, targets={"x": 1})]),
  ]
  path = tmp_path / "trees.jsonl"
  R.save_trees_jsonl(str(path), trees)
  shapes = le.tree_shapes(str(path))
  assert shapes["trees"] == 2 and shapes["delegating_share"] == 0.5
  assert shapes["nodes_mean"] == 1.5 and shapes["depth_max_mean"] == 0.5
  assert shapes["success_by_depth"] == {"0": {"nodes": 2, "success": 0.5},
                                        "1": {"nodes": 1, "success": 0.0}}
  assert shapes["success_by_num_targets"] == {"1": {"tasks": 1, "success": 0.0},
                                              "2": {"tasks": 1, "success": 1.0}}
  assert shapes["delegation_by_outcome"] == {"1": {"alone_failed": 1},
                                             "2": {"delegating_solved": 1}}
  assert le.tree_shapes(str(tmp_path / "missing.jsonl")) is None
