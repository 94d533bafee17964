"""TextCraft-Synth: the paper's grid (single vs. recursive x context 4K/8K/40K x train medium/hard).

Usage:
  --config=experiments/configs/textcraft_synth.py:recursive,ctx=8192,train=medium
  --config=experiments/configs/textcraft_synth.py:single,ctx=40960,train=hard
  --config=experiments/configs/textcraft_synth.py:recursive,smoke      # ~1 minute on CPU
  --config=experiments/configs/textcraft_synth.py:recursive,demo       # what `make demo` runs
"""
from experiments.configs import base

_CONTEXTS = (4096, 8192, 40960)


def get_config(arg: str | None = None):
  args = base.parse_arg(arg)
  c = base.base_config()
  c.env.name = "textcraft_synth"
  c.agent.mode = "single" if "single" in args else "recursive"
  ctx = int(args.get("ctx", 8192))
  if ctx not in _CONTEXTS and "smoke" not in args:
    raise ValueError(f"ctx={ctx}: the paper's grid uses one of {_CONTEXTS}.")
  c.agent.context_window = ctx
  c.rollout.max_cache_len = ctx
  c.env.train_difficulty = args.get("train", "medium")
  c.env.eval_difficulties = ("medium", "hard")
  c.agent.tree_step_budget = 200          # the paper's per-task budget
  if "smoke" in args:
    base.smoke(c)
  if "demo" in args:
    _demo(c)
  return c


def _demo(c):
  """`make demo`: SFT warm start, two RL steps, evaluation; ~7 of the demo's ~9 minutes here.

  SmolLM2-135M trains at roughly 60-100 tokens/s on two CPU cores and an agent's trajectory is
  ~600 tokens (a ~430-token system prompt, one or two cells and their observations), so the
  demo shows every stage at the smallest size that still runs each of them for real.
  """
  base.smoke(c)
  # No recomputation in the backward pass: a micro-batch is one row of 1280 tokens (below), whose
  # activations fit in memory many times over, and recomputing would cost learner time.
  c.model.remat = "none"
  c.total_steps = 2
  c.agent.max_steps_per_agent = 4
  # Groups of 4 sampled at 0.5: at 1.0 the warm start solved 0 of 2 trees in both steps, so no
  # group held a signal and the learner never ran; cooler samples succeed sometimes and fail
  # sometimes, which is what a leave-one-out advantage needs.
  c.agent.temperature = 0.5
  c.rl.group_size = 4
  c.rl.tasks_per_step = 1
  c.eval.every = 0                      # the demo evaluates before and after RL itself
  c.eval.num_tasks = 2                  # per difficulty; greedy trees of up to 1K tokens
  c.sft.num_demos = 16
  c.sft.steps = 6                       # 4 left SmolLM2 redefining the tools as functions
  c.sft.trees_per_step = 2
  c.sft.lr = 1e-4
  # Program-style demonstrations (agent/policies.py): a 135M model imitating "plan" ones
  # learned the format but not a plan's arithmetic (0 of 50 held-out easy tasks).
  c.sft.scripted_style = "program"
  c.agent.max_new_tokens = 192          # the longest demonstrated cell is ~145 tokens
  # Every demonstrated agent fits in 595 tokens (a 430-token system prompt, one or two cells),
  # so a 1280-token window holds any of them with room to spare, and a packed row of 1280 (two
  # agents) costs the learner about 0.6 of a 2048 row holding the same two: the SFT stage is
  # most of the demo's time.
  c.agent.context_window = 1280
  c.rollout.max_cache_len = 1280
  # Few row counts: on a CPU each new one costs a minute of compilation.
  c.learner.bucket_rows = (2, 4)

