"""The pass-through share of `rao_jax.metrics.tree_stats`: children given their parent's goal."""
import pytest

from rao_jax import metrics
from rao_jax.learner.testing import make_node, make_tree


def _node(node_id, parent, depth, children, goal):
  n = make_node(node_id, parent, depth, children, 1.0)
  n.goal = goal
  return n


def test_pass_through_share_counts_children_whose_goal_is_their_parents():
  g = "Finish with 1 then 2."
  # Tree 1: the root forwards its goal to p (a pass-through), p splits it in two parts.
  # Tree 2: the root echoes its goal to two helpers (both count: each was given the whole
  # goal). Tree 3: no children at all.
  t1 = make_tree("t1", "G", [_node("r", None, 0, ["p"], g),
                             _node("p", "r", 1, ["x", "y"], g + " "),
                             _node("x", "p", 2, [], "Finish with 1."),
                             _node("y", "p", 2, [], "Finish with 2.")])
  t2 = make_tree("t2", "G", [_node("r", None, 0, ["a", "b"], g), _node("a", "r", 1, [], g),
                             _node("b", "r", 1, [], g)])
  t3 = make_tree("t3", "G", [_node("r", None, 0, [], g)])
  stats = metrics.tree_stats([t1, t2, t3])
  assert stats["pass_through_share"] == pytest.approx(3 / 5)   # p, a, b of 5 children
  assert metrics.tree_stats([t3])["pass_through_share"] == 0.0
  assert metrics.tree_stats([t1])["pass_through_share"] == pytest.approx(1 / 3)
