"""What the server needs from an engine: ``ServedEngine``, a typing.Protocol.

The server drives its engine through exactly these members (the embedded engine has them all);
another engine can be served by providing them. Only the names and call shapes matter
(structural typing): nothing here is imported by the engine.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from rao_jax.rollout.base import GenerateRequest, GenerateResult

# fn(token_ids so far, logprobs so far) -> True to end the request with FinishReason.STOP.
OnToken = Callable[[list[int], list[float]], bool]


@runtime_checkable
class ServedEngine(Protocol):
  """The engine interface of ``rao_jax.rollout.serve.Server``.

  Attributes:
    config: the engine's shapes; the server reads ``config.capacity`` (the most tokens one
      context may reach) and reports the dataclass in /get_server_info.
    vocab_size: token ids must lie in [0, vocab_size).
    stats: running counters (``decode_tokens``, ``prompt_tokens``, ``cached_tokens``, ...),
      reported in /get_server_info's ``internal_states``.
  """
  config: Any
  vocab_size: int
  stats: Mapping[str, int]

  @property
  def weight_version(self) -> int | str:
    """The version recorded on results from now on."""

  @property
  def num_running(self) -> int:
    """Requests handed to the engine and not yet finished (waiting or running)."""

  @property
  def paused(self) -> bool:
    """Whether scheduling is paused (``pause``)."""

  @property
  def params(self) -> Any:
    """The weights the engine serves (a pytree of arrays; its bytes are reported)."""

  async def generate(self, request: GenerateRequest, *,
                     on_token: OnToken | None = None) -> GenerateResult:
    """Generates; ``on_token`` runs after every token and may end the request (STOP)."""

  async def abort(self, rid: str) -> None:
    """Aborts one request; it returns with FinishReason.ABORT and its tokens so far."""

  def abort_all(self, message: str = "aborted") -> None:
    """Aborts every waiting and running request."""

  def pause(self) -> None:
    """Stops scheduling; requests keep their state until ``resume``."""

  def resume(self) -> None:
    """Undoes ``pause``."""

  def flush_cache(self) -> bool:
    """Drops kept session caches; False (nothing dropped) while requests run. Blocking."""

  def set_weight_version(self, version: int | str) -> None:
    """Relabels the weights being served. Blocking."""

  async def update_weights(self, model: Any, version: int | str) -> None:
    """Serves ``model``'s weights from now on (``Engine.update_weights``)."""

  async def update_adapter(self, model: Any, version: int | str) -> None:
    """Serves a LoRA adapter (a model with one, or its nnx.LoRAParam state) merged into the
    base the engine holds (``Engine.update_adapter``); /load_lora_adapter uses it."""

  def score(self, token_ids: Sequence[int], *, temperature: float = 1.0,
            top_k: int = 0) -> tuple[list[float | None], list[list[tuple[float, int]]]]:
    """Log-prob of each token given the ones before, and top-k alternatives. Blocking."""

  async def close(self) -> None:
    """Releases the engine."""
