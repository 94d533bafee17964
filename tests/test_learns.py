"""RAO learns: the real training loop raises a tiny policy's success on the micro-environment.

`experiments/configs/micro.py:setup` builds a tiny Llama-family policy (own BPE tokenizer,
short supervised warm start, exported as an HF folder) and the run's config from
`base_config()`; `rao_jax.trainer.Trainer` then runs it exactly as `experiments.train` would:
embedded engine, bwrap-sandboxed REPL, verifier, leave-one-out advantages, packing, the jitted
learner step and the weight sync into the engine after every step.

The same run with lr=0 (same seeds, hence the same tasks at every step) is the control: its
success may drift by sampling noise only. Each answer is one generated token (see
`rao_jax/envs/micro.py`), so a flipped advantage sign, a loss mask shifted by one token or an
engine that keeps its old weights each leave the trained run no better than the control, and
this test fails. Checked by hand on seed 0 with the same warm start (windows of 10 of 30
steps; "gain" = rise minus the control's rise +0.06; "lead" = trained minus control over the
last 10 steps, same tasks). At lr 2e-3 (the config): gain +0.20, lead +0.19 (seed 1: +0.14,
+0.20). The breakages were run at lr 3e-3 (correct code there: gain +0.27, lead +0.23):
  advantage sign flipped  gain -0.18, lead -0.44   (collapses to 0% success by step 5)
  mask one token late     gain +0.00, lead +0.01   (the answer token never gets a gradient)
  mask one token early    gain -0.21, lead -0.23   (run at lr 5e-3)
  engine keeps weights    gain -0.03, lead -0.01   (samples the warm start all along)
"""
import json
import os

import numpy as np
import pytest

from experiments import micro_policy
from experiments.configs import micro as micro_config

# The two Trainer runs (152 s on an idle 2-core machine) are `long`: `make test-fast` leaves
# them out, and tests/test_learns_to_delegate.py runs the same loop (one-token turns, a trained
# run against its lr=0 control, a flipped sign measured to fail there too) and also needs the
# helpers' credit to be right; the mask and weight-sync breakages above were measured here.
LONG = pytest.mark.long
WINDOW = 10      # steps averaged at the start and at the end of a run (each step: 4 tasks)
MARGIN = 0.12    # what the trained run must gain over the control (seeds 0, 1: 0.20, 0.14)


def _train_success(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return np.asarray([r["train/success"] for r in rows if "train/success" in r])


def test_micro_env_answers_are_one_token_and_verified():
  from rao_jax.agent import code
  from rao_jax.envs import base, micro, registry
  env = registry.make_env("micro", {"num_answers": 3})
  assert env.cfg.num_answers == 3
  assert {t.fields["answer"] for t in env.tasks("train")} == {"0", "1", "2"}
  tok = micro_policy.tokenizer_for(env)
  for d in "0123456789":
    ids = tok.encode(micro.answer_cell(d))
    assert len(ids) == 1, (d, ids)
    assert code.extract_code(tok.decode(ids, skip_special_tokens=True)) == f'finish("{d}")'
  task = env.tasks("train")[0]
  node = base.NodeInfo("0", None, 0, task.goal, task.fields, 1)
  ep = env.new_episode(task)

  def outcome(finished, message):
    return base.NodeOutcome(node, finished, message, "finish", 1, 1)

  right, wrong = task.fields["answer"], str((int(task.fields["answer"]) + 1) % 3)
  assert env.verify_root(ep, outcome(True, right)) == 1.0
  assert env.verify_root(ep, outcome(True, wrong)) == 0.0
  assert env.verify_root(ep, outcome(False, "")) == 0.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  from rao_jax import trainer
  root = tmp_path_factory.mktemp("learns")
  config = micro_config.setup(str(root))
  out = {}
  for name, lr in (("trained", config.optim.lr), ("control", 0.0)):
    c = micro_config.setup(str(root))   # the policy folder exists: only the config is made
    c.optim.lr = lr
    res = trainer.train(c, str(root / name))
    assert res["step"] == c.total_steps and not res["stopped"]
    out[name] = _train_success(str(root / name))
  with open(os.path.join(config.model.name, "warm_start.json")) as f:
    out["warm_start"] = json.load(f)
  return out


@LONG
@pytest.mark.slow
def test_warm_start_leaves_room_to_learn(runs):
  # No gradient signal at 0% (every group fails) nor room at 100%.
  assert 0.05 <= runs["warm_start"]["success"] <= 0.6, runs["warm_start"]


@LONG
@pytest.mark.slow
def test_success_rises_beyond_the_lr0_control(runs):
  trained, control = runs["trained"], runs["control"]
  assert len(trained) == len(control) <= 30
  rise = trained[-WINDOW:].mean() - trained[:WINDOW].mean()
  control_rise = control[-WINDOW:].mean() - control[:WINDOW].mean()
  # Both runs drew the same tasks at every step, so the control's drift is the task mix and
  # sampling noise (seed 1: -0.11): the trained run must rise by MARGIN more than it, and
  # lead it by MARGIN over the last steps (like for like).
  lead = trained[-WINDOW:].mean() - control[-WINDOW:].mean()
  report = (f"trained {np.round(trained, 2).tolist()}\ncontrol {np.round(control, 2).tolist()}\n"
            f"rise {rise:.3f}, control rise {control_rise:.3f}, lead at the end {lead:.3f}")
  assert control_rise < MARGIN, report
  assert rise - control_rise >= MARGIN, report
  assert lead >= MARGIN, report
