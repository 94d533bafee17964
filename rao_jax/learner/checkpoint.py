"""Orbax checkpoints of the learner's TrainState (async, atomic, restorable onto any mesh).

Each step directory holds two items: "state" (every array of the TrainState, as a flat dict
keyed by its tree path, so a checkpoint is readable without this package's classes) and "meta"
(JSON: the learner and model configs and the caller's `extra`, e.g. the data position). Orbax
writes a save into a temporary directory and renames it when complete, so a process killed
mid-save leaves only that temporary directory, which `latest_step` ignores and the next manager
removes: the last complete checkpoint is what a resume sees.

Restore reads the arrays straight into the shardings of the TARGET state, so a checkpoint
written on an 8-device mesh restores onto one device (or any other mesh) for evaluation.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def _key_name(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def flatten_with_names(tree) -> tuple[dict[str, Any], Any]:
  """({"params.layers.wq.value": leaf, ...}, treedef) for any pytree (names unique)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  flat = {}
  for path, leaf in leaves:
    name = ".".join(_key_name(k) for k in path) or "root"
    if name in flat:
      raise ValueError(f"Checkpoint: two leaves share the name {name!r}.")
    flat[name] = leaf
  return flat, treedef


class Checkpointer:
  """An Orbax CheckpointManager for TrainStates.

  Args:
    directory: where step directories go (created if missing).
    keep: number of checkpoints kept.
    use_async: write in a background thread after copying arrays off the devices.
  """

  def __init__(self, directory: str, keep: int = 3, use_async: bool = True):
    self.directory = os.fspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=use_async,
        cleanup_tmp_directories=True)
    # Handlers named up front: a manager opened only to restore (a new process) can then read
    # item metadata without Orbax warning that it does not know how to restore each item.
    self._mngr = ocp.CheckpointManager(
        os.path.abspath(self.directory), options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def save(self, step: int, state, meta: dict) -> bool:
    """Starts saving `state` and `meta` as `step` (waits for a previous save to finish first)."""
    flat, _ = flatten_with_names(state)
    return bool(self._mngr.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                      meta=ocp.args.JsonSave(meta)), force=True))

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mngr.all_steps())

  def restore(self, step: int | None, target_state) -> tuple[Any, dict]:
    """(state, meta) of `step` (None: the latest complete one) in `target_state`'s shardings.

    Raises:
      FileNotFoundError: no (such) checkpoint.
      ValueError: the checkpoint's arrays do not match the target's names or shapes.
    """
    self._mngr.wait_until_finished()
    if step is None:
      step = self._mngr.latest_step()
      if step is None:
        raise FileNotFoundError(f"No complete checkpoint in {self.directory!r}.")
    elif step not in self._mngr.all_steps():
      raise FileNotFoundError(f"No checkpoint of step {step} in {self.directory!r}; "
                              f"available: {sorted(self._mngr.all_steps())}.")
    flat_target, treedef = flatten_with_names(target_state)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                for k, v in flat_target.items()}
    saved = self._mngr.item_metadata(step)["state"]
    if saved is not None:
      saved_names = set(saved.keys()) if hasattr(saved, "keys") else None
      if saved_names is not None and saved_names != set(abstract):
        raise ValueError(
            f"Checkpoint step {step} in {self.directory!r} does not match this learner's state: "
            f"missing {sorted(set(abstract) - saved_names)[:5]}, unexpected "
            f"{sorted(saved_names - set(abstract))[:5]} (different model or loss config?).")
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    restored = out["state"]
    for k, v in restored.items():
      if v.shape != abstract[k].shape:
        raise ValueError(f"Checkpoint step {step}: {k} has shape {v.shape}, expected "
                         f"{abstract[k].shape}.")
    state = jax.tree_util.tree_unflatten(treedef, [restored[k] for k in flat_target])
    return state, dict(out["meta"] or {})

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()


def restore_params(directory: str, params, step: int | None = None) -> tuple[Any, int]:
  """The policy parameters of a learner checkpoint, without the optimizer state.

  Reads only the ``params.*`` arrays of a TrainState checkpoint (a partial restore: the
  optimizer moments, twice the parameters' size, stay on disk), into ``params``' structure,
  shardings and dtypes. What serving and evaluating a training run need; the learner itself
  resumes with ``Learner.restore``.

  Args:
    directory: the checkpoint directory (``LearnerConfig.ckpt_dir``: a run's ``checkpoints/``).
    params: the target: the parameter state of a model of the checkpoint's config
      (``nnx.state(model, nnx.Param)``); its arrays give the shardings and dtypes.
    step: the step to read; None reads the newest complete one.

  Returns:
    (params, step): the restored state, shaped like ``params``, and the step read.

  Raises:
    FileNotFoundError: no checkpoint at all.
    ValueError: no checkpoint of ``step`` (the message lists the steps there), or the
      checkpoint's parameters do not match ``params`` (names or shapes).
  """
  directory = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"No checkpoint directory {directory!r}: train first "
                            "(python -m experiments.train --workdir=...).")
  # A manager of its own: the learner's saves with the "standard" handler, and only the pytree
  # handler restores part of a tree (the files are the same). "meta" is named too though it is
  # not read: without its handler, Orbax warns twice that it cannot restore it.
  mngr = ocp.CheckpointManager(directory, item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                                                         "meta": ocp.JsonCheckpointHandler()})
  try:
    steps = sorted(mngr.all_steps())
    if not steps:
      raise FileNotFoundError(f"No checkpoint in {directory!r}: train first "
                              "(python -m experiments.train --workdir=...).")
    if step is not None and step not in steps:
      raise ValueError(f"step={step}: no such checkpoint in {directory!r}; available "
                       f"steps: {steps}.")
    step = steps[-1] if step is None else int(step)
    flat, treedef = flatten_with_names({"params": params})
    saved = mngr.item_metadata(step)["state"]
    names = set(saved.keys()) if saved is not None and hasattr(saved, "keys") else set(flat)
    missing = sorted(set(flat) - names)
    if missing:
      raise ValueError(f"Checkpoint step {step} in {directory!r} lacks parameters of this model: "
                       f"{missing[:5]} (a different model config?).")
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                for k, v in flat.items()}
    for k, v in abstract.items():
      shape = tuple(saved[k].shape) if saved is not None and hasattr(saved[k], "shape") else None
      if shape is not None and shape != tuple(v.shape):
        raise ValueError(f"Checkpoint step {step}: {k} has shape {shape}, this model's has "
                         f"{tuple(v.shape)} (a different model config?).")
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=True)))
  finally:
    mngr.close()
  restored = out["state"]
  return jax.tree_util.tree_unflatten(treedef, [restored[k] for k in flat])["params"], step
