"""Orbax checkpoints of the learner's TrainState (async, atomic, restorable onto any mesh).

Each step directory holds two items: "state" (every array of the TrainState, as a flat dict
keyed by its tree path, so a checkpoint is readable without this package's classes) and "meta"
(JSON: the learner and model configs and the caller's `extra`, e.g. the data position). Orbax
writes a save into a temporary directory and renames it when complete, so a process killed
mid-save leaves only that temporary directory, which `latest_step` ignores and the next manager
removes: the last complete checkpoint is what a resume sees.

On a local disk Orbax takes any directory named by a step number for a finished checkpoint. Only
a finished save holds its commit marker (Orbax writes `commit_success.txt` and the commit time in
`_CHECKPOINT_METADATA` just before the rename), so a step directory without it (a copy cut short,
a filesystem that does not rename atomically) is never restored: it is moved aside as
`<step>.incomplete-<time>` when the checkpointer opens, and the step is saved again.

A save that fails on the filesystem (no space, no permission: an OSError, or TensorStore's
error carrying the OS error code) does not stop training: it is logged with the directory and
the cause, kept in `Checkpointer.failures`, its partial files are removed, and the next save
tries again. With asynchronous saves the failure shows when the save is waited for (the next
save, `poll`, `wait`), so it is reported then.

Restore reads the arrays straight into the shardings of the TARGET state, so a checkpoint
written on an 8-device mesh restores onto one device (or any other mesh) for evaluation.
"""
from __future__ import annotations

import dataclasses
import errno as errno_lib
import glob
import json
import logging
import os
import re
import shutil
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)
# Names Orbax gives a save in progress and the marker of a finished one (orbax/_src/path:
# atomicity_types.TMP_DIR_SUFFIX, COMMIT_SUCCESS_FILE; metadata/checkpoint.py).
_TMP_SUFFIX = ".orbax-checkpoint-tmp"
_COMMIT_FILE = "commit_success.txt"
_STEP_METADATA = "_CHECKPOINT_METADATA"
# TensorStore reports an OS failure inside its own error (a ValueError), e.g. "... No space
# left on device [os_error_code='28']"; these status codes name filesystem failures too.
_OS_CODE = re.compile(r"os_error_code='?(\d+)")
_IO_STATUS = ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "UNAVAILABLE", "DATA_LOSS")


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


@dataclasses.dataclass(frozen=True)
class SaveFailure:
  """A checkpoint save the filesystem refused.

  Attributes:
    step: the step whose save failed.
    directory: the checkpoint directory written to.
    errno: the OS error number (errno.ENOSPC, errno.EACCES, ...), None when the error has none.
    cause: the error's text.
  """
  step: int
  directory: str
  errno: int | None
  cause: str

  def __str__(self) -> str:
    code = errno_lib.errorcode.get(self.errno, str(self.errno)) if self.errno else "no errno"
    return (f"checkpoint save of step {self.step} to {self.directory} failed ({code}): "
            f"{self.cause}")


def io_failure(e: BaseException) -> int | None | bool:
  """The OS error number of a filesystem failure `e` (None when it carries none); False when
  `e` is not a filesystem failure (a bug, which should stop the run)."""
  if isinstance(e, OSError):
    return e.errno
  text = str(e)
  m = _OS_CODE.search(text)
  if m:
    return int(m.group(1))
  if isinstance(e, (ValueError, RuntimeError)) and any(c in text for c in _IO_STATUS):
    return None
  return False


def is_committed(step_dir: str) -> bool:
  """Whether `step_dir` holds a finished Orbax save (its commit marker or commit time)."""
  if os.path.isfile(os.path.join(step_dir, _COMMIT_FILE)):
    return True
  try:   # saves by Orbax versions before the marker file record only the commit time
    with open(os.path.join(step_dir, _STEP_METADATA), encoding="utf-8") as f:
      return json.load(f).get("commit_timestamp_nsecs") is not None
  except (OSError, ValueError, AttributeError):
    return False


def set_aside_incomplete(directory: str) -> list[str]:
  """Renames step directories of `directory` that hold no finished save to
  `<step>.incomplete-<time>` (a name Orbax does not read as a step); returns the new paths."""
  moved = []
  if not os.path.isdir(directory):
    return moved
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if name.isdigit() and os.path.isdir(path) and not is_committed(path):
      dest = f"{path}.incomplete-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
      os.rename(path, dest)
      log.warning("Checkpoint step %s in %s was never finished (no %s); moved aside to %s and "
                  "not restored.", name, directory, _COMMIT_FILE, dest)
      moved.append(dest)
  return moved


class Checkpointer:
  """An Orbax CheckpointManager for TrainStates.

  Args:
    directory: where step directories go (created if missing).
    keep: number of checkpoints kept.
    use_async: write in a background thread after copying arrays off the devices.
  """

  def __init__(self, directory: str, keep: int = 3, use_async: bool = True):
    self.directory = os.fspath(directory)
    self.failures: list[SaveFailure] = []
    self._pending: int | None = None   # the step of the save in flight
    if jax.process_index() == 0:
      set_aside_incomplete(os.path.abspath(self.directory))
    if jax.process_count() > 1:   # no process lists the directory before process 0 cleaned it
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("rao_jax checkpoint directory checked")
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
    """Starts saving `state` and `meta` as `step` (waits for a previous save to finish first).

    Returns whether the save started; False when the filesystem refused it (see `failures`).
    """
    self._settle()
    for failure in self.failures[-3:]:   # a failed save's background writers may outlive it
      self._remove_partial(failure.step)
    flat, _ = flatten_with_names(state)
    try:
      started = bool(self._mngr.save(
          step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                        meta=ocp.args.JsonSave(meta)), force=True))
    except Exception as e:  # pylint: disable=broad-except
      if io_failure(e) is False:
        raise
      self._failed(step, e)
      return False
    self._pending = step if started else None
    return started

  def poll(self) -> None:
    """Records the failure of a background save that has ended, without waiting for one
    still running."""
    if self._pending is not None and not self._mngr.is_saving_in_progress():
      self._settle()

  def _settle(self) -> None:
    """Waits for the save in flight; a filesystem failure of it is recorded, not raised."""
    step, self._pending = self._pending, None
    try:
      self._mngr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      if io_failure(e) is False:
        raise
      self._failed(step, e)

  def _failed(self, step: int | None, e: BaseException) -> None:
    code = io_failure(e)
    failure = SaveFailure(int(step) if step is not None else -1,
                          os.path.abspath(self.directory), code if code is not False else None,
                          str(e).strip().splitlines()[0][:500] if str(e).strip() else repr(e))
    self.failures.append(failure)
    log.error("%s. Training goes on; the next checkpoint save tries again.", failure)
    self._drain()
    self._remove_partial(failure.step)
    # Orbax listed the step when the save started; the directory says what is really there.
    self._mngr.reload()

  def _drain(self) -> None:
    """Waits out a failed save's other writers and drops their errors.

    Orbax's finalize thread may fail (e.g. on its metadata file) while the save's background
    writer still runs; that writer's error, kept by Orbax, would be raised at the NEXT save and
    fail it though it wrote fine. The writer is private to Orbax (`_checkpointer`, the
    manager's `_non_blocking_metadata_store`), reached only if present; each wait or check
    raises each kept error once.
    """
    waits = [getattr(getattr(self._mngr, name, None), "wait_until_finished", None)
             for name in ("_checkpointer", "_non_blocking_metadata_store")]
    for _ in range(16):
      try:
        for wait in waits:
          if wait is not None:
            wait()
        self._mngr.check_for_errors()
        return
      except Exception:  # pylint: disable=broad-except
        continue

  def _remove_partial(self, step: int) -> None:
    """Deletes a failed save's temporary directory: on a full disk, the next save needs its
    space (Orbax itself removes it only when the same step is saved again or at the next
    start)."""
    if step >= 0 and jax.process_index() == 0:
      root = glob.escape(os.path.abspath(self.directory))
      for tmp in glob.glob(os.path.join(root, f"{step}{_TMP_SUFFIX}*")):
        shutil.rmtree(tmp, ignore_errors=True)

  def all_steps(self) -> list[int]:
    """The steps of finished checkpoints (and of the save in flight, which a caller must not
    start again), in increasing order; `restore` waits for that save first."""
    root = os.path.abspath(self.directory)
    return sorted(s for s in self._mngr.all_steps()
                  if s == self._pending or is_committed(os.path.join(root, str(s))))

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def restore(self, step: int | None, target_state) -> tuple[Any, dict]:
    """(state, meta) of `step` (None: the latest complete one) in `target_state`'s shardings.

    Raises:
      FileNotFoundError: no (such) checkpoint.
      ValueError: the checkpoint's arrays do not match the target's names or shapes.
    """
    self._settle()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"No complete checkpoint in {self.directory!r}.")
    elif step not in self.all_steps():
      raise FileNotFoundError(f"No checkpoint of step {step} in {self.directory!r}; "
                              f"available: {self.all_steps()}.")
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
    """Waits for the save in flight (a filesystem failure of it goes to `failures`)."""
    self._settle()

  def close(self) -> None:
    self._settle()
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
    steps = sorted(s for s in mngr.all_steps() if is_committed(os.path.join(directory, str(s))))
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


def init_from_dir(path: str) -> str:
  """The checkpoint folder of a run directory (or of its ``checkpoints/`` given directly)."""
  path = os.fspath(path)
  return path if os.path.basename(path.rstrip("/")) == "checkpoints" else os.path.join(
      path, "checkpoints")


def load_params_into(model, path: str, step: int | None = None) -> int:
  """Writes a run's checkpoint parameters (``path``: the run or its checkpoints/) into
  ``model``'s nnx.Param leaves (a LoRA model's adapter excepted); returns the step read.
  What a LoRA run adapts when it starts from another run (``config.ckpt.init_from``)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  target = nnx.state(model, nnx.Not(nnx.LoRAParam))
  params, step = restore_params(init_from_dir(path), target, step)
  nnx.update(model, params)
  log.info("Loaded the parameters of %s (step %d).", init_from_dir(path), step)
  return step
