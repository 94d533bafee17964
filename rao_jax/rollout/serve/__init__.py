"""An SGLang-compatible and OpenAI-compatible HTTP server (aiohttp) over the embedded JAX engine.

    python -m rao_jax.rollout.serve --model smollm2-135m --port 30000
    python -m rao_jax.rollout.serve --checkpoint runs/x [--step N]    # a training run's weights

SGLang-native endpoints in the shapes of SGLang 0.5.6 (``SGLANG_API.md``): /generate (single,
batch, ``n`` samples, SSE streaming, stop strings, ``min_new_tokens``, prompt and top
log-probs, ``max_new_tokens: 0`` scoring, min-p and penalties), /health, /health_generate,
/get_model_info, /get_server_info (with ``internal_states``), /flush_cache, /abort_request,
/update_weights_from_disk, /update_weight_version, /get_weight_version, /pause_generation,
/continue_generation, /load_lora_adapter and /unload_lora_adapter; and the OpenAI-compatible
/v1/models, /v1/completions and /v1/chat/completions (chat template applied, streaming, ``n``,
``stop``, ``max_tokens``, ``logprobs``). Invalid requests, and fields this server does not
implement, get HTTP 400 naming the field: ``{"error": {"message": ...}}`` on the SGLang
endpoints, OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on /v1. With
``--api-key`` (or ``RAO_JAX_API_KEY``) every route but the health checks needs
``Authorization: Bearer <key>`` (401 otherwise); a non-loopback ``--host`` needs a key or
``--allow-no-api-key``; /update_weights_from_disk and
/load_lora_adapter load only under ``--weight-roots`` (403 otherwise).

LoRA (``--max-lora-rank R [--lora-target-modules ...] [--lora-alpha A]``, or a LoRA run's
``--checkpoint``): the engine carries one adapter slot and the server applies ONE adapter at a
time, merged into its weights (decode costs what it costs without one), where SGLang keeps many
and picks one per request:

- ``POST /load_lora_adapter {"lora_name", "lora_path": PEFT folder[, "weight_version"]}``
  reads the folder (inside the weight roots: 403 otherwise; rank <= R, targets among the
  slot's) and replaces the active adapter; ``POST /unload_lora_adapter {"lora_name"[,
  "weight_version"]}`` of the active one serves the base again. Both answer SGLang's
  ``{"success", "error_message", "loaded_adapters": {name: path}}`` (200, or 400 when refused)
  plus ``weight_version``: the optional ``weight_version`` relabels the weights (SGLang's load
  leaves the label). A load or unload aborts the requests the engine holds (they asked for the
  adapter going away; SGLang clients continue aborted requests) and drops every kept KV,
  sessions' included; requests arriving meanwhile wait for it.
- ``/generate`` (and /v1/* as a top-level field) take ``lora_path``: the active adapter's name
  (``/generate`` also a list, one per item). A name that is not the active one is refused
  (400 naming the active adapter; a replaced one says what replaced it), and so is a request
  without ``lora_path`` while an adapter is active: this server cannot serve the base beside
  it, so it says to send the name or unload the adapter instead of answering from other
  weights than SGLang would. /update_weights_from_disk drops the active adapter (new base,
  zero adapter).

Who owns what:

    schema.py         request and response shapes as typed models (SGLang, admin); no web import
    openai_schema.py  the OpenAI request bodies as typed models; no web import
    protocol.py       ServedEngine: what the server needs from an engine
    core.py           ServerCore: shared state, running one item (stops, min_new_tokens, scoring)
    sse.py            Server-Sent Events
    sglang_routes.py  /generate
    openai_routes.py  /v1/*
    admin_routes.py   health, info (internal_states), weights, flush, abort, pause, continue
    lora_routes.py    /load_lora_adapter, /unload_lora_adapter
    adapters.py       AdapterSlot: the one served adapter, fitting PEFT folders into the slot
    door.py           the API key (401 but on health checks), the bind check, weight roots
    server.py         Server: the routes as one aiohttp application
    loading.py        pretrained, checkpoint and tiny models; the engine's stop ids
    cli.py            the command line (engine flags generated from EngineConfig); __main__.py

The package root is lazy: importing ``rao_jax.rollout.serve.schema`` loads neither aiohttp nor
JAX.
"""
import importlib

_LAZY = {"Server": "rao_jax.rollout.serve.server", "build_server": "rao_jax.rollout.serve.cli",
         "main": "rao_jax.rollout.serve.cli", "ServedEngine": "rao_jax.rollout.serve.protocol",
         "BadRequest": "rao_jax.rollout.serve.schema",
         "parse_sampling": "rao_jax.rollout.serve.schema",
         "parse_generate": "rao_jax.rollout.serve.schema"}


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'rao_jax.rollout.serve' has no attribute {name!r}")


__all__ = sorted(_LAZY)
