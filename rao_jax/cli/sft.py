r"""Supervised warm start from the scripted policy's demonstrations.

  rao-sft --config=experiments/configs/textcraft_synth.py:recursive,train=easy \
      --workdir=runs/sft --config.sft.steps=100
  rao-train --config=...:recursive --workdir=runs/rl \
      --config.ckpt.init_from=runs/sft

Demonstrations are written to WORKDIR/demonstrations.jsonl (or read with --demos=FILE). In a
checkout, `python -m experiments.sft` is the same command.
"""
import json

from absl import flags
from ml_collections import config_flags

from rao_jax.cli import common

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, with an optional ':arg'.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the SFT checkpoints go.")
_DEMOS = flags.DEFINE_string("demos", None, "A tree JSONL file of demonstrations to train on.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  common.init_distributed()
  from rao_jax import sft  # pylint: disable=g-import-not-at-top
  print(json.dumps(sft.run_sft(_CONFIG.value, _WORKDIR.value, _DEMOS.value)))


def run() -> None:
  """The `rao-sft` command."""
  common.run(main, __doc__)


if __name__ == "__main__":
  run()
