"""Rollout engines: the only thing the agent runtime knows about generation."""
from rao_jax.rollout.base import (  # noqa: F401
    Engine, FinishReason, GenerateRequest, GenerateResult, SamplingParams)
