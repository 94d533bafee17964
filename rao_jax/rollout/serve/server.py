"""Server: the aiohttp application over one engine, its routes gathered from the route modules.

    sglang_routes.py   /generate
    openai_routes.py   /v1/models, /v1/completions, /v1/chat/completions
    admin_routes.py    health, info, weights, flush, abort, pause, continue
    lora_routes.py     /load_lora_adapter, /unload_lora_adapter (one adapter at a time)
    door.py            the API key every route but the health checks asks for (when set)
"""
from __future__ import annotations

from aiohttp import web

from rao_jax.rollout.serve import door
from rao_jax.rollout.serve.admin_routes import AdminRoutes
from rao_jax.rollout.serve.lora_routes import LoraRoutes
from rao_jax.rollout.serve.openai_routes import OpenAIRoutes
from rao_jax.rollout.serve.sglang_routes import SGLangRoutes


class Server(SGLangRoutes, OpenAIRoutes, AdminRoutes, LoraRoutes):
  """The SGLang- and OpenAI-compatible server over one engine (see ``ServerCore`` for the
  arguments and ``protocol.ServedEngine`` for what the engine must provide)."""

  def app(self) -> web.Application:
    """The aiohttp application with every route (behind the API key when one is set)."""
    # The health checks answer without a key (as SGLang's do): load balancers and the
    # clients' restart detection poll them without credentials.
    health = {"/health": self.health, "/health_generate": self.health_generate}
    middlewares = ([door.api_key_middleware(self._api_key, open_paths=health)]
                   if self._api_key else [])
    app = web.Application(client_max_size=256 * 1024 ** 2, middlewares=middlewares)
    r = app.router
    r.add_post("/generate", self.generate)
    for path, fn in (*health.items(),
                     # /model_info is current SGLang's spelling (it answers /get_weight_version
                     # with 404); the older two are kept for 0.5.x clients.
                     ("/model_info", self.model_info), ("/get_model_info", self.model_info),
                     ("/get_server_info", self.server_info),
                     ("/get_weight_version", self.weight_version),
                     ("/flush_cache", self.flush_cache), ("/v1/models", self.models)):
      r.add_get(path, fn)
      r.add_post(path, fn)
    r.add_post("/abort_request", self.abort_request)
    r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
    r.add_post("/update_weight_version", self.update_weight_version)
    r.add_post("/load_lora_adapter", self.load_lora_adapter)
    r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
    r.add_post("/pause_generation", self.pause_generation)
    r.add_post("/continue_generation", self.continue_generation)
    r.add_post("/v1/completions", self.completions)
    r.add_post("/v1/chat/completions", self.chat_completions)
    return app
