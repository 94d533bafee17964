"""The embedded JAX engine, under its historical import path.

The engine lives in the ``rao_jax.rollout.engine`` package (config, slot table, cache-length
policy, device programs, scheduler, threaded front end); this module re-exports its public
names so ``from rao_jax.rollout.embedded import EmbeddedEngine, EngineConfig`` keeps working.
"""
from rao_jax.rollout.engine import EmbeddedEngine, EngineConfig  # noqa: F401

__all__ = ["EmbeddedEngine", "EngineConfig"]
