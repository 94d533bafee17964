"""Rollout engines: the only thing the agent runtime knows about generation.

    Engine / GenerateRequest / GenerateResult / SamplingParams / FinishReason   (base.py)
    EngineFailedError   an engine that stopped serving (repeated device failures)  (base.py)
    EmbeddedEngine   continuous-batching JAX engine in this process              (engine/)
    SGLangEngine     SGLang-native HTTP servers, or rao_jax.rollout.serve        (sglang_client.py;
                     sglang_sync.py: weight and adapter sync; sglang_http.py: config and
                     errors; server_pool.py: failed servers are skipped until re-synced)
    OpenAIEngine     one OpenAI-compatible /v1/completions server (evaluation)   (openai_client.py)
    python -m rao_jax.rollout.serve   the embedded engine behind SGLang's HTTP API (serve/)

The engines are re-exported lazily: ``from rao_jax.rollout import base`` (or the engine's
plain-Python slot table) does not load JAX, Flax or aiohttp.
"""
import importlib

from rao_jax.rollout.base import (  # noqa: F401
    Engine, EngineFailedError, EngineUnavailableError, FinishReason, GenerateRequest,
    GenerateResult, SamplingParams)

_LAZY = {"EmbeddedEngine": "rao_jax.rollout.engine", "EngineConfig": "rao_jax.rollout.engine",
         "ClientConfig": "rao_jax.rollout.sglang_client",
         "SGLangEngine": "rao_jax.rollout.sglang_client",
         "OpenAIEngine": "rao_jax.rollout.openai_client"}


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'rao_jax.rollout' has no attribute {name!r}")


__all__ = ["ClientConfig", "EmbeddedEngine", "Engine", "EngineConfig", "EngineFailedError",
           "EngineUnavailableError", "FinishReason", "GenerateRequest", "GenerateResult",
           "OpenAIEngine", "SGLangEngine", "SamplingParams"]
