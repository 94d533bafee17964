"""A run assembled in one place: `experiment.assemble` turns a config into the typed parts the
Trainer takes (tasks, task weights, policy and tokenizer, learner config, mesh, remat plan,
initial weights, rollout specs). A bad value fails there, before the policy loads; the parts of
a real assembly are checked in tests/test_trainer.py, beside the tiny model it builds.
"""
import os
import subprocess
import sys

import pytest

from rao_jax import experiment as X
from tests.test_trainer import _config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("key,value,match", [
    ("rl.task_weights", "colour:red=2", "no train task has the field"),
    ("eval.split", "val", r"eval.split='val' needs a validation split"),
    ("rl.deadline_rule", "wait", "deadline_rule"),
])
def test_a_bad_value_fails_at_assembly_before_the_policy_loads(tmp_path, key, value, match):
  c = _config(str(tmp_path / "no-such-model"))   # loading it would fail with another error
  section, field = key.split(".")
  c[section][field] = value
  with pytest.raises(ValueError, match=match):
    X.assemble(c, str(tmp_path / "run"))


def test_assemble_sets_malloc_before_jax_starts_its_backends(tmp_path):
  # host_memory.keep_freed_memory must run before JAX's threads exist; assemble's first query
  # of the processes starts them. A fresh process, since this one's backends have started.
  code = """
import sys
from jax._src import xla_bridge
from rao_jax import experiment as X, host_memory
from tests.test_trainer import _config
seen = []
host_memory.keep_freed_memory = lambda: seen.append(xla_bridge.backends_are_initialized())
c = _config('unused')
c.eval.split = 'val'   # fails once the tasks are built, before the policy loads
try:
  X.assemble(c, sys.argv[1])
except ValueError:
  print('started before:', seen)
"""
  out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.stdout.strip() == "started before: [False]", out.stdout + out.stderr[-2000:]


def test_stop_at_success_is_checked_against_its_range_and_needs_evaluations():
  from experiments.configs import textcraft_synth
  from rao_jax import experiment as X
  c = textcraft_synth.get_config("recursive,smoke")
  assert X._stop_at_success(c) == 0.0   # pylint: disable=protected-access
  c.eval.stop_at_success = 1.5
  with pytest.raises(ValueError, match=r"stop_at_success=1.5: a success in \[0, 1\]"):
    X._stop_at_success(c)   # pylint: disable=protected-access
  c.eval.stop_at_success, c.eval.every = 1.0, 0
  with pytest.raises(ValueError, match="needs in-loop evaluations: set config.eval.every"):
    X._stop_at_success(c)   # pylint: disable=protected-access
