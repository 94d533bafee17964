"""Long-context aggregation (OOLONG style): documents far larger than one agent's window.

  --config=experiments/configs/longcontext.py:recursive,ctx=32768,doc=175000
  --config=experiments/configs/longcontext.py:single,smoke
"""
from experiments.configs import base
from experiments.configs import textcraft_synth


def get_config(arg: str | None = None):
  args = base.parse_arg(arg)
  c = base.base_config()
  c.env.name = "longcontext"
  c.env.train_difficulty = "all"
  c.env.eval_difficulties = ("all",)
  c.env.kwargs.doc_tokens = int(args.get("doc", 175_000))   # document length in tokens
  c.agent.mode = "single" if "single" in args else "recursive"
  c.agent.context_window = int(args.get("ctx", 32768))
  c.rollout.max_cache_len = c.agent.context_window
  if "smoke" in args:
    textcraft_synth._smoke(c)  # pylint: disable=protected-access
    c.env.train_difficulty = "all"
    c.env.eval_difficulties = ("all",)
    c.env.kwargs.doc_tokens = 4096
  return c
