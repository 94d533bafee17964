"""The rollout interface: token ids in, token ids + logprobs out.

The agent runtime talks to every engine (embedded JAX, SGLang over HTTP) through `Engine`.
It never re-tokenizes a history: a request carries the exact prompt ids, so what the model
saw and what the learner trains on are the same tokens.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import operator
from typing import Sequence


class FinishReason(str, enum.Enum):
  STOP = "stop"            # a stop token was generated (it is included in `token_ids`)
  LENGTH = "length"        # max_new_tokens reached
  CONTEXT = "context"      # the session's context-window limit was reached
  ABORT = "abort"          # aborted (by the caller, a weight update policy, or a dead server)
  # The engine's own device step failed while the request was held (a device error, out of
  # memory): an infrastructure failure, never the policy's. The output so far (if any) came
  # from a device state that was then thrown away; callers must not train on it. The engine
  # rebuilt its state and serves later requests (see EngineFailedError for when it cannot).
  ERROR = "error"


class EngineFailedError(RuntimeError):
  """The engine stopped serving: its device steps failed too often in a row to go on
  (``EmbeddedEngine``: ``EngineConfig.max_consecutive_faults``). Every later call raises it;
  a run cannot continue on this engine, unlike a single ``FinishReason.ERROR``."""


class EngineUnavailableError(RuntimeError):
  """No server of an engine has answered for longer than its retry timeout.

  Not a failure of the agent or of one tree: the run cannot go on until a server is back, so
  the trainer stops there with a checkpoint (and resumes when started again).

  Attributes:
    urls: the servers that were tried.
  """

  def __init__(self, message: str, urls: tuple[str, ...] = ()):
    super().__init__(message)
    self.urls = tuple(urls)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Sampling parameters (SGLang's names and defaults). temperature 0 means greedy.

  Attributes:
    temperature: softmax temperature; 0 = greedy (argmax).
    top_p: nucleus mass in (0, 1]; 1 = off.
    top_k: keep the k most likely tokens; -1 = the whole vocabulary.
    min_p: drop tokens whose probability is below min_p times the most likely one's; 0 = off.
    max_new_tokens: tokens to generate at most.
    stop_token_ids: ids that end generation (the matched id is kept in the output). None (the
      default) means the engine's default stop ids: the tokenizer's end-of-turn and
      end-of-text tokens when the engine was given them (``EmbeddedEngine(...,
      default_stop_token_ids=tokenizer.stop_token_ids)``; SGLang servers stop at EOS). An
      explicit tuple means exactly those ids; ``()`` never stops early.
    seed: per-request sampling seed (None: the engine draws one).
    frequency_penalty: subtracted from a token's logit once per time it was generated before.
    presence_penalty: subtracted from the logit of every token generated before.
    repetition_penalty: divides positive (multiplies negative) logits of tokens generated
      before; 1 = off. The penalties see the generated tokens only, as SGLang's penalizers do,
      and apply before temperature (the reported logprobs include them).
    min_new_tokens: no stop id can end generation before this many tokens: the stop ids'
      logits are masked until then (SGLang's ``min_new_tokens``; the reported logprobs are
      those of the masked distribution). 0 = off.
    stop: stop strings (SGLang's ``stop``): generation ends with FinishReason.STOP at the
      token whose decoded text completes one; that token is kept (``no_stop_trim``), so the
      output's text ends with the match. () = none.
  """
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1               # -1: the whole vocabulary
  max_new_tokens: int = 128
  stop_token_ids: tuple[int, ...] | None = None
  seed: int | None = None
  min_p: float = 0.0
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  repetition_penalty: float = 1.0
  min_new_tokens: int = 0
  stop: tuple[str, ...] = ()

  def __post_init__(self):
    stop = (self.stop,) if isinstance(self.stop, str) else self.stop
    try:
      stop = tuple(stop)
    except TypeError:
      stop = (None,)
    if any(not isinstance(x, str) or not x for x in stop):
      raise ValueError(f"SamplingParams.stop={self.stop!r}: must be a tuple of non-empty "
                       "strings (() = no stop string).")
    object.__setattr__(self, "stop", tuple(dict.fromkeys(stop)))
    if not self.temperature >= 0:
      raise ValueError(f"SamplingParams.temperature={self.temperature!r}: must be >= 0 (0 = greedy).")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams.top_p={self.top_p!r}: must be in (0, 1].")
    if self.top_k == 0 or self.top_k < -1:
      raise ValueError(f"SamplingParams.top_k={self.top_k!r}: use -1 for all tokens or a positive int.")
    if self.max_new_tokens < 1:
      raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: must be >= 1.")
    if not 0 <= self.min_new_tokens <= self.max_new_tokens:
      raise ValueError(f"SamplingParams.min_new_tokens={self.min_new_tokens!r}: must be in "
                       f"[0, max_new_tokens={self.max_new_tokens}].")
    if not 0 <= self.min_p <= 1:
      raise ValueError(f"SamplingParams.min_p={self.min_p!r}: must be in [0, 1] (0 = off).")
    for name in ("frequency_penalty", "presence_penalty"):
      if not -2 <= getattr(self, name) <= 2:
        raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: must be in [-2, 2] "
                         "(0 = off).")
    if not 0 < self.repetition_penalty <= 2:
      raise ValueError(f"SamplingParams.repetition_penalty={self.repetition_penalty!r}: must be "
                       "in (0, 2] (1 = off).")
    if self.stop_token_ids is not None:
      try:
        ids = tuple(operator.index(t) for t in self.stop_token_ids)
      except TypeError:
        ids = (-1,)
      if any(t < 0 for t in ids):
        raise ValueError(f"SamplingParams.stop_token_ids={self.stop_token_ids!r}: must be None "
                         "(the engine's defaults) or a tuple of non-negative ints.")
      object.__setattr__(self, "stop_token_ids", ids)

  @property
  def penalized(self) -> bool:
    """Whether any repetition-type penalty is on."""
    return (self.frequency_penalty != 0 or self.presence_penalty != 0
            or self.repetition_penalty != 1)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
  """One generation request.

  Attributes:
    prompt_ids: the full token sequence to continue. With a session, it must start with the
      session's previous prompt + output (the engine then prefills only the new suffix).
    params: sampling parameters.
    session_id: optional; lets an engine keep this conversation's KV cache between turns.
    context_limit: optional cap on prompt + generated tokens (the agent's context window);
      generation stops with FinishReason.CONTEXT when it is reached.
    rid: optional request id (for aborts).
  """
  prompt_ids: Sequence[int]
  params: SamplingParams = SamplingParams()
  session_id: str | None = None
  context_limit: int | None = None
  rid: str | None = None


@dataclasses.dataclass
class GenerateResult:
  token_ids: list[int]          # generated ids (the stop token included when one matched)
  logprobs: list[float]         # float32 log_softmax(logits / temperature) of each generated id
  finish_reason: FinishReason
  weight_version: int | str
  prompt_len: int = 0
  cached_tokens: int = 0        # prompt tokens served from a kept session cache
  message: str = ""             # details for aborts / errors (FinishReason.ERROR: the cause)


class Engine(abc.ABC):
  """Async generation engine. Safe to call from many coroutines at once."""

  @abc.abstractmethod
  async def generate(self, request: GenerateRequest) -> GenerateResult:
    ...

  async def end_session(self, session_id: str) -> None:
    """Frees a session's cache; the default engine keeps none."""

  async def abort(self, rid: str) -> None:
    """Aborts an in-flight request; it returns with FinishReason.ABORT."""

  async def update_weights(self, model, version: int | str) -> None:
    """Serves ``model``'s weights from now on; results finished later carry ``version``.

    The one weight-sync call of every engine: the trainer calls it after each learner step
    and never asks which engine it has. The embedded engine takes the weights in memory
    (copying them: the learner donates its own arrays to its next step); the SGLang client
    exports them as an HF checkpoint folder and has every server load it. It returns once the
    new weights are in use. This default is for engines that hold no weights of their own
    (scripted policies in tests and demos): they serve as before.

    Args:
      model: the policy (a ``rao_jax.model.Transformer``; its ``cfg`` names the architecture).
      version: the new weight version (the trainer passes the step).
    """

  async def update_adapter(self, model, version: int | str) -> None:
    """``update_weights`` for a policy whose LoRA adapter alone changed since the last sync.

    Engines that take an adapter by itself do so: the embedded engine merges it into its own
    copy of the base weights, the SGLang client writes it in PEFT's format and has every
    server load it (``/load_lora_adapter``). Any KV cached under an older adapter is dropped.
    This default sends the whole model (``update_weights``).

    Args:
      model: the policy with its adapter (``model.cfg.lora.rank > 0``); its base must be the
        one the engine holds (built with, or last given by ``update_weights``).
      version: the new weight version.
    """
    await self.update_weights(model, version)

  @property
  @abc.abstractmethod
  def weight_version(self) -> int | str:
    ...

  def check_available(self) -> None:
    """Raises EngineUnavailableError when the engine cannot serve at all now (every server it
    sends to has been down past its retry timeout). An engine whose generate failed for that
    reason raised the same error, which a tree runner records as an infrastructure failure of
    the tree; the trainer calls this after a step's rollouts to stop the run instead of
    training on a step of failed trees. Engines that hold their own weights are always
    available (this default)."""

  def health_metrics(self) -> dict[str, float]:
    """Counters about the engine's servers (servers up, failures, re-syncs) for the trainer's
    metrics; engines without servers have none (this default)."""
    return {}

  async def close(self) -> None:
    """Releases resources."""
