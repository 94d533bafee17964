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


# What "RAO teaches delegation" means for a run against its lr=0 control (same seeds, hence the
# same tasks at every step): over the last END steps against the first START, the trained
# run's success and delegating share must each rise MARGIN more than the control's, and lead
# the control's by MARGIN at the end. The start window is short because delegation moves
# within a few steps.
# MARGIN: full RAO gained 0.35 / 0.26 / 0.19 in success over the control on seeds 0-2 (leads
# 0.28 / 0.28 / 0.23), root-only and sign-flipped runs -0.15 to -0.02 (the ablation run at
# commit 1140779, before the sampler fix); a run's sampling noise on a 10-step mean is about
# 0.05. The current two-digit runs' passes per variant: benchmarks/results/rao_ablations.json,
# tasks.two_digit.variants.<name>.test_passes.
START, END, MARGIN = 5, 10, 0.15


def learning_verdict(trained: dict, control: dict) -> dict:
  """Figures and pass/fail of a trained run against its control.

  Args:
    trained, control: {"success": per-step train success, "delegating": per-step share of
      trees whose root delegated}.

  Returns:
    {"<metric>_gain", "<metric>_lead" for success and delegating, "passes", "report"}.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  out, lines = {}, []
  ok = True
  for key in ("success", "delegating"):
    t, c = np.asarray(trained[key], float), np.asarray(control[key], float)
    rise = t[-END:].mean() - t[:START].mean()
    c_rise = c[-END:].mean() - c[:START].mean()
    lead = t[-END:].mean() - c[-END:].mean()
    out[f"{key}_gain"], out[f"{key}_lead"] = float(rise - c_rise), float(lead)
    ok = ok and rise - c_rise >= MARGIN and lead >= MARGIN
    lines.append(f"{key}: trained {np.round(t, 2).tolist()}\n  control {np.round(c, 2).tolist()}\n"
                 f"  gain over control {rise - c_rise:+.3f}, lead at the end {lead:+.3f}")
  out["passes"] = bool(ok)
  out["report"] = "\n".join(lines)
  return out
