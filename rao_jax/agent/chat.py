"""Token-level chat formatting: the prompt of a node and the tokens of each observation.

The runtime never re-tokenizes a history. A node's token list is the prompt ids, then per turn
the engine's generated ids (ending with a stop token such as ``<|im_end|>``) and the ids of the
observation message encoded on its own. The observation wrapper (the text between the end of
an assistant turn and the start of the next one) is read off the tokenizer's chat template once,
so the sequence is exactly what the template would render for the same conversation.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

_A, _O = "\x00ASSISTANT\x00", "\x00OBSERVATION\x00"


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
  """The chat template's text for `messages` (HF tokenizers or `render_chat` implementers)."""
  if hasattr(tokenizer, "render_chat"):
    return tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
  return tokenizer.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                          tokenize=False)


class ChatFormat:
  """Prompt and observation token ids for one tokenizer.

  Attributes:
    stop_token_ids: ids that end an assistant turn (passed to the engine).
    turn_end_text: the text of the token that closes an assistant turn (e.g. ``<|im_end|>``).
    obs_prefix / obs_suffix: text around an observation (after the turn-end token).
  """

  def __init__(self, tokenizer: Any):
    self.tokenizer = tokenizer
    self.stop_token_ids = tuple(tokenizer.stop_token_ids)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": _A}]
    t1 = render_chat(tokenizer, msgs, add_generation_prompt=False)
    t2 = render_chat(tokenizer, msgs + [{"role": "user", "content": _O}], add_generation_prompt=True)
    after_a = t2[t2.index(_A) + len(_A):]
    between, self.obs_suffix = after_a.split(_O, 1)
    stop_texts = [tokenizer.decode([i]) for i in self.stop_token_ids]
    self.turn_end_text = next((s for s in stop_texts if s and between.startswith(s)), "")
    if not self.turn_end_text:
      raise ValueError(f"ChatFormat: none of the stop tokens {stop_texts} closes an assistant "
                       f"turn in the chat template (text after a turn: {between!r}); set the "
                       "tokenizer's stop_token_ids to include the template's turn-end token.")
    self.obs_prefix = between[len(self.turn_end_text):]
    del t1

  def prompt_ids(self, system: str, user: str) -> list[int]:
    """Ids of the system + user messages followed by the assistant generation prompt."""
    text = render_chat(self.tokenizer, [{"role": "system", "content": system},
                                        {"role": "user", "content": user}],
                       add_generation_prompt=True)
    return list(self.tokenizer.encode(text))

  def observation_ids(self, text: str, turn_closed: bool) -> list[int]:
    """Ids that follow a generated turn: (turn end,) the observation message, next turn start.

    Args:
      text: the observation.
      turn_closed: whether the generated ids already end with a stop token; if not (the turn
        hit max_new_tokens) the turn-end token is inserted first, so the format stays valid.
    """
    head = "" if turn_closed else self.turn_end_text
    return list(self.tokenizer.encode(head + self.obs_prefix + text + self.obs_suffix))


class ByteChatTokenizer:
  """A byte-level tokenizer with a ChatML template: 256 byte ids plus 3 special tokens.

  For tests and the scripted-policy benchmark, where no model is needed: encode/decode are
  exact inverses, so token counts are byte counts.
  """

  SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

  def __init__(self):
    self.special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
    self.eos_token_id = self.special_ids["<|endoftext|>"]
    self.stop_token_ids = [self.special_ids["<|im_end|>"], self.eos_token_id]
    self.vocab_size = 256 + len(self.SPECIALS)

  def encode(self, text: str) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(text):
      j = text.find("<|", i)
      if j < 0:
        out.extend(text[i:].encode("utf-8"))
        break
      out.extend(text[i:j].encode("utf-8"))
      for s, sid in self.special_ids.items():
        if text.startswith(s, j):
          out.append(sid)
          i = j + len(s)
          break
      else:
        out.extend(b"<|")
        i = j + 2
    return out

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    names = {v: k for k, v in self.special_ids.items()}
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    cuts = np.flatnonzero(arr >= 256).tolist()   # byte runs between special tokens
    ids = arr.tolist()
    out, start = [], 0
    for i in cuts + [len(ids)]:
      out.append(arr[start:i].astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
      if i < len(ids) and not skip_special_tokens:
        out.append(names.get(ids[i], ""))
      start = i + 1
    return "".join(out)

  def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

  def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
    return self.encode(self.render_chat(messages, add_generation_prompt))
