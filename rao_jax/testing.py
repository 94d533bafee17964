"""Shared tiny fixtures for tests of every area: a tiny random model derived from the real one.

``SMOLLM2_135M_CONFIG`` is SmolLM2-135M-Instruct's HF config (the registry model; a model test
checks it equals what the installed GGUF file says). ``tiny_config()`` derives a small config with
the same architecture flags and vocabulary, so the real tokenizer works with it.
"""
from __future__ import annotations

from flax import nnx

from rao_jax.model.config import ModelConfig

SMOLLM2_135M_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}


def smollm2_config(**overrides) -> ModelConfig:
  """The real SmolLM2-135M config (float32 unless overridden)."""
  overrides.setdefault("dtype", "float32")
  overrides.setdefault("param_dtype", "float32")
  return ModelConfig.from_hf_config(SMOLLM2_135M_CONFIG, **overrides)


def tiny_config(**overrides) -> ModelConfig:
  """2 layers, D=64, 3 query / 1 kv heads of 16, F=128, V=49152 (the real vocabulary)."""
  return smollm2_config().tiny().replace(**overrides)


def tiny_model(seed: int = 0, **overrides):
  """A randomly initialised Transformer with ``tiny_config(**overrides)``."""
  from rao_jax.model.transformer import Transformer
  return Transformer(tiny_config(**overrides), rngs=nnx.Rngs(seed))
