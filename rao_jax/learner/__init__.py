"""The RAO learner: rewards, leave-one-out advantages, packing, losses, sharded step, checkpoints.

    adv = compute_rewards_and_advantages(trees, lam=0.5)      # RAO_SPEC, host side (numpy)
    batch = pack_trees(trees, adv, row_len=T, bucket_rows=(...))  # fixed-shape numpy arrays
    learner = Learner(LearnerConfig(...), model_cfg, mesh=None, params=None)
    metrics = learner.step(batch)
    learner.save(step, extra={...}); learner.restore()

Loss variants: `rao_jax.learner.losses.get_loss(name)`.
"""
from rao_jax.learner.config import LearnerConfig
from rao_jax.learner.packing import PackedBatch, pack_trees
from rao_jax.learner.rewards import Advantages, compute_rewards_and_advantages

__all__ = ["LearnerConfig", "Advantages", "compute_rewards_and_advantages", "PackedBatch",
           "pack_trees", "Learner", "NonFiniteUpdateError"]


def __getattr__(name):
  # The step pulls in the model and optax/orbax; rewards and packing must not need them.
  if name in ("Learner", "NonFiniteUpdateError"):
    from rao_jax.learner import step
    return getattr(step, name)
  raise AttributeError(f"module 'rao_jax.learner' has no attribute {name!r}")
