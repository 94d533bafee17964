"""TextCraft: recipes (tags, shaped, shapeless), tools, verifiers, gold trajectories."""
import threading

from rao_jax.envs import base
from rao_jax.envs import textcraft as tc

_ENV = None


def _env():
  global _ENV
  if _ENV is None:
    _ENV = tc.TextCraftEnv()
  return _ENV


def _outcome(node_fields, finished=True, node_id="0", goal="g"):
  node = base.NodeInfo(node_id, None if node_id == "0" else "0", node_id.count("."), goal,
                       node_fields, 10)
  return base.NodeOutcome(node, finished, "done" if finished else "", "finish" if finished else
                          "max_steps", 1, 1)


def test_every_gold_trajectory_replays_to_success():
  env = _env()
  tasks = env.tasks("all")   # "train" (900) + the held-out "test" (every 10th task)
  assert len(tasks) == 1000
  top_ups = 0
  for t in tasks:
    ep, msgs = tc.replay_gold(env, t)
    assert not [m for m in msgs if m.startswith("Error")], (t.task_id, msgs)
    top_ups += sum(m.startswith("top-up") for m in msgs)
    assert env.verify_root(ep, _outcome(t.fields)) == 1.0, t.task_id
    # Without finish(...) the root fails even with the items.
    assert env.verify_root(ep, _outcome(t.fields, finished=False)) == 0.0
  # The 3 gold trajectories that under-count planks are the only ones needing a top-up craft.
  assert top_ups <= 4


def test_recipe_kinds_and_tags():
  book = _env().book
  assert "oak_planks" in book.tag_members("tag:planks")
  assert book.is_base("oak_log") and book.depth("oak_log") == 0
  # shaped (stick: 2 planks -> 4), shapeless (book), tag ingredient (stick uses tag:planks)
  (stick,) = book.recipes["stick"][:1]
  assert stick.result_count == 4 and stick.ingredients == {"tag:planks": 2}
  assert book.depth("writable_book") == 3


def _task(inv, targets):
  return base.Task(task_id="t", env="textcraft", goal=tc.targets_goal(targets),
                   fields={"initial_inventory": inv, "target_items": targets})


def test_craft_errors_change_nothing_and_tags_mix():
  env = _env()
  ep = env.new_episode(_task({"oak_planks": 1, "birch_planks": 1, "oak_log": 1}, {"stick": 4}))
  before = ep.view_inventory()
  for bad in [({"oak_planks": 2}, ("stick", 4)),          # not enough oak planks
              ({"oak_planks": 1, "birch_planks": 1}, ("stick", 3)),   # not a multiple of 4
              ({"tag:planks": 2}, ("stick", 4)),          # tag name instead of an item
              ({"oak_planks": 1, "birch_planks": 1, "oak_log": 1}, ("stick", 4)),  # extra
              ("planks", ("stick", 4)), ({"oak_planks": 2}, "stick"),
              ({"oak_log": 1}, ("oak_log", 1))]:          # base item
    msg = ep.craft(*bad)
    assert msg.startswith("Error"), (bad, msg)
    assert ep.view_inventory() == before
  # Two kinds of planks cover one tag ingredient; a JSON list works as the target.
  assert ep.craft({"oak_planks": 1, "birch_planks": 1}, ["stick", 4]) == "Crafted 4 stick."
  assert ep.view_inventory() == {"oak_log": 1, "stick": 4}
  info = ep.get_info(["stick", "oak_log", "nope"])
  assert info[0]["can_craft"] and info[0]["in_inventory"] == 4
  assert info[0]["recipes"][0]["ingredients"]["tag:planks"]["count"] == 2
  assert info[1]["is_base"] and info[1]["crafting_depth"] == 0
  assert info[2]["error"] == "unknown item"


def test_concurrent_crafts_keep_the_inventory_consistent():
  env = _env()
  ep = env.new_episode(_task({"oak_log": 400}, {"oak_planks": 1600}))
  tools = [env.node_tools(ep, base.NodeInfo(f"0.{i}", "0", 1, "g", {}, 5)) for i in range(8)]

  def work(t):
    for _ in range(60):   # 8 x 60 = 480 attempts for 400 logs: 80 must fail cleanly
      t["craft"]({"oak_log": 1}, ("oak_planks", 4))

  threads = [threading.Thread(target=work, args=(t,)) for t in tools]
  [th.start() for th in threads]
  [th.join() for th in threads]
  assert ep.view_inventory() == {"oak_planks": 1600}
  assert sum(ep.crafted_by_subtree(f"0.{i}")["oak_planks"] for i in range(8)) == 1600
  assert ep.crafted_by_subtree("0")["oak_planks"] == 1600


def test_subtask_verifier_and_child_spec():
  env = _env()
  ep = env.new_episode(_task({"oak_log": 2}, {"stick": 4}))
  spec = env.child_spec(ep, None, ({"oak_planks": 4},), {"num_steps": 3, "context": "logs -> planks"})
  assert spec.num_steps == 3 and spec.fields["targets"] == {"oak_planks": 4}
  assert spec.goal.startswith("Craft the following items: 4x oak_planks")
  child = env.node_tools(ep, base.NodeInfo("0.1", "0", 1, spec.goal, spec.fields, 3))
  assert env.verify_subtask(ep, _outcome(spec.fields, node_id="0.1")) == 0.0
  child["craft"]({"oak_log": 1}, ("oak_planks", 4))
  assert env.verify_subtask(ep, _outcome(spec.fields, node_id="0.1")) == 1.0
  assert env.verify_subtask(ep, _outcome(spec.fields, node_id="0.1", finished=False)) == 0.0
  assert env.verify_subtask(ep, _outcome({}, node_id="0.2")) is None
  for args, kwargs in [((), {}), (({"a": 0}, 3), {}), (({"a": 1}, 0), {}), (({"a": 1},), {}),
                       (({"a": 1}, 2), {"bogus": 1}), (({"a": 1}, 2, "c", 4), {})]:
    try:
      env.child_spec(ep, None, args, kwargs)
    except base.SubagentArgError:
      continue
    raise AssertionError(f"accepted {args} {kwargs}")
