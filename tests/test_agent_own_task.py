"""An agent works from its task, not its own copy of it (issue 45, item 3): the node's targets
are its REPL variable `targets` and the program-style demonstrations read it; at the depth
limit nothing in the prompt offers helpers; a helper's reply says whether it finished and
crafted its targets; each helper's record carries its scope flags from launch."""
import asyncio
import re

import pytest

from rao_jax import metrics
from rao_jax.agent import chat, local_exec, policies, prompts, records as R, runner as rn
from rao_jax.envs import base, registry
from rao_jax.envs import textcraft as tc
from rao_jax.envs import textcraft_synth as ts
from rao_jax.rollout.scripted import ScriptedTurnEngine

TOK = chat.ByteChatTokenizer()
BUDGET = 8
_ENVS = {}


def synth(budget: int = 0) -> ts.TextCraftSynthEnv:
  if budget not in _ENVS:
    _ENVS[budget] = ts.TextCraftSynthEnv(ts.SynthConfig(
        tasks_per_difficulty=8, items_per_tier=60, craft_budget_per_agent=budget))
  return _ENVS[budget]


class CodeEngine(ScriptedTurnEngine):
  """Writes the turn `fn(prompt_text)` returns: a policy for the runtime's edge cases."""

  def __init__(self, fn):
    super().__init__(TOK, lambda text, n: fn(text), 0.0, "test")


def _code(body: str) -> str:
  return f"Working.\n```python\n{body}\n```"


def run(env, engine, tasks, **kw):
  cfg = rn.RunnerConfig(**{"max_depth": 3, "context_window": 16384, "max_new_tokens": 4096,
                           "temperature": 0.0, **kw})
  r = rn.TreeRunner(env, engine, TOK, local_exec.LocalReplPool(), cfg)
  return asyncio.run(r.run_tasks(tasks))


def system_text(node: R.NodeRecord) -> str:
  """The node's system message, as its prompt tokens decode."""
  text = TOK.decode(node.token_ids[:node.turn_starts[0]])
  return text.split("<|im_start|>user", 1)[0]


def two_target_task(env):
  return next(t for t in env.tasks("test/medium") if len(t.fields["target_items"]) == 2)


def test_targets_variable_at_root_and_child():
  env = synth()
  task = two_target_task(env)
  item, n = next(iter(task.fields["target_items"].items()))

  def fn(text):
    if "[turns left: " in text:
      return _code("finish('seen')")
    if "you are at depth 0" in text:   # the root hands its first target on without retyping it
      return _code("print('ROOT', targets)\nitem, n = next(iter(targets.items()))\n"
                   "print(await launch_subagent({item: n}, 3))")
    return _code("print('CHILD', targets)")

  (tree,) = run(env, CodeEngine(fn), [task])
  root, child = tree.nodes
  assert root.extras["turns"][0]["observation"].startswith(
      f"ROOT {task.fields['target_items']}\n")
  assert child.task_fields["targets"] == {item: n}
  assert child.extras["turns"][0]["observation"].startswith(f"CHILD {({item: n})}\n")
  for node in (root, child):   # the docs name the variable in every node's prompt
    assert "REPL variable `targets`" in system_text(node)


def _no_literal_targets(tree):
  """Every cell of every node names none of that node's target items: it read `targets`."""
  for node in tree.nodes:
    items = tc.task_targets(node.task_fields)
    assert items
    for turn in node.extras["turns"]:
      assert not any(re.search(rf"\b{re.escape(x)}\b", turn["code"]) for x in items), turn["code"]


@pytest.mark.parametrize("budget,recursive", [(BUDGET, True), (0, True), (0, False)])
def test_program_policy_reads_its_targets_from_the_repl(budget, recursive):
  # The warm start's demonstrations come from this policy: budgeted recursive trees (the
  # budget program), the several-target program and the single agent's program.
  env = synth(budget)
  tasks = [two_target_task(env)] + [t for t in env.tasks("test/medium")
                                    if ts.closure_crafts(env.book, t.fields["target_items"])
                                    > BUDGET][:2]
  eng = policies.ScriptedTextCraftEngine(TOK, policies.ScriptedConfig(style="program"))
  trees = run(env, eng, tasks, recursive=recursive, max_depth=6, max_steps_per_agent=12)
  for t in trees:
    assert t.root.success == 1.0, [n.extras["turns"] for n in t.nodes]
    assert all(n.success == 1.0 for n in t.nodes)
    # Without a budget the program gives each of several targets to a helper, else works alone.
    delegates = recursive and (budget > 0 or len(t.root.task_fields["target_items"]) > 1)
    assert (len(t.nodes) > 1) == delegates
    _no_literal_targets(t)
    for n in t.nodes[1:]:
      assert n.extras["scope"] == {"outside_root": False, "outside_parent": False}


def test_program_policy_reads_targets_in_the_real_sandbox():
  from rao_jax import sandbox_host
  if not sandbox_host.bwrap_available():
    pytest.skip(sandbox_host.missing_bwrap_message())
  env = synth(BUDGET)
  task = two_target_task(env)
  eng = policies.ScriptedTextCraftEngine(TOK, policies.ScriptedConfig(style="program"))
  cfg = rn.RunnerConfig(max_depth=6, max_steps_per_agent=12, context_window=16384,
                        max_new_tokens=4096, temperature=0.0)

  async def go():
    pool = sandbox_host.SandboxPool(sandbox_host.SandboxConfig(cell_timeout_s=30), size=2)
    await pool.start()
    try:
      return await rn.TreeRunner(env, eng, TOK, pool, cfg).run_tree(task)
    finally:
      await pool.close()

  tree = asyncio.run(go())
  assert tree.root.success == 1.0 and len(tree.nodes) > 1, [n.extras for n in tree.nodes]
  _no_literal_targets(tree)


@pytest.mark.parametrize("budget", [0, BUDGET])
def test_nothing_offers_helpers_at_the_depth_limit(budget):
  env = synth(budget)
  task = two_target_task(env)

  def fn(text):
    if "you are at depth 0" in text and "[turns left: " not in text:
      return _code("print(await launch_subagent(dict([next(iter(targets.items()))]), 3))")
    if "[turns left: " not in text:   # the child tries anyway: a clear error, not a helper
      return _code("print(await launch_subagent(targets, 1))")
    return _code("finish('stop')")

  (tree,) = run(env, CodeEngine(fn), [task], max_depth=1)
  root, child = tree.nodes
  assert child.depth == 1 and child.children == []
  top, deep = system_text(root), system_text(child)
  assert "launch_subagent" in top and "helpers may go down to depth 1" in top
  for banned in ("launch_subagent", "helper like you", "step budget", "give a helper",
                 "helpers may go down"):
    assert banned not in deep, banned
  assert "you are at depth 1, the deepest: you cannot launch helpers" in deep
  if budget:
    assert "Each helper has its own" in top and "Each helper has its own" not in deep
  assert "maximum depth 1 reached" in child.extras["turns"][0]["observation"]
  # The craft budget's refusal points to helpers only where the agent may launch them.
  ep = env.new_episode(task)
  for can_launch in (True, False):
    info = base.NodeInfo("0.1", "0", 1, "g", {"targets": {"x": 1}}, 5, can_launch=can_launch)
    craft = env.node_tools(ep, info)["craft"]
    msgs = [craft({"nope": 1}, ("x", 1)) for _ in range(max(budget, 1) + 1)]
    assert ("launch_subagent" in msgs[-1]) == (can_launch and budget > 0), msgs[-1]


@pytest.mark.parametrize("name,options", [
    ("textcraft", {}), ("textcraft_synth", {"items_per_tier": 20, "craft_budget_per_agent": 4}),
    ("longcontext", {}), ("search", {}), ("micro", {}), ("delegation", {}),
    ("delegation_deep", {})])
def test_every_envs_single_agent_docs_offer_no_helper(name, options):
  # What a node at the depth limit is given (the runner passes its can_launch).
  env = registry.make_env(name, options)
  text = prompts.system_prompt(env.tool_docs(False), True, 2, 2, 10, 10, 4096)
  assert "launch_subagent" not in text and "helper like you" not in text
  assert "you cannot launch helpers" in text
  assert "helper" not in env.tool_docs(False).lower()


def test_a_helpers_reply_says_whether_it_finished_and_crafted():
  env = synth()
  task = two_target_task(env)
  item, n = next(iter(task.fields["target_items"].items()))
  child_cells = {
      "finishes_idle": "finish('done')",          # claims done, crafted nothing
      "never_finishes": "print(view_inventory())",
  }

  def policy(kind):
    def fn(text):
      if "you are at depth 0" in text:
        return _code(f"print(await launch_subagent({{{item!r}: {n}}}, 3))\nfinish('over')")
      return _code(child_cells[kind])
    return fn

  (tree,) = run(env, CodeEngine(policy("finishes_idle")), [task])
  obs = tree.root.extras["turns"][0]["observation"]
  assert obs.startswith(f"Subagent finished; its targets were NOT crafted (missing {n}x {item})"
                        " (used 1 of 3 steps). Its message: done"), obs
  (tree,) = run(env, CodeEngine(policy("never_finishes")), [task])
  obs = tree.root.extras["turns"][0]["observation"]
  assert obs.startswith(f"Subagent did NOT finish (budget); its targets were NOT crafted "
                        f"(missing {n}x {item}) (used 3 of 3 steps)."), obs
  # A helper that crafted its targets and finished says so.
  ep = env.new_episode(task)
  spec = env.child_spec(ep, None, ({item: n}, 5), {})
  info = base.NodeInfo("0.1", "0", 1, spec.goal, spec.fields, 5)
  ep.crafted["0.1.2"][item] += n   # made by the helper's own helper: its subtree counts
  done = base.NodeOutcome(info, True, "made it", "finish", 2, 4)
  assert env.format_child_result(ep, spec, done) == (
      "Subagent finished; it crafted its targets (used 4 of 5 steps). Its message: made it")
  late = base.NodeOutcome(info, False, "", "max_steps", 5, 5)
  assert env.format_child_result(ep, spec, late).startswith(
      "Subagent did NOT finish (max_steps); it crafted its targets")
  # The default of environments that cannot check a subtask says at least whether it finished.
  default = base.Environment.format_child_result
  assert default(env, ep, spec, done) == "Subagent finished: made it [subagent used 4 steps]"
  assert default(env, ep, spec, late) == (
      "Subagent did NOT finish (max_steps). [subagent used 5 steps]")


def test_scope_flags_recorded_at_launch_and_rereadable():
  env = synth()
  task = two_target_task(env)
  (a, na), (b, nb) = task.fields["target_items"].items()
  ing = next(iter(env.book.recipes[a][0].ingredients))
  goals = {"whole": f"{{{a!r}: {na}, {b!r}: {nb}}}", "ingredient": f"{{{ing!r}: 1}}",
           "more": f"{{{a!r}: {na + 3}}}", "invented": "{'z9_i4': 1}"}

  def fn(text):
    if "you are at depth 0" in text and "[turns left: " not in text:
      return _code("\n".join(f"await launch_subagent({g}, 2)" for g in goals.values())
                   + "\nfinish('over')")
    return _code("finish('x')")

  (tree,) = run(env, CodeEngine(fn), [task])
  kids = tree.nodes[1:]
  assert [k.extras["scope"] for k in kids] == [
      {"outside_root": False, "outside_parent": False},
      {"outside_root": False, "outside_parent": False},
      {"outside_root": False, "outside_parent": True},
      {"outside_root": True, "outside_parent": True}]
  # The flags re-read from the stored tree with the pure function are the same.
  back = R.TreeRecord.from_json(tree.to_json())
  nodes = {n.node_id: n for n in back.nodes}
  for k in back.nodes[1:]:
    assert k.extras["scope"] == tc.subtask_scope(
        env.book, tc.task_targets(back.root.task_fields),
        tc.task_targets(nodes[k.parent_id].task_fields), tc.task_targets(k.task_fields))
  assert "scope" not in tree.root.extras


@pytest.mark.parametrize("code,rewrites", [
    ("targets = {'a': 1}", True), ("targets['x'] = 2", True), ("targets |= {'b': 1}", True),
    ("del targets['x']", True), ("targets.update(b=1)", True), ("targets.pop('a')", True),
    ("for targets in [1]:\n  pass", True), ("if (targets := {}):\n  pass", True),
    ("a, targets = 1, 2", True), ("async def f():\n  targets = 1", True),
    ("for item, n in targets.items():\n  await launch_subagent({item: n}, 4)", False),
    ("x = dict(targets)", False), ("x[targets['a']] = 1", False), ("print(targets)", False),
    ("targets2 = {}", False), ("def (", False), ("", False), (None, False)])
def test_code_rewrites_reads_stores_into_the_task_variable(code, rewrites):
  assert metrics.code_rewrites(code, ("targets",)) is rewrites


def test_task_retyped_counts_nodes_that_rewrite_their_targets():
  # The root retypes its task (with an invented item), its helper reads its own `targets`.
  env = synth()
  task = two_target_task(env)

  def fn(text):
    if "[turns left: " in text:
      return _code("finish('seen')")
    if "you are at depth 0" in text:
      return _code("targets = dict(targets, z9_i4=1)\nitem, n = next(iter(targets.items()))\n"
                   "print(await launch_subagent({item: n}, 3))")
    return _code("print(targets)")

  (tree,) = run(env, CodeEngine(fn), [task])
  assert [n.extras["task_vars"] for n in tree.nodes] == [["targets"], ["targets"]]
  assert metrics.drift_stats([tree], 3)["drift/task_retyped"] == 0.5
  # The program policy (the warm start's demonstrations) never rewrites them.
  eng = policies.ScriptedTextCraftEngine(TOK, policies.ScriptedConfig(style="program"))
  trees = run(env, eng, [task], max_depth=6, max_steps_per_agent=12)
  assert metrics.drift_stats(trees, 6)["drift/task_retyped"] == 0.0
  # Trees of an environment without task variables carry no such share.
  for n in tree.nodes:
    del n.extras["task_vars"]
  assert "drift/task_retyped" not in metrics.drift_stats([tree], 3)
