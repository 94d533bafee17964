"""rao-evaluate's --set: KEY=VALUE overrides of a run's config for one evaluation."""
import pytest
from absl import app

from rao_jax.cli import evaluate


def test_set_values_are_json_or_text_and_a_bad_item_names_the_form():
  assert evaluate._overrides(["agent.max_depth=8", "env.kwargs.seed=1", "env.name=textcraft",
                              "agent.temperature=0.5"]) == {
      "agent.max_depth": 8, "env.kwargs.seed": 1, "env.name": "textcraft",
      "agent.temperature": 0.5}
  with pytest.raises(app.UsageError, match="'agent.max_depth': use KEY=VALUE"):
    evaluate._overrides(["agent.max_depth"])
  with pytest.raises(app.UsageError, match="use KEY=VALUE"):
    evaluate._overrides(["=3"])
