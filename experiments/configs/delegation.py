"""The delegation micro-run: RAO teaches a tiny policy to delegate where one agent cannot answer.

Usage:
  python -m experiments.train --config=experiments/configs/delegation.py:model=DIR --workdir=...
  (DIR from `setup(workdir)` or `experiments.micro_policy.build_policy`)

Arguments (comma-separated): `seed=N`, `parts=k` (digits a task names, 2 by default), `single`
(the single-agent baseline: no `launch_subagent`), `model=DIR`.

Every agent has one turn of one token (`rao_jax/envs/delegation.py`), so one agent answers at
most one of the k parts and a task is solved only when the root delegates (one token) and each
helper answers its part (one token each). `setup(workdir)` builds the warm-started policy: it
delegates about half the time and its helpers answer about 40% of parts, which leaves RL room
on both decisions. `tests/test_learns_to_delegate.py` and `benchmarks/bench_rao_ablations.py`
run it.
"""
import os

from experiments.configs import base


def get_config(arg: str | None = None):
  args = base.parse_arg(arg)
  c = base.base_config()
  c.seed = int(args.get("seed", 0))
  c.total_steps = 30
  c.model.name = args.get("model", "")   # the folder `setup` / `build_policy` wrote
  c.model.remat = "none"                 # rows of 320 tokens: nothing to save by recomputing
  c.env.name = "delegation"
  c.env.train_difficulty = "all"
  c.env.eval_difficulties = ("all",)
  c.env.kwargs.num_parts = int(args.get("parts", 2))
  c.env.kwargs.num_answers = 4          # digits 0-3
  c.env.kwargs.seed = c.seed
  c.agent.mode = "single" if "single" in args else "recursive"
  c.agent.context_window = 320          # a root's prompt is ~250 tokens of the micro tokenizer
  c.agent.max_new_tokens = 1            # a cell is one token: one agent answers one part
  c.agent.max_steps_per_agent = 1
  c.agent.max_depth = 1                 # the root's helpers answer; they cannot delegate
  c.agent.tree_step_budget = 0          # the task's own budget (k + 2 steps)
  c.rl.group_size = 6
  c.rl.tasks_per_step = 2               # 12 trees a step: the test's 3-minute budget
  c.optim.lr = 2e-3                     # as the micro-run (a 2-layer D=64 model)
  c.optim.warmup_steps = 2
  c.learner.micro_batch_rows = 12
  # One device: on a machine with several (or the test suite's eight fake CPU devices), "auto"
  # would pad every micro-batch of a 2-layer D=64 model to the device count for nothing.
  c.learner.mesh = "data=1"
  c.learner.bucket_rows = (36,)         # one row per node: up to 12 roots + 24 helpers; one
                                        # bucket, one compilation
  c.rollout.num_slots = 36              # every node of a step's 12 trees at once
  # A turn is one token, sampled from the prefill's logits: decode batches barely run, so
  # one decode shape (instead of 1, 4, 16, 36) saves their compilations.
  c.rollout.embedded.decode_rows = (36,)
  c.rollout.max_cache_len = 320
  c.sandbox.pool_size = 12
  c.ckpt.every = 1000                   # the trainer still saves at the end
  c.ckpt.keep = 1
  c.eval.every = 1000                   # evaluated once, at the end
  c.eval.num_tasks = 32
  c.eval.num_html_trees = 4
  c.log.tensorboard = False
  c.log.progress = False
  return c


def setup(workdir: str, arg: str | None = None, **warm_start):
  """Builds the warm-started policy under `workdir/model` (once) and returns the run's config.

  `warm_start` goes to `experiments.micro_policy.build_policy` (e.g. `p_delegate`, `target`).
  """
  from experiments import micro_policy  # pylint: disable=g-import-not-at-top
  from rao_jax import experiment as X  # pylint: disable=g-import-not-at-top
  c = get_config(arg)
  c.model.name = os.path.join(os.path.abspath(workdir), "model")
  if not os.path.exists(os.path.join(c.model.name, "warm_start.json")):
    # The demonstrations are the recursive runtime's (roots may delegate) in either mode.
    demo_cfg = X.runner_config(c, recursive=True)
    micro_policy.build_policy(c.model.name, demo_cfg, X.make_env(c), seed=c.seed, **warm_start)
  return c


# What "RAO teaches delegation" means for a run against its lr=0 control. Both runs start from
# the same weights and draw the same tasks at every step (`train_tasks_for_step(seed, step)`),
# so their difference at a step has that step's task mix removed, and before the trained run's
# first update it is zero in expectation. The verdict: over the last END steps, the trained
# run's success and delegating share must each exceed the control's by MARGIN. That is the
# rise the training caused; the control's own drift is sampling noise around a fixed policy.
#
# Why not "the trained run's rise from its first START steps minus the control's rise" (the
# verdict until 2026-12-07, START = 5): it estimates the runs' start difference, which is known
# to be zero, from steps 0..START-1, but the trained run's rollouts come from updated weights
# from step 1 on, so a run that learns within START steps has its learning subtracted; and the
# control's noise in the start window (60 roots) enters undamped, while a trained share at its
# ceiling of 1 no longer moves with it. A run at f703884 (seed 0) failed that way while it
# clearly learned: delegating share 0.75, 0.50, 0.50, 0.92, 0.67 in steps 0-4 and 0.98 over the
# last 10 against the control's 0.43 (first 5) and 0.69 (last 10); the control's policy is the
# warm start, whose exact delegation probability on those steps' tasks is 0.58 and 0.59
# (Probe.measure per task), so its rise of +0.26 was noise, and the old statistic read
# 0.31 - 0.26 = +0.05 for a lead of +0.28. Here the start difference is its known value, 0.
# Precondition: both runs from the same warm-start folder and seed (as the test runs them).
# MARGIN: for a run that does not learn, the end-window difference is two 120-root means of
# one policy: sd at most 0.064 for a delegating share near 0.58 and 0.042 for success near
# 0.12 (independent draws; the runs share some sampling seeds, which only shrinks it), so 0.15
# is 2.3 and 3.6 sd and both must hold. Learning runs led by 0.28 / 0.28 / 0.23 in success
# (seeds 0-2, ablation run at commit 1140779) and, on 2026-12-07 (seed 0), by 0.41-0.59 in
# success and 0.29-0.43 in delegating share (the default credit at f703884 and at 229dbf7, the
# paper's 'loo' with equal groups kept at 229dbf7, the default before the prompt and credit
# changes at 6003a3c); runs that do not learn trail or tie (lr=0 against another lr=0 run:
# +0.08 / +0.06; the advantage sign flipped: -0.12 / -0.51). tests/test_learns_to_delegate.py
# checks the verdict on recorded curves of these.
END, MARGIN = 10, 0.15


def learning_verdict(trained: dict, control: dict) -> dict:
  """Figures and pass/fail of a trained run against its lr=0 control (same warm start, seed).

  Args:
    trained, control: {"success": per-step train success, "delegating": per-step share of
      trees whose root delegated}, one entry per step of the same steps.

  Returns:
    {"<metric>_lead" (trained minus control over the last END steps: the verdict's figure)
    and "<metric>_step0" (their difference at step 0, before any update: sampling noise
    around 0) for success and delegating, "passes", "report"}.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  out, lines = {}, []
  ok = True
  for key in ("success", "delegating"):
    t, c = np.asarray(trained[key], float), np.asarray(control[key], float)
    if t.shape != c.shape or len(t) < END:
      raise ValueError(f"learning_verdict: {key} curves of {len(t)} and {len(c)} steps; both "
                       f"need the same steps, at least END={END}.")
    lead = float(t[-END:].mean() - c[-END:].mean())
    out[f"{key}_lead"], out[f"{key}_step0"] = lead, float(t[0] - c[0])
    ok = ok and lead >= MARGIN
    lines.append(f"{key}: trained {np.round(t, 2).tolist()}\n  control {np.round(c, 2).tolist()}\n"
                 f"  lead over the last {END} steps {lead:+.3f} (needs {MARGIN:+.2f}); "
                 f"at step 0 {t[0] - c[0]:+.3f}")
  out["passes"] = bool(ok)
  out["report"] = "\n".join(lines)
  return out
