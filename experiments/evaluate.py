"""Held-out evaluation from a checkout: `python -m experiments.evaluate` runs `rao-evaluate`.

Flags and examples: rao_jax/cli/evaluate.py (`--help` lists them).
"""
from rao_jax.cli import evaluate

if __name__ == "__main__":
  evaluate.run()
