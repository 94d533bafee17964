"""Multi-hop search (DeepDive style) over a generated local corpus.

  --config=experiments/configs/search.py:recursive,hops=4
  --config=experiments/configs/search.py:single,smoke
"""
from experiments.configs import base


def get_config(arg: str | None = None):
  args = base.parse_arg(arg)
  c = base.env_config("search", args, default_ctx=8192)
  c.env.kwargs.hops = 2 if "smoke" in args else int(args.get("hops", 4))   # hops (2-6)
  return c
