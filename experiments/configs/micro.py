"""The micro-run: a tiny policy on the micro-environment, whose success RAO raises in a minute.

Usage:
  python -m experiments.train --config=experiments/configs/micro.py:model=DIR --workdir=...
  (DIR from `setup(workdir)` or `experiments.micro_policy.build_policy`)

`setup(workdir)` builds the policy folder and returns the config: what `tests/test_learns.py`
runs (with its lr=0 control) and what a demo can open with. See `rao_jax/envs/micro.py` for
why every turn is one token.
"""
import os

from experiments.configs import base


def get_config(arg: str | None = None):
  args = base.parse_arg(arg)
  c = base.base_config()
  c.seed = int(args.get("seed", 0))
  c.total_steps = 30
  c.model.name = args.get("model", "")   # the folder `setup` / `build_policy` wrote
  c.model.remat = "none"                 # rows of 256 tokens: nothing to save by recomputing
  c.env.name = "micro"
  c.env.train_difficulty = "all"
  c.env.eval_difficulties = ("all",)
  c.env.kwargs.num_answers = 4          # digits 0-3
  c.env.kwargs.seed = c.seed
  c.agent.mode = "single"
  c.agent.context_window = 256          # the prompt is ~190 tokens of the micro tokenizer
  c.agent.max_new_tokens = 1            # an answer cell is one token
  c.agent.max_steps_per_agent = 1
  c.agent.max_depth = 0
  c.rl.group_size = 8
  c.rl.tasks_per_step = 4
  c.optim.lr = 2e-3                     # a 2-layer D=64 model (3e-3 and up collapsed on seed 1)
  c.optim.warmup_steps = 2
  c.learner.micro_batch_rows = 8
  c.learner.bucket_rows = (32,)          # one row per node: one shape, one compilation
  c.rollout.num_slots = 32
  c.rollout.max_cache_len = 256
  c.sandbox.pool_size = 16
  c.ckpt.every = 1000                   # the trainer still saves at the end
  c.ckpt.keep = 1
  c.eval.every = 1000                   # evaluated once, at the end
  c.eval.num_tasks = 16
  c.eval.num_html_trees = 2
  c.log.tensorboard = False
  c.log.progress = False
  return c


def setup(workdir: str, arg: str | None = None):
  """Builds the micro policy under `workdir/model` (once) and returns the run's config."""
  from experiments import micro_policy  # pylint: disable=g-import-not-at-top
  from rao_jax import experiment as X  # pylint: disable=g-import-not-at-top
  c = get_config(arg)
  c.model.name = os.path.join(os.path.abspath(workdir), "model")
  if not os.path.exists(os.path.join(c.model.name, "warm_start.json")):
    micro_policy.build_policy(c.model.name, X.runner_config(c), X.make_env(c), seed=c.seed)
  return c
