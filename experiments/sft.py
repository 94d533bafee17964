"""Supervised warm start from a checkout: `python -m experiments.sft` runs `rao-sft`.

Flags and examples: rao_jax/cli/sft.py (`--help` lists them).
"""
from rao_jax.cli import sft

if __name__ == "__main__":
  sft.run()
