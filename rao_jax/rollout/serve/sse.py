"""Server-Sent Events for the streaming endpoints: ``data: {json}`` per update, then
``data: [DONE]``."""
from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable, Sequence

from aiohttp import web

# (index, ids so far, logprobs so far) -> chunks; (index, result) -> chunks; message -> chunk.
Partial = Callable[[int, list, list], list]
Final = Callable[[int, object], list]
Error = Callable[[str], dict]


async def stream(request: web.Request, items: Sequence, run: Callable[..., Awaitable],
                 partial: Partial, final: Final, error: Error,
                 tail: Callable[[], list] | None = None) -> web.StreamResponse:
  """Runs ``items`` concurrently and streams their progress as Server-Sent Events.

  Updates that pile up while a chunk is written are merged (the newest per item is sent), so a
  slow client slows its stream, not the engine.

  Args:
    request: the HTTP request to answer.
    items: what to run, one entry per choice.
    run: ``await run(item, progress=fn)`` runs one item, calling ``fn(ids, logps)`` from the
      event loop as tokens arrive; returns its result or raises ValueError.
    partial: item k's progress -> the chunks to send (possibly none).
    final: item k's result -> the chunks to send.
    error: a failed item's message -> its error chunk.
    tail: chunks to send after every item finished (e.g. usage).

  Returns:
    The finished stream response.
  """
  resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                     "Cache-Control": "no-cache"})
  await resp.prepare(request)
  queue: asyncio.Queue = asyncio.Queue()

  async def one(k, it):
    try:
      d = await run(it, progress=lambda ids, lps: queue.put_nowait((k, "part", ids, lps)))
      queue.put_nowait((k, "done", d, None))
    except ValueError as e:
      queue.put_nowait((k, "error", str(e), None))
  tasks = [asyncio.create_task(one(k, it)) for k, it in enumerate(items)]
  left = len(items)

  async def send(obj):
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
  try:
    while left:
      events = [await queue.get()]
      while not queue.empty():
        events.append(queue.get_nowait())
      latest = {}
      for ev in events:
        if ev[1] == "part":
          latest[ev[0]] = ev
          continue
        latest.pop(ev[0], None)
        if ev[1] == "error":
          await send(error(ev[2]))
        else:
          for chunk in final(ev[0], ev[2]) or []:
            await send(chunk)
        left -= 1
      for k, ev in latest.items():
        for chunk in partial(k, ev[2], ev[3]) or []:
          await send(chunk)
    for chunk in (tail() if tail else []):
      await send(chunk)
    await resp.write(b"data: [DONE]\n\n")
  except (ConnectionResetError, asyncio.CancelledError):
    for t in tasks:      # the client went away: abort what it no longer reads
      t.cancel()
    raise
  return resp
