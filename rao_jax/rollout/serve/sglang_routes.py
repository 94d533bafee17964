"""SGLang's /generate: single, batch, ``n`` samples, SSE streaming, log-probs and scoring,
answered in SGLang 0.5.6's shapes (``SGLANG_API.md``)."""
from __future__ import annotations

import asyncio

from aiohttp import web

from rao_jax.rollout.serve import sse
from rao_jax.rollout.serve.core import ServerCore, sglang_error
from rao_jax.rollout.serve.schema import BadRequest, Done, Item, parse_generate


class SGLangRoutes(ServerCore):
  """/generate and the SGLang response formatting."""

  def _lp_entry(self, lp, tok, it: Item):
    text = self._decode([tok], False) if it.text_in_logprobs else None
    return [lp, int(tok), text]

  def _top_entry(self, alts, it: Item):
    if alts is None:
      return None
    return [self._lp_entry(lp, t, it) for lp, t in alts]

  def _sglang_json(self, d: Done, index: int | None = None) -> dict:
    it = d.item
    meta = {
        "id": it.rid, "finish_reason": d.finish, "prompt_tokens": len(it.prompt),
        "weight_version": d.version, "completion_tokens": len(d.ids),
        "cached_tokens": d.cached, "e2e_latency": d.latency,
    }
    if it.return_logprob:
      meta["input_token_logprobs"] = [self._lp_entry(lp, t, it) for lp, t in (d.input_lps or [])]
      meta["output_token_logprobs"] = [self._lp_entry(lp, t, it) for lp, t in zip(d.logps, d.ids)]
      if it.top_logprobs_num:
        meta["input_top_logprobs"] = [self._top_entry(a, it) for a in (d.input_top or [])]
        meta["output_top_logprobs"] = [self._top_entry(a, it) for a in (d.output_top or [])]
    # SGLang trims only the text at a stop: output_ids keep every generated id, matching
    # completion_tokens and output_token_logprobs.
    out = {"output_ids": d.ids, "meta_info": meta}
    if d.text is not None:
      out = {"text": d.text, **out}
    if index is not None:
      out["index"] = index
    return out

  def _sglang_partial(self, it: Item, ids, logps, index: int | None) -> dict:
    meta = {"id": it.rid, "finish_reason": None, "prompt_tokens": len(it.prompt),
            "weight_version": str(self.engine.weight_version), "completion_tokens": len(ids),
            "cached_tokens": 0}
    if it.return_logprob:
      meta["input_token_logprobs"] = []
      meta["output_token_logprobs"] = [self._lp_entry(lp, t, it) for lp, t in zip(logps, ids)]
    out = {"output_ids": list(ids), "meta_info": meta}
    text = self._visible_text(it, ids)
    if text is not None:
      out = {"text": text, **out}
    if index is not None:
      out["index"] = index
    return out

  async def generate(self, request: web.Request) -> web.StreamResponse:
    """POST /generate (SGLang's GenerateReqInput)."""
    try:
      body = await self._json(request)
      items, as_list, stream = parse_generate(body, self.tokenizer, self.engine.vocab_size,
                                              self.eos_ids, self.preferred)
    except BadRequest as e:
      return sglang_error(str(e))
    # Like SGLang, requests that arrive while paused wait here, outside the engine, so a
    # /flush_cache during a weight update sees an idle engine.
    await self.unpaused.wait()
    if stream:
      return await sse.stream(
          request, items, self._run,
          partial=lambda k, ids, lps: [self._sglang_partial(items[k], ids, lps,
                                                            k if as_list else None)],
          final=lambda k, d: [self._sglang_json(d, k if as_list else None)],
          error=lambda msg: {"error": {"message": msg}})
    try:
      done = await asyncio.gather(*[self._run(it) for it in items])
    except ValueError as e:
      return sglang_error(str(e))
    out = [self._sglang_json(d) for d in done]
    return web.json_response(out if as_list else out[0])
