"""Environments by name, so configs and command lines can say `env.name = "textcraft_synth"`."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

from rao_jax.envs import base


def _textcraft(**kw) -> base.Environment:
  from rao_jax.envs import textcraft  # pylint: disable=g-import-not-at-top
  return textcraft.TextCraftEnv(**kw)


def _textcraft_synth(**kw) -> base.Environment:
  from rao_jax.envs import textcraft_synth  # pylint: disable=g-import-not-at-top
  return textcraft_synth.TextCraftSynthEnv(textcraft_synth.SynthConfig(**kw))


def _longcontext(**kw) -> base.Environment:
  from rao_jax.envs import longcontext  # pylint: disable=g-import-not-at-top
  return longcontext.LongContextEnv(**kw)


def _search(**kw) -> base.Environment:
  from rao_jax.envs import search  # pylint: disable=g-import-not-at-top
  return search.SearchEnv(**kw)


def _micro(**kw) -> base.Environment:
  from rao_jax.envs import micro  # pylint: disable=g-import-not-at-top
  return micro.MicroEnv(**kw)


def _delegation(**kw) -> base.Environment:
  from rao_jax.envs import delegation  # pylint: disable=g-import-not-at-top
  return delegation.DelegationEnv(**kw)


def _delegation_deep(**kw) -> base.Environment:
  from rao_jax.envs import delegation_deep  # pylint: disable=g-import-not-at-top
  return delegation_deep.DeepDelegationEnv(**kw)


ENVIRONMENTS: dict[str, Callable[..., base.Environment]] = {
    "textcraft": _textcraft,
    "textcraft_synth": _textcraft_synth,
    "longcontext": _longcontext,
    "search": _search,
    "micro": _micro,   # the micro-run's environment (tests/test_learns.py)
    "delegation": _delegation,   # k-part tasks that need helpers (test_learns_to_delegate.py)
    "delegation_deep": _delegation_deep,   # k in {1, 2, 4, 8} items, two helpers per agent
}


# The held-out split of every environment is "test": evaluation (experiments.evaluate,
# rao_jax.evaluation) reads it, training reads "train". TextCraft: every 10th task of the
# shipped file (100 of 1,000; the other 900 train); TextCraft-Synth, long context and search:
# generated with a different seed / split name than "train", never repeating a train task.
HELD_OUT_SPLIT = "test"


def make_env(name: str, kwargs: Mapping[str, Any] | None = None,
             task_files: Mapping[str, str] | None = None) -> base.Environment:
  """Builds the environment registered as `name` with keyword options `kwargs`.

  Args:
    name: a key of ENVIRONMENTS.
    kwargs: the environment's options (``config.env.kwargs``).
    task_files: {split: path of a JSONL task file} (``config.env.task_files``); those splits
      come from the files instead of the environment (see ``with_task_files``).
  """
  if name not in ENVIRONMENTS:
    raise ValueError(f"Unknown environment {name!r}; known: {sorted(ENVIRONMENTS)} "
                     "(set --config.env.name).")
  try:
    env = ENVIRONMENTS[name](**dict(kwargs or {}))
  except TypeError as e:
    raise ValueError(f"Environment {name!r} rejected options {dict(kwargs or {})}: {e} "
                     "(check --config.env.kwargs).") from e
  return with_task_files(env, task_files) if task_files else env


def load_task_file(env: base.Environment, path: str) -> list[base.Task]:
  """The tasks of a JSONL task file, for `env`.

  TextCraft and TextCraft-Synth read the RAO authors' format, one object a line:
  ``{"goal", "id", "max_steps", "misc": {"target_items", "initial_inventory",
  "gold_trajectory", ...}}`` (``misc.difficulty`` optional). Every environment also reads
  ``Task.to_dict()`` lines (``{"task_id", "goal", "fields", "difficulty", "max_steps"}``) and
  ``{"id", "goal", "misc"}`` lines (``misc`` becomes the task's fields).
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"task file {path!r} does not exist.")
  if env.name in ("textcraft", "textcraft_synth"):
    from rao_jax.envs import textcraft  # pylint: disable=g-import-not-at-top
    return textcraft.load_textcraft_jsonl(path, env=env.name)
  tasks = []
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        d = json.loads(line)
        fields = d["fields"] if "fields" in d else d.get("misc", {})
        tasks.append(base.Task(
            task_id=str(d["task_id"] if "task_id" in d else d["id"]), env=env.name,
            goal=d["goal"], fields=dict(fields),
            difficulty=d.get("difficulty", fields.get("difficulty")),
            max_steps=int(d.get("max_steps") or base.DEFAULT_MAX_STEPS)))
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}:{lineno}: not a task ({e!r}); expected "
                         "{'task_id', 'goal', 'fields', ...} or {'id', 'goal', 'misc'}.") from e
  return tasks


def with_task_files(env: base.Environment, task_files: Mapping[str, str]) -> base.Environment:
  """Makes `env` read the named splits from task files (the env object itself is returned).

  ``env.tasks(split)`` then answers from a file given for ``split`` (e.g. "test" or
  "test/hard"); a "<split>/<difficulty>" without its own file keeps the tasks of
  ``<split>``'s file with that difficulty; splits without a file come from the environment.
  Files load on first use.
  """
  files = {str(k): str(v) for k, v in dict(task_files).items() if v}
  for split, path in files.items():
    if not os.path.isfile(path):
      raise FileNotFoundError(f"config.env.task_files.{split}={path!r}: no such file.")
  original = env.tasks
  loaded: dict[str, list[base.Task]] = {}

  def tasks(split: str = "train"):
    name, _, difficulty = split.partition("/")
    if split in files:
      key, difficulty = split, ""
    elif name in files:
      key = name
    else:
      return original(split)
    if key not in loaded:
      loaded[key] = load_task_file(env, files[key])
      if not loaded[key]:
        raise ValueError(f"config.env.task_files.{key}={files[key]!r} holds no tasks.")
    return [t for t in loaded[key] if not difficulty or t.difficulty == difficulty]
  env.tasks = tasks
  env.task_files = dict(files)
  return env


def split_name(env: base.Environment, split: str, difficulty: str | None) -> str:
  """The task split holding `difficulty` ("all" or None: the whole split)."""
  if difficulty in (None, "", "all"):
    return split
  return f"{split}/{difficulty}"
