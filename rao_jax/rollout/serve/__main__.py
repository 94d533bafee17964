"""``python -m rao_jax.rollout.serve``: see ``rao_jax.rollout.serve.cli``."""
from rao_jax.rollout.serve.cli import main

if __name__ == "__main__":
  main()
