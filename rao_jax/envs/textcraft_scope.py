"""What a TextCraft node was asked to craft, and whether a helper's task lies inside it.

Agents after RL (issue 45, seed 1) wrote their helpers' goals by hand and sent helpers after
invented items or after more of an item than their own task held. These pure functions read a
node's targets from its task fields and judge a helper's targets against its root's and its
parent's, from the recipe book alone, so they apply at launch (`TextCraftEnv.subtask_scope`)
and to stored trees (`NodeRecord.task_fields`) alike. `textcraft` re-exports them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:   # only for annotations: textcraft imports this module
  from rao_jax.envs.textcraft import RecipeBook


def task_targets(fields: Mapping[str, Any]) -> dict[str, int]:
  """A node's own targets from its task fields: the root's `target_items`, a child's `targets`.

  Works on live `NodeInfo.fields` and on stored `NodeRecord.task_fields` alike.
  """
  t = fields.get("targets")
  if not isinstance(t, Mapping):
    t = fields.get("target_items")
  return dict(t) if isinstance(t, Mapping) else {}


def recipe_closure(book: RecipeBook, targets: Iterable[str]) -> set[str]:
  """Every item some crafting route to `targets` may use: the targets, the ingredients of every
  recipe of each (all recipes, not only the first: Minecraft items have several), recursively;
  a tag stands for each of its concrete members."""
  seen: set[str] = set()
  stack = list(targets)
  while stack:
    x = stack.pop()
    if x in seen:
      continue
    seen.add(x)
    for r in book.recipes.get(x, []):
      for ing in r.ingredients:
        stack.extend(book.concrete(ing))
  return seen


def subtask_scope(book: RecipeBook, root_targets: Mapping[str, int],
                  parent_targets: Mapping[str, int],
                  child_targets: Mapping[str, int]) -> dict[str, bool]:
  """Whether a helper's targets lie outside its root's task and outside its parent's task.

  A pure function of the recipe book and three target dicts, so stored trees can be re-read
  (`task_targets` of the root's, the parent's and the child's `task_fields`).

  Returns:
    {"outside_root": some child item is not in the recipe closure of the root's targets
       (an item no route to the tree's task uses: invented, or another task's),
     "outside_parent": some child item is not in the closure of the parent's targets, or is one
       of the parent's own targets asked for in a larger count than the parent's task holds
       (a helper sent after more than its parent was asked for)}.
  """
  def outside(task: Mapping[str, int]) -> bool:
    closure = recipe_closure(book, task)
    return any(item not in closure for item in child_targets)

  more = any(item in parent_targets and n > parent_targets[item]
             for item, n in child_targets.items())
  return {"outside_root": outside(root_targets),
          "outside_parent": outside(parent_targets) or more}
