"""The ONE table of logical-axis -> mesh-axis rules, and helpers built on it.

Meshes have axes ("data", "fsdp", "tensor"). Parameters carry logical axis names (see
``transformer.LAYER_PARAM_AXES``); every PartitionSpec of the package is made here.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or a tuple of mesh axes, or None = replicated).
LOGICAL_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),   # rows of a batch split over every data-parallel axis
    "vocab": "tensor",
    "embed": "fsdp",             # parameters' D axis is sharded ZeRO-3 style
    "mlp": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": None,
    "norm": None,
    "seq": None,
    "cache_len": None,
}


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh over the first data*fsdp*tensor devices."""
  devices = list(devices if devices is not None else jax.devices())
  n = data * fsdp * tensor
  if n > len(devices):
    raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} needs {n} devices; "
                     f"only {len(devices)} available.")
  return Mesh(np.asarray(devices[:n]).reshape(data, fsdp, tensor), MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None, rules: dict[str, Any] | None = None) -> P:
  """PartitionSpec for logical axes. With shape and mesh, an axis whose size the mesh axes do
  not divide stays replicated (e.g. 3 kv heads over tensor=2), and a mesh axis is used once."""
  rules = LOGICAL_RULES if rules is None else rules
  used: set[str] = set()
  out = []
  for i, name in enumerate(axes):
    target = rules.get(name) if name is not None else None
    names = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
    names = tuple(a for a in names if a not in used)
    if mesh is not None:
      names = tuple(a for a in names if mesh.shape[a] > 1)
      if shape is not None and names and shape[i] % int(np.prod([mesh.shape[a] for a in names])):
        names = ()
    used.update(names)
    out.append(None if not names else (names[0] if len(names) == 1 else names))
  return P(*out)


def _axes_of(var: nnx.Variable):
  return var.get_metadata().get("out_sharding")


def state_partition_specs(state: Any, mesh: Mesh | None = None) -> Any:
  """PartitionSpecs for a model state (``nnx.state(model)``), same tree structure."""
  def spec(var):
    axes = _axes_of(var) if isinstance(var, nnx.Variable) else None
    if axes is None:
      return P()
    return logical_to_spec(axes, var.shape, mesh)
  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(state: Any, mesh: Mesh) -> Any:
  """NamedShardings for a model state on ``mesh``."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), state_partition_specs(state, mesh),
                      is_leaf=lambda x: isinstance(x, P))


def batch_spec(ndim: int = 2) -> P:
  """Batch arrays [B, ...]: rows over ("data", "fsdp"), the rest replicated."""
  return P(LOGICAL_RULES["batch"], *([None] * (ndim - 1)))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), mesh=mesh))


def cache_spec() -> P:
  """KV cache [L, B, S, K, h]: rows over the data axes, kv heads over "tensor"."""
  return logical_to_spec(("layers", "batch", "cache_len", "kv_heads", "head_dim"))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
  """Places a model's parameters on ``mesh`` by the rules (in place); returns the model."""
  state = nnx.state(model)
  shardings = state_shardings(state, mesh)
  nnx.update(model, jax.device_put(state, shardings))
  return model
