r"""RAO training: rao-train --config=CONFIG[:ARG] --workdir=DIR.

CONFIG is a config file's path, or the name of one of the project's configs (the files of
`experiments/configs/`, which the wheel ships; an unknown name lists them).

Examples (in a checkout, `python -m experiments.train` is the same command):
  rao-train --config=textcraft_synth:recursive,ctx=8192 --workdir=runs/tcs
  rao-train --config=experiments/configs/textcraft_synth.py:recursive,smoke \
      --workdir=/tmp/smoke --config.rl.group_size=4

Restarting the same command resumes from the newest complete checkpoint in --workdir. A fault
the run cannot survive (updates that keep diverging, every rollout server gone, a rollout engine
that keeps failing) saves a checkpoint, prints what happened and how to go on, without a
traceback, and exits with status 1.
"""
from absl import flags
from ml_collections import config_flags

from rao_jax.cli import common

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, with an optional ':arg'.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and trees go.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  # A misspelt key would otherwise be silently ignored.
  common.check_keys(_CONFIG.value, config_flags.get_config_filename(flags.FLAGS["config"]))
  common.init_distributed()
  from rao_jax import trainer  # pylint: disable=g-import-not-at-top  (after distributed init)
  train_or_exit(trainer, _CONFIG.value, _WORKDIR.value)


def train_or_exit(trainer, config, workdir: str):
  """``trainer.train``; a fault the run cannot survive (``trainer.FatalRunError``) exits with its
  message and status 1. The message is the report (what happened, where the checkpoint is, how
  to resume); a traceback would bury it."""
  try:
    return trainer.train(config, workdir)
  except trainer.FatalRunError as e:
    raise SystemExit(f"rao-train: {e}") from None


def run() -> None:
  """The `rao-train` command."""
  common.run(main, __doc__)


if __name__ == "__main__":
  run()
