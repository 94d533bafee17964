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


class BackgroundServer:
  """Serves a `rao_jax.rollout.serve.Server` on a loopback port from a background event loop
  (real HTTP for a test's clients in the same process); closes the server and its engine.

    with BackgroundServer(server) as url:
      requests.post(url + "/generate", json=...)
  """

  def __init__(self, server, host: str = "127.0.0.1"):
    import asyncio  # pylint: disable=g-import-not-at-top
    import threading  # pylint: disable=g-import-not-at-top
    from aiohttp import web  # pylint: disable=g-import-not-at-top
    self.server = server
    self.loop = asyncio.new_event_loop()
    started, self._runner, self._error = threading.Event(), None, None

    def run():
      asyncio.set_event_loop(self.loop)
      try:
        self._runner = web.AppRunner(server.app())
        self.loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, host, 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]   # port 0: the OS picked one
      except BaseException as e:   # noqa: BLE001 - reported to the constructing thread
        self._error = e
        started.set()
        return
      started.set()
      self.loop.run_forever()
    self.thread = threading.Thread(target=run, daemon=True)
    self.thread.start()
    if not started.wait(120) or self._error is not None:
      raise RuntimeError(f"BackgroundServer did not start: {self._error!r}")
    self.url = f"http://{host}:{self.port}"

  def close(self):
    import asyncio  # pylint: disable=g-import-not-at-top
    if not self.thread.is_alive():
      return
    asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
    asyncio.run_coroutine_threadsafe(self.server.engine.close(), self.loop).result(30)
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(30)

  def __enter__(self) -> str:
    return self.url

  def __exit__(self, *exc):
    self.close()
