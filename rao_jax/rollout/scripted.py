"""A scripted `Engine`: each turn comes from a function of the decoded prompt.

The scripted policies (`rao_jax.agent.policies` for TextCraft, the long-context and search
demonstrators beside their environments, judges in tests) subclass it; it drives the agent
runtime without a model, with an optional simulated latency per generated token.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from rao_jax.rollout import base as rollout


class ScriptedTurnEngine(rollout.Engine):
  """An `Engine` whose turns come from a function of the decoded prompt.

  Args:
    tokenizer: the runtime's tokenizer (decodes prompts, encodes turns).
    turn_fn: `(prompt_text, prompt_tokens) -> turn text`.
    token_latency_s: simulated seconds per generated token.
    weight_version: reported with every generation.
  """

  def __init__(self, tokenizer: Any, turn_fn: Callable[[str, int], str],
               token_latency_s: float = 0.0, weight_version: int | str = "scripted"):
    self.tokenizer, self.turn_fn = tokenizer, turn_fn
    self.token_latency_s = token_latency_s
    self._weight_version = weight_version
    stops = list(getattr(tokenizer, "stop_token_ids", []))
    # The ChatML turn end when the tokenizer has one, else its first stop id.
    im_end = [i for i in stops if tokenizer.decode([i]) == "<|im_end|>"]
    self._turn_end = (im_end or stops or [None])[0]
    self.generated_tokens = 0
    self.requests = 0
    self._sessions: dict[str, tuple[list[int], str]] = {}

  @property
  def weight_version(self) -> int | str:
    return self._weight_version

  def _decode_all(self, ids: list[int]) -> str:
    # The fast tokenizer's own decode: transformers' wrapper spends most of its time checking
    # the id list, and prompts here are tens of thousands of tokens.
    backend = getattr(getattr(self.tokenizer, "hf", None), "backend_tokenizer", None)
    if backend is not None:
      return backend.decode(ids, skip_special_tokens=False)
    return self.tokenizer.decode(ids)

  def _decode(self, ids: list[int], session_id: str | None) -> str:
    """The prompt's text; a session's earlier prompt is reused and only new ids are decoded."""
    prev = self._sessions.get(session_id) if session_id is not None else None
    if prev is not None and len(ids) >= len(prev[0]) and ids[:len(prev[0])] == prev[0]:
      tail = self._decode_all(ids[len(prev[0]):])
      # A multi-byte character split at the boundary decodes as U+FFFD: decode it all then.
      text = prev[1] + tail if "\ufffd" not in tail else self._decode_all(ids)
    else:
      text = self._decode_all(ids)
    if session_id is not None:
      self._sessions[session_id] = (ids, text)
    return text

  async def end_session(self, session_id: str) -> None:
    self._sessions.pop(session_id, None)

  async def generate(self, request: rollout.GenerateRequest) -> rollout.GenerateResult:
    prompt = self._decode(list(request.prompt_ids), request.session_id)
    text = self.turn_fn(prompt, len(request.prompt_ids))
    ids = list(self.tokenizer.encode(text))
    if self._turn_end is not None:
      ids.append(self._turn_end)
    reason = rollout.FinishReason.STOP
    limit = request.params.max_new_tokens
    if request.context_limit is not None:
      limit = min(limit, request.context_limit - len(request.prompt_ids))
    if len(ids) > limit:
      ids = ids[:max(limit, 0)]
      reason = (rollout.FinishReason.CONTEXT if request.context_limit is not None
                and len(request.prompt_ids) + len(ids) >= request.context_limit
                else rollout.FinishReason.LENGTH)
    self.generated_tokens += len(ids)
    self.requests += 1
    if self.token_latency_s:
      await asyncio.sleep(self.token_latency_s * len(ids))
    return rollout.GenerateResult(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=reason,
                                  weight_version=self._weight_version,
                                  prompt_len=len(request.prompt_ids))
