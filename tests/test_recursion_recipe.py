"""Choosing the RL recipe on the validation split: candidates, curves, the rule, the JSON."""
import json
import os

import pytest
from absl import app

from experiments import recursion_evidence as rec
from experiments import recursion_recipe as rr
from rao_jax import metrics as metrics_lib


def _stage(d, minutes=1.0, result=None):
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "stage.json"), "w") as f:
    json.dump({"minutes": minutes, "result": result or {}}, f)


def _rl(root, name, val, depth_limit, outside=None, complete=True):
  d = os.path.join(root, name, "rl")
  w = metrics_lib.MetricsWriter(d, tensorboard=False)
  for step, v in enumerate(val, 1):
    w.write(step, {"success": 0.5, "delegating_share": 1.0,
                   "drift/at_depth_limit": depth_limit[step - 1],
                   "drift/helpers_outside_root": (outside or [0.0] * len(val))[step - 1],
                   "drift/update_applied": 1.0, "learner/no_signal": 0.0}, prefix="train/")
    w.write(step, {"success_val": v}, prefix="eval/")
  w.close()
  if complete:
    _stage(d, 30.0, {"step": len(val)})


def test_recipes_and_candidates_parse_with_clear_errors():
  assert rec.parse_recipe("lr=1e-4,lam=0,rl_steps=4,drop_equal_groups=false") == {
      "lr": 1e-4, "lam": 0, "rl_steps": 4, "drop_equal_groups": False}
  with pytest.raises(ValueError, match=r"'beta=1'.*KEY one of"):
    rec.parse_recipe("beta=1")
  assert rr.parse_candidates(["a:lr=1e-4", "b:lam=0.5"]) == {"a": {"lr": 1e-4},
                                                             "b": {"lam": 0.5}}
  for bad in (["a/b:lr=1"], ["lr=1"], ["a:lr=1", "a:lam=0"]):
    with pytest.raises(app.UsageError):
      rr.parse_candidates(bad)


def test_recipe_reaches_the_rl_config():
  s = dict(rec._SCALES["cpu_rao"], **rec.parse_recipe("lr=1e-4,lam=0,grad_clip=0.5,kl=0.01"))
  c = rec.rl_config_for("recursive", s)
  assert (c.optim.lr, c.rl.lam, c.optim.grad_clip, c.rl.kl_coef) == (1e-4, 0, 0.5, 0.01)
  # The validation split is checked after every step and every checkpoint is kept.
  assert (c.eval.every, c.eval.split, c.eval.num_tasks, c.ckpt.keep) == (1, "val", 16, 5)
  assert c.env.val_tasks == 16


def test_the_rule_picks_on_validation_and_sets_drifting_candidates_aside(tmp_path):
  root = str(tmp_path)
  _stage(os.path.join(root, "val_before"), result={"val": {"success": 0.5}})
  # "fast" reaches the best validation score but fills the depth limit at that step.
  _rl(root, "fast", [0.5, 0.8125, 0.75], [0.0, 0.2, 0.3])
  _rl(root, "slow", [0.5, 0.625, 0.6875], [0.0, 0.0, 0.05])
  _rl(root, "tie", [0.6875, 0.5, 0.5], [0.08, 0.08, 0.08])
  _rl(root, "running", [0.9], [0.0], complete=False)
  cands = rr.parse_candidates(["fast:lr=3e-4", "slow:lr=1e-4", "tie:lr=1e-4",
                               "running:lr=1e-5", "absent:lr=1e-5"])
  out = rr.write(root, rec._SCALES["cpu_rao"], cands, str(tmp_path / "r.json"))
  c = out["candidates"]
  assert c["fast"]["score"] == {"best_step": 2, "best_val": 0.8125, "drifting": True,
                                "at_depth_limit_mean": pytest.approx(0.5 / 3)}
  assert c["slow"]["score"]["best_step"] == 3 and not c["slow"]["score"]["drifting"]
  # slow and tie both reach 0.6875 without drift; slow's depth-limit share is lower.
  assert out["chosen"] == "slow"
  assert out["val_before"] == 0.5 and out["rule"] == rr.RULE
  assert not c["running"]["complete"] and not c["absent"]["complete"]
  assert c["absent"]["score"]["best_val"] is None
  assert c["fast"]["curves"]["val"] == [0.5, 0.8125, 0.75]
  assert json.load(open(tmp_path / "r.json"))["chosen"] == "slow"


def test_val_pick_takes_the_best_and_earliest_validated_step(tmp_path):
  _rl(str(tmp_path), "c", [0.5, 0.75, 0.75, 0.625], [0.0] * 4)
  step, curve = rec.val_pick(str(tmp_path / "c" / "rl"))
  assert step == 2 and curve == [(1, 0.5), (2, 0.75), (3, 0.75), (4, 0.625)]
  assert rec.val_pick(str(tmp_path / "nothing")) == (None, [])


def test_carry_out_and_in_keep_what_resumes_and_refuse_another_warm_start(tmp_path):
  root, dest, again = str(tmp_path / "run"), str(tmp_path / "carry"), str(tmp_path / "next")
  _stage(os.path.join(root, "val_before"), result={"val": {"success": 0.5}})
  _rl(root, "done", [0.5, 0.6], [0.0, 0.0])
  _rl(root, "running", [0.5], [0.0], complete=False)
  for cand, steps in (("done", (1, 2)), ("running", (0, 1))):
    for st in steps:
      ck = os.path.join(root, cand, "rl", "checkpoints", str(st))
      os.makedirs(ck)
      open(os.path.join(ck, "state"), "w").write(f"{cand}{st}")
  open(os.path.join(root, "running", "rl", "trees.jsonl"), "w").write("big")
  m = rr.carry_out("warm", root, dest, fingerprint=lambda d: "aaa")
  # The unfinished candidate's newest checkpoint only; the finished one needs none.
  assert "running/rl/checkpoints/1/" in m["files"]
  assert not any("checkpoints/0" in f or "done/rl/checkpoints" in f for f in m["files"])
  assert "running/rl/metrics.jsonl" in m["files"] and "val_before/stage.json" in m["files"]
  assert not os.path.exists(os.path.join(dest, "running", "rl", "trees.jsonl"))
  with pytest.raises(app.UsageError, match=r"warm start \(recursive bbb, .*ran on recursive aaa"):
    rr.carry_in(dest, "warm", again, fingerprint=lambda d: "bbb")
  assert rr.carry_in(dest, "warm", again, fingerprint=lambda d: "aaa")["restored"] == len(
      m["files"])
  assert open(os.path.join(again, "running", "rl", "checkpoints", "1", "state")).read() == (
      "running1")
  assert rec.val_pick(os.path.join(again, "done", "rl"))[0] == 2


def test_the_seeds_scale_is_the_committed_choice():
  """`cpu_rao_seeds` (what the RL seeds run) is cpu_rao with the recipe the committed recipe
  JSON chose on the validation split: a new choice that is not frozen into the scale fails."""
  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                      "recursion_recipe.json")
  with open(path) as f:
    result = json.load(f)
  chosen = result["chosen"]
  assert chosen is not None and result["candidates"][chosen]["complete"]
  assert result["scale"] == rec._SCALES["cpu_rao"]
  assert rec._SCALES["cpu_rao_seeds"] == dict(rec._SCALES["cpu_rao"],
                                              **result["candidates"][chosen]["recipe"])
