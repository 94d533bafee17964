"""Original TextCraft (Minecraft recipes, 1,000 training tasks shipped with the package).

  --config=experiments/configs/textcraft.py:recursive
  --config=experiments/configs/textcraft.py:single,smoke
"""
from experiments.configs import base


def get_config(arg: str | None = None):
  return base.env_config("textcraft", base.parse_arg(arg), default_ctx=8192)
