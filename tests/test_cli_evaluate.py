"""rao-evaluate's --set: KEY=VALUE overrides of a run's config for one evaluation (parsed by
rao_jax.evaluation, which the command calls; the command's module defines absl flags that
other test modules define too, so it is not imported here)."""
import pytest

from rao_jax import evaluation


def test_set_values_are_json_or_text_and_a_bad_item_names_the_form():
  assert evaluation.parse_overrides(["agent.max_depth=8", "env.kwargs.seed=1",
                                     "env.name=textcraft", "agent.temperature=0.5"]) == {
      "agent.max_depth": 8, "env.kwargs.seed": 1, "env.name": "textcraft",
      "agent.temperature": 0.5}
  with pytest.raises(ValueError, match="'agent.max_depth': use KEY=VALUE"):
    evaluation.parse_overrides(["agent.max_depth"])
  with pytest.raises(ValueError, match="use KEY=VALUE"):
    evaluation.parse_overrides(["=3"])
