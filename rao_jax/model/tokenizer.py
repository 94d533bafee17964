"""The tokenizer and chat template, through transformers, without torch.

transformers 5.x builds a GGUF tokenizer via ``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``, which imports torch. The runtime must not need torch, so for GGUF files we build
the byte-level BPE ourselves from the file's vocabulary and merges with the ``tokenizers``
library and wrap it in ``PreTrainedTokenizerFast`` with the file's chat template. Tests check
that the ids equal transformers' own on many texts.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from rao_jax.model import gguf_file

# Token type codes in GGUF files (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes of byte-level vocabularies, by ``tokenizer.ggml.pre`` (as llama.cpp names them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
           "deepseek-r1-qwen": _QWEN2_SPLIT}


def _pre_tokenizer(pre: str | None):
  from tokenizers import Regex, pre_tokenizers
  if pre == "smollm":
    # SmolLM's own tokenizer.json (and llama.cpp's "smollm"): single digits, then GPT-2 bytes.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                             use_regex=True)])
  if pre in _SPLITS:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def build_hf_tokenizer_from_gguf(path: str):
  """A ``PreTrainedTokenizerFast`` from a GGUF file's byte-level BPE vocabulary (no torch)."""
  from tokenizers import AddedToken, Tokenizer as TkTokenizer, decoders, models, processors
  from transformers import PreTrainedTokenizerFast
  reader = gguf_file.open_reader(path)
  fields = gguf_file.read_tokenizer_fields(reader)
  kind = fields.get("ggml.model")
  if kind != "gpt2":
    raise gguf_file.UnsupportedModelError(
        f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2').")
  tokens = list(fields["tokens"])
  merges = [tuple(m.split(" ", 1)) for m in fields.get("merges", [])]
  vocab = {t: i for i, t in enumerate(tokens)}
  tk = TkTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                              continuing_subword_prefix="", end_of_word_suffix=""))
  tk.pre_tokenizer = _pre_tokenizer(fields.get("ggml.pre"))
  tk.decoder = decoders.ByteLevel()
  tk.post_processor = processors.ByteLevel(trim_offsets=False)
  types = list(fields.get("token_type", [1] * len(tokens)))
  special = [AddedToken(t, normalized=False, special=True)
             for t, ty in zip(tokens, types) if ty == _CONTROL]
  tk.add_special_tokens(special)
  tk.add_tokens([AddedToken(t, normalized=False, special=False)
                 for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

  def tok(key):
    i = fields.get(f"ggml.{key}")
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

  return PreTrainedTokenizerFast(
      tokenizer_object=tk, bos_token=tok("bos_token_id"), eos_token=tok("eos_token_id"),
      unk_token=tok("unknown_token_id"), pad_token=tok("padding_token_id"),
      chat_template=fields.get("chat_template"), clean_up_tokenization_spaces=False,
      add_bos_token=bool(fields.get("ggml.add_bos_token", False)),
      model_max_length=int(1e9))


class Tokenizer:
  """Encode/decode and the chat template, over a transformers ``PreTrainedTokenizerFast``.

  Attributes:
    hf: the underlying transformers tokenizer.
    eos_token_id: the model's end-of-sequence id.
    stop_token_ids: ids that end an assistant turn (eos plus e.g. ``<|im_end|>``).
  """

  # Special tokens that close an assistant turn in the chat formats we know.
  _TURN_END = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

  def __init__(self, hf):
    self.hf = hf
    vocab = hf.get_vocab()
    self.eos_token_id = hf.eos_token_id
    self.bos_token_id = hf.bos_token_id
    self.pad_token_id = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
    stops = {self.eos_token_id} if self.eos_token_id is not None else set()
    template = hf.chat_template or ""
    stops.update(vocab[t] for t in self._TURN_END if t in vocab and t in template)
    self.stop_token_ids = sorted(stops)

  @classmethod
  def from_gguf(cls, path: str) -> "Tokenizer":
    return cls(build_hf_tokenizer_from_gguf(os.fspath(path)))

  @classmethod
  def from_hf_folder(cls, folder: str) -> "Tokenizer":
    from transformers import PreTrainedTokenizerFast
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
      raise FileNotFoundError(f"{folder}: no tokenizer.json (needed for the tokenizer).")
    return cls(PreTrainedTokenizerFast.from_pretrained(folder))

  @property
  def vocab_size(self) -> int:
    return len(self.hf)

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text`` (special-token strings in it are parsed as special tokens)."""
    return list(self.hf.encode(text, add_special_tokens=False))

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict[str, Any]],
                          add_generation_prompt: bool = True, **kwargs) -> list[int]:
    """Token ids of ``messages`` formatted with the model's chat template."""
    text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       tokenize=False, **kwargs)
    return self.encode(text)

  def save(self, out_dir: str) -> None:
    """Writes tokenizer.json, tokenizer_config.json and the chat template into ``out_dir``."""
    self.hf.save_pretrained(out_dir)
