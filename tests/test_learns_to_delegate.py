"""RAO teaches delegation: on tasks one agent cannot hold, the real loop raises both root success
and the share of trees that delegate, beyond an lr=0 control.

The environment (`rao_jax/envs/delegation.py`, config `experiments/configs/delegation.py`):
a task names k = 2 digits and is solved by finishing with both; every agent has one turn of
one token, so one agent answers at most one part (1/k, success 0: measured below), while a
root that emits the one-token delegation cell launches a helper per part, and a helper given
one part answers it with one token. The warm start (`experiments/micro_policy.py`) delegates
about half the time and its helpers answer about 40% of parts, so root success starts near
0.1 and both decisions have room.

`trainer.Trainer` runs it as `experiments.train` would (embedded engine, bwrap sandboxes,
verifiers for roots and helpers, leave-one-out advantages, depth weights, packing, the jitted
learner step, weight sync), then the same run at lr=0 on the same seed (the same weights at
step 0, the same tasks at every step). `experiments.configs.delegation.learning_verdict`
compares them: over the last 10 of 30 steps, success and delegating share must each lead the
control's by 0.15 (why the lead and not a rise from the first steps: the comment above
END, MARGIN there; `test_verdict_passes_a_fast_learner_and_fails_runs_that_do_not_learn`).

Figures from `benchmarks/bench_rao_ablations.py` at commit 1140779, before the sampler fix
(same config; success gain / success lead / delegating gain, seeds 0 and 1, "gain" being the
rise over the first 5 steps minus the control's, which the verdict read until 2026-12-07;
the verdict now reads the leads: (a) and (c) trail the control in success and still fail;
the current run's passes per variant are its JSON's `test_passes`):
  full RAO                              +0.35 / +0.28 / +0.30    +0.26 / +0.28 / +0.34   passes
  (a) root-only training                -0.14 / -0.12 / +0.22    -0.15 / -0.10 / +0.28   fails
      (the roots learn to delegate, and the delegation cell reinforced at depth 0 spreads to
      the untrained helpers: at step 30 of seed 0, 16 of 24 helpers delegated in turn and
      failed, helpers' success 0.4 -> 0.05)
  (c) advantage sign flipped            -0.02 / -0.13 / -0.42    -0.03 / -0.10 / -0.16   fails
  (b) helpers' baselines from another group (shuffled across tasks)
                                        +0.33 / +0.32 / +0.29    +0.23 / +0.19 / +0.38   passes
(b) is not a bias: a baseline that does not depend on the helper's own action leaves the
expected gradient unchanged, and here every group's tasks are alike, so another group's
baseline is nearly as good a control variate; the curves cannot tell it apart at this scale.
`test_helpers_are_credited_against_their_own_groups_baseline` catches it on the run's own
trees (it fails when rewards.py takes helpers' baselines from another group).
"""
import json
import os

import numpy as np
import pytest

from experiments.configs import delegation as cfg_lib


def _curves(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  rows = [r for r in rows if "train/success" in r]
  return {"success": [r["train/success"] for r in rows],
          "delegating": [r.get("train/delegating_share", 0.0) for r in rows]}


def test_one_agent_answers_at_most_one_part_and_helpers_solve_the_task():
  # The scripted policies measure the environment's caps through the real runtime: the best
  # single agent (the first digit) gets 1/k of the parts and no task; delegating roots with
  # right helpers solve every task.
  from experiments import micro_policy
  from rao_jax import experiment as X
  from rao_jax.envs import delegation
  for k in (2, 3):
    c = cfg_lib.get_config(f"parts={k}")
    env = X.make_env(c)
    tok = micro_policy.tokenizer_for(env)
    for cell in delegation.CELLS:
      assert len(tok.encode(cell)) == 1, cell
    tasks = env.tasks("test")[:6]

    def policy(p_delegate):
      rng = np.random.default_rng(0)
      return lambda text, n: delegation.demonstration(micro_policy.user_goal(text), rng,
                                                      p_delegate)
    single = micro_policy.grow_trees(env, tok, X.runner_config(c, recursive=False), tasks,
                                     policy(0.0))
    assert [t.nodes[0].success for t in single] == [0.0] * len(tasks)
    assert [t.meta["episode"]["parts_right"] for t in single] == [pytest.approx(1 / k)] * 6
    # Even a single agent that could write the answer cell of a two-digit string cannot: its
    # one token is one cell, and no cell finishes with more than one digit.
    rec = micro_policy.grow_trees(env, tok, X.runner_config(c), tasks, policy(1.0))
    assert [t.nodes[0].success for t in rec] == [1.0] * len(tasks)
    assert all(len(t.nodes) == 1 + k and all(n.success == 1.0 for n in t.nodes) for t in rec)
    # A helper that delegates in turn hits the depth limit and fails its part.
    assert c.agent.max_depth == 1


def _group_loo_baselines(trees, lam, baseline):
  """Each tree's leave-one-out baseline, computed here from the recorded successes alone.

  `baseline` is the run's `rl.baseline`: "loo_success" averages the other roots' success
  s(r_j), "loo" (the paper's) their reward R(r_j) = s(r_j) + lam * mean s(children).
  """
  if baseline not in ("loo_success", "loo"):
    raise ValueError(f"this check knows the leave-one-out baselines, not {baseline!r}")
  root_r = {}
  for t in trees:
    kids = [n for n in t.nodes if n.parent_id == "0"]
    bonus = lam * np.mean([n.success for n in kids]) if kids else 0.0
    root_r[t.tree_id] = t.nodes[0].success + (bonus if baseline == "loo" else 0.0)
  out = {}
  for t in trees:
    mates = [u.tree_id for u in trees if u.group_id == t.group_id and u.tree_id != t.tree_id]
    out[t.tree_id] = np.mean([root_r[m] for m in mates])
  return out


# Recorded curves (train success, delegating share per step; seed 0, this config, one warm
# start: its exact delegation probability is 0.58, on the control's steps 0-4 and last 10
# alike, measured with micro_policy.Probe per task). "fast": the trained run and its control
# of a run at f703884 that the rise-over-the-first-5-steps verdict failed (delegating gain
# +0.05) though it learned; "control2": a second lr=0 run at 229dbf7; "flipped": the run at
# 229dbf7 with every advantage's sign flipped (Learner.advantages patched in a script).
_FAST = {
    "success": [0.33, 0.08, 0.08, 0.08, 0.08, 0.17, 0.33, 0.42, 0.25, 0.17, 0.0, 0.17, 0.33,
                0.25, 0.0, 0.33, 0.67, 0.33, 0.58, 0.58, 0.5, 0.5, 0.58, 0.33, 0.83, 0.58,
                0.83, 0.58, 0.58, 0.83],
    "delegating": [0.75, 0.5, 0.5, 0.92, 0.67, 0.92, 0.92, 1.0, 0.92, 0.92, 0.67, 0.75, 0.92,
                   0.92, 1.0, 0.92, 1.0, 0.92, 1.0, 0.92, 1.0, 0.92, 0.92, 1.0, 1.0, 1.0, 1.0,
                   0.92, 1.0, 1.0]}
_CONTROL = {
    "success": [0.25, 0.17, 0.0, 0.17, 0.08, 0.0, 0.08, 0.08, 0.0, 0.08, 0.17, 0.08, 0.0, 0.0,
                0.0, 0.25, 0.08, 0.0, 0.25, 0.08, 0.08, 0.25, 0.08, 0.25, 0.25, 0.08, 0.17,
                0.58, 0.17, 0.08],
    "delegating": [0.75, 0.42, 0.33, 0.42, 0.25, 0.5, 0.67, 0.58, 0.42, 0.33, 0.83, 0.58, 0.5,
                   0.5, 0.33, 0.5, 0.58, 0.25, 0.33, 0.67, 0.75, 0.75, 0.83, 0.83, 0.58, 0.42,
                   0.58, 0.75, 0.58, 0.83]}
_CONTROL2 = {
    "success": [0.17, 0.0, 0.0, 0.0, 0.17, 0.0, 0.25, 0.08, 0.25, 0.08, 0.25, 0.17, 0.0, 0.08,
                0.25, 0.17, 0.08, 0.08, 0.17, 0.0, 0.17, 0.0, 0.0, 0.17, 0.17, 0.0, 0.08, 0.42,
                0.17, 0.0],
    "delegating": [0.75, 0.5, 0.42, 0.67, 0.42, 0.17, 0.75, 0.75, 0.75, 0.83, 0.67, 0.5, 0.5,
                   0.33, 0.33, 0.5, 0.33, 0.25, 0.42, 0.5, 0.58, 0.58, 0.67, 0.75, 0.58, 0.42,
                   0.58, 0.75, 0.58, 0.83]}
_FLIPPED = {
    "success": [0.17, 0.0, 0.08] + [0.0] * 27,
    "delegating": [0.83, 0.5, 0.33, 0.25, 0.17, 0.0, 0.08, 0.17, 0.0, 0.25, 0.17, 0.08, 0.08,
                   0.25, 0.08, 0.17, 0.08, 0.17, 0.08, 0.0, 0.25, 0.0, 0.33, 0.0, 0.25, 0.0,
                   0.08, 0.17, 0.08, 0.08]}


def test_verdict_passes_a_fast_learner_and_fails_runs_that_do_not_learn():
  verdict = cfg_lib.learning_verdict
  # A run that learns to delegate within its first steps and sits at the ceiling of 1 after:
  # the lead over the control on the same tasks is the training's effect, whichever lr=0
  # sample it is read against.
  for control in (_CONTROL, _CONTROL2):
    v = verdict(_FAST, control)
    assert v["passes"], v["report"]
    assert v["delegating_lead"] > 0.25 and v["success_lead"] > 0.4, v["report"]
  # Runs that do not learn: the control against itself and against another lr=0 run (either
  # way round), and a broken estimator (sign flipped), which unlearns.
  for trained, control in ((_CONTROL, _CONTROL), (_CONTROL, _CONTROL2), (_CONTROL2, _CONTROL),
                           (_FLIPPED, _CONTROL), (_FLIPPED, _CONTROL2)):
    v = verdict(trained, control)
    assert not v["passes"], v["report"]
  # Either metric alone fails it: a run that delegates more without solving more does not
  # pass, nor one whose success rose with a delegating share no higher than the control's.
  half = {"success": _FAST["success"], "delegating": _CONTROL["delegating"]}
  assert not verdict(half, _CONTROL)["passes"]
  half = {"success": _CONTROL["success"], "delegating": _FAST["delegating"]}
  assert not verdict(half, _CONTROL)["passes"]
  with pytest.raises(ValueError, match="same steps"):
    verdict(_FAST, {k: v[:20] for k, v in _CONTROL.items()})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  from rao_jax import trainer
  root = tmp_path_factory.mktemp("delegate")
  out = {}
  for name, lr in (("trained", None), ("control", 0.0)):
    c = cfg_lib.setup(str(root))   # the policy folder is built once, then reused
    if lr is not None:
      c.optim.lr = lr
    c.eval.every = 0               # the verdict reads the training curves
    res = trainer.train(c, str(root / name))
    assert res["step"] == c.total_steps and not res["stopped"]
    out[name] = _curves(str(root / name))
    out[name + "_dir"] = str(root / name)
  with open(os.path.join(c.model.name, "warm_start.json")) as f:
    out["warm_start"] = json.load(f)
  return out


@pytest.mark.slow
def test_warm_start_delegates_sometimes_and_its_helpers_answer_sometimes(runs):
  measured = runs["warm_start"]["measured"]
  assert 0.2 <= measured["delegate"] <= 0.8, measured
  assert 0.3 <= measured["child_right"] <= 0.7, measured
  assert measured["success"] <= 0.35, measured


@pytest.mark.slow
def test_rao_raises_success_and_delegation_beyond_the_lr0_control(runs):
  verdict = cfg_lib.learning_verdict(runs["trained"], runs["control"])
  assert len(runs["trained"]["success"]) == len(runs["control"]["success"]) == 30
  assert verdict["passes"], verdict["report"]


@pytest.mark.slow
def test_helpers_are_credited_against_their_own_groups_baseline(runs):
  # The run's own trees, as the learner prepares them: every helper's baseline is the
  # leave-one-out mean over ITS group's roots (of their success under the default
  # "loo_success", of their R under the paper's "loo"). A baseline taken from
  # another group is unbiased (it does not depend on the helper's action), so the learning
  # curves above cannot tell it apart at this scale (bench_rao_ablations' shuffled_baselines
  # passes the verdict); this check does.
  from rao_jax.agent import records
  from rao_jax.learner import Learner
  from rao_jax import experiment as X
  c = cfg_lib.get_config("")
  lam = float(c.rl.lam)
  checked = 0
  for step in (0, 10, 20):
    path = os.path.join(runs["trained_dir"], "trees", f"step_{step:06d}.jsonl")
    trees = [t for t in records.load_trees_jsonl(path) if not t.meta.get("excluded")]
    adv = Learner.advantages(trees, X.learner_config(c, "/tmp/unused"))
    expected = _group_loo_baselines(trees, lam, c.rl.baseline)
    for i, (tid, depth) in enumerate(zip(adv.tree_ids, adv.depth_N)):
      assert adv.baseline_N[i] == pytest.approx(expected[tid]), (step, tid, depth)
      checked += int(depth > 0)
  assert checked > 0, "no helper was checked"
