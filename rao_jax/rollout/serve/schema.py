"""The server's request and response shapes as typed models: plain Python, no web framework.

Each JSON body becomes a frozen dataclass whose fields carry SGLang's (or OpenAI's) names,
types and defaults. ``from_json`` refuses unknown fields, treats ``null`` as the default (as
SGLang does), checks every field against its annotation and then the ranges in
``__post_init__``; every refusal is a ``BadRequest`` whose message names the field and the bad
value, and whose ``param`` is the field (the OpenAI error's ``param``). The routes turn a
BadRequest into HTTP 400.

    SamplingParamsIn   SGLang's ``sampling_params`` (0.5.6 names, defaults and ranges)
    GenerateIn         SGLang's GenerateReqInput (``/generate``)
    CompletionIn       OpenAI's ``/v1/completions`` body
    ChatIn             OpenAI's ``/v1/chat/completions`` body
    UpdateWeightsFromDiskIn, UpdateWeightVersionIn, AbortIn, PauseIn   admin bodies
    LoadLoraAdapterIn, UnloadLoraAdapterIn   /load_lora_adapter, /unload_lora_adapter
    Sampling, Item, Done   what the routes run and what the formatters read
"""
from __future__ import annotations

import dataclasses
import types
import typing
import uuid
from typing import Any, Callable

from rao_jax.rollout.base import FinishReason, GenerateResult, SamplingParams

TOP_LOGPROBS_MAX = 20       # SGLang's and OpenAI's bound on alternatives per position

# Fields SGLang has and this server does not implement: refused when set.
UNSUPPORTED_SAMPLING = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex",
                        "logit_bias")
UNSUPPORTED_BODY = ("input_embeds", "image_data", "video_data", "audio_data",
                    "custom_logit_processor", "token_ids_logprob", "return_hidden_states",
                    "bootstrap_host", "bootstrap_port", "bootstrap_room")


class BadRequest(ValueError):
  """A request this server refuses (HTTP 400); ``param`` names the offending field."""

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.param = param


# ---- typed fields ---------------------------------------------------------------------------
def _describe(tp) -> str:
  args = [a for a in typing.get_args(tp) if a is not type(None)]
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    return " or ".join(_describe(a) for a in args)
  if typing.get_origin(tp) is tuple:
    return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
  return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          dict: "an object", list: "a list"}.get(tp, getattr(tp, "__name__", str(tp)))


def _conform(v, tp):
  """``v`` as a value of annotation ``tp`` (JSON lists become tuples, integral floats ints),
  or raises TypeError."""
  origin = typing.get_origin(tp)
  if tp is Any:
    return v
  if origin in (typing.Union, types.UnionType):
    for a in typing.get_args(tp):
      try:
        return _conform(v, a)
      except TypeError:
        pass
    raise TypeError
  if tp is type(None):
    if v is None:
      return v
    raise TypeError
  if isinstance(v, bool) and tp is not bool:
    raise TypeError        # JSON true is not the number 1
  if tp is bool and isinstance(v, bool):
    return v
  if tp is int and isinstance(v, (int, float)) and float(v) == int(v):
    return int(v)
  if tp is float and isinstance(v, (int, float)):
    return float(v)
  if tp in (str, dict, list) and isinstance(v, tp):
    return v
  if origin is tuple and isinstance(v, (list, tuple)):
    return tuple(_conform(x, typing.get_args(tp)[0]) for x in v)
  raise TypeError


class JsonBody:
  """from_json for the frozen dataclasses below: unknown fields, null, types, then ranges."""

  WHERE = "request"          # prefix of field names in messages
  # Unknown fields: refused (sampling_params, OpenAI bodies) or ignored (SGLang's other bodies,
  # whose pydantic models ignore extra fields, so clients send routing and logging hints).
  STRICT = True

  @classmethod
  def from_json(cls, obj: Any, where: str | None = None):
    """Builds the model from a decoded JSON object.

    Args:
      obj: the decoded JSON (must be an object).
      where: prefix of field names in error messages (default: the class's WHERE).

    Returns:
      The validated, frozen model.

    Raises:
      BadRequest: naming the first bad field and its value.
    """
    where = where or cls.WHERE
    if obj is None:
      obj = {}
    if not isinstance(obj, dict):
      raise BadRequest(f"{where} must be a JSON object, got {type(obj).__name__}.", where)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(obj) - names)
    if unknown and cls.STRICT:
      raise BadRequest(f"unknown {where} fields: {unknown}.", unknown[0])
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for k, v in obj.items():
      if k not in names or v is None:
        continue
      try:
        kwargs[k] = _conform(v, hints[k])
      except TypeError:
        raise BadRequest(f"{where}.{k}={v!r} must be {_describe(hints[k])}.", k) from None
    return cls(**kwargs)


def _check(ok: bool, where: str, name: str, value, rule: str):
  if not ok:
    raise BadRequest(f"{where}.{name}={value!r} {rule}.", name)


# ---- SGLang ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sampling:
  """One request's resolved sampling: the engine's SamplingParams plus what the server does.

  Attributes:
    params: what the engine samples with; None when max_new_tokens == 0 (scoring only).
    max_new: max_new_tokens.
    n: samples per prompt.
    stop_strs: stop strings (the server matches them on decoded text).
    stop_ids: every id that ends generation (the request's and, unless ignore_eos, EOS).
    no_stop_trim: keep the matched stop in the text.
    skip_special: skip special tokens when decoding.
    min_new: no stop (id or string) ends generation before this many tokens.
  """
  params: SamplingParams | None
  max_new: int
  n: int
  stop_strs: tuple[str, ...]
  stop_ids: tuple[int, ...]
  no_stop_trim: bool
  skip_special: bool
  min_new: int = 0


@dataclasses.dataclass(frozen=True)
class SamplingParamsIn(JsonBody):
  """SGLang 0.5.6's ``sampling_params``: names, defaults and ranges."""
  WHERE = "sampling_params"
  max_new_tokens: int = 128
  min_new_tokens: int = 0
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  min_p: float = 0.0
  n: int = 1
  stop: str | tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  skip_special_tokens: bool = True
  spaces_between_special_tokens: bool = True
  no_stop_trim: bool = False
  sampling_seed: int | None = None
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  repetition_penalty: float = 1.0
  # custom_params only feed a custom_logit_processor (refused at the body level), so, as on
  # SGLang without one, they change nothing.
  custom_params: dict | None = None
  json_schema: Any = None
  regex: Any = None
  ebnf: Any = None
  structural_tag: Any = None
  stop_regex: Any = None
  logit_bias: Any = None

  def __post_init__(self):
    w = self.WHERE
    for k in UNSUPPORTED_SAMPLING:
      if getattr(self, k) not in (None, {}, ""):
        raise BadRequest(f"{w}.{k} is not supported by this server (no constrained decoding "
                         "or logit bias).", k)
    _check(self.temperature >= 0, w, "temperature", self.temperature, "must be >= 0 (0 = greedy)")
    _check(0 < self.top_p <= 1, w, "top_p", self.top_p, "must be in (0, 1]")
    _check(self.top_k == -1 or self.top_k >= 1, w, "top_k", self.top_k,
           "must be -1 (all) or >= 1")
    _check(self.max_new_tokens >= 0, w, "max_new_tokens", self.max_new_tokens,
           "must be >= 0 (0 = score the prompt only)")
    _check(0 <= self.min_new_tokens <= self.max_new_tokens, w, "min_new_tokens",
           self.min_new_tokens, f"must be in [0, max_new_tokens={self.max_new_tokens}]")
    _check(0 <= self.min_p <= 1, w, "min_p", self.min_p, "must be in [0, 1]")
    _check(self.n >= 1, w, "n", self.n, "must be >= 1")
    for k in ("frequency_penalty", "presence_penalty"):
      _check(-2 <= getattr(self, k) <= 2, w, k, getattr(self, k), "must be in [-2, 2]")
    _check(0 < self.repetition_penalty <= 2, w, "repetition_penalty", self.repetition_penalty,
           "must be in (0, 2]")
    _check(all(t >= 0 for t in self.stop_token_ids), w, "stop_token_ids", self.stop_token_ids,
           "must be token ids (non-negative)")
    stops = (self.stop,) if isinstance(self.stop, str) else self.stop
    object.__setattr__(self, "stop", tuple(s for s in dict.fromkeys(stops) if s))

  @classmethod
  def parse(cls, obj: Any, preferred: dict | None = None) -> "SamplingParamsIn":
    """``from_json`` over ``preferred`` defaults (the server's --preferred-sampling-params)."""
    if obj is not None and not isinstance(obj, dict):
      raise BadRequest(f"sampling_params must be an object, got {type(obj).__name__}.",
                       "sampling_params")
    return cls.from_json({**(preferred or {}), **(obj or {})})

  def resolve(self, default_stop_ids: tuple[int, ...], has_tokenizer: bool) -> Sampling:
    """The engine's SamplingParams and the server's settings for this request.

    Args:
      default_stop_ids: EOS and end-of-turn ids, used unless ignore_eos.
      has_tokenizer: whether the server can decode (stop strings need it).

    Returns:
      The resolved Sampling.
    """
    if self.stop and not has_tokenizer:
      raise BadRequest("stop strings need a tokenizer and this server has none; use "
                       "stop_token_ids.", "stop")
    # SGLang treats temperatures below 1e-6 as greedy.
    temperature = 0.0 if self.temperature < 1e-6 else self.temperature
    stops = tuple(dict.fromkeys(self.stop_token_ids
                                + (() if self.ignore_eos else tuple(default_stop_ids))))
    params = None
    if self.max_new_tokens > 0:
      try:
        params = SamplingParams(
            temperature=temperature, top_p=self.top_p, top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            # Before min_new_tokens the engine masks the stop ids (SGLang's logit processor).
            min_new_tokens=self.min_new_tokens, stop_token_ids=stops, seed=self.sampling_seed,
            min_p=self.min_p, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty)
      except ValueError as e:
        raise BadRequest(str(e)) from None
    return Sampling(params=params, max_new=self.max_new_tokens, n=self.n,
                    stop_strs=self.stop, stop_ids=stops, no_stop_trim=self.no_stop_trim,
                    skip_special=self.skip_special_tokens, min_new=self.min_new_tokens)


def parse_sampling(sp: Any, default_stop_ids: tuple[int, ...], has_tokenizer: bool,
                   preferred: dict | None = None) -> Sampling:
  """Validates one SGLang ``sampling_params`` dict and resolves it (see SamplingParamsIn).

  Args:
    sp: the decoded ``sampling_params`` (None: all defaults).
    default_stop_ids: EOS and end-of-turn ids.
    has_tokenizer: whether the server can decode.
    preferred: the server's preferred defaults, overridden by ``sp``.

  Returns:
    The resolved Sampling.

  Raises:
    BadRequest: naming the bad field.
  """
  return SamplingParamsIn.parse(sp, preferred).resolve(default_stop_ids, has_tokenizer)


@dataclasses.dataclass
class Item:
  """One generation the server runs (a batch item, or one of its n samples)."""
  prompt: list[int]
  sampling: Sampling
  params: SamplingParams | None
  rid: str
  return_logprob: bool = False
  logprob_start_len: int = -1
  top_logprobs_num: int = 0
  text_in_logprobs: bool = False
  session_id: str | None = None
  temperature: float = 1.0
  lora: str | None = None          # the adapter the request names (``lora_path``); None: base


@dataclasses.dataclass
class Done:
  """A finished item: everything the SGLang and OpenAI formatters need."""
  item: Item
  ids: list[int]                   # every generated id (a matched stop token included)
  logps: list[float]
  finish: dict[str, Any]
  text: str | None                 # decoded, trimmed at the stop (unless no_stop_trim)
  cached: int
  version: str
  latency: float
  input_lps: list | None = None    # [logprob|None, id] per prompt position from logprob_start_len
  input_top: list | None = None
  output_top: list | None = None


PerItem = Any    # one value for every item of a batch, or a list with one per item


@dataclasses.dataclass(frozen=True)
class GenerateIn(JsonBody):
  """SGLang's GenerateReqInput (the fields this server reads, and those it refuses)."""
  text: str | tuple[str, ...] | None = None
  input_ids: Any = None
  sampling_params: Any = None
  rid: str | tuple[str, ...] | None = None
  return_logprob: PerItem = False
  logprob_start_len: PerItem = -1
  top_logprobs_num: PerItem = 0
  return_text_in_logprobs: bool = False
  stream: bool = False
  session_params: dict | None = None
  input_embeds: Any = None
  image_data: Any = None
  video_data: Any = None
  audio_data: Any = None
  # The name of a loaded adapter (SGLang: one name, or a list with one per item, null = base).
  lora_path: str | tuple[str | None, ...] | None = None
  custom_logit_processor: Any = None
  token_ids_logprob: Any = None
  return_hidden_states: Any = None
  bootstrap_host: Any = None
  bootstrap_port: Any = None
  bootstrap_room: Any = None
  STRICT = False

  def __post_init__(self):
    for k in UNSUPPORTED_BODY:
      if getattr(self, k) not in (None, False, [], {}):
        raise BadRequest(f"{k} is not supported by this server.", k)
    if (self.text is None) == (self.input_ids is None):
      raise BadRequest("give exactly one of `text` or `input_ids`.", "text")


def _per_item(v, n: int, key: str):
  if isinstance(v, list):
    if len(v) != n:
      raise BadRequest(f"{key} is a list of {len(v)}; give one value or one per item ({n}).",
                       key)
    return v
  return [v] * n


def _prompt_rows(g: GenerateIn, tokenizer, vocab_size: int) -> tuple[list[list[int]], bool]:
  if g.input_ids is not None:
    ids = g.input_ids
    if not isinstance(ids, list) or not ids:
      raise BadRequest("input_ids must be a non-empty list of ints (or a list of such lists).",
                       "input_ids")
    is_batch = isinstance(ids[0], list)
    rows = ids if is_batch else [ids]
    for r in rows:
      if not isinstance(r, list) or not r or not all(
          isinstance(t, int) and not isinstance(t, bool) for t in r):
        raise BadRequest("input_ids must be non-empty lists of ints.", "input_ids")
      if any(not 0 <= t < vocab_size for t in r):
        raise BadRequest(f"input_ids contain ids outside [0, {vocab_size}).", "input_ids")
    return rows, is_batch
  if tokenizer is None:
    raise BadRequest("this server has no tokenizer; send input_ids.", "text")
  is_batch = isinstance(g.text, tuple)
  texts = g.text if is_batch else [g.text]
  if not texts:
    raise BadRequest("text must be a string or a non-empty list of strings.", "text")
  rows = [tokenizer.encode(t) for t in texts]
  if any(not r for r in rows):
    raise BadRequest("text encodes to no tokens.", "text")
  return rows, is_batch


def _lora_names(lora_path, B: int) -> list[str | None]:
  """One adapter name (or None) per item of ``lora_path`` (a name, or a list of B)."""
  names = list(lora_path) if isinstance(lora_path, tuple) else [lora_path] * B
  if len(names) != B:
    raise BadRequest(f"lora_path is a list of {len(names)}; give one name or one per item "
                     f"({B}).", "lora_path")
  for name in names:
    if name is not None and not name.strip():
      raise BadRequest(f"lora_path={name!r} must name a loaded adapter (or be null for the "
                       "base model).", "lora_path")
  return names


def _rids(rid, B: int, n: int) -> list[str]:
  total = B * n
  if rid is None:
    base = [uuid.uuid4().hex for _ in range(B)]
    rids = [f"{base[i]}_{j}" if n > 1 else base[i] for i in range(B) for j in range(n)]
  elif isinstance(rid, str):
    rids = [rid] if total == 1 else [f"{rid}_{k}" for k in range(total)]
  else:
    if len(rid) != B:
      raise BadRequest(f"rid must be a string or a list of {B} strings (one per item).", "rid")
    rids = [f"{rid[i]}_{j}" if n > 1 else rid[i] for i in range(B) for j in range(n)]
  if len(set(rids)) != total:
    raise BadRequest("rids must be unique.", "rid")
  return rids


def parse_generate(body: Any, tokenizer, vocab_size: int, eos_ids: tuple[int, ...],
                   preferred: dict | None = None) -> tuple[list[Item], bool, bool]:
  """Validates a GenerateReqInput body into the items to run.

  A batch of B items with ``n`` samples each becomes B * n items, item-major (SGLang's order);
  a string ``rid`` becomes ``rid_0, rid_1, ...``, a list of rids gets ``_j`` suffixes per
  sample when n > 1; sample j > 0 of a seeded request uses ``sampling_seed + j`` so the n
  samples differ.

  Args:
    body: the decoded JSON body.
    tokenizer: the server's tokenizer, or None (input_ids only).
    vocab_size: the engine's vocabulary size (ids must be below it).
    eos_ids: EOS and end-of-turn ids.
    preferred: the server's preferred sampling defaults.

  Returns:
    (items, answer_with_a_list, stream).

  Raises:
    BadRequest: naming the bad field.
  """
  if not isinstance(body, dict):
    raise BadRequest("the body must be a JSON object (GenerateReqInput).")
  g = GenerateIn.from_json(body)
  rows, is_batch = _prompt_rows(g, tokenizer, vocab_size)
  B = len(rows)
  sps = g.sampling_params
  if isinstance(sps, list):
    if not is_batch or len(sps) != B:
      raise BadRequest(f"sampling_params is a list of {len(sps)}; give one dict, or one per "
                       f"item ({B}).", "sampling_params")
  else:
    sps = [sps] * B
  samplings = [parse_sampling(sp, eos_ids, tokenizer is not None, preferred) for sp in sps]
  n = samplings[0].n
  if any(s.n != n for s in samplings):
    raise BadRequest("n must be the same for every item of a batch (SGLang's rule).", "n")
  rids = _rids(g.rid, B, n)
  ret_lp = _per_item(g.return_logprob, B, "return_logprob")
  start = _per_item(g.logprob_start_len, B, "logprob_start_len")
  top_n = _per_item(g.top_logprobs_num, B, "top_logprobs_num")
  loras = _lora_names(g.lora_path, B)
  if g.return_text_in_logprobs and tokenizer is None:
    raise BadRequest("return_text_in_logprobs needs a tokenizer; this server has none.",
                     "return_text_in_logprobs")
  sid = g.session_params.get("id") if g.session_params else None
  items = []
  for i in range(B):
    rl = ret_lp[i] if ret_lp[i] is not None else False
    if not isinstance(rl, bool):
      raise BadRequest(f"return_logprob={rl!r} must be true or false.", "return_logprob")
    s0 = -1 if start[i] is None else start[i]
    if isinstance(s0, bool) or not isinstance(s0, int) or s0 < -1:
      raise BadRequest(f"logprob_start_len={s0!r} must be -1 (output only) or >= 0.",
                       "logprob_start_len")
    if rl and s0 >= len(rows[i]):
      raise BadRequest(f"logprob_start_len={s0} must be less than the input length "
                       f"({len(rows[i])}).", "logprob_start_len")
    k = 0 if top_n[i] is None else top_n[i]
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= TOP_LOGPROBS_MAX:
      raise BadRequest(f"top_logprobs_num={k!r} must be an int in [0, {TOP_LOGPROBS_MAX}].",
                       "top_logprobs_num")
    smp = samplings[i]
    for j in range(n):
      params = smp.params
      if params is not None and j and params.seed is not None:
        params = dataclasses.replace(params, seed=params.seed + j)
      items.append(Item(prompt=list(rows[i]), sampling=smp, params=params,
                        rid=rids[i * n + j], return_logprob=rl, logprob_start_len=s0,
                        top_logprobs_num=k if rl else 0,
                        text_in_logprobs=g.return_text_in_logprobs,
                        session_id=sid if B * n == 1 else None,
                        temperature=params.temperature if params else 1.0, lora=loras[i]))
  return items, is_batch or n > 1, g.stream


def finish_reason_json(r: GenerateResult, max_new: int, matched: Any = None) -> dict:
  """SGLang's ``meta_info.finish_reason`` of an engine result.

  Args:
    r: the engine's result.
    max_new: the request's max_new_tokens.
    matched: the stop id or stop string that ended it, if any.

  Returns:
    ``{"type": "stop", "matched": ...}``, ``{"type": "length", "length": N}`` or
    ``{"type": "abort", "message": ...}``.
  """
  if r.finish_reason == FinishReason.STOP:
    return {"type": "stop", "matched": matched if matched is not None else r.token_ids[-1]}
  if r.finish_reason == FinishReason.LENGTH:
    return {"type": "length", "length": max_new}
  if r.finish_reason == FinishReason.CONTEXT:
    # SGLang reports running into the context window as "length"; "reason" tells them apart.
    return {"type": "length", "length": len(r.token_ids), "reason": "context",
            "message": r.message}
  return {"type": "abort", "message": r.message or "aborted"}


def _lp_entry(lp, tok, it: Item, text_of: Callable[[int], str]) -> list:
  return [lp, int(tok), text_of(tok) if it.text_in_logprobs else None]


def sglang_output(d: Done, text_of: Callable[[int], str], index: int | None = None) -> dict:
  """A finished item as SGLang's /generate answers it: text, output_ids and meta_info.

  SGLang trims only the text at a stop: ``output_ids`` keep every generated id, matching
  ``completion_tokens`` and ``output_token_logprobs``.

  Args:
    d: the finished item.
    text_of: one token's text (for ``return_text_in_logprobs``).
    index: the item's index in a batch or ``n`` answer (None: a single answer).

  Returns:
    The JSON object.
  """
  it = d.item
  meta = {"id": it.rid, "finish_reason": d.finish, "prompt_tokens": len(it.prompt),
          "weight_version": d.version, "completion_tokens": len(d.ids),
          "cached_tokens": d.cached, "e2e_latency": d.latency}
  if it.return_logprob:
    meta["input_token_logprobs"] = [_lp_entry(lp, t, it, text_of) for lp, t in (d.input_lps or [])]
    meta["output_token_logprobs"] = [_lp_entry(lp, t, it, text_of)
                                     for lp, t in zip(d.logps, d.ids)]
    if it.top_logprobs_num:
      def top(alts):
        return None if alts is None else [_lp_entry(lp, t, it, text_of) for lp, t in alts]
      meta["input_top_logprobs"] = [top(a) for a in (d.input_top or [])]
      meta["output_top_logprobs"] = [top(a) for a in (d.output_top or [])]
  out = {"output_ids": d.ids, "meta_info": meta}
  if d.text is not None:
    out = {"text": d.text, **out}
  if index is not None:
    out["index"] = index
  return out


def sglang_partial(it: Item, ids: list[int], logps: list[float], text: str | None,
                   version: str, text_of: Callable[[int], str], index: int | None = None
                   ) -> dict:
  """A streamed chunk of an unfinished item (cumulative, like SGLang's default stream).

  Args:
    it: the item.
    ids: the ids generated so far.
    logps: their log-probs.
    text: the text a stream may show so far (None without a tokenizer).
    version: the weight version being served.
    text_of: one token's text (for ``return_text_in_logprobs``).
    index: the item's index in a batch or ``n`` answer.

  Returns:
    The JSON object, with ``finish_reason: None``.
  """
  meta = {"id": it.rid, "finish_reason": None, "prompt_tokens": len(it.prompt),
          "weight_version": version, "completion_tokens": len(ids), "cached_tokens": 0}
  if it.return_logprob:
    meta["input_token_logprobs"] = []
    meta["output_token_logprobs"] = [_lp_entry(lp, t, it, text_of) for lp, t in zip(logps, ids)]
  out = {"output_ids": list(ids), "meta_info": meta}
  if text is not None:
    out = {"text": text, **out}
  if index is not None:
    out["index"] = index
  return out


def held_back(text: str, stops: tuple[str, ...]) -> int:
  """How many trailing characters of a partial output a stream must not send yet.

  Args:
    text: the output decoded so far.
    stops: the request's stop strings.

  Returns:
    The length of the longest tail that is an incomplete UTF-8 character (decoded as U+FFFD)
    or the start of a stop string that may complete with the next tokens.
  """
  hold = 0
  for s in stops:
    for k in range(min(len(s) - 1, len(text)), 0, -1):
      if text.endswith(s[:k]):
        hold = max(hold, k)
        break
  if text.endswith("\ufffd"):
    hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
  return hold


# ---- admin bodies ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class UpdateWeightsFromDiskIn(JsonBody):
  """``/update_weights_from_disk``: a checkpoint folder and the version it becomes."""
  STRICT = False
  model_path: str = ""
  weight_version: str | int | None = None
  abort_all_requests: bool = False

  def __post_init__(self):
    if not self.model_path:
      raise BadRequest("model_path (a checkpoint folder) is required.", "model_path")


@dataclasses.dataclass(frozen=True)
class UpdateWeightVersionIn(JsonBody):
  """``/update_weight_version``: relabels the weights being served."""
  STRICT = False
  new_version: str = ""
  abort_all_requests: bool = False

  def __post_init__(self):
    if not self.new_version:
      raise BadRequest("new_version (a non-empty string) is required.", "new_version")


@dataclasses.dataclass(frozen=True)
class AbortIn(JsonBody):
  """``/abort_request``: one request by rid, or all of them."""
  STRICT = False
  rid: str = ""
  abort_all: bool = False

  def __post_init__(self):
    if not self.rid and not self.abort_all:
      raise BadRequest("give `rid` (a string) or `abort_all: true`.", "rid")


@dataclasses.dataclass(frozen=True)
class PauseIn(JsonBody):
  """``/pause_generation``: abort what runs, retract it, or hold it in place."""
  STRICT = False
  mode: str = "abort"

  def __post_init__(self):
    if self.mode not in ("abort", "retract", "in_place"):
      raise BadRequest(f"request.mode={self.mode!r}: use 'abort', 'retract' or 'in_place'.",
                       "mode")


@dataclasses.dataclass(frozen=True)
class LoadLoraAdapterIn(JsonBody):
  """``/load_lora_adapter`` (SGLang's LoadLoRAAdapterReqInput): a PEFT folder under a name.

  ``weight_version`` (a rao_jax extension, as on /update_weights_from_disk) relabels the served
  weights; SGLang's own load leaves the label as it is. ``pinned`` is accepted and changes
  nothing here (one adapter at a time is always resident).
  """
  STRICT = False
  lora_name: str = ""
  lora_path: str = ""
  pinned: bool = False
  weight_version: str | int | None = None

  def __post_init__(self):
    if not self.lora_name.strip():
      raise BadRequest("lora_name (a non-empty string) is required.", "lora_name")
    if not self.lora_path:
      raise BadRequest("lora_path (a PEFT adapter folder on the server) is required.",
                       "lora_path")


@dataclasses.dataclass(frozen=True)
class UnloadLoraAdapterIn(JsonBody):
  """``/unload_lora_adapter`` (SGLang's UnloadLoRAAdapterReqInput); ``weight_version`` as in
  LoadLoraAdapterIn."""
  STRICT = False
  lora_name: str = ""
  weight_version: str | int | None = None

  def __post_init__(self):
    if not self.lora_name.strip():
      raise BadRequest("lora_name (a non-empty string) is required.", "lora_name")
