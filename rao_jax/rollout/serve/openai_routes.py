"""OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions (chat template applied,
streaming, ``n``, ``stop``, ``max_tokens``, ``logprobs``), with OpenAI's error shape."""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from aiohttp import web

from rao_jax.rollout.serve import sse
from rao_jax.rollout.serve.core import ServerCore
from rao_jax.rollout.serve.openai_schema import ChatIn, CompletionIn
from rao_jax.rollout.serve.schema import BadRequest, Done, Item, parse_sampling


def openai_error(message: str, param: str | None = None, status: int = 400) -> web.Response:
  """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
  return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                      "param": param, "code": status}}, status=status)


def _stream_error(msg: str) -> dict:
  return {"error": {"message": msg, "code": 400}}


class OpenAIRoutes(ServerCore):
  """The /v1 endpoints."""

  async def models(self, request):
    """GET /v1/models: the one served model."""
    return web.json_response({"object": "list", "data": [{
        "id": self.served_model_name, "object": "model", "created": self.created,
        "owned_by": "rao_jax", "root": self.model_path,
        "max_model_len": int(self.engine.config.capacity)}]})

  def _openai_items(self, prompts: list[list[int]], body, logprobs: bool, top: int,
                    echo: bool) -> list[Item]:
    smp = parse_sampling(body.sampling_json(int(self.engine.config.capacity)), self.eos_ids,
                         self.tokenizer is not None, self.preferred)
    base = uuid.uuid4().hex
    n = body.n
    items = []
    for i, p in enumerate(prompts):
      if not p:
        raise BadRequest("the prompt encodes to no tokens.", "prompt")
      if any(not 0 <= t < self.engine.vocab_size for t in p):
        raise BadRequest(f"prompt token ids outside [0, {self.engine.vocab_size}).", "prompt")
      for j in range(n):
        params = smp.params
        if params is not None and j and params.seed is not None:
          params = dataclasses.replace(params, seed=params.seed + j)
        items.append(Item(prompt=list(p), sampling=smp, params=params,
                          rid=f"{base}_{i * n + j}", return_logprob=logprobs or echo,
                          logprob_start_len=0 if echo and logprobs else -1,
                          top_logprobs_num=top,
                          temperature=params.temperature if params else 1.0,
                          lora=body.lora_path))
    return items

  def _token_str(self, t: int) -> str:
    return self._decode([t], False) if self.tokenizer is not None else str(t)

  @staticmethod
  def _usage(done: list[Done], n_prompts_tokens: int) -> dict:
    c = sum(len(d.ids) for d in done)
    return {"prompt_tokens": n_prompts_tokens, "completion_tokens": c,
            "total_tokens": n_prompts_tokens + c}

  @staticmethod
  def _oa_finish(d: Done) -> str:
    kind = d.finish.get("type")
    return "stop" if kind == "stop" else "length" if kind == "length" else "abort"

  def _completion_logprobs(self, d: Done, echo: bool, top: int) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    toks, lps, tops = [], [], []
    if echo:
      prompt_top = d.input_top or [None] * len(d.input_lps or [])
      for (lp, t), alts in zip(d.input_lps or [], prompt_top):
        toks.append(t)
        lps.append(lp)
        tops.append(alts if top else None)
    for k, t in enumerate(d.ids):
      toks.append(t)
      lps.append(d.logps[k])
      tops.append(d.output_top[k] if top and d.output_top else None)
    strs = [self._token_str(t) for t in toks]
    offsets, pos = [], 0
    for s in strs:
      offsets.append(pos)
      pos += len(s)
    return {"tokens": strs, "token_logprobs": lps, "text_offset": offsets,
            "top_logprobs": [None if a is None else {self._token_str(t): lp for lp, t in a}
                             for a in tops]}

  async def completions(self, request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    try:
      body = CompletionIn.from_json(await self._json(request))
      prompts = body.prompts()
      if any(isinstance(p, str) for p in prompts):
        if self.tokenizer is None:
          raise BadRequest("this server has no tokenizer; send token ids as the prompt.",
                           "prompt")
        ids = [self.tokenizer.encode(p) for p in prompts]
      else:
        ids = [list(p) for p in prompts]
      lp, echo, n = body.logprobs, body.echo, body.n
      items = self._openai_items(ids, body, lp is not None, lp or 0, echo)
    except BadRequest as e:
      return openai_error(str(e), e.param)
    await self.unpaused.wait()
    try:
      await self.check_items(items)      # lora_path names the adapter served (or none)
    except BadRequest as e:
      return openai_error(str(e), e.param)
    rid = f"cmpl-{uuid.uuid4().hex}"
    model = body.model or self.served_model_name
    prompt_tokens = sum(len(p) for p in ids)
    echo_text = [self._decode(p) if self.tokenizer is not None else "" for p in ids]

    def choice(k: int, d: Done) -> dict:
      text = d.text or ""
      if echo:
        text = echo_text[k // n] + text
      out = {"index": k, "text": text,
             "logprobs": self._completion_logprobs(d, echo, lp or 0) if lp is not None
             else None,
             "finish_reason": self._oa_finish(d), "matched_stop": d.finish.get("matched")}
      if body.return_token_ids:   # vLLM's extension: the generated ids (stop included), untrimmed
        out["token_ids"] = d.ids
      return out

    def envelope(choices, **extra):
      return {"id": rid, "object": "text_completion", "created": int(time.time()),
              "model": model, "choices": choices, **extra}
    if not body.stream:
      try:
        done = await asyncio.gather(*[self._run(it) for it in items])
      except ValueError as e:
        return openai_error(str(e))
      return web.json_response(envelope(
          [choice(k, d) for k, d in enumerate(done)], usage=self._usage(done, prompt_tokens * n),
          metadata={"weight_version": done[0].version if done else None}))
    sent = [""] * len(items)      # text already streamed per choice
    results: list[Done] = []

    def partial(k, ids_, lps_):
      full = (echo_text[k // n] if echo else "") + (self._visible_text(items[k], ids_) or "")
      delta = full[len(sent[k]):]
      if not delta:
        return []
      sent[k] = full
      return [envelope([{"index": k, "text": delta, "logprobs": None, "finish_reason": None}])]

    def final(k, d):
      results.append(d)
      full = choice(k, d)["text"]
      delta = full[len(sent[k]):] if full.startswith(sent[k]) else full
      c = {"index": k, "text": delta, "finish_reason": self._oa_finish(d),
           "matched_stop": d.finish.get("matched"),
           "logprobs": self._completion_logprobs(d, echo, lp or 0) if lp is not None else None}
      return [envelope([c])]

    def tail():
      if body.include_usage:
        return [envelope([], usage=self._usage(results, prompt_tokens * n))]
      return []
    return await sse.stream(request, items, self._run, partial, final, _stream_error, tail)

  def _chat_prompt(self, body: ChatIn) -> list[int]:
    if self.tokenizer is None:
      raise BadRequest("this server has no tokenizer, so no chat template; use /generate with "
                       "input_ids.", "messages")
    try:
      return self.tokenizer.apply_chat_template(list(body.messages), add_generation_prompt=True,
                                                **(body.chat_template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - a template error is the caller's input problem
      raise BadRequest(f"the chat template failed on these messages: {e}", "messages") from None

  def _chat_logprobs(self, d: Done, top: int) -> dict:
    content = []
    for k, (t, lp) in enumerate(zip(d.ids, d.logps)):
      s = self._token_str(t)
      alts = (d.output_top[k] if top and d.output_top else [])[:top]
      content.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                      "top_logprobs": [{"token": self._token_str(a), "logprob": alp,
                                        "bytes": list(self._token_str(a).encode("utf-8"))}
                                       for alp, a in alts]})
    return {"content": content}

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    try:
      body = ChatIn.from_json(await self._json(request))
      prompt = self._chat_prompt(body)
      want_lp, top, n = body.logprobs, body.top_logprobs or 0, body.n
      items = self._openai_items([prompt], body, want_lp, top, False)
    except BadRequest as e:
      return openai_error(str(e), e.param)
    await self.unpaused.wait()
    try:
      await self.check_items(items)      # lora_path names the adapter served (or none)
    except BadRequest as e:
      return openai_error(str(e), e.param)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    model = body.model or self.served_model_name

    def envelope(choices, obj="chat.completion", **extra):
      return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
              "choices": choices, **extra}
    if not body.stream:
      try:
        done = await asyncio.gather(*[self._run(it) for it in items])
      except ValueError as e:
        return openai_error(str(e))
      choices = [{"index": k, "message": {"role": "assistant", "content": d.text or ""},
                  "logprobs": self._chat_logprobs(d, top) if want_lp else None,
                  "finish_reason": self._oa_finish(d), "matched_stop": d.finish.get("matched")}
                 for k, d in enumerate(done)]
      return web.json_response(envelope(choices, usage=self._usage(done, len(prompt) * n),
                                        metadata={"weight_version": done[0].version}))
    sent: dict[int, str] = {}
    results: list[Done] = []

    def chunk(k, delta, finish=None, logprobs=None):
      return envelope([{"index": k, "delta": delta, "logprobs": logprobs,
                        "finish_reason": finish}], obj="chat.completion.chunk")

    def partial(k, ids_, lps_):
      out = []
      if k not in sent:
        sent[k] = ""
        out.append(chunk(k, {"role": "assistant", "content": ""}))
      text = self._visible_text(items[k], ids_) or ""
      if len(text) > len(sent[k]):
        out.append(chunk(k, {"content": text[len(sent[k]):]}))
        sent[k] = text
      return out

    def final(k, d):
      results.append(d)
      out = []
      if k not in sent:
        sent[k] = ""
        out.append(chunk(k, {"role": "assistant", "content": ""}))
      text = d.text or ""
      rest = text[len(sent[k]):] if text.startswith(sent[k]) else text
      out.append(chunk(k, {"content": rest} if rest else {}, self._oa_finish(d),
                       self._chat_logprobs(d, top) if want_lp else None))
      return out

    def tail():
      if body.include_usage:
        return [envelope([], obj="chat.completion.chunk",
                         usage=self._usage(results, len(prompt) * n))]
      return []

    return await sse.stream(request, items, self._run, partial, final, _stream_error, tail)
