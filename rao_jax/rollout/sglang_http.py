"""What SGLangEngine and the OpenAI client share: the client config, the retryable errors, the
error shapes of SGLang's answers and the API-key header.

Refusals come as ``{"error": {"message": ...}}`` (SGLang's /generate) or flat
``{"object": "error", "message": ...}`` (its request validation, OpenAI-style), or FastAPI's
``{"detail": ...}``; ``error_message`` reads all of them, so each reaches the caller's error.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import Any

import aiohttp

# The environment variable the entry points read the servers' key from; rao_jax.rollout.serve's
# --api-key defaults to it too (its door imports this name: one spelling for both ends).
API_KEY_ENV = "RAO_JAX_API_KEY"

_RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError,
              ConnectionError)


class ServerError(RuntimeError):
  """A retryable server failure (5xx or a malformed answer)."""


def error_message(data: Any) -> str:
  """The message of an error answer in any of SGLang's shapes (nested, flat, or plain text)."""
  if isinstance(data, dict):
    err = data.get("error")
    if isinstance(err, dict) and err.get("message") is not None:
      return str(err["message"])
    if isinstance(err, str) and err:
      return err
    if data.get("message") is not None:
      return str(data["message"])
    if data.get("detail") is not None:       # FastAPI's default validation shape
      return str(data["detail"])
    return json.dumps(data)[:500]
  return str(data)[:500]


def auth_headers(api_key: str | None) -> dict[str, str] | None:
  """The ``Authorization`` header carrying ``api_key`` (None without one)."""
  if api_key is None or api_key == "":
    return None
  if not isinstance(api_key, str) or api_key != api_key.strip() or any(
      c in api_key for c in "\r\n"):
    # Not echoed: the value is a secret.
    raise ValueError("api_key: give the server's key as one line of text without surrounding "
                     "spaces.")
  return {"Authorization": f"Bearer {api_key}"}


def api_key_from_env(name: str = API_KEY_ENV) -> str | None:
  """The rollout servers' API key from the environment variable ``name`` (None when unset or
  empty): how entry points hand the key to the clients without writing it anywhere."""
  return os.environ.get(name) or None


def honours_seed(server_info: Any) -> bool:
  """Whether a server's /get_server_info says it reproduces ``sampling_seed``."""
  if not isinstance(server_info, dict):
    return False
  return bool(server_info.get("sampling_seed_honoured")
              or server_info.get("enable_deterministic_inference"))


@dataclasses.dataclass(frozen=True)
class ClientConfig:
  """Timeouts and retry policy of SGLangEngine.

  Attributes:
    request_timeout: seconds one HTTP /generate may take.
    connect_timeout: seconds to establish a connection.
    retry_timeout: seconds a request keeps retrying after its first failure before it is
      reported aborted; and seconds every server may be down before the client raises
      EngineUnavailableError (the trainer then stops with a checkpoint).
    health_interval: seconds between two health checks of a server marked down.
    backoff: first retry delay in seconds (doubles each retry, with jitter).
    max_backoff: cap on the retry delay.
    max_continuations: times a server-aborted request is continued before giving up.
    flush_timeout: seconds /flush_cache is retried during a weight update.
    forward_session_ids: send ``session_params: {"id": ...}`` (understood by
      rao_jax.rollout.serve; real SGLang servers reuse prefixes with their radix cache instead).
  """
  request_timeout: float = 600.0
  connect_timeout: float = 10.0
  retry_timeout: float = 120.0
  health_interval: float = 1.0
  backoff: float = 0.25
  max_backoff: float = 4.0
  max_continuations: int = 16
  flush_timeout: float = 120.0
  forward_session_ids: bool = False

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.type in ("float", "int") and not v > 0 and f.name != "max_continuations":
        raise ValueError(f"ClientConfig.{f.name}={v!r}: must be > 0.")
    if self.max_continuations < 0:
      raise ValueError(f"ClientConfig.max_continuations={self.max_continuations!r}: must be "
                       ">= 0.")
