"""Rollout engines: the only thing the agent runtime knows about generation.

    Engine / GenerateRequest / GenerateResult / SamplingParams / FinishReason   (base.py)
    EmbeddedEngine   continuous-batching JAX engine in this process                (embedded.py)
    SGLangEngine     SGLang-native HTTP servers, or rao_jax.rollout.serve          (sglang_client.py)
    python -m rao_jax.rollout.serve   the embedded engine behind SGLang's HTTP API (serve.py)
"""
from rao_jax.rollout.base import (  # noqa: F401
    Engine, FinishReason, GenerateRequest, GenerateResult, SamplingParams)
from rao_jax.rollout.embedded import EmbeddedEngine, EngineConfig  # noqa: F401
from rao_jax.rollout.sglang_client import ClientConfig, SGLangEngine  # noqa: F401
