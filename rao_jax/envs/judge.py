"""The LLM judge: the second success source of RAO_SPEC's chain (verifier -> judge -> proxy).

`LLMJudge` shows a node's goal and final answer to a model and parses its verdict: "yes" / "no"
or a score in [0, 1]. The model is either a rollout `Engine` (by default the policy's own engine,
with the policy's tokenizer for the chat template) or an HTTP endpoint: an OpenAI-compatible
`/v1/chat/completions` (vLLM, SGLang, ...) or SGLang's native `/generate`. Malformed output is
re-asked (sampling, so a retry can differ) up to `max_retries` times, then recorded as a failure
(score None: the runtime falls through to the proxy). Verdicts are cached per (goal, answer), and
concurrent identical requests share one call. Every call is logged: the verdict's `log` (which
the runtime stores in the node's record, so it is saved with the tree) and `LLMJudge.calls`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from typing import Any, Mapping

from rao_jax.envs import base
from rao_jax.rollout import base as rollout

APIS = ("engine", "openai", "sglang")

_SYSTEM = ("You are a strict grader. You are shown a task given to an agent and the agent's "
           "final answer. Judge only whether the answer accomplishes the task.")
_USER = """\
Task:
{goal}

Agent's final answer:
{answer}

Does the answer accomplish the task? Reply with exactly one line: "VERDICT: yes", \
"VERDICT: no", or "SCORE: <a number from 0 to 1>" for partial success."""

_VERDICT = re.compile(r"\bverdict\s*[:=]\s*\**\s*(yes|no)\b", re.I)
_SCORE = re.compile(r"\bscore\s*[:=]\s*\**\s*([0-9]*\.?[0-9]+)", re.I)
_BARE = re.compile(r"^\W*(yes|no)\b", re.I)
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*$")


def parse_verdict(text: str) -> float | None:
  """1.0 / 0.0 for yes / no, a score in [0, 1], or None when `text` holds no clear verdict.

  Accepted: "VERDICT: yes|no", "SCORE: x" (x in [0, 1]), a reply that starts with yes / no, or a
  bare number in [0, 1]. Conflicting verdicts, or a score outside [0, 1], are malformed.
  """
  verdicts = {m.group(1).lower() for m in _VERDICT.finditer(text)}
  scores = []
  for m in _SCORE.finditer(text):
    try:
      scores.append(float(m.group(1)))
    except ValueError:
      return None
  if len(verdicts) > 1 or len(set(scores)) > 1 or (verdicts and scores):
    return None
  if verdicts:
    return 1.0 if verdicts.pop() == "yes" else 0.0
  if scores:
    return scores[0] if 0.0 <= scores[0] <= 1.0 else None
  m = _BARE.match(text)
  if m:
    return 1.0 if m.group(1).lower() == "yes" else 0.0
  m = _NUMBER.match(text)
  if m:
    v = float(m.group(1))
    return v if 0.0 <= v <= 1.0 else None
  return None


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
  """How the judge asks.

  Attributes:
    max_retries: re-asks after a malformed (or failed) reply; then the verdict is a failure.
    max_new_tokens: tokens the judge may generate per reply.
    temperature: sampling temperature of the first ask (0 = greedy).
    retry_temperature: temperature of re-asks (> 0 so that a retry can differ).
    timeout_s: seconds per HTTP request.
    model: the "model" field of OpenAI-compatible requests.
    judge_unfinished: also ask about nodes that never called finish; by default they score 0
      without a call (there is no answer to judge).
  """
  max_retries: int = 2
  max_new_tokens: int = 32
  temperature: float = 0.0
  retry_temperature: float = 0.7
  timeout_s: float = 60.0
  model: str = "default"
  judge_unfinished: bool = False

  def __post_init__(self):
    if self.max_retries < 0:
      raise ValueError(f"JudgeConfig.max_retries={self.max_retries}: must be >= 0.")
    if self.max_new_tokens < 1:
      raise ValueError(f"JudgeConfig.max_new_tokens={self.max_new_tokens}: must be >= 1.")
    if self.temperature < 0 or self.retry_temperature < 0:
      raise ValueError(f"JudgeConfig.temperature={self.temperature}, retry_temperature="
                       f"{self.retry_temperature}: must be >= 0.")
    if self.timeout_s <= 0:
      raise ValueError(f"JudgeConfig.timeout_s={self.timeout_s}: must be > 0.")


class LLMJudge(base.Judge):
  """A model that scores a node's answer against its goal (see the module docstring).

  Args:
    engine: a rollout engine (e.g. the policy's own); needs `tokenizer`.
    tokenizer: chat template, encode / decode and stop ids for `engine` (and, optionally, the
      chat template of a native SGLang endpoint).
    url: base URL of an HTTP endpoint instead of an engine (e.g. "http://127.0.0.1:30000").
    api: "openai" (POST {url}/v1/chat/completions) or "sglang" (POST {url}/generate); with an
      engine it is "engine".
    cfg: retries, sampling, timeouts.
  """

  def __init__(self, engine: rollout.Engine | None = None, tokenizer: Any = None,
               url: str | None = None, api: str | None = None,
               cfg: JudgeConfig = JudgeConfig()):
    if (engine is None) == (url is None):
      raise ValueError("LLMJudge: pass exactly one of `engine` (e.g. the policy's engine) or "
                       "`url` (an OpenAI-compatible or SGLang server).")
    api = api or ("engine" if engine is not None else "openai")
    if api not in APIS or (engine is not None) != (api == "engine"):
      raise ValueError(f"LLMJudge(api={api!r}): use 'engine' with an engine, or 'openai' / "
                       "'sglang' with a url.")
    if engine is not None and tokenizer is None:
      raise ValueError("LLMJudge: an engine judge needs the engine's `tokenizer` (chat template, "
                       "decode).")
    self.engine, self.tokenizer, self.url, self.api, self.cfg = engine, tokenizer, url, api, cfg
    if url is not None:
      self.url = url.rstrip("/")
    self._cache: dict[tuple[str, str], asyncio.Future] = {}
    self._session = None
    self.calls: list[dict[str, Any]] = []   # every model call, in order, for saving with trees
    self.num_requests = 0

  @classmethod
  def for_policy(cls, policy_engine: rollout.Engine, tokenizer: Any, url: str | None = None,
                 api: str | None = None, cfg: JudgeConfig = JudgeConfig()) -> "LLMJudge":
    """The default judge: the policy's own engine, unless a judge endpoint `url` is given."""
    if url:
      return cls(url=url, api=api or "openai", tokenizer=tokenizer, cfg=cfg)
    return cls(engine=policy_engine, tokenizer=tokenizer, cfg=cfg)

  # -- public ----------------------------------------------------------------------------------

  async def __call__(self, request: base.JudgeRequest) -> base.JudgeVerdict:
    goal, answer = request.node.goal, request.answer
    if not answer.strip() and not self.cfg.judge_unfinished:
      return base.JudgeVerdict(0.0, {"skipped": f"no answer (ended by {request.end_reason})"})
    key = (goal, answer)
    fut = self._cache.get(key)
    if fut is not None:
      score, log = await asyncio.shield(fut)
      return base.JudgeVerdict(score, {**log, "cached": True})
    fut = asyncio.get_running_loop().create_future()
    self._cache[key] = fut
    try:
      score, log = await self._judge(goal, answer, request)
    except BaseException as e:
      self._cache.pop(key, None)
      fut.set_exception(e)
      fut.exception()   # retrieved: no "never retrieved" warning when nobody else waits
      raise
    if score is None:
      # Failures are not cached: a later call may get a well-formed reply.
      self._cache.pop(key, None)
    fut.set_result((score, log))
    return base.JudgeVerdict(score, {**log, "cached": False})

  def cache_items(self) -> list[dict[str, Any]]:
    """The cached verdicts as JSON rows (goal, answer, score)."""
    return [{"goal": g, "answer": a, "score": f.result()[0]}
            for (g, a), f in self._cache.items() if f.done() and not f.exception()]

  async def close(self) -> None:
    if self._session is not None:
      await self._session.close()
      self._session = None

  # -- internals -------------------------------------------------------------------------------

  def messages(self, goal: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": _SYSTEM},
            {"role": "user", "content": _USER.format(goal=goal, answer=answer)}]

  async def _judge(self, goal: str, answer: str, request: base.JudgeRequest
                   ) -> tuple[float | None, dict[str, Any]]:
    msgs = self.messages(goal, answer)
    attempts = []
    for attempt in range(self.cfg.max_retries + 1):
      temp = self.cfg.temperature if attempt == 0 else self.cfg.retry_temperature
      t0 = time.perf_counter()
      entry: dict[str, Any] = {"attempt": attempt, "api": self.api, "temperature": temp,
                               "node_id": request.node.node_id, "env": request.env}
      try:
        raw = await self._ask(msgs, temp, seed=attempt)
        entry["raw"] = raw
        entry["score"] = parse_verdict(raw)
      except Exception as e:  # a dead endpoint is a failed attempt, not a crashed tree
        entry["error"] = f"{type(e).__name__}: {e}"
        entry["score"] = None
      entry["latency_s"] = time.perf_counter() - t0
      attempts.append(entry)
      self.calls.append({"goal": goal, "answer": answer, **entry})
      if entry["score"] is not None:
        return entry["score"], {"prompt": msgs[1]["content"], "attempts": attempts}
    return None, {"prompt": msgs[1]["content"], "attempts": attempts,
                  "failure": f"no well-formed verdict in {len(attempts)} attempts"}

  async def _ask(self, msgs: list[dict[str, str]], temperature: float, seed: int) -> str:
    self.num_requests += 1
    if self.api == "engine":
      return await self._ask_engine(msgs, temperature, seed)
    return await self._ask_http(msgs, temperature)

  async def _ask_engine(self, msgs, temperature: float, seed: int) -> str:
    ids = list(self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    params = rollout.SamplingParams(
        temperature=temperature, max_new_tokens=self.cfg.max_new_tokens, seed=seed,
        stop_token_ids=tuple(getattr(self.tokenizer, "stop_token_ids", ())))
    res = await self.engine.generate(rollout.GenerateRequest(prompt_ids=ids, params=params))
    if res.finish_reason == rollout.FinishReason.ABORT:
      raise RuntimeError(f"judge generation aborted: {res.message}")
    return self.tokenizer.decode(res.token_ids, skip_special_tokens=True)

  async def _ask_http(self, msgs, temperature: float) -> str:
    import aiohttp  # local: only HTTP judges need it
    if self._session is None:
      self._session = aiohttp.ClientSession(
          timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))
    if self.api == "openai":
      body = {"model": self.cfg.model, "messages": msgs, "temperature": temperature,
              "max_tokens": self.cfg.max_new_tokens}
      async with self._session.post(f"{self.url}/v1/chat/completions", json=body) as r:
        data = await _json_or_raise(r)
      return str(data["choices"][0]["message"]["content"] or "")
    text = (self.tokenizer.hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            if self.tokenizer is not None and hasattr(self.tokenizer, "hf")
            else "\n\n".join(m["content"] for m in msgs) + "\n")
    body = {"text": text, "sampling_params": {"temperature": temperature, "top_p": 1.0,
                                              "top_k": -1,
                                              "max_new_tokens": self.cfg.max_new_tokens}}
    async with self._session.post(f"{self.url}/generate", json=body) as r:
      data = await _json_or_raise(r)
    if isinstance(data, list):
      data = data[0]
    return str(data["text"])


async def _json_or_raise(r) -> Any:
  if r.status != 200:
    text = await r.text()
    raise RuntimeError(f"HTTP {r.status} from {r.url}: {text[:200]}")
  return await r.json(content_type=None)


class RuleJudge(base.Judge):
  """A judge without a model: a node that called finish(...) with a non-empty answer scores 1,
  any other ending 0. Cheap and deterministic; it rewards closing subtasks with a report, not
  their correctness, so it suits environments whose subtasks no verifier can check and where a
  model judge is too slow."""

  RULE = "finished with a non-empty answer"

  async def __call__(self, request: base.JudgeRequest) -> base.JudgeVerdict:
    ok = bool(request.answer.strip()) and request.end_reason == "finish"
    return base.JudgeVerdict(1.0 if ok else 0.0,
                             {"rule": self.RULE, "end_reason": request.end_reason})


def judge_log_rows(judge: LLMJudge) -> list[Mapping[str, Any]]:
  """All calls a judge made (goal, answer, raw reply, parsed score, latency), for a JSONL log."""
  return list(judge.calls)
