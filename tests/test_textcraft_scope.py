"""A helper's scope on real recipe books: `textcraft.subtask_scope` says whether its targets lie
outside its root's task (an item no route to the tree's targets uses) and outside its parent's
(such an item, or more of one of the parent's own targets than the parent was asked for)."""
from rao_jax.envs import base
from rao_jax.envs import textcraft as tc
from rao_jax.envs import textcraft_synth as ts

_BOOKS = {}
IN = {"outside_root": False, "outside_parent": False}


def minecraft() -> tc.RecipeBook:
  if "mc" not in _BOOKS:
    _BOOKS["mc"] = tc.TextCraftEnv().book
  return _BOOKS["mc"]


def synth_env() -> ts.TextCraftSynthEnv:
  if "synth" not in _BOOKS:
    _BOOKS["synth"] = ts.TextCraftSynthEnv(ts.SynthConfig(tasks_per_difficulty=8,
                                                          items_per_tier=60))
  return _BOOKS["synth"]


def test_minecraft_scope_follows_every_recipe_and_tag():
  book = minecraft()
  root = {"wooden_pickaxe": 1, "bucket": 1}
  parent = {"stick": 2}
  scope = lambda child: tc.subtask_scope(book, root, parent, child)
  # A proper ingredient, reached through the tag:planks slot of stick's recipe, and one reached
  # only through stick's second recipe.
  assert scope({"oak_planks": 1}) == IN
  assert scope({"bamboo": 2}) == IN
  assert scope(parent) == IN                                  # the parent's whole task
  assert scope({"stick": 5}) == {"outside_root": False, "outside_parent": True}   # more of it
  # A sibling's part: in the root's task (bucket <- iron_ingot), not in this parent's.
  assert scope({"iron_ingot": 3}) == {"outside_root": False, "outside_parent": True}
  assert scope({"diamond_sword": 1}) == {"outside_root": True, "outside_parent": True}
  assert scope({"stick": 1, "unobtainium": 1}) == {"outside_root": True, "outside_parent": True}
  # A child of the root: its parent's task is the root's, and a repeat beyond it is flagged.
  assert tc.subtask_scope(book, root, root, {"bucket": 1}) == IN
  assert tc.subtask_scope(book, root, root, {"bucket": 2}) == {"outside_root": False,
                                                              "outside_parent": True}


def test_synth_scope_on_generated_tasks():
  env = synth_env()
  book = env.book
  task = next(t for t in env.tasks("test/medium") if len(t.fields["target_items"]) == 2)
  root = task.fields["target_items"]
  (a, na), (b, _) = root.items()
  only_b = sorted(ts._closure(book, {b: 1}) - ts._closure(book, {a: 1}))
  assert only_b and tc.recipe_closure(book, root) == ts._closure(book, root)
  ing = next(iter(book.recipes[a][0].ingredients))
  base_item = next(x for x in ts.tree_expansion_needs(book, {a: na}))
  parent = {a: na}
  assert tc.subtask_scope(book, root, parent, {ing: 3}) == IN
  assert tc.subtask_scope(book, root, parent, {base_item: 1}) == IN
  assert tc.subtask_scope(book, root, parent, {a: na}) == IN
  assert tc.subtask_scope(book, root, parent, {a: na + 1}) == {"outside_root": False,
                                                               "outside_parent": True}
  assert tc.subtask_scope(book, root, parent, {only_b[0]: 1}) == {"outside_root": False,
                                                                  "outside_parent": True}
  # An invented name in the domain's pattern (a tier no world has).
  assert tc.subtask_scope(book, root, parent, {"m0_i13": 1}) == {"outside_root": True,
                                                                 "outside_parent": True}


def test_env_hook_reads_root_parent_and_child_fields():
  env = synth_env()
  task = next(t for t in env.tasks("test/medium") if len(t.fields["target_items"]) == 2)
  (a, na), _ = task.fields["target_items"].items()
  ep = env.new_episode(task)
  root = base.NodeInfo("0", None, 0, task.goal, task.fields, 200)
  helper = base.NodeInfo("0.1", "0", 1, "g", {"targets": {a: na}}, 20)
  spec = env.child_spec(ep, root, ({a: na + 2}, 5), {})
  assert env.subtask_scope(ep, root, spec) == {"outside_root": False, "outside_parent": True}
  spec = env.child_spec(ep, helper, ({a: na}, 5), {})
  assert env.subtask_scope(ep, helper, spec) == IN
  assert tc.task_targets(task.fields) == task.fields["target_items"]
  assert tc.task_targets(spec.fields) == {a: na} and tc.task_targets({}) == {}
