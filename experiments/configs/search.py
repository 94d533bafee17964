"""Multi-hop search (DeepDive style) over a generated local corpus.

  --config=experiments/configs/search.py:recursive,hops=4
  --config=experiments/configs/search.py:single,smoke
"""
from experiments.configs import base
from experiments.configs import textcraft_synth


def get_config(arg: str | None = None):
  args = base.parse_arg(arg)
  c = base.base_config()
  c.env.name = "search"
  c.env.train_difficulty = "all"
  c.env.eval_difficulties = ("all",)
  c.env.kwargs.hops = int(args.get("hops", 4))   # hops per question (2-6)
  c.agent.mode = "single" if "single" in args else "recursive"
  c.agent.context_window = int(args.get("ctx", 8192))
  c.rollout.max_cache_len = c.agent.context_window
  if "smoke" in args:
    textcraft_synth._smoke(c)  # pylint: disable=protected-access
    c.env.train_difficulty = "all"
    c.env.eval_difficulties = ("all",)
    c.env.kwargs.hops = 2
  return c
