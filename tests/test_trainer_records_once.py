"""A resumed run records each step once: what a killed attempt wrote after the checkpoint it is
resumed from moves aside (readable, never dropped), crash-safely.

The end-to-end test SIGKILLs a real training process between a step's metrics row and that
step's checkpoint (from the checkpoint hook, after the previous checkpoint is on disk), then
resumes in the same workdir: the tiny random SmolLM2 of test_trainer.py, through the same
loading, engine, sandbox, runner, learner and checkpoint code as `python -m experiments.train`.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rao_jax import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(wd, steps, torn=True):
  """A workdir as a run killed during step `steps + 1` leaves it: train and eval rows, tree
  files (numbered by step index) and evaluation folders, and a torn last line."""
  os.makedirs(os.path.join(wd, "trees"))
  with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
    for s in range(1, steps + 1):
      f.write(json.dumps({"step": s, "train/reward": s / 10}) + "\n")
      if s % 2 == 0:
        f.write(json.dumps({"step": s, "eval/success_easy": 0.5}) + "\n")
        os.makedirs(os.path.join(wd, "eval", f"step_{s:06d}"))
        open(os.path.join(wd, "eval", f"step_{s:06d}", "trees.jsonl"), "w").write("{}\n")
    if torn:
      f.write('{"step": %d, "train/rew' % (steps + 1))
  for i in range(steps + 1):
    open(os.path.join(wd, "trees", f"step_{i:06d}.jsonl"), "w").write(f'{{"i": {i}}}\n')


def _aside_dirs(wd):
  root = os.path.join(wd, "superseded")
  return sorted(os.listdir(root)) if os.path.isdir(root) else []


def test_rows_and_files_after_the_restored_step_move_aside(tmp_path):
  wd = str(tmp_path)
  _write_run(wd, 4)
  moved = metrics_lib.set_aside_superseded(wd, 2, {"trees": 2, "eval": 3})
  assert moved == {"metrics": 4, "trees": 3, "eval": 1}
  kept = metrics_lib.read_metrics(os.path.join(wd, "metrics.jsonl"))
  assert [(r["step"], "eval/success_easy" in r) for r in kept] == [(1, False), (2, False),
                                                                    (2, True)]
  assert open(os.path.join(wd, "metrics.jsonl"), "rb").read().endswith(b"\n")
  aside = metrics_lib.read_metrics(os.path.join(wd, "metrics.superseded.jsonl"))
  assert [r.get("step") for r in aside] == [3, 4, 4, None]
  assert aside[-1]["unreadable_line"] == '{"step": 5, "train/rew'
  assert {r["superseded"]["resumed_from_step"] for r in aside} == {2}
  assert aside[0]["train/reward"] == 0.3
  assert sorted(os.listdir(os.path.join(wd, "trees"))) == ["step_000000.jsonl",
                                                            "step_000001.jsonl"]
  assert sorted(os.listdir(os.path.join(wd, "eval"))) == ["step_000002"]
  (attempt,) = _aside_dirs(wd)
  assert attempt.endswith("-step000002")
  d = os.path.join(wd, "superseded", attempt)
  assert sorted(os.listdir(os.path.join(d, "trees"))) == [f"step_{i:06d}.jsonl" for i in (2, 3, 4)]
  assert open(os.path.join(d, "trees", "step_000003.jsonl")).read() == '{"i": 3}\n'
  assert os.listdir(os.path.join(d, "eval")) == ["step_000004"]
  # Nothing left to move: the files stay as they are.
  before = open(os.path.join(wd, "metrics.jsonl"), "rb").read()
  assert metrics_lib.set_aside_superseded(wd, 2, {"trees": 2, "eval": 3}) == {
      "metrics": 0, "trees": 0, "eval": 0}
  assert open(os.path.join(wd, "metrics.jsonl"), "rb").read() == before


def test_a_crash_during_the_rewrite_loses_nothing(tmp_path, monkeypatch):
  wd = str(tmp_path)
  _write_run(wd, 3, torn=False)
  original = open(os.path.join(wd, "metrics.jsonl"), "rb").read()
  real, calls = metrics_lib.write_atomically, []

  def crash_on_second(path, data):
    calls.append(path)
    if len(calls) == 2:    # the aside file is written; the process dies before the rewrite
      raise KeyboardInterrupt("killed")
    real(path, data)
  monkeypatch.setattr(metrics_lib, "write_atomically", crash_on_second)
  with pytest.raises(KeyboardInterrupt):
    metrics_lib.set_aside_superseded(wd, 1, {"trees": 1})
  assert open(os.path.join(wd, "metrics.jsonl"), "rb").read() == original
  assert not [n for n in os.listdir(wd) if ".tmp-" in n]
  monkeypatch.setattr(metrics_lib, "write_atomically", real)
  # The next resume finishes the job and writes no row aside twice.
  metrics_lib.set_aside_superseded(wd, 1, {"trees": 1})
  assert [r["step"] for r in metrics_lib.read_metrics(os.path.join(wd, "metrics.jsonl"))] == [1]
  aside = metrics_lib.read_metrics(os.path.join(wd, "metrics.superseded.jsonl"))
  assert [r["step"] for r in aside] == [2, 2, 3]
  assert sorted(os.listdir(os.path.join(wd, "trees"))) == ["step_000000.jsonl"]


# ---- a real run, killed between a step's metrics row and its checkpoint ----------------------

OVERRIDES = {
    "total_steps": 3, "agent.max_new_tokens": 16, "agent.max_steps_per_agent": 2,
    "agent.context_window": 1024, "rollout.max_cache_len": 1024, "rollout.num_slots": 4,
    "learner.row_len": 1024, "learner.mesh": "data=2", "rl.tasks_per_step": 1,
    # No gradient signal from a random model's equal rewards, so the learner step is skipped
    # (the records, not the update, are under test; the state is checkpointed all the same).
    "rl.kl_coef": 0.0, "ckpt.every": 1, "eval.every": 2, "eval.num_tasks": 1,
    "log.progress": False, "log.tensorboard": True, "warmup": False,
}

CHILD = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, {root!r})
    from rao_jax import trainer as tr
    sys.path.insert(0, {tests!r})
    import test_trainer_records_once as t

    real_hooks = tr.Trainer.hooks

    def hooks(self, repls, stopper, state):
      out = real_hooks(self, repls, stopper, state)
      for h in out:
        if h.name == "checkpoint":
          save = h.fn
          def killing(step, m, save=save):
            if step == {kill_at}:   # its metrics row and evaluation are written, no checkpoint
              self.learner.wait_for_checkpoints()   # the previous checkpoint is on disk
              os.kill(os.getpid(), signal.SIGKILL)
            return save(step, m)
          h.fn = killing
      return out

    tr.Trainer.hooks = hooks
    tr.train(t.config({model!r}), {wd!r})
""")


def config(model_dir):
  from experiments.configs import textcraft_synth
  c = textcraft_synth.get_config("recursive,smoke")
  c.model.name = model_dir
  for key, value in OVERRIDES.items():
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c



def _train_steps(rows):
  return [r["step"] for r in rows if "train/success" in r]


@pytest.mark.slow
def test_sigkill_between_metrics_and_checkpoint_then_resume(tiny_hf_dir, tmp_path):
  from rao_jax import trainer
  from rao_jax.agent import records as R
  wd = str(tmp_path / "run")
  child = CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"), kill_at=2,
                       model=tiny_hf_dir, wd=wd)
  proc = subprocess.run([sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  metrics = os.path.join(wd, "metrics.jsonl")
  killed_rows = metrics_lib.read_metrics(metrics)
  # The kill landed where it should: step 2 logged (and evaluated), only step 1 checkpointed.
  assert _train_steps(killed_rows) == [1, 2]
  assert [r["step"] for r in killed_rows if "eval/time/eval_s" in r] == [2]
  assert sorted(d for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()) == ["1"]
  killed_tree = open(os.path.join(wd, "trees", "step_000001.jsonl")).read()

  res = trainer.train(config(tiny_hf_dir), wd)
  assert res["step"] == 3 and res["checkpoint"] == 3
  rows = metrics_lib.read_metrics(metrics)
  assert _train_steps(rows) == [1, 2, 3]                   # each step once, none missing
  assert [r["step"] for r in rows if "eval/time/eval_s" in r] == [2, 3]
  # Rows are in step order: the resumed attempt continues the file where step 1 ended.
  assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)
  assert sorted(os.listdir(os.path.join(wd, "trees"))) == [f"step_{i:06d}.jsonl" for i in range(3)]
  assert sorted(os.listdir(os.path.join(wd, "eval"))) == ["step_000002", "step_000003"]

  # The killed attempt's step 2 is aside, readable, marked with the resume that replaced it.
  aside = metrics_lib.read_metrics(os.path.join(wd, "metrics.superseded.jsonl"))
  assert sorted(r["step"] for r in aside) == [2, 2]
  assert all(r["superseded"]["resumed_from_step"] == 1 for r in aside)
  assert [r for r in aside if "train/success" in r][0] == dict(
      [r for r in killed_rows if "train/success" in r and r["step"] == 2][0],
      superseded=aside[0]["superseded"])
  (attempt,) = _aside_dirs(wd)
  d = os.path.join(wd, "superseded", attempt)
  assert os.listdir(os.path.join(d, "trees")) == ["step_000001.jsonl"]
  assert open(os.path.join(d, "trees", "step_000001.jsonl")).read() == killed_tree
  assert R.load_trees_jsonl(os.path.join(d, "trees", "step_000001.jsonl"))
  assert os.listdir(os.path.join(d, "eval")) == ["step_000002"]
