"""AdapterSlot: the one LoRA adapter a server applies, merged into its engine's weights.

SGLang keeps many adapters loaded and picks one per request (``lora_path`` on /generate). The
embedded engine holds one set of weights and merges an adapter into them (W + alpha / r A B,
``EmbeddedEngine.update_adapter``), so a decode step costs what it costs without one; this
server therefore applies ONE adapter at a time:

- The engine is built with an adapter "slot" of rank R (``--max-lora-rank``), targets
  (``--lora-target-modules``) and alpha (``--lora-alpha``), all zero (B = 0: the base exactly).
- ``/load_lora_adapter`` reads a PEFT folder and fits it into the slot: a rank r <= R adapter is
  padded with zero rank columns (A B is unchanged), targets the slot has and the adapter lacks
  get zeros, and an adapter of another alpha / r has its B rescaled by
  (alpha / r) / (slot alpha / R) in float32 (exact when the scales are equal; otherwise the
  merged weights may differ from a server built with the adapter's own alpha in the last bit).
  It replaces whatever adapter was active.
- ``/unload_lora_adapter`` of the active adapter serves the base again (a zero adapter).
- A request must name the active adapter (``lora_path``) while one is active, and name none
  while none is: anything else is refused naming the active one (see ``check``).

No web framework here; the routes are in lora_routes.py.
"""
from __future__ import annotations

import collections
import os

import jax
import numpy as np
from flax import nnx

from rao_jax.model import lora as lora_lib
from rao_jax.model import peft
from rao_jax.rollout.serve.schema import BadRequest

# HF module names (PEFT's and SGLang's --lora-target-modules) -> rao_jax adapter targets.
HF_TARGETS = {m.split(".")[1]: t for t, m in peft.HF_MODULES.items()}
# How many replaced adapter names the slot remembers to say "replaced by" in refusals.
_REMEMBERED = 64


def parse_target_modules(spec) -> tuple[str, ...]:
  """rao_jax targets of SGLang's ``--lora-target-modules`` (HF names, or ``all``).

  Args:
    spec: a list of module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
      down_proj), ``all`` / ``all-linear``, or a comma-separated string of those.

  Raises:
    ValueError: an unknown module name (naming it and the valid ones).
  """
  names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
  if not names or any(n in ("all", "all-linear") for n in names):
    return lora_lib.TARGETS
  bad = [n for n in names if n not in HF_TARGETS]
  if bad:
    raise ValueError(f"--lora-target-modules {bad}: name modules among "
                     f"{', '.join(HF_TARGETS)} (or 'all').")
  return tuple(t for t in lora_lib.TARGETS if t in {HF_TARGETS[n] for n in names})


class AdapterSlot:
  """The served adapter slot: its config, which adapter is active, and the fit of a folder.

  Args:
    model: the served Transformer, with the slot's adapter (``model.cfg.lora.rank`` > 0); only
      its config and the adapter's shapes are kept.
  """

  def __init__(self, model):
    if not model.cfg.lora.enabled:
      raise ValueError("AdapterSlot: the served model has no adapter slot (model.lora.rank 0); "
                       "build it with rao_jax.model.lora.add_adapters (serve's "
                       "--max-lora-rank).")
    self.cfg = model.cfg
    self.lora = model.cfg.lora
    # Shapes and dtypes only (the engine holds the values): the State a fit fills in.
    self._abstract = jax.eval_shape(lambda: nnx.state(model, nnx.LoRAParam))
    self.active: str | None = None          # the adapter name being served (None: the base)
    self.active_path: str | None = None
    self.replaced: collections.OrderedDict[str, str] = collections.OrderedDict()

  @property
  def loaded(self) -> dict[str, str]:
    """SGLang's ``loaded_adapters``: {name: path} (at most the active one here)."""
    return {self.active: self.active_path} if self.active is not None else {}

  def describe(self) -> dict:
    """The slot as /get_server_info reports it."""
    return {"max_lora_rank": self.lora.rank, "lora_alpha": self.lora.alpha,
            "lora_target_modules": [peft.HF_MODULES[t].split(".")[1] for t in self.lora.targets],
            "active_adapter": self.active, "loaded_adapters": self.loaded,
            "adapters_at_a_time": 1}

  # ---- building the engine's adapter state ---------------------------------------------------
  def _state(self, arrays: dict[str, np.ndarray]) -> nnx.State:
    """An nnx.State of the slot's structure holding ``arrays`` ({"{t}_a": ..., "{t}_b": ...})."""
    state = jax.tree.map(lambda x: x, self._abstract)
    nnx.replace_by_pure_dict(state, {"lora": arrays})
    return state

  def zero(self) -> nnx.State:
    """The all-zero adapter: the engine serves the base weights exactly."""
    return self._state({k: np.zeros(v.shape, v.dtype)
                        for k, v in self._abstract.to_pure_dict()["lora"].items()})

  def fit(self, folder: str) -> nnx.State:
    """The PEFT adapter in ``folder`` as the slot's adapter state (see the module docstring).

    Raises:
      FileNotFoundError: a file of the folder is missing.
      ValueError: the adapter does not fit the slot (rank, targets) or the model (shapes), or
        a PEFT field rao_jax does not support; the message names the value and the fix.
    """
    cfg, slot = self.cfg, self.lora
    lcfg = peft.read_adapter_config(folder, cfg.n_layers)
    where = os.path.join(folder, peft.CONFIG_FILE)
    if lcfg.rank > slot.rank:
      raise ValueError(f"{where}: r={lcfg.rank} exceeds this server's --max-lora-rank "
                       f"{slot.rank}; restart the server with --max-lora-rank {lcfg.rank} (or "
                       "more).")
    extra = [t for t in lcfg.targets if t not in slot.targets]
    if extra:
      hf = [peft.HF_MODULES[t].split(".")[1] for t in extra]
      raise ValueError(f"{where}: target_modules {hf} are not among this server's "
                       f"--lora-target-modules "
                       f"{[peft.HF_MODULES[t].split('.')[1] for t in slot.targets]}; restart "
                       "it with --lora-target-modules all (or naming them).")
    arrays = peft.read_adapter_arrays(folder, cfg, lcfg)      # float32
    ratio = lcfg.scale / slot.scale
    out = {}
    for name, like in self._abstract.to_pure_dict()["lora"].items():
      t, factor = name.rsplit("_", 1)
      if t not in lcfg.targets:
        out[name] = np.zeros(like.shape, like.dtype)
        continue
      value = arrays[name]
      if factor == "b" and ratio != 1.0:
        value = value * np.float32(ratio)
      if value.shape != like.shape:      # a smaller rank: zero rank columns leave A B as it is
        padded = np.zeros(like.shape, np.float32)
        padded[tuple(slice(0, n) for n in value.shape)] = value
        value = padded
      out[name] = value.astype(like.dtype)
    return self._state(out)

  # ---- which adapter is served ---------------------------------------------------------------
  def activate(self, name: str | None, path: str | None, why: str) -> None:
    """Records that ``name`` (None: the base) is served from now on; ``why`` names the call
    that replaced the previous adapter (for later refusals of its name)."""
    if self.active is not None and self.active != name:
      self.replaced[self.active] = why
      self.replaced.move_to_end(self.active)
      while len(self.replaced) > _REMEMBERED:
        self.replaced.popitem(last=False)
    self.replaced.pop(name, None)
    self.active, self.active_path = name, path

  def check(self, name: str | None) -> None:
    """Refuses a request whose ``lora_path`` is not what the server applies now.

    Raises:
      BadRequest: naming the active adapter and what to send or load.
    """
    if name == self.active:
      return
    rule = ("this server applies one LoRA adapter at a time, merged into its weights")
    if name is None:
      raise BadRequest(f"lora_path is missing, but adapter {self.active!r} is active ({rule}); "
                       f"send lora_path {self.active!r}, or POST /unload_lora_adapter "
                       f"{{\"lora_name\": {self.active!r}}} to serve the base model.",
                       "lora_path")
    active = repr(self.active) if self.active is not None else "none (the base model)"
    if name in self.replaced:
      raise BadRequest(f"lora_path {name!r} is no longer loaded: {self.replaced[name]} "
                       f"({rule}; the active adapter is {active}). Load it again with "
                       "/load_lora_adapter to switch back.", "lora_path")
    raise BadRequest(f"lora_path {name!r} is not loaded ({rule}; the active adapter is "
                     f"{active}, loaded_adapters {self.loaded}). Load it first with "
                     "POST /load_lora_adapter {\"lora_name\": ..., \"lora_path\": FOLDER}.",
                     "lora_path")


def check_without_slot(name: str | None) -> None:
  """Refuses ``lora_path`` on a server without an adapter slot."""
  if name is not None:
    raise BadRequest(f"lora_path {name!r}: this server was started without LoRA support; "
                     "restart it with --max-lora-rank R (and --lora-target-modules) to load "
                     "adapters with /load_lora_adapter.", "lora_path")
