"""The deep delegation micro-run: k in {1, 2, 4, 8} items, at most two helpers per agent.

Usage:
  python -m experiments.train --config=experiments/configs/delegation_deep.py:model=DIR \
      --workdir=...   (DIR from `setup(workdir)`)

Arguments (comma-separated): `seed=N`, `single` (the single-agent baseline: no
`launch_subagent`), `model=DIR`.

Every agent has one turn of one token (`rao_jax/envs/delegation_deep.py`): it answers one item,
splits its items in two halves for two helpers, or launches helpers beyond what the split needs
(a pass-through or an echo of its own goal). A task of 8 items is solved by three levels of
splits below the root. `setup(workdir)` builds the warm-started policy: nodes of several items
split about half the time, one-item nodes answer about 40% right, and about one node in ten
launches helpers it does not need, which leaves RL room on every decision.
`benchmarks/bench_rao_ablations.py` runs it.
"""
import os

from experiments.configs import base


def get_config(arg: str | None = None):
  args = base.parse_arg(arg)
  c = base.base_config()
  c.seed = int(args.get("seed", 0))
  c.total_steps = 30
  c.model.name = args.get("model", "")   # the folder `setup` / `build_policy` wrote
  c.model.remat = "none"                 # rows of 384 tokens: nothing to save by recomputing
  c.env.name = "delegation_deep"
  c.env.train_difficulty = "all"
  c.env.eval_difficulties = ("all",)
  c.env.kwargs.num_answers = 4          # digits 0-3
  c.env.kwargs.seed = c.seed
  c.agent.mode = "single" if "single" in args else "recursive"
  c.agent.context_window = 384          # a prompt is ~260 tokens of the micro tokenizer
  c.agent.max_new_tokens = 1            # a cell is one token: one agent answers one item
  c.agent.max_steps_per_agent = 1
  # Above what any budget allows (k = 8: 46 -> 22 -> 10 -> 4 -> 1 steps, depth 4 at most):
  # the tree's depth is what the policy's splits make it.
  c.agent.max_depth = 8
  c.agent.max_live_agents = 64         # a tree has at most 46 nodes (its budget): never binds
  c.agent.tree_step_budget = 0          # the task's own budget (6k - 2 steps)
  c.rl.group_size = 4                   # 8 trees a step (~50 nodes): 8 seeds of 11 variants
  c.rl.tasks_per_step = 2               # fit the benchmark's hour on two shared cores
  c.optim.lr = 2e-3                     # as the two-digit run (a 2-layer D=64 model)
  c.optim.warmup_steps = 2
  c.learner.micro_batch_rows = 12
  c.learner.mesh = "data=1"             # one device (see experiments/configs/delegation.py)
  # One row per node: 8 trees of up to 46 nodes. A batch costs what its bucket holds, and
  # each bucket is one compilation.
  c.learner.bucket_rows = (48, 96, 192, 372)
  c.rollout.num_slots = 64              # a step's nodes at one level run together
  c.rollout.embedded.decode_rows = (64,)
  c.rollout.max_cache_len = 384
  c.sandbox.pool_size = 16
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

  `warm_start` goes to `experiments.micro_policy.build_policy` (e.g. `p_delegate`, `p_extra`).
  """
  from experiments import micro_policy  # pylint: disable=g-import-not-at-top
  from rao_jax import experiment as X  # pylint: disable=g-import-not-at-top
  c = get_config(arg)
  c.model.name = os.path.join(os.path.abspath(workdir), "model")
  if not os.path.exists(os.path.join(c.model.name, "warm_start.json")):
    demo_cfg = X.runner_config(c, recursive=True)
    micro_policy.build_policy(c.model.name, demo_cfg, X.make_env(c), seed=c.seed, **warm_start)
  return c
