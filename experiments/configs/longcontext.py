"""Long-context aggregation (OOLONG style): documents far larger than one agent's window.

  --config=experiments/configs/longcontext.py:recursive,ctx=32768,doc=175000
  --config=experiments/configs/longcontext.py:single,smoke
"""
from experiments.configs import base


def get_config(arg: str | None = None):
  args = base.parse_arg(arg)
  c = base.env_config("longcontext", args, default_ctx=32768)
  # Document length in tokens.
  c.env.kwargs.doc_tokens = 4096 if "smoke" in args else int(args.get("doc", 175_000))
  return c
