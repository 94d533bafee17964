"""The craft budget per agent on TextCraft-Synth: enforced per node on the trusted side, recorded
in tree records, validated, and closing the single-agent route while the recursive scripted
policy, which adapts its decomposition to the budget, still solves medium tasks."""
import asyncio

import pytest

from rao_jax.agent import chat, local_exec, policies, runner as rn
from rao_jax.envs import base, registry
from rao_jax.envs import textcraft as tc
from rao_jax.envs import textcraft_synth as ts

TOK = chat.ByteChatTokenizer()
BUDGET = 8
_ENVS = {}


def synth(budget: int) -> ts.TextCraftSynthEnv:
  if budget not in _ENVS:
    _ENVS[budget] = ts.TextCraftSynthEnv(ts.SynthConfig(
        tasks_per_difficulty=8, items_per_tier=60, craft_budget_per_agent=budget))
  return _ENVS[budget]


def node(node_id: str) -> base.NodeInfo:
  return base.NodeInfo(node_id, None if node_id == "0" else "0", node_id.count("."), "g", {}, 10)


def one_craft_task(env):
  """A task whose inventory allows many crafts of one tier-1 item (4 units of each of its
  ingredients per craft are ample)."""
  item = sorted(x for x in env.book.recipes if env.book.depth(x) == 1)[0]
  r = env.book.recipes[item][0]
  inv = {k: 100 * v for k, v in r.ingredients.items()}
  task = base.Task("t", "textcraft_synth", tc.targets_goal({item: 1}),
                   {"target_items": {item: 1}, "initial_inventory": inv})
  return task, item, dict(r.ingredients), r.result_count


def test_budget_enforced_and_the_refused_call_changes_nothing():
  env = synth(3)
  task, item, ings, rc = one_craft_task(env)
  ep = env.new_episode(task)
  tools = env.node_tools(ep, node("0"))
  assert tools["craft"](ings, (item, rc)).startswith(f"Crafted {rc} {item}. (2 of 3 crafts left)")
  # A failed call spends the budget too (as every observation fills a window).
  assert tools["craft"]({"nope": 1}, (item, rc)).startswith("Error")
  assert tools["craft"](ings, (item, rc)).endswith("(0 of 3 crafts left)")
  before = ep.view_inventory()
  msg = tools["craft"](ings, (item, rc))
  assert msg.startswith("Error: craft budget spent") and "3" in msg and "helpers" in msg.lower()
  assert ep.view_inventory() == before
  assert ep.num_crafts == 2
  assert ep.crafted["0"][item] == 2 * rc
  tools["get_info"]([item])
  s = ep.summary()
  assert s["craft_budget_per_agent"] == 3
  assert s["tool_calls"]["0"] == {"craft": 3, "craft_refused": 1, "get_info": 1}


def test_each_node_has_its_own_budget():
  env = synth(2)
  task, item, ings, rc = one_craft_task(env)
  ep = env.new_episode(task)
  root, child = env.node_tools(ep, node("0")), env.node_tools(ep, node("0.1"))
  for _ in range(2):
    assert root["craft"](ings, (item, rc)).startswith("Crafted")
  assert root["craft"](ings, (item, rc)).startswith("Error: craft budget spent")
  for _ in range(2):
    assert child["craft"](ings, (item, rc)).startswith("Crafted")
  assert child["craft"](ings, (item, rc)).startswith("Error: craft budget spent")
  # A fresh episode (another tree) starts every node again from zero.
  assert env.node_tools(env.new_episode(task), node("0"))["craft"](ings, (item, rc)).startswith(
      "Crafted")
  assert ep.view_inventory()[item] == 4 * rc
  assert ep.summary()["tool_calls"] == {"0": {"craft": 2, "craft_refused": 1},
                                        "0.1": {"craft": 2, "craft_refused": 1}}


def test_no_budget_by_default_and_docs_and_variable_when_on():
  off = synth(0)
  task, item, ings, rc = one_craft_task(off)
  ep = off.new_episode(task)
  craft = off.node_tools(ep, node("0"))["craft"]
  assert all(craft(ings, (item, rc)) == f"Crafted {rc} {item}." for _ in range(12))
  assert "craft_budget_per_agent" not in ep.summary()
  root = base.NodeInfo("0", None, 0, task.goal, task.fields, 10)
  assert "craft budget" not in off.tool_docs(True).lower()
  assert off.node_variables(ep, root) == {"targets": {item: 1}}
  on = synth(BUDGET)
  assert f"at most {BUDGET} times" in on.tool_docs(False)
  assert "own" in on.tool_docs(True) and "own" not in on.tool_docs(False)
  assert on.node_variables(on.new_episode(task), root) == {"targets": {item: 1},
                                                           "craft_budget": BUDGET}


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_config_validation_names_the_field(bad):
  with pytest.raises(ValueError, match="craft_budget_per_agent"):
    ts.SynthConfig(craft_budget_per_agent=bad)
  with pytest.raises(ValueError, match="craft_budget_per_agent"):
    tc.TextCraftEnv(book=synth(0).book, craft_budget_per_agent=bad)
  with pytest.raises(ValueError, match="craft_budget_per_agent"):
    registry.make_env("textcraft_synth", {"craft_budget_per_agent": bad, "items_per_tier": 60})


def test_closure_crafts_is_the_gold_plan_length():
  env = synth(0)
  for t in env.tasks("test/medium"):
    assert ts.closure_crafts(env.book, t.fields["target_items"]) == len(
        t.fields["gold_trajectory"])


def run(env, tasks, recursive, style="program", **kw):
  eng = policies.ScriptedTextCraftEngine(TOK, policies.ScriptedConfig(style=style))
  cfg = rn.RunnerConfig(recursive=recursive, max_depth=kw.pop("max_depth", 6),
                        max_steps_per_agent=12, context_window=16384, max_new_tokens=4096,
                        temperature=0.0, **kw)
  r = rn.TreeRunner(env, eng, TOK, local_exec.LocalReplPool(), cfg)
  return asyncio.run(r.run_tasks(tasks))


def medium_tasks(env, n=3):
  tasks = [t for t in env.tasks("test/medium")
           if ts.closure_crafts(env.book, t.fields["target_items"]) > BUDGET]
  assert len(tasks) >= n
  return tasks[:n]


def test_recursive_policy_solves_medium_within_budget_and_single_agents_cannot():
  env = synth(BUDGET)
  tasks = medium_tasks(env)
  trees = run(env, tasks, recursive=True)
  for t in trees:
    assert t.root.success == 1.0, [n.extras["turns"] for n in t.nodes]
    calls = t.meta["episode"]["tool_calls"]
    assert len(t.nodes) > 1 and set(calls) <= {n.node_id for n in t.nodes}
    assert all(c.get("craft", 0) <= BUDGET and not c.get("craft_refused") for c in calls.values())
    assert all(n.success == 1.0 for n in t.nodes)
  for style in ("program", "plan"):   # the generic program and the merged plan (fewest crafts)
    for t in run(env, tasks, recursive=False, style=style):
      assert t.root.success == 0.0 and len(t.nodes) == 1
      assert t.meta["episode"]["tool_calls"]["0"]["craft"] == BUDGET


def test_recursive_policy_adapts_its_decomposition_to_the_budget():
  task = medium_tasks(synth(BUDGET), 1)[0]
  need = ts.closure_crafts(synth(0).book, task.fields["target_items"])
  big = synth(need + 8)   # one agent's budget holds the whole task: no helper
  alone = run(big, [task], recursive=True)[0]
  assert alone.root.success == 1.0 and len(alone.nodes) == 1
  tight = run(synth(BUDGET), [task], recursive=True)[0]
  assert tight.root.success == 1.0 and len(tight.nodes) > 1
  # At a depth limit below what the budget needs, the deepest agents overspend and fail.
  shallow = run(synth(BUDGET), [task], recursive=True, max_depth=0)[0]
  assert shallow.root.success == 0.0
  assert shallow.meta["episode"]["tool_calls"]["0"]["craft_refused"] > 0
