"""Carrying a run between sessions: what goes, what resumes, and refusal on other weights."""
import json
import os

import pytest
from absl import app

from experiments import carry
from experiments import recursion_evidence as rev
from rao_jax import metrics as metrics_lib


def _stage(d, result=None):
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "stage.json"), "w") as f:
    json.dump({"minutes": 1.0, "result": result or {}}, f)


def _rl(d, val, steps, complete):
  w = metrics_lib.MetricsWriter(d, tensorboard=False)
  for step, v in enumerate(val, 1):
    w.write(step, {"success_val": v}, prefix="eval/")
  w.close()
  for st in steps:
    ck = os.path.join(d, "checkpoints", str(st))
    os.makedirs(ck)
    open(os.path.join(ck, "state"), "w").write(f"{d}:{st}")
  open(os.path.join(d, "config.json"), "w").write("{}")
  if complete:
    _stage(d, {"step": len(val)})


def _seed_workdir(tmp_path):
  """A warm start and a seed run on it, linked as --share_stages_from links them: the seed's
  recursive RL is at step 3 of 4 (validation best at step 1), its single RL is complete with
  its held-out evaluation still to run."""
  warm, seed = str(tmp_path / "warm"), str(tmp_path / "seed")
  for mode in ("recursive", "single"):
    for st in ("demos", "sft", "eval_before"):
      _stage(os.path.join(warm, mode, st))
    os.makedirs(os.path.join(warm, mode, "sft", "checkpoints", "8"))
  _stage(os.path.join(warm, "caps"))
  assert "recursive/sft" in rev.share_stages(warm, seed, ("recursive", "single"))
  _rl(os.path.join(seed, "recursive", "rl"), [0.9, 0.8, 0.85], (0, 1, 2, 3), complete=False)
  _rl(os.path.join(seed, "single", "rl"), [0.1, 0.2, 0.2, 0.1], (0, 1, 2, 3, 4), complete=True)
  return warm, seed


def test_a_seed_carries_its_resume_point_and_the_checkpoints_its_evaluations_read(tmp_path):
  warm, seed = _seed_workdir(tmp_path)
  s = {"val_tasks": 16}
  dest = str(tmp_path / "carry")
  fp = {os.path.realpath(os.path.join(warm, m, "sft")): m[:3] for m in ("recursive", "single")}
  fingerprint = lambda d: fp[os.path.realpath(d)]  # noqa: E731
  m = carry.carry_out(rev.sft_dirs(seed, ("recursive", "single")), seed, dest, fingerprint,
                      pending=lambda d: rev.pending_checkpoint(d, s))
  assert m["warm_sha256"] == {"recursive": "rec", "single": "sin"}
  ckpts = sorted(f for f in m["files"] if f.endswith("/"))
  # recursive: the newest (resume) and the validation's pick (step 1); single: its pick (2).
  assert ckpts == ["recursive/rl/checkpoints/1/", "recursive/rl/checkpoints/3/",
                   "single/rl/checkpoints/2/"]
  # The warm start's linked stages belong to the warm start's own carry.
  assert not any(f.startswith(("recursive/sft", "caps", "recursive/eval_before"))
                 for f in m["files"])
  assert "single/rl/stage.json" in m["files"] and "recursive/rl/metrics.jsonl" in m["files"]

  # A later session: the same warm start restores; other weights are refused by name.
  again = str(tmp_path / "again")
  rev.share_stages(warm, again, ("recursive", "single"))
  with pytest.raises(app.UsageError, match=r"single xxx, made here on .*ran on single sin, "
                     r"made on .*run the stages again here without the carry"):
    carry.carry_in(dest, rev.sft_dirs(again, ("recursive", "single")), again,
                   lambda d: "xxx" if "single" in d else fingerprint(d))
  # A stage this session completed itself (here the single RL) keeps its own record.
  _stage(os.path.join(again, "single", "rl"), {"step": 4, "mine": True})
  got = carry.carry_in(dest, rev.sft_dirs(again, ("recursive", "single")), again, fingerprint)
  assert got["restored"] + got["kept_own"] == len(m["files"]) and got["kept_own"] == 1
  with open(os.path.join(again, "single", "rl", "stage.json")) as f:
    assert json.load(f)["result"]["mine"]
  os.remove(os.path.join(again, "single", "rl", "stage.json"))
  got = carry.carry_in(dest, rev.sft_dirs(again, ("recursive", "single")), again, fingerprint)
  assert got["restored"] == len(m["files"])
  rl = os.path.join(again, "recursive", "rl")
  assert carry.checkpoint_steps(os.path.join(rl, "checkpoints")) == [1, 3]
  assert not os.path.exists(os.path.join(rl, "stage.json"))        # it resumes
  assert rev.val_pick(rl)[0] == 1
  assert rev.pending_checkpoint(os.path.join(again, "single", "rl"), s) == 2

  # Once the evaluation ran, its checkpoint is no longer carried.
  _stage(os.path.join(seed, "single", "eval_after"))
  m2 = carry.carry_out(rev.sft_dirs(seed, ("recursive", "single")), seed,
                       str(tmp_path / "carry2"), fingerprint,
                       pending=lambda d: rev.pending_checkpoint(d, s))
  assert not any(f.startswith("single/rl/checkpoints") for f in m2["files"])
  # A reading taken of the warm start keeps the pick until its reading after RL is taken.
  _stage(os.path.join(seed, "recursive", "rl"), {"step": 4})
  _stage(os.path.join(seed, "recursive", "eval_after"))
  rl = os.path.join(seed, "recursive", "rl")
  assert rev.pending_checkpoint(rl, s) is None
  _stage(os.path.join(seed, "recursive", "reading_hard_before"))
  assert rev.pending_checkpoint(rl, s) == 1
  _stage(os.path.join(seed, "recursive", "reading_hard_after"))
  assert rev.pending_checkpoint(rl, s) is None


def test_pending_checkpoint_without_a_validation_split_is_the_newest_of_a_complete_stage(
    tmp_path):
  d = str(tmp_path / "recursive" / "rl")
  _rl(d, [], (0, 2, 4), complete=False)
  assert rev.pending_checkpoint(d, {}) is None
  _stage(d)
  assert rev.pending_checkpoint(d, {}) == 4
  assert rev.pending_checkpoint(str(tmp_path / "recursive" / "sft"), {}) is None


def test_of_several_carries_the_one_made_on_these_weights_is_restored(tmp_path, monkeypatch):
  # A warm start's records from two CPU kinds: the same command gave weights "a" on one and
  # "b" on the other; a run restores the records of the weights it has, whichever is listed
  # first, and names the CPU each was made on.
  made = {}
  for fp_, cpu in (("a", "CPU A"), ("b", "CPU B")):
    src = str(tmp_path / f"run_{fp_}")
    _stage(os.path.join(src, "recursive", "eval_before"), {"weights": fp_})
    monkeypatch.setattr(carry, "cpu_signature", lambda cpu=cpu: {"model": cpu, "isa": ["avx2"]})
    made[fp_] = str(tmp_path / f"warm_{fp_}")
    m = carry.carry_out({"recursive": "sft"}, src, made[fp_], lambda d, fp_=fp_: fp_)
    assert m["cpu"] == {"model": cpu, "isa": ["avx2"]}
  for fp_ in ("a", "b"):
    root = str(tmp_path / f"again_{fp_}")
    got = carry.carry_in([made["a"], made["b"]], {"recursive": "sft"}, root,
                         lambda d, fp_=fp_: fp_)
    assert got["from"] == made[fp_] and got["restored"] == 1
    with open(os.path.join(root, "recursive", "eval_before", "stage.json")) as f:
      assert json.load(f)["result"]["weights"] == fp_
  with pytest.raises(app.UsageError, match=r"no folder matches .*recursive c, .*ran on recursive "
                     r"a, made on CPU A \(avx2\); .*ran on recursive b, made on CPU B"):
    carry.carry_in([made["a"], made["b"]], {"recursive": "sft"}, str(tmp_path / "c"),
                   lambda d: "c")


def test_a_run_of_some_modes_restores_those_modes_only(tmp_path):
  # A warm start's records of both modes, restored by a run of the recursive mode only (the
  # adapter re-evaluation): the single agent's warm start is not built, so its stages are left
  # out rather than the carry refused.
  src, dest = str(tmp_path / "src"), str(tmp_path / "c")
  for st in ("recursive/eval_before", "single/eval_before", "caps"):
    _stage(os.path.join(src, st))
  carry.carry_out({"recursive": "a", "single": "b"}, src, dest, lambda d: d)
  root = str(tmp_path / "x")
  got = carry.carry_in(dest, {"recursive": "a"}, root, lambda d: d)
  assert got["modes_left_out"] == ["single"] and got["warm_sha256"] == {"recursive": "a"}
  assert os.path.exists(os.path.join(root, "recursive", "eval_before", "stage.json"))
  assert os.path.exists(os.path.join(root, "caps", "stage.json"))
  assert not os.path.exists(os.path.join(root, "single"))
  with pytest.raises(app.UsageError, match=r"this run builds none of them"):
    carry.carry_in(dest, {"other": "a"}, root, lambda d: d)


def test_readings_after_rl_read_the_step_the_held_out_evaluation_reads(tmp_path, monkeypatch):
  root = str(tmp_path)
  _rl(os.path.join(root, "recursive", "rl"), [0.9, 0.95, 0.8], (1, 2, 3), complete=True)
  seen = []
  monkeypatch.setattr(rev, "reading_stage", lambda src, name, step=None: (
      lambda d: seen.append((os.path.basename(src), name, step)) or {}))
  rev.run_readings(root, "after", ("hard",), {"val_tasks": 16})
  rev.run_readings(root, "before", ("hard",), {"val_tasks": 16})
  rev.run_readings(str(tmp_path / "noval"), "after", ("other_world",), {})
  assert seen == [("rl", "hard", 2), ("sft", "hard", None), ("rl", "other_world", None)]
