"""The tree runtime: scripted TextCraft-Synth solving, limits with their end reasons,
token-in-token-out, failures as data, the success chain and the HTML view."""
import asyncio
import re

import pytest

from rao_jax.agent import chat, local_exec, policies, records as R, runner as rn, view
from rao_jax.envs import base
from rao_jax.envs import textcraft as tc
from rao_jax.envs import textcraft_synth as ts
from rao_jax.rollout import base as rollout

TOK = chat.ByteChatTokenizer()
_SYNTH = []


def synth_env():
  if not _SYNTH:
    _SYNTH.append(ts.TextCraftSynthEnv(ts.SynthConfig(tasks_per_difficulty=6, items_per_tier=60)))
  return _SYNTH[0]


class Recording(rollout.Engine):
  """Wraps an engine and keeps every (request, result) pair, by session."""

  def __init__(self, inner):
    self.inner, self.calls = inner, []

  @property
  def weight_version(self):
    return self.inner.weight_version

  async def generate(self, request):
    res = await self.inner.generate(request)
    self.calls.append((request, res))
    return res


class CodeEngine(rollout.Engine):
  """Writes the code `fn(prompt_text, turn)` returns (a policy for runtime edge cases)."""

  def __init__(self, fn, weight_version=7):
    self.fn, self.version = fn, weight_version

  @property
  def weight_version(self):
    return self.version

  async def generate(self, request):
    text = TOK.decode(request.prompt_ids)
    turn = text.count("[turns left: ")
    out = self.fn(text, turn)
    if out is None:
      raise RuntimeError("engine failure for the test")
    ids = TOK.encode(out) + [TOK.stop_token_ids[0]]
    room = request.params.max_new_tokens
    reason = rollout.FinishReason.STOP
    if len(ids) > room:
      ids, reason = ids[:room], rollout.FinishReason.CONTEXT
    return rollout.GenerateResult(ids, [-0.5] * len(ids), reason, self.version)


def run(env, engine, tasks, group_size=1, **cfg):
  r = rn.TreeRunner(env, engine, TOK, local_exec.LocalReplPool(), rn.RunnerConfig(**cfg))
  return asyncio.run(r.run_tasks(tasks, group_size))


@pytest.mark.parametrize("recursive", [False, True])
def test_scripted_policy_solves_synth_medium(recursive, tmp_path):
  env = synth_env()
  tasks = env.tasks("test/medium")
  eng = Recording(policies.ScriptedTextCraftEngine(TOK))
  trees = run(env, eng, tasks, group_size=2, recursive=recursive, max_depth=6,
              context_window=32768, max_new_tokens=8192, observation_max_chars=32768)
  assert len(trees) == 2 * len(tasks)
  assert [t.root.success for t in trees] == [1.0] * len(trees)
  assert all(t.root.success_source == "verifier" for t in trees)
  # The K trees of one task share a group id; different tasks do not.
  assert len({t.group_id for t in trees}) == len(tasks)
  if recursive:
    kids = [n for t in trees for n in t.nodes if n.depth > 0]
    assert kids and all(n.success == 1.0 and n.success_source == "verifier" for n in kids)
  else:
    assert all(len(t.nodes) == 1 for t in trees)
  for t in trees:
    t.validate()
    assert t.root.end_reason == "finish" and sum(n.num_steps for n in t.nodes) <= 200
  # Token-in-token-out: every prompt the engine saw is a prefix of its node's token list, and
  # the generated ids sit right after it, masked 1 with the rollout logprobs.
  by_session = {}
  for req, res in eng.calls:
    by_session.setdefault(req.session_id, []).append((req, res))
  nodes = {f"{t.tree_id}/{n.node_id}": n for t in trees for n in t.nodes}
  assert set(by_session) == set(nodes)
  for sid, calls in by_session.items():
    n = nodes[sid]
    assert len(calls) == n.num_steps == len(n.turn_starts)
    for (req, res), start in zip(calls, n.turn_starts):
      p = list(req.prompt_ids)
      assert n.token_ids[:len(p)] == p and start == len(p)
      assert n.token_ids[start:start + len(res.token_ids)] == res.token_ids
      assert n.gen_mask[start:start + len(res.token_ids)] == [1] * len(res.token_ids)
    assert sum(n.gen_mask) == sum(len(res.token_ids) for _, res in calls)
  demos = policies.demonstrations(trees)
  assert len(demos) == sum(len(t.nodes) for t in trees)
  path = tmp_path / "trees.jsonl"
  R.save_trees_jsonl(str(path), trees)
  assert [t.to_dict() for t in R.load_trees_jsonl(str(path))] == [t.to_dict() for t in trees]


def _task(env, max_steps=200):
  t = env.tasks("test/easy")[0]
  return base.Task(task_id=t.task_id, env=t.env, goal=t.goal, fields=t.fields,
                   difficulty=t.difficulty, max_steps=max_steps)


def _code(body):
  return f"Working.\n```python\n{body}\n```"


def test_depth_limit_returns_an_error_instead_of_a_child():
  env = synth_env()
  target = next(iter(_task(env).fields["target_items"]))

  def fn(text, turn):
    if turn == 0:
      return _code(f"print(await launch_subagent({{{target!r}: 1}}, 5))")
    return _code("finish('gave up')")

  (tree,) = run(env, CodeEngine(fn), [_task(env)], max_depth=0)
  root = tree.root
  assert root.children == [] and len(tree.nodes) == 1
  assert "maximum depth 0 reached" in root.extras["turns"][0]["observation"]
  assert root.end_reason == "finish" and root.success == 0.0
  # Depth 1 allows one level: the child (depth 1) is refused a grandchild.
  (tree,) = run(env, CodeEngine(fn), [_task(env)], max_depth=1)
  assert [n.depth for n in tree.nodes] == [0, 1]
  assert "maximum depth 1 reached" in tree.nodes[1].extras["turns"][0]["observation"]


def test_step_budget_and_turn_limit_end_nodes_with_their_reasons():
  env = synth_env()
  target = next(iter(_task(env).fields["target_items"]))

  def fn(text, turn):
    if "you are at depth 0" in text and turn == 0:
      return _code(f"print(await launch_subagent({{{target!r}: 1}}, 50))")
    return _code("print(view_inventory())")   # never finishes

  (tree,) = run(env, CodeEngine(fn), [_task(env, max_steps=6)], max_depth=2)
  root, child = tree.nodes
  # The child asked for 50 steps; the tree had 6, the root keeps one: the child got 4.
  assert child.num_steps == 4 and child.end_reason == "budget"
  assert "used 4 of 4 steps" in root.extras["turns"][0]["observation"]
  assert root.end_reason == "budget" and root.num_steps + child.num_steps == 6
  assert child.success == 0.0 and child.success_source == "verifier"
  (tree,) = run(env, CodeEngine(fn), [_task(env)], max_depth=2, max_steps_per_agent=3)
  assert [n.end_reason for n in tree.nodes] == ["max_steps", "max_steps"]
  assert [n.num_steps for n in tree.nodes] == [3, 3]


def test_node_timeout_ends_the_node():
  env = synth_env()

  class Slow(CodeEngine):
    async def generate(self, request):
      await asyncio.sleep(0.05)
      return await super().generate(request)

  (tree,) = run(env, Slow(lambda text, turn: _code("print(1)")), [_task(env)],
                recursive=False, node_timeout_s=0.12)
  assert tree.root.end_reason == "timeout" and 1 <= tree.root.num_steps <= 3


def test_context_limit_ends_the_node():
  env = synth_env()
  (tree,) = run(env, CodeEngine(lambda text, turn: _code("print('x' * 3000)")),
                [_task(env)], recursive=False, context_window=6000)
  root = tree.root
  assert root.end_reason == "context" and len(root.token_ids) <= 6000
  assert root.num_steps >= 1
  # A turn that overruns the window is cut by the engine and also ends the node.
  (tree,) = run(env, CodeEngine(lambda text, turn: _code("# " + "y" * 9000)),
                [_task(env)], recursive=False, context_window=4000, max_new_tokens=8192)
  assert tree.root.end_reason == "context" and len(tree.root.token_ids) == 4000

  class Full(CodeEngine):   # an engine whose own window is smaller than the runner's
    async def generate(self, request):
      return rollout.GenerateResult([], [], rollout.FinishReason.CONTEXT, 7, message="full")

  (tree,) = run(env, Full(None), [_task(env)], recursive=False)
  assert tree.root.end_reason == "context" and tree.root.num_steps == 0


def test_failures_are_data():
  env = synth_env()
  bodies = ["no code here", _code("def broken(:"), _code("craft({'nope': 1}, ('x', 1))\n1 / 0"),
            _code("finish('done')")]
  (tree,) = run(env, CodeEngine(lambda text, turn: bodies[min(turn, 3)]), [_task(env)])
  obs = [t["observation"] for t in tree.root.extras["turns"]]
  assert "No code block found" in obs[0]
  assert "SyntaxError" in obs[1]
  assert "ZeroDivisionError" in obs[2]
  assert tree.root.end_reason == "finish" and tree.root.final_message == "done"
  # An engine that raises ends the node with "error"; the tree still gets a record.
  (tree,) = run(env, CodeEngine(lambda text, turn: None), [_task(env)])
  assert tree.root.end_reason == "error" and "engine failure" in tree.root.extras["error"]
  assert tree.root.success == 0.0


class _NoSubtaskVerifier(ts.TextCraftSynthEnv):
  def verify_subtask(self, episode, outcome):
    return None


class _HalfJudge(base.Judge):
  def __init__(self, score):
    self.score, self.seen = score, []

  async def __call__(self, request):
    self.seen.append(request.node.node_id)
    return base.JudgeVerdict(self.score, {"prompt": request.node.goal[:20]})


@pytest.mark.parametrize("judge_score,source", [(0.5, "judge"), (None, "proxy")])
def test_success_chain_verifier_judge_proxy(judge_score, source):
  env0 = synth_env()
  env = _NoSubtaskVerifier(env0.cfg)
  env._tasks = env0._tasks
  judge = _HalfJudge(judge_score)
  r = rn.TreeRunner(env, policies.ScriptedTextCraftEngine(TOK), TOK, local_exec.LocalReplPool(),
                    rn.RunnerConfig(max_depth=4, context_window=32768, max_new_tokens=8192,
                                    observation_max_chars=32768), judge=judge)
  tree = asyncio.run(r.run_tree(env.tasks("test/medium")[0]))
  assert tree.root.success_source == "verifier" and tree.root.success == 1.0
  kids = tree.nodes[1:]
  assert kids and sorted(judge.seen) == sorted(n.node_id for n in kids)
  for n in kids:
    assert n.success_source == source
    assert n.success == (judge_score if judge_score is not None else tree.root.success)


def test_tree_file_renders_to_html(tmp_path):
  env = synth_env()
  trees = run(env, policies.ScriptedTextCraftEngine(TOK), env.tasks("test/easy")[:2],
              max_depth=3, context_window=32768, max_new_tokens=8192)
  bad = run(env, CodeEngine(lambda text, turn: _code("print(1)")), [_task(env)],
            max_steps_per_agent=2)
  src = tmp_path / "trees.jsonl"
  R.save_trees_jsonl(str(src), trees + bad)
  out = tmp_path / "page.html"
  assert view.main([str(src), "-o", str(out)]) == 0
  page = out.read_text()
  assert page.startswith("<!DOCTYPE html>") and "<script" not in page
  assert page.count("<details") >= sum(len(t.nodes) for t in trees + bad)
  for t in trees + bad:
    assert t.tree_id in page
  assert "rgb(30,150,60)" in page and "rgb(200,60,60)" in page   # success and failure colours
  assert "max_steps" in page and "craft(" in page


def test_code_extraction():
  from rao_jax.agent import code
  assert code.extract_code("a\n```python\nx = 1\n```\nb\n```\ny = 2\n```") == "x = 1\n\ny = 2"
  assert code.extract_code("```py\nz = 3") == "z = 3"     # cut by max_new_tokens
  assert code.extract_code("no code") is None
  assert code.syntax_error("await f()") is None
  assert "SyntaxError" in code.syntax_error("def (")


def test_chat_format_matches_the_template():
  f = chat.ChatFormat(TOK)
  ids = f.prompt_ids("S", "U")
  gen = TOK.encode("A") + [TOK.stop_token_ids[0]]
  obs = f.observation_ids("O", turn_closed=True)
  full = TOK.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                          {"role": "assistant", "content": "A"}, {"role": "user", "content": "O"}],
                         add_generation_prompt=True)
  assert TOK.decode(ids + gen + obs) == full
  assert TOK.decode(f.observation_ids("O", turn_closed=False)).startswith("<|im_end|>")


def test_runner_config_validation():
  for bad in [dict(max_depth=-1), dict(context_window=0), dict(min_turn_tokens=9000),
              dict(temperature=-1.0), dict(max_steps_per_agent=0)]:
    with pytest.raises(ValueError, match=re.escape(next(iter(bad)))):
      rn.RunnerConfig(**bad)


def test_run_tasks_reports_each_tree_as_it_finishes(caplog):
  """What an evaluation's progress lines count: every finished tree, once, with its agents."""
  from rao_jax.collection import RolloutProgress
  env = synth_env()
  tasks = env.tasks("test/medium")
  eng = policies.ScriptedTextCraftEngine(TOK)
  r = rn.TreeRunner(env, eng, TOK, local_exec.LocalReplPool(),
                    rn.RunnerConfig(recursive=True, max_depth=6, context_window=32768,
                                    max_new_tokens=8192, observation_max_chars=32768))
  progress = RolloutProgress(r, 0, len(tasks), every_s=60.0, label="eval held-out medium")
  seen = []

  def on_tree(tree):
    seen.append(tree.tree_id)
    progress.count(tree)

  trees = asyncio.run(r.run_tasks(tasks, on_tree=on_tree))
  assert sorted(seen) == sorted(t.tree_id for t in trees) and len(seen) == len(tasks)
  assert progress.agents == sum(len(t.nodes) for t in trees) > len(tasks)
  assert progress.line().startswith(
      f"eval held-out medium: {len(tasks)}/{len(tasks)} trees done ({len(tasks)} solved)")
