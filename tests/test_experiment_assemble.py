"""A run assembled in one place: `experiment.assemble` turns a config into the typed parts the
Trainer takes (tasks, task weights, policy and tokenizer, learner config, mesh, remat plan,
initial weights, rollout specs). A bad value fails there, before the policy loads; the parts of
a real assembly are checked in tests/test_trainer.py, beside the tiny model it builds.
"""
import pytest

from rao_jax import experiment as X
from tests.test_trainer import _config


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
