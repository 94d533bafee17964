"""OpenAI's /v1/completions and /v1/chat/completions bodies as typed models (no web import).

Both become SGLang ``sampling_params`` (``sampling_json``) so one validator (``schema.
SamplingParamsIn``) holds every range; what only OpenAI has (prompt and message shapes,
``logprobs``, ``echo``, ``best_of``, tools) is checked here. Refusals are ``BadRequest``s whose
``param`` is OpenAI's ``error.param``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rao_jax.rollout.serve.schema import TOP_LOGPROBS_MAX, BadRequest, JsonBody

# Set to anything but these, a field is refused: this server has no tools, logit bias,
# suffixes, audio, predictions or reasoning controls.
_REFUSED = ("logit_bias", "suffix", "tools", "audio", "prediction", "modalities",
            "reasoning_effort")

# OpenAI name -> SGLang sampling_params name, copied when set.
_TO_SGLANG = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
              ("min_p", "min_p"), ("presence_penalty", "presence_penalty"),
              ("frequency_penalty", "frequency_penalty"),
              ("repetition_penalty", "repetition_penalty"), ("seed", "sampling_seed"),
              ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"),
              ("skip_special_tokens", "skip_special_tokens"), ("no_stop_trim", "no_stop_trim"),
              ("min_tokens", "min_new_tokens"))


@dataclasses.dataclass(frozen=True)
class _OpenAIIn(JsonBody):
  """The fields both OpenAI endpoints share (OpenAI's, and SGLang's and vLLM's extensions)."""
  model: str | None = None
  max_tokens: int | None = None
  max_completion_tokens: int | None = None
  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  min_p: float | None = None
  min_tokens: int | None = None
  n: int = 1
  best_of: int | None = None
  stream: bool = False
  stream_options: dict | None = None
  stop: str | tuple[str, ...] | None = None
  stop_token_ids: tuple[int, ...] | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  repetition_penalty: float | None = None
  seed: int | None = None
  ignore_eos: bool | None = None
  skip_special_tokens: bool | None = None
  no_stop_trim: bool | None = None
  return_token_ids: bool = False
  logit_bias: Any = None
  suffix: Any = None
  response_format: Any = None
  tools: Any = None
  tool_choice: Any = None
  parallel_tool_calls: Any = None
  audio: Any = None
  prediction: Any = None
  modalities: Any = None
  reasoning_effort: Any = None
  # Accepted with no effect here: bookkeeping fields of OpenAI and SGLang.
  user: Any = None
  rid: Any = None
  metadata: Any = None
  store: Any = None
  service_tier: Any = None
  separate_reasoning: Any = None
  continue_final_message: Any = None
  chat_template_kwargs: dict | None = None
  # SGLang's extension (OpenAI clients send it with extra_body): the loaded LoRA adapter to
  # generate with, by name; None: the base model.
  lora_path: str | None = None

  def __post_init__(self):
    for k in _REFUSED:
      if getattr(self, k) not in (None, [], {}, ""):
        raise BadRequest(f"{k} is not supported by this server.", k)
    if self.tool_choice not in (None, "none"):
      raise BadRequest("tool_choice is not supported by this server (no tools).", "tool_choice")
    if self.response_format not in (None, {"type": "text"}):
      raise BadRequest("response_format other than {\"type\": \"text\"} is not supported by "
                       "this server.", "response_format")
    if self.n < 1:
      raise BadRequest(f"request.n={self.n} must be >= 1.", "n")
    if self.best_of is not None and self.best_of != self.n:
      raise BadRequest("best_of != n is not supported by this server.", "best_of")

  @property
  def include_usage(self) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    return bool((self.stream_options or {}).get("include_usage"))

  def _max_tokens(self) -> int | None:
    return self.max_tokens

  def sampling_json(self, capacity: int) -> dict:
    """The request's sampling as SGLang ``sampling_params`` (n included).

    Args:
      capacity: the engine's context capacity: a chat without max_tokens may run to it.

    Returns:
      A dict for ``schema.parse_sampling``.
    """
    max_tokens = self._max_tokens()
    sp: dict[str, Any] = {"n": self.n,
                          "max_new_tokens": capacity if max_tokens is None else max_tokens}
    for src, dst in _TO_SGLANG:
      if getattr(self, src) is not None:
        sp[dst] = getattr(self, src)
    if self.stop is not None:
      sp["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
    return sp


@dataclasses.dataclass(frozen=True)
class CompletionIn(_OpenAIIn):
  """``/v1/completions``: a prompt (text, ids, or a list of either), ``logprobs``, ``echo``."""
  prompt: Any = None
  logprobs: int | None = None
  echo: bool = False

  def __post_init__(self):
    super().__post_init__()
    p = self.prompt
    ok = (isinstance(p, str)
          or (isinstance(p, list) and p and (
              all(isinstance(x, str) for x in p)
              or all(isinstance(t, int) and not isinstance(t, bool) for t in p)
              or all(isinstance(x, list) for x in p))))
    if not ok:
      raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a "
                       "list of such lists.", "prompt")
    if self.logprobs is not None and not 0 <= self.logprobs <= TOP_LOGPROBS_MAX:
      raise BadRequest(f"logprobs={self.logprobs!r} must be an int in [0, {TOP_LOGPROBS_MAX}].",
                       "logprobs")

  def _max_tokens(self) -> int | None:
    return 16 if self.max_tokens is None else self.max_tokens      # OpenAI's default

  def prompts(self) -> list:
    """The prompts, one per choice group: strings or lists of token ids."""
    p = self.prompt
    if isinstance(p, str):
      return [p]
    if all(isinstance(t, int) for t in p):
      return [list(p)]
    return list(p)


@dataclasses.dataclass(frozen=True)
class ChatIn(_OpenAIIn):
  """``/v1/chat/completions``: text messages, ``logprobs: bool`` and ``top_logprobs``."""
  messages: Any = None
  logprobs: bool = False
  top_logprobs: int | None = None
  echo: Any = None

  def __post_init__(self):
    super().__post_init__()
    if self.top_logprobs is not None:
      if not 0 <= self.top_logprobs <= TOP_LOGPROBS_MAX:
        raise BadRequest(f"top_logprobs={self.top_logprobs!r} must be an int in "
                         f"[0, {TOP_LOGPROBS_MAX}].", "top_logprobs")
      if self.top_logprobs and not self.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true.", "top_logprobs")
    if self.echo is not None:
      raise BadRequest("echo is a /v1/completions field.", "echo")
    object.__setattr__(self, "messages", self._clean(self.messages))

  def _max_tokens(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None \
        else self.max_tokens

  @staticmethod
  def _clean(msgs) -> tuple[dict, ...]:
    """Messages as ``{role, content: str}`` (text content parts joined)."""
    if not isinstance(msgs, list) or not msgs:
      raise BadRequest("messages must be a non-empty list of {role, content} objects.",
                       "messages")
    clean = []
    for m in msgs:
      if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest("each message needs a string `role`.", "messages")
      content = m.get("content")
      if isinstance(content, list):
        parts = []
        for p in content:
          if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(
              p.get("text"), str):
            raise BadRequest("only text content parts ({\"type\": \"text\", \"text\": ...}) are "
                             "supported by this server.", "messages")
          parts.append(p["text"])
        content = "".join(parts)
      if content is None:
        content = ""
      if not isinstance(content, str):
        raise BadRequest("message content must be a string or a list of text parts.",
                         "messages")
      if m.get("tool_calls"):
        raise BadRequest("tool_calls in messages are not supported by this server.", "messages")
      clean.append({"role": m["role"], "content": content})
    return tuple(clean)
