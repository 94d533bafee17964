"""The policy model: Llama-family decoder in Flax NNX, weights (GGUF, HF), tokenizer, sharding.

Modules: config (ModelConfig), transformer (the NNX model), logprobs (token_logprobs,
token_logprob_sum: target log-probs under the LM head, chunked),
weights (registry, GGUF / HF loading, export_hf), gguf_file (GGUF reading), tokenizer (torch-free
tokenizer and chat template), sharding (logical-axis rules, PartitionSpecs), chat (a command-line
chat). The platform kernels it calls (products, attention) are ``rao_jax.kernels``, chosen by the
lowering platform and, on CPU, by the static ``ModelConfig.kernels``.

The names below are re-exported lazily: ``from rao_jax.model import sharding`` (or ``config``)
loads that module alone, not the model, its weights and the tokenizer.

    ## The model API
    
    ```python
    from flax import nnx
    from rao_jax.model import ModelConfig, Transformer, token_logprobs, load_pretrained
    
    cfg = ModelConfig.from_hf_config(dict_or_path_to_config_json)   # frozen dataclass, validated
    cfg = ModelConfig.from_gguf(path)                                # from GGUF metadata
    tiny = cfg.tiny()          # small random-weights config derived from the real one (same arch
                               # flags: tied emb, qk_norm, biases, rope scaling), few layers, small D,
                               # vocab kept equal so the real tokenizer works; for fast tests
    model = Transformer(cfg, rngs=nnx.Rngs(0))   # param dtype cfg.param_dtype; activations cfg.dtype
    
    # 1) Full forward over packed rows. segment_ids 0 = padding; tokens attend only within the
    #    same segment, causally; positions restart per segment (RoPE uses `positions`).
    hidden_BxTxD = model(tokens_BxT, positions_BxT, segment_ids_BxT)
    logits_BxTxV = model.logits(hidden_BxTxD)                 # float32
    # Log-prob of each target token under softmax(logits / temperature), float32, computed in
    # chunks over T (or V) so no full [B, T, V] float32 array is materialised; differentiable.
    logp_BxT = token_logprobs(model, hidden_BxTxD, targets_BxT, temperature=1.0)
    # A loss linear in the log-probs, sum(coef * logp), with its gradient computed in the
    # forward pass (no logits recomputed in the backward); logp comes back without gradient.
    total, logp_BxT = token_logprob_sum(model, hidden_BxTxD, targets_BxT, coef_BxT)
    
    # 2) + 3) KV cache: prefill and decode are the same call with different T.
    cache = model.init_cache(batch_size=B, max_len=S)   # {"k": L x [B,K,h,S], "v": L x [B,K,S,h]}
    hidden_BxTxD, cache = model.forward_cached(tokens_BxT, positions_BxT, cache, write_index_B)
    #   Writes the T new tokens' K/V into cache slots [write_index_B[b], write_index_B[b] + T) of
    #   each row b (rows are independent: continuous batching), and query i of row b attends to
    #   cache slots j <= write_index_B[b] + i. A cache with more rows than B: rows [0, B) used. Tokens past a row's real length are padding: their
    #   K/V land beyond the row's length and are overwritten by the next write, never read.
    #   Must be jittable with the cache donated; S is a static shape (the engine buckets it).
    # The same as pure functions of per-layer weights (what the rollout engine runs):
    fns, params = model.inference_fns(), model.inference_params()
    hidden_BxTxD, cache = fns(params, tokens_BxT, positions_BxT, cache, write_index_B)
    logits = fns.logits(params, hidden_BxTxD)
    
    model, tokenizer = load_pretrained("smollm2-135m", dtype=...)  # registry name, a GGUF file,
                                                                     # or an HF checkpoint folder
    tokenizer.encode(text) -> list[int]; tokenizer.decode(ids) -> str
    tokenizer.apply_chat_template(messages, add_generation_prompt=True) -> list[int]
    tokenizer.eos_token_id; tokenizer.stop_token_ids (ids that end an assistant turn, e.g. <|im_end|>)
    tokenizer.hf  # the underlying transformers PreTrainedTokenizerFast
    rao_jax.model.weights.export_hf(model, cfg, tokenizer, out_dir)  # config.json + safetensors +
                                                                     # tokenizer files, HF names
    ```
    Parameters carry logical sharding annotations (nnx.with_partitioning / sharding names with
    logical axes like "vocab", "embed", "mlp", "q_heads", "kv_heads", "head_dim", "layers"), and
    `rao_jax/model/sharding.py` holds the ONE table of logical-axis -> mesh-axis rules for a mesh
    with axes ("data", "fsdp", "tensor") plus helpers to get PartitionSpecs/NamedShardings for a
    model state and for batches. All PartitionSpecs of the package live in that module.
"""

import importlib

_EXPORTS = {
    "ModelConfig": "config", "RopeScaling": "config", "UnsupportedModelError": "config",
    "Transformer": "transformer", "make_packed_inputs": "transformer",
    "token_logprob_sum": "logprobs", "token_logprobs": "logprobs",
    "Tokenizer": "tokenizer",
    "CheckpointMismatchError": "weights", "WeightFileError": "weights", "export_hf": "weights",
    "known_models": "weights", "load_model": "weights", "load_pretrained": "weights",
    "resolve_model_path": "weights",
}

__all__ = [
    "ModelConfig", "RopeScaling", "UnsupportedModelError", "Transformer", "token_logprobs",
    "token_logprob_sum", "make_packed_inputs", "Tokenizer", "load_pretrained", "load_model",
    "export_hf", "known_models", "resolve_model_path", "CheckpointMismatchError",
    "WeightFileError",
]


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
