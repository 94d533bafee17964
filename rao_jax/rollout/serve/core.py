"""ServerCore: the state every route shares and how one item runs on the engine.

Running an item is the same for every API: hand the engine a GenerateRequest, watch the tokens
for stop strings (none before ``min_new_tokens``; the engine masks stop ids until then), decode
and trim the text, and score prompt and top-k log-probs by one extra prefill when asked.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, Callable, Sequence

from aiohttp import web

from rao_jax.rollout.base import FinishReason, GenerateRequest, GenerateResult
from rao_jax.rollout.serve import adapters, door
from rao_jax.rollout.serve.protocol import ServedEngine
from rao_jax.rollout.serve.schema import BadRequest, Done, Item, finish_reason_json, held_back


def sglang_error(message: str, status: int = 400) -> web.Response:
  """SGLang's error shape: ``{"error": {"message": ...}}``."""
  return web.json_response({"error": {"message": message}}, status=status)


class ServerCore:
  """Shared state of the routes: the engine, the tokenizer, pause state and counters.

  Args:
    engine: what generates (see ``ServedEngine``).
    tokenizer: decodes outputs and encodes text prompts; None serves token ids only.
    model_path: reported as model_path/tokenizer_path.
    loader: ``loader(path) -> model`` for /update_weights_from_disk; None refuses it.
    server_args: the command line, reported by /get_server_info.
    served_model_name: the model id of /v1/models (default model_path).
    preferred_sampling_params: sampling defaults every request starts from.
    api_key: when set, every route but the health checks needs ``Authorization: Bearer
      <api_key>`` (``door.api_key_middleware``).
    weight_roots: the folders /update_weights_from_disk and /load_lora_adapter may read
      (``door.WeightRoots``); None: the working directory.
    adapter_slot: the LoRA adapter slot the engine's model carries (``adapters.AdapterSlot``);
      None refuses /load_lora_adapter and ``lora_path``.
  """

  def __init__(self, engine: ServedEngine, tokenizer=None, *, model_path: str = "",
               loader: Callable[[str], Any] | None = None, server_args: dict | None = None,
               served_model_name: str | None = None,
               preferred_sampling_params: dict | None = None, api_key: str | None = None,
               weight_roots: Sequence[str] | None = None,
               adapter_slot: adapters.AdapterSlot | None = None):
    self.engine = engine
    self.tokenizer = tokenizer
    self.model_path = model_path
    self.served_model_name = served_model_name or model_path or "rao_jax"
    self.preferred = preferred_sampling_params
    self.loader = loader
    # The key stays in this private attribute; server_args is reported by /get_server_info,
    # so a key passed there by mistake is dropped.
    self._api_key = api_key or None
    self.server_args = {k: v for k, v in (server_args or {}).items() if k != "api_key"}
    self.weight_roots = door.WeightRoots(weight_roots if weight_roots is not None
                                         else [os.getcwd()])
    self.ready = True
    self.created = int(time.time())
    self.unpaused = asyncio.Event()
    self.unpaused.set()
    eos = []
    if tokenizer is not None:
      eos = [tokenizer.eos_token_id] + list(getattr(tokenizer, "stop_token_ids", []))
    self.eos_ids = tuple(dict.fromkeys(int(t) for t in eos if t is not None))
    self._update_lock = asyncio.Lock()
    self.adapter_slot = adapter_slot
    # Cleared while an adapter load or unload swaps the weights: requests arriving then wait,
    # and are checked against the adapter served after it (``_admit``).
    self.weights_ready = asyncio.Event()
    self.weights_ready.set()

  def check_lora(self, name: str | None) -> None:
    """Refuses (BadRequest) a ``lora_path`` that is not what the engine serves now."""
    if self.adapter_slot is None:
      adapters.check_without_slot(name)
    else:
      self.adapter_slot.check(name)

  async def check_items(self, items: Sequence[Item]) -> None:
    """Waits out an adapter swap and refuses (BadRequest) items naming an adapter that is not
    served: the routes call it before answering, so a refusal is a 400, not a stream error."""
    await self.weights_ready.wait()
    for it in items:
      self.check_lora(it.lora)

  async def _admit(self, it: Item) -> None:
    """Waits out an adapter swap, then checks the item's adapter. The caller hands the item to
    the engine with no await in between, so no swap can start between the check and the
    engine taking it (a swap aborts what the engine holds)."""
    await self.weights_ready.wait()
    self.check_lora(it.lora)

  async def _json(self, request: web.Request, allow_empty: bool = False):
    raw = await request.read()
    if not raw.strip():
      if allow_empty:
        return {}
      raise BadRequest("empty body; send a JSON object.")
    try:
      return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise BadRequest(f"malformed JSON: {e}") from None

  def _decode(self, ids, skip_special: bool = True) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

  def _visible_text(self, it: Item, ids: list[int]) -> str | None:
    """A partial output's text as a stream may show it (see schema.held_back)."""
    if self.tokenizer is None:
      return None
    smp = it.sampling
    text = self._decode(ids, smp.skip_special)
    for s in smp.stop_strs:
      pos = text.find(s)
      if pos >= 0:
        return text[:pos] if not smp.no_stop_trim else text[:pos + len(s)]
    return text[:len(text) - held_back(text, smp.stop_strs)]

  async def _run(self, it: Item, progress: Callable[[list[int], list[float]], None] | None = None
                 ) -> Done:
    """Generates (or, for max_new_tokens 0, only scores) one item.

    Args:
      it: the item.
      progress: called on the event loop with (ids, logprobs) after every token (streams).

    Returns:
      The finished item.
    """
    t0 = time.perf_counter()
    smp = it.sampling
    loop = asyncio.get_running_loop()
    matched: list[str] = []
    await self._admit(it)
    if it.params is None:
      r = GenerateResult([], [], FinishReason.LENGTH, self.engine.weight_version,
                         len(it.prompt))
    else:
      tail = max((len(s) for s in smp.stop_strs), default=0) + 8

      def on_token(out, logps):   # on the engine's scheduler thread: quick, no blocking
        if progress is not None:
          snap = (list(out), list(logps))
          loop.call_soon_threadsafe(progress, *snap)
        if len(out) < smp.min_new:
          return False            # SGLang checks no stop string before min_new_tokens
        if smp.stop_strs:
          piece = self._decode(out[-tail:], smp.skip_special)
          for s in smp.stop_strs:
            if s in piece:
              matched.append(s)
              return True
        return False
      r = await self.engine.generate(
          GenerateRequest(prompt_ids=it.prompt, params=it.params, session_id=it.session_id,
                          rid=it.rid), on_token=on_token)
    ids = list(r.token_ids)
    match = None
    if r.finish_reason == FinishReason.STOP:
      # A stop token takes precedence over a stop string ending on the same token (SGLang
      # checks the ids first).
      match = ids[-1] if ids and ids[-1] in smp.stop_ids else (matched[0] if matched else None)
    text = None
    if self.tokenizer is not None:
      shown = ids[:-1] if (isinstance(match, int) and not smp.no_stop_trim) else ids
      text = self._decode(shown, smp.skip_special)
      if isinstance(match, str) and not smp.no_stop_trim:
        pos = text.find(match)
        text = text[:pos] if pos >= 0 else text
    done = Done(item=it, ids=ids, logps=[float(x) for x in r.logprobs],
                finish=finish_reason_json(r, smp.max_new, match), text=text,
                cached=r.cached_tokens, version=str(r.weight_version), latency=0.0)
    if it.return_logprob and (it.logprob_start_len >= 0 or it.top_logprobs_num > 0):
      await self._score(done)
    done.latency = time.perf_counter() - t0
    return done

  async def _score(self, d: Done) -> None:
    """Prompt log-probs from logprob_start_len, and top-k alternatives, by one extra prefill."""
    it = d.item
    seq = it.prompt + d.ids
    lps, top = await asyncio.to_thread(self.engine.score, seq, temperature=it.temperature,
                                       top_k=it.top_logprobs_num)
    P = len(it.prompt)
    if it.logprob_start_len >= 0:
      d.input_lps = [[lps[p], it.prompt[p]] for p in range(it.logprob_start_len, P)]
      if it.top_logprobs_num:
        d.input_top = [top[p] if p else None for p in range(it.logprob_start_len, P)]
    if it.top_logprobs_num:
      d.output_top = [top[P + k] for k in range(len(d.ids))]
