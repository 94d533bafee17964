"""The main job end to end on a tiny random model: train, checkpoint, resume, evaluate, stop.

The model is a random-weights ModelConfig.tiny() of SmolLM2 written as an HF folder, so the
run goes through the same loading, engine, sandbox, runner, learner and checkpoint code that
`python -m experiments.train` uses; only the weights are small.
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments.configs import textcraft_synth

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _config(model_dir, total_steps=2):
  c = textcraft_synth.get_config("recursive,smoke")
  c.model.name = model_dir
  c.total_steps = total_steps
  c.agent.max_new_tokens = 16
  c.agent.max_steps_per_agent = 2
  c.agent.context_window = 1024
  c.rollout.max_cache_len = 1024
  c.rollout.num_slots = 4
  c.rl.kl_coef = 0.01          # keeps every node in the batch, and the step runs at s = 0:
  c.rl.update_without_signal = True   # the tiny random policy never succeeds (no signal)
  c.rl.drop_equal_groups = False   # (its groups are all equal: keep them)
  c.learner.row_len = 1024
  # Rows sharded over two of the suite's eight fake CPU devices: "auto" (all eight) pads every
  # micro-batch to 8 rows, which on 2 cores made each learner step ~35 s instead of ~5.
  c.learner.mesh = "data=2"
  c.eval.every = 2
  c.eval.num_tasks = 1
  c.log.progress = False
  c.log.tensorboard = True
  return c


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f]


def test_assemble_builds_each_part_once_as_the_config_says(tiny_hf_dir, tmp_path):
  """The Trainer's parts (`experiment.assemble`), each what the config's own builder makes; in
  this module for its tiny model (the cheap checks of assembly: test_experiment_assemble.py)."""
  from rao_jax import experiment as X
  c = _config(tiny_hf_dir)
  c.env.val_tasks, c.eval.split, c.rl.task_weights = 3, "val", "target_items:1=3"
  c.ckpt.init_from = str(tmp_path / "sft")   # read by the Trainer when nothing resumes
  wd = str(tmp_path / "run")
  parts = X.assemble(c, wd)
  assert parts.workdir == wd and json.load(open(os.path.join(wd, "config.json")))["env"][
      "val_tasks"] == 3
  assert parts.rl == X.rl_config(c)
  # Tasks: RL draws from the train tasks without the validation split, which is what the
  # in-loop evaluation scores (eval.split = "val"); the rule's weights are each train task's.
  train, val = X.train_and_val_tasks(X.make_env(c), c)
  ids = lambda tasks: [t.task_id for t in tasks]
  assert ids(parts.train_tasks) == ids(train) and len(val) == 3
  assert [(name, ids(tasks)) for name, tasks in parts.eval_sets] == [
      ("val", ids(val[:c.eval.num_tasks]))]
  np.testing.assert_array_equal(parts.task_weights, X.task_weights(train, "target_items:1=3"))
  assert parts.train_seed == c.env.train_seed and parts.train_difficulty == "easy"
  # Policy and learner: one mesh for the learner and the remat plan ("auto" planned).
  assert parts.learner == X.learner_config(c, wd)
  assert dict(parts.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 1}
  assert parts.remat == parts.model_cfg.remat and parts.remat in ("none", "dots", "full")
  assert parts.initial == X.InitialWeights(
      checkpoints=os.path.join(wd, "checkpoints"), init_from=str(tmp_path / "sft"),
      init_from_dir=str(tmp_path / "sft" / "checkpoints"), pretrained=tiny_hf_dir)
  # Rollouts: the engine, runners, judges and sandboxes the config's own builders make.
  assert parts.engine == X.engine_spec(c, export_dir=os.path.join(wd, "weights"))
  assert parts.engine.embedded == X.engine_config(c) and parts.engine.max_cache_len == 1024
  assert parts.train_runner == X.runner_config(c)
  assert parts.eval_runner == X.runner_config(c, greedy=True, seed=c.env.eval_seed)
  assert (parts.train_judge, parts.eval_judge) == (X.judge_spec(c, "train"),
                                                   X.judge_spec(c, "eval"))
  assert parts.sandbox == X.sandbox_config(c) and parts.sandbox_pool_size == c.sandbox.pool_size
  assert (parts.warmup, parts.eval_every, parts.tensorboard, parts.progress) == (
      True, 2, True, False)
  # The policy goes to one learner: the parts let go of it.
  model = parts.take_model()
  assert model.cfg is parts.model_cfg and parts.model is None
  with pytest.raises(RuntimeError, match="taken already"):
    parts.take_model()


def test_train_resume_and_evaluate(tiny_hf_dir, tmp_path):
  from rao_jax import evaluation, trainer
  wd = str(tmp_path / "run")
  res = trainer.train(_config(tiny_hf_dir, 2), wd)
  assert res["step"] == 2 and not res["stopped"]
  rows = _metrics(wd)
  train_steps = [r["step"] for r in rows if "train/success" in r]
  assert train_steps == [1, 2]
  row = [r for r in rows if "train/success" in r][-1]
  for key in ("train/reward", "train/learner/loss", "train/rollout/tokens_per_s",
              "train/time/rollout_s", "train/time/learner_s", "train/tree_depth",
              "train/rl/source_frac/verifier", "train/rl/reward/depth_0",
              "train/drift/at_depth_limit", "train/drift/update_applied",
              "train/drift/groups_all_equal", "train/rl/signal"):
    assert key in row, (key, sorted(row))
  assert any("eval/success_easy" in r for r in rows)
  assert any("eval/drift/at_depth_limit" in r for r in rows)
  assert os.path.exists(os.path.join(wd, "plot.png"))
  assert os.path.exists(os.path.join(wd, "eval", "step_000002", "trees.html"))
  assert os.listdir(os.path.join(wd, "tensorboard"))
  assert sorted(os.listdir(os.path.join(wd, "trees"))) == ["step_000000.jsonl",
                                                           "step_000001.jsonl"]

  # Restarting with more steps resumes at the saved data position.
  res = trainer.train(_config(tiny_hf_dir, 3), wd)
  assert res["step"] == 3
  assert [r["step"] for r in _metrics(wd) if "train/success" in r] == [1, 2, 3]

  ev = evaluation.evaluate_checkpoint(wd, num_tasks=1)
  assert ev["step"] == 3
  assert set(ev["modes"]) == {"recursive", "single"}
  for per in ev["modes"].values():
    assert 0.0 <= per["easy"]["success"] <= 1.0 and per["easy"]["num_tasks"] == 1
    # The embedded engine's time split is recorded with the evaluation.
    eng = per["easy"]["engine"]
    assert eng["decode_calls"] >= 1 and eng["decode_s"] > 0 and 0 < eng["occupancy"] <= 1
    assert eng["engine_busy_s"] + eng["engine_idle_s"] >= per["easy"]["wall_s"] * 0.99
  assert os.path.exists(os.path.join(ev["out_dir"], "trees.html"))
  with pytest.raises(ValueError, match="available steps"):
    evaluation.evaluate_checkpoint(wd, step=99, num_tasks=1)


def test_sigterm_saves_a_checkpoint_and_the_same_command_resumes(tiny_hf_dir, tmp_path):
  wd = str(tmp_path / "run")
  cmd = [sys.executable, "-m", "experiments.train",
         "--config=experiments/configs/textcraft_synth.py:recursive,smoke", f"--workdir={wd}",
         f"--config.model.name={tiny_hf_dir}", "--config.total_steps=50",
         "--config.agent.max_new_tokens=16", "--config.agent.max_steps_per_agent=2",
         "--config.agent.context_window=1024", "--config.rollout.max_cache_len=1024",
         "--config.learner.row_len=1024", "--config.learner.mesh=data=2",
         "--config.rl.kl_coef=0.01", "--config.rl.update_without_signal=True",
         "--config.rl.drop_equal_groups=False",
         "--config.ckpt.every=1000", "--config.eval.every=1000", "--config.log.progress=False"]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  metrics = os.path.join(wd, "metrics.jsonl")
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
      break
    time.sleep(0.5)
  assert proc.poll() is None, proc.stdout.read()
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=180)
  assert proc.returncode == 0, out
  steps = sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit())
  assert steps and steps[-1] >= 1, (steps, out)
  done = len([1 for l in open(metrics) if "train/success" in l])
  assert steps[-1] == done
  # The same command resumes from there (run it for one more step only).
  cmd2 = [a if not a.startswith("--config.total_steps") else f"--config.total_steps={done + 1}"
          for a in cmd]
  out = subprocess.run(cmd2, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout + out.stderr
  assert [r["step"] for r in _metrics(wd) if "train/success" in r] == list(range(1, done + 2))


def test_training_ends_once_an_evaluation_reaches_stop_at_success(tiny_hf_dir, tmp_path,
                                                                  monkeypatch):
  """With eval.stop_at_success, the loop ends after the step whose evaluation reaches it (its
  checkpoint saved), and the same command run again trains no further."""
  from rao_jax import trainer
  successes = {1: 0.5, 2: 1.0, 3: 1.0, 4: 1.0}
  seen = []

  async def evaluate(self, repls, step):   # the evaluation's figures, not its trees
    del repls
    seen.append(step)
    return {f"success_{name}": successes[step] for name, _ in self.parts.eval_sets}

  monkeypatch.setattr(trainer.Trainer, "evaluate", evaluate)
  c = _config(tiny_hf_dir, 4)
  c.eval.every, c.eval.stop_at_success, c.log.tensorboard = 1, 1.0, False
  wd = str(tmp_path / "run")
  res = trainer.train(c, wd)
  assert (res["step"], res["stopped_at_success"], res["checkpoint"]) == (2, 2, 2)
  assert seen == [1, 2] and not res["stopped"]
  assert [r["step"] for r in _metrics(wd) if "train/success" in r] == [1, 2]
  res = trainer.train(c, wd)            # resumed: its metrics already reached it
  assert (res["step"], res["stopped_at_success"]) == (2, 2) and seen == [1, 2]
  c.eval.stop_at_success = 0.0          # off: the run goes on to its total
  assert trainer.train(c, wd)["step"] == 4 and seen == [1, 2, 3, 4]
