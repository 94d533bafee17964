"""LoRA adapters in Hugging Face PEFT's format: ``save_adapter`` and ``load_adapter``.

A LoRA run's policy is its base model plus a small adapter (``rao_jax.model.lora``). PEFT, the
library transformers, vLLM and SGLang users load adapters with, keeps one in a folder of two
files:

  adapter_config.json        peft_type "LORA", r, lora_alpha, lora_dropout, target_modules
                             (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), ...
  adapter_model.safetensors  per layer i and target, with M = self_attn.q_proj, mlp.down_proj, ...
      base_model.model.model.layers.{i}.{M}.lora_A.weight  [r, in]
      base_model.model.model.layers.{i}.{M}.lora_B.weight  [out, r]

PEFT's factors are torch ``nn.Linear`` weights ([out_features, in_features]) and it computes
y = x W^T + (lora_alpha / r) x A^T B^T, while ``rao_jax.model.lora`` stacks A [L, in, r] and
B [L, r, out] and computes y = x W + (alpha / r) (x A) B: layer i's files hold A[i].T and B[i].T.
``in``/``out`` are the flattened projection widths, in HF's order (q's out is heads-major,
H h, as HF's q_proj rows).

Use an exported adapter with transformers::

    base = transformers.AutoModelForCausalLM.from_pretrained(BASE_HF_FOLDER)
    policy = peft.PeftModel.from_pretrained(base, ADAPTER_FOLDER)

and one trained elsewhere (or exported here) with rao_jax, on top of its base model::

    from rao_jax.model import load_pretrained
    from rao_jax.model.peft import load_adapter
    model, tokenizer = load_pretrained(BASE)        # registry name, .gguf or HF folder
    model = load_adapter(ADAPTER_FOLDER, model)     # adds the adapter; logits as PEFT's

``rao-export --workdir=RUN`` writes a LoRA run's adapter folder (``--merge``: a full HF folder
with the adapter merged into the weights).
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rao_jax.model import lora as lora_lib
from rao_jax.model.weights import read_safetensors, write_safetensors

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Our adapter target -> the HF module (under model.layers.{i}) it adapts.
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}
# The prefix PeftModelForCausalLM's state dict gives the wrapped LlamaForCausalLM-style model
# (its ``base_model`` is the LoraModel, whose ``model`` is the transformers model); PEFT strips
# the adapter's name ("default") from the keys when it saves.
KEY_PREFIX = "base_model.model."
# PEFT config fields whose non-default values change what the adapter computes (or where it
# sits) in ways these stacked, every-layer, plain-LoRA adapters cannot express.
_MUST_BE_FALSE = ("use_dora", "use_rslora", "use_qalora", "lora_bias", "fan_in_fan_out")
_MUST_BE_EMPTY = ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern",
                  "exclude_modules", "layer_replication", "target_parameters",
                  "trainable_token_indices", "alora_invocation_tokens", "use_bdlora",
                  "kasa_config", "monteclora_config", "arrow_config")
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class AdapterFormatError(ValueError):
  """An adapter folder this model cannot take (naming the file, the field and the fix)."""


def _key(i: int, target: str, factor: str) -> str:
  return f"{KEY_PREFIX}model.layers.{i}.{HF_MODULES[target]}.lora_{factor}.weight"


def _np_dtype(dtype, default) -> np.dtype:
  name = jnp.dtype(dtype if dtype is not None else default).name
  if name not in _FLOAT_DTYPES:
    raise ValueError(f"dtype={dtype!r}: adapter tensors are stored as one of "
                     f"{', '.join(_FLOAT_DTYPES)}.")
  return np.dtype(jnp.dtype(name))


def _write_json(path: str, obj: Any) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
    f.write("\n")
  os.replace(tmp, path)


def _adapter_of(model, what: str):
  adapter = getattr(model, "lora", None)
  if not model.cfg.lora.enabled or adapter is None:
    raise ValueError(f"{what}: the model has no LoRA adapter (model.lora.rank is 0). "
                     "rao_jax.model.weights.export_hf writes a full model's HF folder.")
  return adapter


def adapter_bytes(model) -> int:
  """Bytes of the model's adapter arrays (0 without an adapter)."""
  adapter = getattr(model, "lora", None)
  if not model.cfg.lora.enabled or adapter is None:
    return 0
  return sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
             for v in adapter.arrays().values())


def peft_config(lcfg: lora_lib.LoraConfig, base_model: str | None = None) -> dict[str, Any]:
  """The adapter_config.json of an adapter of LoraConfig ``lcfg`` (PEFT's LoraConfig fields)."""
  alpha = float(lcfg.alpha)
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model or "",
      "r": int(lcfg.rank),
      "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
      "lora_dropout": float(lcfg.dropout),
      "target_modules": [HF_MODULES[t].split(".")[1] for t in lcfg.targets],
      "bias": "none",
      "use_rslora": False,
      "use_dora": False,
      "fan_in_fan_out": False,
      "modules_to_save": None,
      "layers_to_transform": None,
      "layers_pattern": None,
      "rank_pattern": {},
      "alpha_pattern": {},
      "init_lora_weights": True,
      "inference_mode": True,
      "revision": None,
  }


def save_adapter(model, out_dir: str, *, base_model: str | None = None, dtype=None) -> str:
  """Writes the model's LoRA adapter as a PEFT adapter folder.

  Args:
    model: a Transformer with an adapter (``model.lora.rank`` > 0).
    out_dir: the folder (created); its adapter_config.json and adapter_model.safetensors are
      replaced atomically, each written to a temporary file and renamed.
    base_model: ``base_model_name_or_path`` in the config: what the adapter goes on top of
      (a hub id or folder); "" when None.
    dtype: dtype of the stored tensors: float32, bfloat16 or float16 (default: the model's
      parameter dtype).

  Returns:
    out_dir.

  Raises:
    ValueError: the model has no adapter, or an unsupported dtype.
  """
  adapter = _adapter_of(model, "save_adapter")
  cfg = model.cfg
  dt = _np_dtype(dtype, cfg.jnp_param_dtype)
  tensors = {}
  for t in cfg.lora.targets:
    # Cast on the host through float32: bf16 params stay exact, float16 storage rounds once.
    a = np.asarray(jax.device_get(getattr(adapter, f"{t}_a")[...]), np.float32)
    b = np.asarray(jax.device_get(getattr(adapter, f"{t}_b")[...]), np.float32)
    for i in range(cfg.n_layers):
      tensors[_key(i, t, "A")] = np.ascontiguousarray(a[i].T.astype(dt))
      tensors[_key(i, t, "B")] = np.ascontiguousarray(b[i].T.astype(dt))
  os.makedirs(out_dir, exist_ok=True)
  write_safetensors(os.path.join(out_dir, WEIGHTS_FILE), tensors, {"format": "pt"})
  _write_json(os.path.join(out_dir, CONFIG_FILE), peft_config(cfg.lora, base_model))
  return out_dir


# ---- loading ------------------------------------------------------------------------------------
def _module_names(n_layers: int) -> dict[str, list[str]]:
  """target -> the full HF module name of that projection in each layer."""
  return {t: [f"model.layers.{i}.{m}" for i in range(n_layers)] for t, m in HF_MODULES.items()}


def _matches(spec, name: str) -> bool:
  """Whether PEFT's ``target_modules`` ``spec`` selects module ``name``: a string is a regex
  matched against the whole name, a list's entries match the name or a dotted suffix of it."""
  if isinstance(spec, str):
    return re.fullmatch(spec, name) is not None
  return any(name == e or name.endswith("." + e) for e in spec)


def _targets(spec, n_layers: int, where: str) -> tuple[str, ...]:
  """Our targets from PEFT's ``target_modules`` (a list of names, a regex, or "all-linear")."""
  if spec == "all-linear":   # PEFT: every linear layer but the output head
    return lora_lib.TARGETS
  if not isinstance(spec, str) and not (
      isinstance(spec, list) and spec and all(isinstance(e, str) for e in spec)):
    raise AdapterFormatError(
        f"{where}: target_modules={spec!r} must be a non-empty list of module names "
        "(q_proj, ..., down_proj) or a regex string.")
  if isinstance(spec, str):
    try:
      re.compile(spec)
    except re.error as e:
      raise AdapterFormatError(f"{where}: target_modules={spec!r} is not a valid regex "
                               f"({e}).") from e
  for other in ("lm_head", "model.embed_tokens"):
    if _matches(spec, other):
      raise AdapterFormatError(
          f"{where}: target_modules={spec!r} selects {other}; rao_jax adapts only the "
          f"decoder's projections ({', '.join(m.split('.')[1] for m in HF_MODULES.values())}).")
  out = []
  for t, names in _module_names(n_layers).items():
    hit = [i for i, n in enumerate(names) if _matches(spec, n)]
    if hit and len(hit) != n_layers:
      raise AdapterFormatError(
          f"{where}: target_modules={spec!r} selects {HF_MODULES[t]} in layers {hit} only; "
          f"rao_jax adapters cover all {n_layers} layers of a target.")
    if hit:
      out.append(t)
  if not isinstance(spec, str):
    ours = {m.split(".")[1] for m in HF_MODULES.values()}
    unknown = [e for e in spec
               if not any(_matches([e], n) for names in _module_names(n_layers).values()
                          for n in names)]
    if unknown:
      raise AdapterFormatError(
          f"{where}: target_modules entries {unknown} name no projection of this model; "
          f"rao_jax adapts {', '.join(sorted(ours))}.")
  if not out:
    raise AdapterFormatError(f"{where}: target_modules={spec!r} selects no projection of "
                             "this model.")
  return tuple(out)


def read_adapter_config(folder: str, n_layers: int) -> lora_lib.LoraConfig:
  """The LoraConfig of the PEFT adapter in ``folder``, refusing what it cannot express.

  Args:
    folder: a PEFT adapter folder.
    n_layers: the decoder layers of the model it goes on (for ``target_modules`` patterns).

  Raises:
    FileNotFoundError: no adapter_config.json.
    AdapterFormatError: a field rao_jax's adapters do not support (named, with its value).
  """
  path = os.path.join(folder, CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: is {folder!r} a PEFT adapter folder "
                            "(adapter_config.json + adapter_model.safetensors)?")
  try:
    with open(path) as f:
      c = json.load(f)
  except json.JSONDecodeError as e:
    raise AdapterFormatError(f"{path} is not valid JSON ({e}).") from e
  if not isinstance(c, dict):
    raise AdapterFormatError(f"{path}: expected a JSON object, got {type(c).__name__}.")
  if c.get("peft_type") != "LORA":
    raise AdapterFormatError(f"{path}: peft_type={c.get('peft_type')!r}; only LORA adapters "
                             "load into rao_jax models.")
  if c.get("task_type") not in (None, "CAUSAL_LM"):
    raise AdapterFormatError(f"{path}: task_type={c['task_type']!r}; rao_jax models are "
                             "causal LMs (task_type CAUSAL_LM).")
  for field in _MUST_BE_FALSE:
    if c.get(field):
      raise AdapterFormatError(f"{path}: {field}={c[field]!r} is not supported; rao_jax "
                               f"adapters are plain LoRA (retrain with {field}=False).")
  for field in _MUST_BE_EMPTY:
    if c.get(field):
      raise AdapterFormatError(f"{path}: {field}={c[field]!r} is not supported; rao_jax "
                               "adapters use one rank and alpha on every layer of each target "
                               f"and train nothing else (retrain without {field}).")
  if c.get("bias", "none") != "none":
    raise AdapterFormatError(f"{path}: bias={c['bias']!r} is not supported (the adapter would "
                             "train biases); only bias='none' loads.")
  r, alpha = c.get("r"), c.get("lora_alpha")
  if not isinstance(r, int) or isinstance(r, bool) or r < 1:
    raise AdapterFormatError(f"{path}: r={r!r} must be an int >= 1.")
  if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
    raise AdapterFormatError(f"{path}: lora_alpha={alpha!r} must be a number > 0.")
  targets = _targets(c.get("target_modules"), n_layers, path)
  try:
    return lora_lib.LoraConfig(rank=r, alpha=float(alpha), targets=targets,
                               dropout=float(c.get("lora_dropout") or 0.0))
  except ValueError as e:
    raise AdapterFormatError(f"{path}: {e}") from e


def read_adapter_arrays(folder: str, cfg, lcfg: lora_lib.LoraConfig) -> dict[str, np.ndarray]:
  """{"{t}_a": [L, in, r], "{t}_b": [L, r, out]} (float32) from a folder's safetensors file.

  Args:
    folder: a PEFT adapter folder.
    cfg: the ModelConfig of the model it goes on (widths and layers).
    lcfg: the adapter's config (``read_adapter_config``).

  Raises:
    FileNotFoundError: no adapter_model.safetensors.
    AdapterFormatError: a missing or unexpected tensor, or a shape that does not fit ``cfg``.
  """
  path = os.path.join(folder, WEIGHTS_FILE)
  if not os.path.isfile(path):
    hint = (" It has adapter_model.bin (a torch pickle, which rao_jax does not read): load it "
            "in PEFT and save_pretrained(..., safe_serialization=True)."
            if os.path.isfile(os.path.join(folder, "adapter_model.bin")) else "")
    raise FileNotFoundError(f"{path} does not exist.{hint}")
  tensors = read_safetensors(path)
  L, r = cfg.n_layers, lcfg.rank
  expected = {_key(i, t, f) for t in lcfg.targets for i in range(L) for f in ("A", "B")}
  missing = sorted(expected - set(tensors))
  if missing:
    raise AdapterFormatError(
        f"{path}: {len(missing)} tensors the config's targets and this model's {L} layers need "
        f"are missing, e.g. {missing[:3]} (an adapter of another model, or a file cut short?).")
  extra = sorted(set(tensors) - expected)
  if extra:
    raise AdapterFormatError(
        f"{path}: unexpected tensors, e.g. {extra[:3]}: not a plain LoRA adapter of the "
        f"targets {list(lcfg.targets)} on a {L}-layer model.")
  out = {}
  for t in lcfg.targets:
    n_in, n_out = lora_lib.io_dims(cfg, t)
    for f, shape in (("A", (r, n_in)), ("B", (n_out, r))):
      per = []
      for i in range(L):
        w = tensors[_key(i, t, f)]
        if tuple(w.shape) != shape:
          raise AdapterFormatError(
              f"{path}: {_key(i, t, f)} has shape {tuple(w.shape)}, this model needs {shape} "
              f"(r={r}, {HF_MODULES[t]} is {n_in} -> {n_out}): an adapter of another model?")
        per.append(np.asarray(w, np.float32).T)
      out[f"{t}_{f.lower()}"] = np.stack(per)
  return out


def load_adapter(folder: str, model):
  """Loads a PEFT LoRA adapter folder into ``model``; returns the model.

  A model without an adapter gets one of the file's r, lora_alpha, targets and lora_dropout
  (``rao_jax.model.lora.add_adapters``); a model with one must have the same rank, alpha and
  targets. The arrays are stored in the model's parameter dtype. Everything is checked before
  the model is changed.

  Args:
    folder: a PEFT adapter folder (adapter_config.json + adapter_model.safetensors), as
      ``save_adapter`` or PEFT's ``save_pretrained`` writes it.
    model: the base Transformer (e.g. ``load_pretrained(base)[0]``).

  Returns:
    The model, with the adapter.

  Raises:
    FileNotFoundError: a file is missing.
    AdapterFormatError: a config field rao_jax does not support, a tensor missing or of the
      wrong shape, or an adapter config that differs from the model's existing adapter.
  """
  cfg = model.cfg
  lcfg = read_adapter_config(folder, cfg.n_layers)
  arrays = read_adapter_arrays(folder, cfg, lcfg)
  if cfg.lora.enabled:
    have = cfg.lora
    for field, mine, theirs in (("r", have.rank, lcfg.rank),
                                ("lora_alpha", have.alpha, lcfg.alpha),
                                ("target_modules", sorted(have.targets), sorted(lcfg.targets))):
      if mine != theirs:
        raise AdapterFormatError(
            f"{os.path.join(folder, CONFIG_FILE)}: {field}={theirs!r} but the model's adapter "
            f"has {mine!r}; load into a model without an adapter (load_pretrained) to take "
            "the file's.")
    if have.dropout != lcfg.dropout:
      log.info("load_adapter: keeping the model's lora dropout %s (the file says %s; dropout "
               "only acts in training)", have.dropout, lcfg.dropout)
  else:
    lora_lib.add_adapters(model, lcfg)
  dt = model.cfg.jnp_param_dtype
  for name, value in arrays.items():
    var = getattr(model.lora, name)
    new = jnp.asarray(value, dt)
    old = var[...]
    if isinstance(getattr(old, "sharding", None), jax.sharding.Sharding):
      new = jax.device_put(new, old.sharding)
    var.set_value(new)
  return model
