"""What the entry points share: multi-host flags, and loading config files by path or by name.

`--config=NAME[:ARG]` (a name without a folder, e.g. `textcraft_synth:recursive,smoke`) names
one of the project's experiment configs: an installed wheel ships them under
`rao_jax/cli/shipped/experiments/` (copied from the checkout's `experiments/` when the wheel is
built), and an editable install finds them in its checkout. A path is used as it is.

A config file (`--config=PATH[:ARG]`, loaded by ml_collections from its path) may import its
siblings by package name, as `experiments/configs/textcraft.py` imports
`experiments.configs.base`. The package that holds it (its folders up to the first without
`__init__.py`) is made importable from that folder's parent, as `python -m` from a checkout
does with the working directory, so a checkout's configs run from any directory and from an
installed wheel, which ships no `experiments` package of its own. A config package that has a
`base` module with `check_keys(config)` is the schema its configs are checked against.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

from absl import app
from absl import flags
from absl import logging

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for multi-host runs.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-host run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (0-based).")


def init_distributed() -> None:
  """Calls jax.distributed.initialize when multi-host flags are given; a no-op otherwise."""
  given = [f.value is not None for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)]
  if not any(given):
    return
  if not all(given):
    raise flags.ValidationError(
        "Multi-host runs need all three of --coordinator_address, --num_processes and "
        f"--process_id (got coordinator_address={_COORDINATOR.value!r}, "
        f"num_processes={_NUM_PROCESSES.value!r}, process_id={_PROCESS_ID.value!r}).")
  import jax  # pylint: disable=g-import-not-at-top  (only multi-host runs pay for it here)
  jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                             num_processes=_NUM_PROCESSES.value,
                             process_id=_PROCESS_ID.value)
  logging.info("jax.distributed initialised: process %d of %d, %d global devices",
               jax.process_index(), jax.process_count(), jax.device_count())


def config_path(argv: list[str], name: str = "config") -> str | None:
  """The file of `--<name>=PATH[:ARG]` (or `--<name> PATH[:ARG]`) in argv, else None."""
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      value = arg.split("=", 1)[1]
    elif arg == f"--{name}" and i + 1 < len(argv):
      value = argv[i + 1]
    else:
      continue
    return value.split(":", 1)[0]
  return None


def config_package(path: str) -> tuple[str, str] | None:
  """(import root, package name) of the package holding the file at `path`, or None."""
  folder = os.path.dirname(os.path.abspath(path))
  parts = []
  while os.path.isfile(os.path.join(folder, "__init__.py")):
    parts.insert(0, os.path.basename(folder))
    folder = os.path.dirname(folder)
  return (folder, ".".join(parts)) if parts else None


def shipped_configs() -> str | None:
  """The folder of the project's experiment configs: the wheel's copy, else the checkout's."""
  here = os.path.dirname(os.path.abspath(__file__))
  for folder in (os.path.join(here, "shipped", "experiments", "configs"),
                 os.path.join(os.path.dirname(os.path.dirname(here)), "experiments", "configs")):
    if os.path.isfile(os.path.join(folder, "base.py")):
      return folder
  return None


def config_names(folder: str | None) -> list[str]:
  """The experiment configs in `folder` (file names without .py; `base` is their schema)."""
  if folder is None:
    return []
  return sorted(n[:-3] for n in os.listdir(folder)
                if n.endswith(".py") and n not in ("base.py", "__init__.py"))


def resolve_config(argv: list[str], name: str = "config") -> list[str]:
  """argv with `--<name>=NAME[:ARG]` replaced by the shipped config's path (module docstring).

  A value whose file exists, or that has a folder in it, is left as it is.

  Raises:
    SystemExit: the value is neither a file nor a shipped config; the message lists them.
  """
  path = config_path(argv, name)
  if path is None or os.path.isfile(path):
    return argv
  folder = shipped_configs()
  names = config_names(folder)
  stem = path[:-3] if path.endswith(".py") else path
  if os.sep in path or stem not in names:
    raise SystemExit(
        f"--{name}={path}: no such file, and no shipped experiment config of that name. Give a "
        f"config file's path, or one of {', '.join(names) or '(none: this install has none)'} "
        f"by name, e.g. --{name}=textcraft_synth:recursive,smoke.")
  full = os.path.join(folder, stem + ".py")
  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith(f"--{name}="):
      out[i] = f"--{name}={full}" + arg.split("=", 1)[1][len(path):]
      break
    if arg == f"--{name}" and i + 1 < len(out):
      out[i + 1] = full + out[i + 1][len(path):]
      break
  return out


def make_config_importable(argv: list[str]) -> None:
  """Puts the import root of argv's --config file's package on sys.path (see the docstring).

  Runs before absl parses the flags: that is when ml_collections runs the config file.
  """
  path = config_path(argv)
  found = config_package(path) if path else None
  if found is not None and found[0] not in sys.path:
    sys.path.insert(0, found[0])


def run(main: Callable[[list[str]], None], doc: str) -> None:
  """Runs an entry point's absl `main` with its --config file's package importable.

  Args:
    main: the absl main function.
    doc: the entry point's docstring: absl shows the __main__ module's docstring as the usage
      (`--help`), and __main__ is a console-script stub or an experiments/ wrapper.
  """
  sys.modules["__main__"].__doc__ = doc
  # `--help` lists the main module's key flags; the entry point's are defined in its module.
  for flag in flags.FLAGS.get_key_flags_for_module(main.__module__):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  sys.argv[:] = resolve_config(sys.argv)
  make_config_importable(sys.argv)
  app.run(main)


def check_keys(config, path: str) -> None:
  """Checks `config`, loaded from `path`, against its package's `base.check_keys`, if any.

  Raises:
    ValueError: from the schema, naming an unknown key.
  """
  if not os.path.isfile(path):
    # ml_collections names the file with its argument when the argument holds a "/"
    # (`micro.py:model=/runs/policy`); the file is what comes before the first ":".
    path = path.split(":", 1)[0]
  found = config_package(path)
  check = None
  if found is not None:
    name = f"{found[1]}.base"
    try:
      check = getattr(importlib.import_module(name), "check_keys", None)
    except ModuleNotFoundError as e:
      if e.name != name:
        raise
  if check is None:
    logging.warning("the config file %s has no schema (a base.check_keys beside it): its keys "
                    "are not checked, so a misspelt one would be ignored", path)
    return
  check(config)
