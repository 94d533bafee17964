"""SGLang's /generate: single, batch, ``n`` samples, SSE streaming, log-probs and scoring,
answered in SGLang 0.5.6's shapes (``SGLANG_API.md``)."""
from __future__ import annotations

import asyncio

from aiohttp import web

from rao_jax.rollout.serve import sse
from rao_jax.rollout.serve.core import ServerCore, sglang_error
from rao_jax.rollout.serve.schema import (BadRequest, Done, Item, parse_generate,
                                          sglang_output, sglang_partial)


class SGLangRoutes(ServerCore):
  """/generate and the SGLang response formatting."""

  def _text_of(self, tok: int) -> str:
    return self._decode([tok], False)

  def _sglang_json(self, d: Done, index: int | None = None) -> dict:
    return sglang_output(d, self._text_of, index)

  def _sglang_partial(self, it: Item, ids, logps, index: int | None) -> dict:
    return sglang_partial(it, ids, logps, self._visible_text(it, ids),
                          str(self.engine.weight_version), self._text_of, index)

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
    # Refused here, before a stream starts, when the adapter named is not the one served (and
    # checked again as each item enters the engine, ServerCore._admit).
    try:
      await self.check_items(items)
    except BadRequest as e:
      return sglang_error(str(e))
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
