"""RL training from a checkout: `python -m experiments.train` runs `rao-train`.

Flags and examples: rao_jax/cli/train.py (`--help` lists them).
"""
from rao_jax.cli import train

if __name__ == "__main__":
  train.run()
