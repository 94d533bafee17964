"""What serve serves: a pretrained model, a training run's checkpoint, or a tiny random model;
and the embedded engine over it.

A run's checkpoint is read with ``rao_jax.learner.checkpoint.restore_params`` (the parameters
only, not the optimizer state), the one loader evaluation uses too.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from flax import nnx

from rao_jax.learner.checkpoint import load_params_into, restore_params
from rao_jax.model import ModelConfig, Transformer, load_pretrained
from rao_jax.model import lora as lora_lib
from rao_jax.model.tokenizer import Tokenizer
from rao_jax.model.weights import load_model, resolve_model_path

log = logging.getLogger(__name__)


def run_model_name(workdir: str) -> tuple[str, str]:
  """(model name, dtype) a training run started from, read from its ``config.json``.

  Args:
    workdir: the run directory (``python -m experiments.train --workdir=...``).

  Returns:
    ``config.model.name`` (registry name, GGUF file or HF folder) and ``config.model.dtype``.

  Raises:
    FileNotFoundError: ``workdir`` holds no config.json.
    ValueError: the config names no model.
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: is {workdir!r} a training run directory "
                            "(python -m experiments.train --workdir=...)?")
  with open(path) as f:
    model = json.load(f).get("model") or {}
  if not isinstance(model.get("name"), str) or not model["name"]:
    raise ValueError(f"{path}: model.name is missing; the run's config names its base model "
                     "there.")
  return model["name"], str(model.get("dtype") or "auto")


def run_lora(workdir: str) -> dict | None:
  """A run's ``config.model.lora`` section (None when its config has none)."""
  with open(os.path.join(workdir, "config.json")) as f:
    return (json.load(f).get("model") or {}).get("lora")


def run_init_from(workdir: str) -> str:
  """A run's ``config.ckpt.init_from`` ("" when it started from its model.name)."""
  with open(os.path.join(workdir, "config.json")) as f:
    return str((json.load(f).get("ckpt") or {}).get("init_from") or "")


def load_run_checkpoint(workdir: str, step: int | None = None, dtype: Any = None):
  """(model, tokenizer, step) of a training run's checkpoint ``step`` (default: the newest).

  The run's base model is built (its config and tokenizer) and its parameters replaced by the
  checkpoint's.

  Args:
    workdir: the run directory (has config.json and checkpoints/).
    step: the checkpoint step; None = the newest complete one.
    dtype: activation and parameter dtype; None = the run's ``model.dtype`` ("auto": float32
      on CPU, bfloat16 on accelerators).

  Returns:
    (model, tokenizer, step).
  """
  workdir = os.path.abspath(workdir)
  name, run_dtype = run_model_name(workdir)
  if dtype is None and run_dtype != "auto":
    dtype = run_dtype
  model, tokenizer = load_pretrained(name, dtype=dtype)
  # A LoRA run's checkpoint holds the adapter only: the base is the run's model.name, or the
  # run it started from (ckpt.init_from) when it names one.
  lora = lora_lib.from_dict(run_lora(workdir))
  init_from = run_init_from(workdir)
  if lora.enabled and init_from:
    load_params_into(model, init_from)
  lora_lib.add_adapters(model, lora)
  params, step = restore_params(os.path.join(workdir, "checkpoints"),
                                nnx.state(model, lora_lib.trainable(model.cfg)), step)
  nnx.update(model, params)
  return model, tokenizer, step


def tiny_model(name: str, dtype: Any = None):
  """(model, tokenizer) of a tiny random model with ``name``'s architecture and tokenizer.

  ``ModelConfig.tiny()`` of the named model (2 layers, small widths, the same vocabulary), so
  the real tokenizer works with it; for smoke runs and tests of the HTTP path.

  Args:
    name: registry name, .gguf file or HF folder.
    dtype: activation and parameter dtype (default float32).

  Returns:
    (model, tokenizer), the tokenizer None when the file has none.
  """
  path = resolve_model_path(name)
  folder = os.path.isdir(path)
  cfg = (ModelConfig.from_hf_config(path) if folder else ModelConfig.from_gguf(path)).tiny()
  if dtype is not None:
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  try:
    tokenizer = Tokenizer.from_hf_folder(path) if folder else Tokenizer.from_gguf(path)
  except Exception as e:  # noqa: BLE001 - a tiny test model can serve input_ids only
    log.warning("no tokenizer in %s (%s); serving input_ids only", path, e)
    tokenizer = None
  return model, tokenizer


def stop_ids(tokenizer) -> tuple[int, ...]:
  """EOS and end-of-turn ids of ``tokenizer`` (() without one): the engine's default stops."""
  if tokenizer is None:
    return ()
  ids = [tokenizer.eos_token_id, *tokenizer.stop_token_ids]
  return tuple(dict.fromkeys(int(t) for t in ids if t is not None))


def weights_loader(dtype: Any = None, lora: Any = None):
  """``loader(path) -> model`` for /update_weights_from_disk (an HF folder or GGUF file).

  Args:
    dtype: activation and parameter dtype.
    lora: the served model's adapter slot (a LoraConfig; None or rank 0: none). The loaded
      weights get a zero adapter of it, so they have the engine's structure and serve the new
      base exactly.
  """
  def load(path):
    return lora_lib.add_adapters(load_model(path, dtype=dtype), lora)
  return load
