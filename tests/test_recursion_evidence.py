"""The recursion-evidence script: configs at the craft budget, the scripted `caps` stage, its
statistics, and the result's shape (the SmolLM2 stages themselves are long and not run here)."""
import os

import pytest

from experiments import recursion_evidence as rev
from experiments import recursion_report as rep
from rao_jax import experiment as X
from rao_jax import stats
from rao_jax.agent import chat, records as R


@pytest.mark.parametrize("scale", sorted(rev._SCALES))
@pytest.mark.parametrize("mode", ["recursive", "single"])
def test_configs_carry_the_budget_for_every_scale(scale, mode):
  s = rev._SCALES[scale]
  c = rev.config_for(mode, s)
  assert c.agent.mode == mode and c.env.kwargs.craft_budget_per_agent == s["budget"] > 0
  assert c.env.eval_difficulties == (s["eval_diff"],) and c.env.train_difficulty == s["train"]
  assert c.agent.max_depth == s["max_depth"] and c.agent.context_window == s["ctx"]
  assert c.env.kwargs.tasks_per_difficulty >= max(s["eval_tasks"], s["caps_tasks"])
  assert c.total_steps == s["rl_steps"] and c.rl.group_size == s["group"] >= 2


def test_wilson_interval():
  assert rev.wilson95(0, 100) == pytest.approx([0.0, 0.0370], abs=1e-4)
  assert rev.wilson95(100, 100) == pytest.approx([0.9630, 1.0], abs=1e-4)
  lo, hi = rev.wilson95(5, 100)
  assert lo < 0.05 < hi and hi == pytest.approx(0.1118, abs=1e-4)
  r = rev.rate([1, 0, 0, 0])
  assert r["success"] == 0.25 and r["successes"] == 1 and r["n"] == 4
  assert r["ci95"] == pytest.approx(list(stats.binomial_ci95([1, 0, 0, 0])))


def test_caps_stage_separates_recursive_from_single(tmp_path):
  # Byte tokens: the window is widened so that only the craft budget can stop an agent.
  s = dict(rev._SCALES["tiny"], caps_tasks=4, ctx=16384, max_new_tokens=4096)
  out = rev.run_caps(s, str(tmp_path), tokenizer=chat.ByteChatTokenizer())
  p = out["policies"]
  assert out["tasks"] == 4 and out["craft_budget_per_agent"] == s["budget"]
  assert p["recursive_program"]["success"] == 1.0
  assert p["recursive_program"]["craft_calls_per_agent"]["max"] <= s["budget"]
  assert p["recursive_program"]["craft_calls_per_agent"]["agents_over_budget"] == 0
  assert p["recursive_program"]["agents_per_tree"]["mean"] > 1
  bound = out["single_agent_upper_bound"]["success"]
  for name in ("single_program", "single_plan_best"):
    assert p[name]["success"] <= bound and p[name]["craft_calls_refused"] > 0
    assert p[name]["craft_calls_per_agent"]["max"] == s["budget"]
  # Without the budget the same single program solves them: the budget is what closes it.
  assert p["single_program_no_budget"]["success"] == 1.0
  assert p["single_program_no_budget"]["craft_calls_per_agent"]["agents_over_budget"] > 0
  assert out["single_successes_beyond_the_bound"] == [] and all(out["verdict"].values())
  trees = R.load_trees_jsonl(os.path.join(tmp_path, "recursive_program.trees.jsonl"))
  assert len(trees) == 4 and all(t.meta["episode"]["tool_calls"] for t in trees)


def _tree(task_id: str, nodes: int, success: float) -> R.TreeRecord:
  ns = [R.NodeRecord("0", None, 0, "g", children=[f"0.{i}" for i in range(1, nodes)],
                     success=success)]
  ns += [R.NodeRecord(f"0.{i}", "0", 1, "g", success=1.0) for i in range(1, nodes)]
  return R.TreeRecord(task_id, task_id, task_id, "textcraft_synth", ns)


def test_summary_has_the_issue_shape(tmp_path):
  tasks = [f"t{i}" for i in range(10)]
  def ev(k):
    per = {t: float(i < k) for i, t in enumerate(tasks)}
    return {"success": k / 10, "ci95": [0.0, 1.0], "per_task": per}
  for stage, nodes in (("eval_before", 3), ("eval_after", 2)):
    d = tmp_path / "recursive" / stage
    d.mkdir(parents=True)
    R.save_trees_jsonl(str(d / "trees.jsonl"), [_tree(t, nodes if i % 2 else 1, 0.0)
                                                for i, t in enumerate(tasks)])
  raw = {"recursive": {"before": ev(2), "after": ev(7)}, "single": {"before": ev(1),
                                                                     "after": ev(1)}}
  out = rep.summarize(raw, str(tmp_path))
  rec = out["modes"]["recursive"]
  assert (rec["before"], rec["after"]) == (0.2, 0.7)
  assert rec["paired"]["delta"] == pytest.approx(0.5) and rec["paired"]["n"] == 10
  assert len(rec["paired"]["ci95"]) == 2
  assert rec["delegating_share"] == {"before": 0.5, "after": 0.5}
  assert (out["modes"]["single"]["before"], out["modes"]["single"]["after"]) == (0.1, 0.1)
  assert out["modes"]["single"]["n"] == 10
  assert out["vs_single"]["delta"] == pytest.approx(0.6) and out["vs_single"]["n"] == 10


def test_report_from_disk_keeps_a_stopped_rl_stage_and_says_what_it_compared(tmp_path):
  """A run whose recursive RL was set aside: `after` stays None, the attempt's step metrics are
  kept, and vs_single names the warm start as the recursive side."""
  import json  # pylint: disable=g-import-not-at-top
  tasks = [f"t{i}" for i in range(10)]

  def stage(mode, name, result):
    d = tmp_path / mode / name
    d.mkdir(parents=True)
    (d / "stage.json").write_text(json.dumps({"minutes": 1.5, "result": result}))

  def ev(k):
    return {"medium": {"success": k / 10, "ci95": [0.0, 1.0],
                       "per_task": {t: float(i < k) for i, t in enumerate(tasks)}}}
  for mode in ("recursive", "single"):
    stage(mode, "demos", {})
    stage(mode, "sft", {})
  stage("recursive", "eval_before", ev(6))
  stage("single", "eval_before", ev(1))
  stage("single", "rl", {"step": 4})
  stage("single", "eval_after", ev(1))
  aborted = tmp_path / "recursive" / "rl_temperature1.0_before_sampler_fix_aborted"
  aborted.mkdir()
  (aborted / "config.json").write_text(json.dumps({"agent": {"temperature": 1.0}}))
  (aborted / "metrics.jsonl").write_text(json.dumps(
      {"step": 1, "train/success": 0.0, "train/delegating_share": 0.0}) + "\n")
  out = rep.report_from_disk(dict(rev._SCALES["cpu"]), str(tmp_path), ["recursive", "single"])
  assert out["complete"] is False
  assert out["missing"] == {"recursive": ["rl", "eval_after"], "single": []}
  rec = out["modes"]["recursive"]
  assert rec["before"] == 0.6 and rec["after"] is None and rec["paired"] is None
  (attempt,) = rec["rl_attempts"]
  assert attempt["temperature"] == 1.0 and attempt["steps"]["success"] == [0.0]
  assert attempt["why"] == "temperature1.0 before sampler fix"
  assert out["training"] == {}   # no RL stage wrote metrics here
  assert out["vs_single"]["delta"] == pytest.approx(0.5)
  assert out["vs_single"]["recursive_side"].startswith("warm start")
  assert out["minutes"] == pytest.approx(1.5 * 8)


def test_rl_config_of_the_lora_scale_carries_the_adapter_and_the_task_mix():
  s = rev._SCALES["cpu_lora"]
  c = rev.rl_config_for("recursive", s)
  assert c.model.lora.rank == s["lora_rank"] > 0 and c.rl.task_weights == s["task_weights"]
  assert X.rl_config(c).tasks_per_step * X.rl_config(c).group_size >= 16
  # The warm start (SFT) is full-parameter: config_for carries no adapter.
  assert rev.config_for("recursive", s).model.lora.rank == 0
  tasks = X.task_split(X.make_env(c), "train", s["train"])
  w = X.task_weights(tasks, c.rl.task_weights)
  two = [len(t.fields["target_items"]) == 2 for t in tasks]
  assert all((x == 3.0) == y for x, y in zip(w, two))
  assert c.eval.stop_at_success == 0.0            # no validation split: no early end
  # With a validation split RL ends once a step solves it: no later step could be read.
  v = rev.rl_config_for("recursive", rev._SCALES["cpu_rao_seeds"])
  assert (v.eval.split, v.eval.every, v.eval.stop_at_success) == ("val", 1, 1.0)


def test_report_reads_the_further_readings_and_keeps_earlier_attempts(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  tasks = [f"t{i}" for i in range(8)]

  def stage(mode, name, result, trees=None):
    d = tmp_path / mode / name
    d.mkdir(parents=True)
    (d / "stage.json").write_text(json.dumps({"minutes": 2.0, "result": result}))
    if trees:
      R.save_trees_jsonl(str(d / "trees.jsonl"), trees)

  def ev(k, diff="medium"):
    r = {"success": k / 8, "ci95": [0.0, 1.0],
         "per_task": {t: float(i < k) for i, t in enumerate(tasks)}}
    return {diff: r}
  for name, k in (("eval_before", 3), ("eval_after", 6)):
    stage("recursive", name, ev(k), [_tree(t, 3, float(i < k)) for i, t in enumerate(tasks)])
  stage("single", "eval_before", ev(1))
  stage("recursive", "reading_hard_before", ev(1, "hard")["hard"])
  stage("recursive", "reading_hard_after", ev(4, "hard")["hard"],
        [_tree(t, 5, float(i < 4)) for i, t in enumerate(tasks)])
  previous = {"scale": "cpu", "settings": dict(rev._SCALES["cpu"]), "training": {},
              "modes": {"recursive": {"before": 0.5, "after": 0.5, "paired": {"delta": 0.0},
                                      "rl_attempts": [{"folder": "rl_full_2e-06",
                                                       "why": "kept then", "steps": {}}]}}}
  out = rep.report_from_disk(dict(rev._SCALES["cpu_lora"]), str(tmp_path),
                             ["recursive", "single"], previous)
  rec = out["modes"]["recursive"]
  assert rec["paired"]["delta"] == pytest.approx(3 / 8)
  hard = out["readings"]["hard"]
  assert (hard["before"], hard["after"]) == (1 / 8, 4 / 8)
  assert hard["paired"]["improved"] == 3 and hard["overrides"]["agent.max_depth"] == 8
  assert "other_world" not in out["readings"]          # not run: no entry, no made-up figure
  assert out["vs_single"]["single_side"].startswith("warm start")
  assert out["vs_single"]["delta"] == pytest.approx(5 / 8)
  kept, earlier = rec["rl_attempts"]
  assert kept["folder"] == "rl_full_2e-06" and kept["folder_kept"] is False
  # The earlier result's own run, under other settings, is kept as an attempt with its figures.
  assert earlier["folder"] == "rl_cpu_lr2e-06_4_steps" and earlier["held_out"]["after"] == 0.5
  assert out["stage_minutes"]["recursive"]["reading_hard_after"] == 2.0
  assert out["minutes"] == pytest.approx(2.0 * 5)
  # The written result: the JSON (earlier attempts carried from the file it replaces), the
  # plot with the readings' bars, the trees page.
  path = tmp_path / "result.json"
  path.write_text(json.dumps(previous))
  seed1 = tmp_path / "seed1.json"
  seed1.write_text(json.dumps({"settings": {"rl_seed": 1},
                               "modes": {"recursive": {"after": 0.25}}}))
  res = rep.write_report("cpu_lora", dict(rev._SCALES["cpu_lora"]), str(tmp_path),
                         ["recursive", "single"], str(path), replications=[str(seed1)])
  written = json.loads(path.read_text())
  assert written["readings"]["hard"]["after"] == 0.5
  assert [(r["rl_seed"], r["after"]) for r in written["replications"]] == [(1, 0.25)]
  assert set(written["bar"]) == {"beats_warm_start", "beats_single", "delegating_share_kept",
                                 "within_3_hours"}
  assert res["modes"]["recursive"]["rl_attempts"][0]["folder"] == "rl_full_2e-06"
  assert (tmp_path / "result.png").read_bytes()[:4] == b"\x89PNG"
  assert "hard, after RL" in (tmp_path / "result_trees.html").read_text()


def test_train_trees_by_number_of_targets(tmp_path):
  def tree(i, n, ok):
    t = _tree(f"t{i}", 2, float(ok))
    t.root.task_fields = {"target_items": {f"x{j}": 1 for j in range(n)}}
    return t
  d = tmp_path / "rl" / "trees"
  d.mkdir(parents=True)
  R.save_trees_jsonl(str(d / "step_000000.jsonl"),
                     [tree(0, 1, 1), tree(1, 2, 0), tree(2, 2, 1), tree(3, 2, 0)])
  (step,) = rep.train_by_num_targets(str(tmp_path / "rl"))
  # A stopped and resumed RL stage: its minutes are its steps' recorded times.
  (tmp_path / "rl" / "metrics.jsonl").write_text(
      '{"step": 1, "train/time/step_s": 600.0, "train/time/warmup_s": 60.0}\n'
      '{"step": 2, "train/time/step_s": 540.0}\n')
  assert rep.rl_minutes(str(tmp_path / "rl")) == pytest.approx(20.0)
  assert step == {"1": {"trees": 1, "success": 1.0}, "2": {"trees": 3, "success": 1 / 3}}


@pytest.mark.parametrize("mode", ["recursive", "single"])
def test_demonstrations_are_successful_trees_at_the_budget(mode):
  import asyncio  # pylint: disable=g-import-not-at-top
  s = dict(rev._SCALES["tiny"], demos=3, ctx=16384, max_new_tokens=4096)
  c = rev.config_for(mode, s)
  c.env.kwargs.tasks_per_difficulty = 8   # few train tasks: the single agent solves no medium one
  trees = asyncio.run(rev._collect_demos(c, s, mode, chat.ByteChatTokenizer()))
  assert len(trees) == 3 and all(t.root.success == 1.0 for t in trees)
  for t in trees:
    assert t.meta["episode"]["craft_budget_per_agent"] == s["budget"]
    assert all(c.get("craft", 0) <= s["budget"] for c in t.meta["episode"]["tool_calls"].values())
  diffs = {t.meta["difficulty"] for t in trees}
  if mode == "recursive":
    assert diffs == {"medium"} and all(len(t.nodes) > 1 for t in trees)
  else:   # medium closures exceed the budget: the single agent's demonstrations are easy tasks
    assert "easy" in diffs and all(len(t.nodes) == 1 for t in trees)


def test_plot_of_the_result(tmp_path):
  result = {"modes": {
      "recursive": {"before": 0.1, "after": 0.4, "before_ci95": [0.0, 0.2],
                    "after_ci95": [0.3, 0.5], "paired": {"n": 64}},
      "single": {"before": 0.05, "after": 0.05, "before_ci95": [0.0, 0.1],
                 "after_ci95": [0.0, 0.1]}},
      "training": {"recursive": {"success": [0.1, 0.3], "tree_nodes": [5.0, 5.5]}}}
  path = str(tmp_path / "recursion.png")
  rep.plot(result, str(tmp_path), "medium", path)
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_rl_seed_moves_only_the_rl_stage_and_zero_is_the_default_run():
  s = dict(rev._SCALES["cpu_lora"])
  default = rev.rl_config_for("recursive", s)
  assert rev.rl_config_for("recursive", {**s, "rl_seed": 0}) == default
  other = rev.rl_config_for("recursive", {**s, "rl_seed": 1})
  assert (other.seed, other.env.train_seed) == (1, 2) != (default.seed, default.env.train_seed)
  # The warm start and its evaluations (config_for) keep their seeds: replications share them.
  assert rev.config_for("recursive", {**s, "rl_seed": 1}) == rev.config_for("recursive", s)
  a, b = (X.train_tasks_for_step(X.task_split(X.make_env(c), "train", s["train"]), 0,
                                 s["tasks_per_step"], int(c.env.train_seed), c.rl.task_weights)
          for c in (default, other))
  assert [t.task_id for t in a] != [t.task_id for t in b]


def test_bar_item_by_item_and_replications_in_the_result(tmp_path):
  import json  # pylint: disable=g-import-not-at-top

  def result(after_share, minutes, lo=0.1, side="after RL"):
    return {"modes": {"recursive": {"paired": {"ci95": [lo, 0.5]},
                                    "delegating_share": {"before": 0.9375,
                                                         "after": after_share}}},
            "vs_single": {"ci95": [0.8, 0.9], "recursive_side": side}, "minutes": minutes}
  assert rep.bar(result(0.9375, 160)) == {"beats_warm_start": True, "beats_single": True,
                                          "delegating_share_kept": True, "within_3_hours": True}
  got = rep.bar(result(59 / 64, 190, lo=0.0, side="warm start"))
  assert got == {"beats_warm_start": False, "beats_single": False,
                 "delegating_share_kept": False, "within_3_hours": False}
  assert rep.bar({"modes": {"recursive": {"paired": None}}, "minutes": 1}) is None
  with pytest.raises(FileNotFoundError, match="--rl_seed"):
    rep.replication(str(tmp_path / "missing.json"))
  other = tmp_path / "seed1.json"
  other.write_text(json.dumps({
      **result(1.0, 90), "settings": {"rl_seed": 1}, "complete": True,
      "bar": rep.bar(result(1.0, 90)),
      "readings": {"hard": {"before": 0.0, "after": 0.125}}}))
  rep_ = rep.replication(str(other))
  assert rep_["rl_seed"] == 1 and rep_["bar"]["delegating_share_kept"] is True
  assert rep_["delegating_share"]["after"] == 1.0 and rep_["readings_after"] == {"hard": 0.125}


def test_share_stages_links_the_complete_warm_start_stages_only(tmp_path):
  src, dst = tmp_path / "first", tmp_path / "second"
  for name in ("caps", "recursive/demos", "recursive/sft", "recursive/eval_before",
               "recursive/reading_hard_before", "recursive/rl", "single/sft"):
    (src / name).mkdir(parents=True)
    (src / name / "stage.json").write_text("{}")
  (src / "single" / "demos").mkdir()                     # not complete: this run redoes it
  (dst / "recursive" / "demos").mkdir(parents=True)      # the new workdir's own: kept
  linked = rev.share_stages(str(src), str(dst), ["recursive", "single"])
  assert sorted(linked) == ["caps", "recursive/eval_before", "recursive/reading_hard_before",
                            "recursive/sft", "single/sft"]
  linked_sft = dst / "recursive" / "sft"
  assert linked_sft.is_symlink() and (linked_sft / "stage.json").exists()
  assert not (dst / "recursive" / "demos").is_symlink() and not (dst / "recursive" / "rl").exists()
  assert rev.share_stages(str(src), str(dst), ["recursive", "single"]) == []   # idempotent


def test_unknown_reading_is_refused_before_any_stage(tmp_path):
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = subprocess.run([sys.executable, "-m", "experiments.recursion_evidence", "--scale=tiny",
                      "--readings=hard,harder", f"--workdir={tmp_path}/w",
                      f"--caps_out={tmp_path}/caps.json"],
                     cwd=root, capture_output=True, text=True, timeout=300)
  assert p.returncode != 0
  assert "['harder'] are not readings; choose among hard, other_world" in p.stderr
  assert not os.path.exists(tmp_path / "w")      # refused before the first stage


@pytest.mark.parametrize("stop,readings,taken", [
    ("eval_before", "hard,other_world", [("before", ("hard", "other_world"))]),
    ("eval_before", "", []), ("sft", "hard", [])])
def test_stopping_at_the_warm_start_takes_its_readings_for_the_seeds_to_share(
    tmp_path, monkeypatch, stop, readings, taken):
  from absl import flags
  from absl.testing import flagsaver
  calls = []
  monkeypatch.setattr(rev, "run_caps", lambda s, d, repl: {
      "single_agent_upper_bound": {}, "verdict": {}})
  monkeypatch.setattr(rev, "run_stages", lambda mode, s, root, names=(): calls.append(
      ("stages", mode, tuple(names))))
  monkeypatch.setattr(rev, "run_readings", lambda root, which, names, s=None: calls.append(
      (which, tuple(names))))
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["rec", "--scale=tiny", f"--workdir={tmp_path}/w", f"--stop_after={stop}",
                 f"--readings={readings}", f"--caps_out={tmp_path}/caps.json"])
    rev.main([])
  assert [c for c in calls if c[0] != "stages"] == taken
  assert [c[1] for c in calls if c[0] == "stages"] == ["recursive", "single"]
