"""Multi-hop search (DeepDive style): graph, corpus, BM25, questions, verifiers, scripted runs."""
import asyncio
import re

import numpy as np
import pytest

from rao_jax.agent import records as R
from rao_jax.agent.chat import ByteChatTokenizer
from rao_jax.agent.local_exec import LocalReplPool
from rao_jax.agent.runner import RunnerConfig, TreeRunner
from rao_jax.envs import base
from rao_jax.envs import search_data as data
from rao_jax.envs.search import SearchConfig, SearchEnv
from rao_jax.envs.search_scripted import make_search_engine

SMALL = data.WorldConfig(seed=3, num_people=120, num_cities=20, num_universities=15,
                         num_companies=40, num_books=60, filler_sentences=8)


@pytest.fixture(scope="module")
def world():
  return data.get_world(SMALL)


def test_normalize_and_aliases():
  assert data.normalize("  The Kalor   Atlas. ") == "kalor atlas"
  e = data.Entity("person-0000", "person", "Mira Kaltenbrook",
                  ("M. Kaltenbrook", "Kaltenbrook, Mira"), {}, {})
  assert data.answer_matches("mira kaltenbrook", e)
  assert data.answer_matches("M. Kaltenbrook", e)
  assert data.answer_matches("Kaltenbrook, Mira.", e)
  assert not data.answer_matches("Kaltenbrook", e)
  assert not data.answer_matches("", e)


def test_world_is_seeded_and_pages_link_names_not_ids(world):
  again = data.World(SMALL)
  assert again.pages == world.pages
  assert len(world.pages) == 120 + 20 + 15 + 40 + 60
  ids = re.compile(r"\b(person|city|university|company|book)-\d{4}\b")
  assert not any(ids.search(p) for p in world.pages.values())
  e = world.by_type("person")[0]
  page = world.open(e.eid)
  assert page.startswith(e.name) and f"Born in: {world.entities[e.rels['born_in']].name}" in page
  assert world.open("nope-1").startswith("Error")


def test_bm25_search_finds_an_entity_by_its_name(world):
  for e in world.by_type("company")[:10]:
    hits = world.search(e.name, k=5)
    assert hits and {"id", "title", "snippet"} == set(hits[0])
    assert e.eid in [h["id"] for h in hits]
  assert world.search("", k=5) == [] and world.search("zzzqqq", k=5) == []
  assert len(world.search("university", k=3)) == 3


def test_questions_walk_2_to_6_hops_with_unique_blurred_descriptions(world):
  rng = np.random.default_rng(0)
  for hops in (2, 3, 4, 5, 6):
    q = None
    while q is None:
      q = data.make_question(world, hops, rng)
    assert q.hops == hops and len(q.path) == hops + 1 and len(set(q.path)) == hops + 1
    anchor = world.entities[q.path[0]]
    # Blurred: no name and no exact year of the anchor appears in the question.
    assert anchor.name not in q.text
    assert not re.search(r"\b\d{4}\b(?!s)", q.text)
    assert [e.eid for e in world.find(q.anchor)] == [q.path[0]]
    assert data.parse_description(q.anchor.text()) == q.anchor
    for i, d in enumerate(q.steps):
      assert data.parse_description(d.text()) == d
      prev = world.entities[q.path[i]]
      concrete = data.parse_step_goal(data.step_goal(d, prev.name, data.HOP_NAMES[i]))
      assert [e.eid for e in world.find(concrete)] == [q.path[i + 1]]
    assert q.answer == world.entities[q.path[-1]].name


def test_description_parser_rejects_text_outside_the_grammar():
  assert data.parse_description("the city where A was born") is not None
  assert data.parse_description("the architect born in the 1960s") == data.Description(
      "person", "architect", (("birth_decade", "1960s"),))
  assert data.parse_description("a city somewhere") is None
  assert data.parse_description("the city that is nice") is None
  assert data.parse_step_goal("Please find the city.") is None


def _env(num_tasks=4, hops=(2, 3)):
  return SearchEnv(SearchConfig(num_tasks=num_tasks, hops=hops, world=SMALL))


def _outcome(goal, finished, message, node_id="0.1"):
  node = base.NodeInfo(node_id, "0" if node_id != "0" else None, node_id.count("."), goal, {}, 5)
  return base.NodeOutcome(node, finished, message, "finish" if finished else "max_steps", 1, 1)


def test_tools_verifiers_and_child_spec(world):
  env = _env()
  task = env.tasks("test")[0]
  ep = env.new_episode(task)
  root = base.NodeInfo("0", None, 0, task.goal, dict(task.fields), 20)
  tools = env.node_tools(ep, root)
  assert set(tools) == {"search", "open"}
  assert tools["search"]("", 3).startswith("Error") and tools["search"]("x", 0).startswith("Error")
  assert tools["open"](3).startswith("Error")
  ans = world.entities[task.fields["answer_id"]]
  assert env.verify_root(ep, _outcome(task.goal, True, ans.name.upper(), "0")) == 1.0
  if ans.aliases:
    assert env.verify_root(ep, _outcome(task.goal, True, ans.aliases[0], "0")) == 1.0
  assert env.verify_root(ep, _outcome(task.goal, True, "someone else", "0")) == 0.0
  assert env.verify_root(ep, _outcome(task.goal, False, "", "0")) == 0.0
  # A hop goal is verified exactly against the graph.
  person = world.by_type("person")[0]
  city = world.entities[person.rels["born_in"]]
  goal = f"Find the city where {person.name} was born. Reply with only its name."
  spec = env.child_spec(ep, root, (goal,), {"num_steps": 3})
  assert spec.num_steps == 3
  assert spec.fields["description"] == f"the city where {person.name} was born"
  assert env.verify_subtask(ep, _outcome(goal, True, city.name)) == 1.0
  assert env.verify_subtask(ep, _outcome(goal, True, "Nowhere")) == 0.0
  assert env.verify_subtask(ep, _outcome("Find something nice.", True, "x")) is None
  # A description that fits several entities cannot be checked exactly.
  assert env.verify_subtask(ep, _outcome("Find the city. Reply with only its name.", True,
                                         city.name)) is None
  for args, kwargs, match in (((), {}, "goal"), (("g",), {"num_steps": "3"}, "num_steps"),
                              (("g",), {"context": "x"}, "unknown")):
    with pytest.raises(base.SubagentArgError, match=match):
      env.child_spec(ep, root, args, kwargs)


def _run(env, tasks, recursive):
  tok = ByteChatTokenizer()
  # No cell timeout: the local REPL counts time spent awaiting helpers (the jailed one does not).
  runner = TreeRunner(env, make_search_engine(tok), tok, LocalReplPool(cell_timeout_s=None),
                      RunnerConfig(recursive=recursive, context_window=60_000, max_depth=1,
                                   max_new_tokens=2048))
  return asyncio.run(runner.run_tasks(tasks))


def test_scripted_policies_resolve_one_hop_per_helper_sequentially_and_single():
  env = _env(num_tasks=4, hops=(2, 4))
  tasks = list(env.tasks("test"))
  trees = _run(env, tasks, recursive=True)
  for task, t in zip(tasks, trees):
    root = t.nodes[0]
    assert root.success == 1.0, (t.task_id, root.final_message)
    kids = t.nodes[1:]
    assert len(kids) == task.fields["hops"] + 1   # the anchor, then one helper per hop
    assert all(k.success == 1.0 and k.success_source == R.SOURCE_VERIFIER for k in kids)
    # Sequential: each helper starts after the previous one ended.
    assert all(b.timings["start"] >= a.timings["end"] for a, b in zip(kids, kids[1:]))
  assert all(t.meta["episode"]["searches"] >= len(t.nodes) - 1 for t in trees)
  single = _run(env, tasks, recursive=False)
  for t in single:
    assert len(t.nodes) == 1
    assert t.nodes[0].success == 1.0, (t.task_id, t.nodes[0].final_message)
    assert "launch_subagent" not in t.nodes[0].extras["turns"][0]["code"]


def test_tools_work_through_the_real_sandbox():
  """`search` / `open` are forwarded from the jailed REPL (`open` shadows the builtin there)."""
  from rao_jax.sandbox_host.config import SandboxConfig
  from rao_jax.sandbox_host.pool import SandboxPool

  env = _env(num_tasks=1, hops=(2,))
  tok = ByteChatTokenizer()

  async def go():
    pool = SandboxPool(SandboxConfig(), size=2)
    try:
      await pool.start()
    except Exception as e:  # no bubblewrap on this machine
      pytest.skip(f"sandbox unavailable: {e}")
    try:
      runner = TreeRunner(env, make_search_engine(tok), tok, pool,
                          RunnerConfig(recursive=False, context_window=60_000,
                                       max_new_tokens=2048))
      return await runner.run_tree(env.tasks("test")[0])
    finally:
      await pool.close()

  tree = asyncio.run(go())
  assert tree.nodes[0].success == 1.0, tree.nodes[0].extras
  assert tree.meta["episode"]["opens"] >= 1 and tree.meta["episode"]["searches"] >= 3


def test_registry_options_and_difficulty_splits():
  from rao_jax.envs import registry
  from rao_jax.envs.search_scripted import ScriptedSearchEngine
  env = registry.make_env("search", {"hops": 2, "num_tasks": 2, "world": dict(
      seed=3, num_people=120, num_cities=20, num_universities=15, num_companies=40,
      num_books=60, filler_sentences=8)})
  assert env.cfg.hops == (2,) and [t.difficulty for t in env.tasks("test")] == ["2-hop"] * 2
  assert len(env.tasks("test/2-hop")) == 2 and env.tasks("test/3-hop") == []
  with pytest.raises(ValueError, match="unknown options"):
    SearchEnv(hop=2)
  assert isinstance(ScriptedSearchEngine(ByteChatTokenizer()), ScriptedSearchEngine)
