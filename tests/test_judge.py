"""LLM judge: verdict parsing, engine and HTTP judges, retries, failures, cache, call log."""
import asyncio
import json

import pytest
from aiohttp import web

from rao_jax.agent import records as R
from rao_jax.agent.chat import ByteChatTokenizer
from rao_jax.agent.local_exec import LocalReplPool
from rao_jax.agent.runner import RunnerConfig, TreeRunner
from rao_jax.envs import base
from rao_jax.envs.judge import JudgeConfig, LLMJudge, parse_verdict
from rao_jax.envs.longcontext import LongContextConfig, LongContextEnv
from rao_jax.envs.longcontext_scripted import ScriptedTurnEngine, chat_messages


@pytest.mark.parametrize("text,expected", [
    ("VERDICT: yes", 1.0), ("verdict: NO", 0.0), ("The answer is right.\nVERDICT: **yes**", 1.0),
    ("SCORE: 0.25", 0.25), ("score=1", 1.0), ("Yes, it does.", 1.0), ("no.", 0.0),
    ("0.5", 0.5), ("SCORE: 1.5", None), ("2", None), ("maybe", None), ("", None),
    ("VERDICT: yes ... VERDICT: no", None), ("VERDICT: yes SCORE: 0.2", None),
])
def test_parse_verdict(text, expected):
  assert parse_verdict(text) == expected


def _request(goal="Add 2 and 2.", answer="4", end_reason="finish"):
  task = base.Task(task_id="t", env="e", goal=goal)
  node = base.NodeInfo("0.1", "0", 1, goal, {}, 3)
  return base.JudgeRequest(env="e", task=task, node=node, answer=answer, end_reason=end_reason)


class _Replies:
  """A scripted judge model: answers from a list per (goal, answer) prompt, in order."""

  def __init__(self, replies):
    self.replies, self.prompts = list(replies), []

  def __call__(self, text, n):
    self.prompts.append(text)
    return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]


def _engine_judge(replies, **cfg):
  tok = ByteChatTokenizer()
  fn = _Replies(replies)
  engine = ScriptedTurnEngine(tok, fn)
  return LLMJudge(engine=engine, tokenizer=tok, cfg=JudgeConfig(**cfg)), fn, engine


def test_engine_judge_shows_goal_and_answer_and_parses_the_verdict():
  judge, fn, _ = _engine_judge(["VERDICT: yes"])
  v = asyncio.run(judge(_request()))
  assert v.score == 1.0 and not v.log["cached"]
  msgs = chat_messages(fn.prompts[0])
  assert "Add 2 and 2." in msgs[1][1] and "\n4\n" in msgs[1][1]
  assert v.log["attempts"][0]["raw"] == "VERDICT: yes"
  assert judge.calls[0]["goal"] == "Add 2 and 2." and judge.calls[0]["score"] == 1.0


def test_malformed_output_is_retried_then_recorded_as_a_failure():
  judge, _, engine = _engine_judge(["I think so", "SCORE: 0.75"])
  v = asyncio.run(judge(_request()))
  assert v.score == 0.75 and len(v.log["attempts"]) == 2
  assert v.log["attempts"][1]["temperature"] == JudgeConfig().retry_temperature
  judge, _, engine = _engine_judge(["hmm"], max_retries=2)
  v = asyncio.run(judge(_request()))
  assert v.score is None and "no well-formed verdict in 3 attempts" in v.log["failure"]
  assert engine.requests == 3 and len(judge.calls) == 3
  # Failures are not cached: the next call asks again.
  asyncio.run(judge(_request()))
  assert engine.requests == 6


def test_verdicts_are_cached_per_goal_and_answer_and_shared_by_concurrent_calls():
  judge, _, engine = _engine_judge(["VERDICT: no"])

  async def go():
    same = await asyncio.gather(*(judge(_request()) for _ in range(5)))
    other = await judge(_request(answer="5"))
    again = await judge(_request())
    return same, other, again

  same, other, again = asyncio.run(go())
  assert engine.requests == 2
  assert all(v.score == 0.0 for v in same + [other, again])
  assert sum(not v.log["cached"] for v in same) == 1 and again.log["cached"]
  assert {(r["goal"], r["answer"]) for r in judge.cache_items()} == {("Add 2 and 2.", "4"),
                                                                     ("Add 2 and 2.", "5")}


def test_unfinished_nodes_score_zero_without_a_call():
  judge, _, engine = _engine_judge(["VERDICT: yes"])
  v = asyncio.run(judge(_request(answer="", end_reason="context")))
  assert v.score == 0.0 and engine.requests == 0 and "context" in v.log["skipped"]


def test_for_policy_defaults_to_the_policy_engine():
  tok = ByteChatTokenizer()
  engine = ScriptedTurnEngine(tok, lambda t, n: "VERDICT: yes")
  assert LLMJudge.for_policy(engine, tok).engine is engine
  remote = LLMJudge.for_policy(engine, tok, url="http://127.0.0.1:30000/")
  assert remote.engine is None and remote.url == "http://127.0.0.1:30000" and remote.api == "openai"


def test_constructor_errors_name_the_fix():
  with pytest.raises(ValueError, match="exactly one"):
    LLMJudge()
  with pytest.raises(ValueError, match="tokenizer"):
    LLMJudge(engine=ScriptedTurnEngine(ByteChatTokenizer(), lambda t, n: ""))
  with pytest.raises(ValueError, match="api"):
    LLMJudge(url="http://127.0.0.1:1", api="grpc")
  with pytest.raises(ValueError, match="max_retries"):
    JudgeConfig(max_retries=-1)


async def _with_server(handler_map, body):
  """Runs `body(url)` against a loopback aiohttp server (the test's peer)."""
  app = web.Application()
  for path, handler in handler_map.items():
    app.router.add_post(path, handler)
  runner = web.AppRunner(app)
  await runner.setup()
  site = web.TCPSite(runner, "127.0.0.1", 0)
  await site.start()
  port = site._server.sockets[0].getsockname()[1]
  try:
    return await body(f"http://127.0.0.1:{port}")
  finally:
    await runner.cleanup()


def test_openai_compatible_http_judge_with_retry_after_server_error():
  seen = []

  async def chat(request):
    body = await request.json()
    seen.append(body)
    if len(seen) == 1:
      return web.json_response({"error": {"message": "overloaded"}}, status=500)
    user = body["messages"][1]["content"]
    verdict = "VERDICT: yes" if "\n42\n" in user else "VERDICT: no"
    return web.json_response({"choices": [{"message": {"role": "assistant", "content": verdict}}]})

  async def body(url):
    judge = LLMJudge(url=url, cfg=JudgeConfig(model="judge-model", timeout_s=10))
    try:
      good = await judge(_request(goal="What is 6 x 7?", answer="42"))
      bad = await judge(_request(goal="What is 6 x 7?", answer="41"))
    finally:
      await judge.close()
    return good, bad

  good, bad = asyncio.run(_with_server({"/v1/chat/completions": chat}, body))
  assert good.score == 1.0 and bad.score == 0.0
  assert "HTTP 500" in good.log["attempts"][0]["error"] and len(good.log["attempts"]) == 2
  assert seen[0]["model"] == "judge-model" and seen[0]["temperature"] == 0.0
  assert seen[0]["messages"][0]["role"] == "system"


def test_sglang_native_http_judge():
  async def generate(request):
    body = await request.json()
    assert "What is 6 x 7?" in body["text"] and body["sampling_params"]["max_new_tokens"] == 32
    return web.json_response({"text": "SCORE: 0.5",
                              "meta_info": {"finish_reason": {"type": "stop"}}})

  async def body(url):
    judge = LLMJudge(url=url, api="sglang")
    try:
      return await judge(_request(goal="What is 6 x 7?", answer="about 40"))
    finally:
      await judge.close()

  v = asyncio.run(_with_server({"/generate": generate}, body))
  assert v.score == 0.5 and v.log["attempts"][0]["api"] == "sglang"


def test_dead_endpoint_is_a_recorded_failure_not_a_crash():
  async def body():
    judge = LLMJudge(url="http://127.0.0.1:9", cfg=JudgeConfig(max_retries=1, timeout_s=2))
    try:
      return await judge(_request())
    finally:
      await judge.close()

  v = asyncio.run(body())
  assert v.score is None and len(v.log["attempts"]) == 2 and "error" in v.log["attempts"][0]


def test_runner_uses_the_judge_for_free_form_subtasks_and_saves_its_log():
  """A helper with a free-form goal (no exact verifier) is scored by the judge in the tree."""
  tok = ByteChatTokenizer()

  def policy(text, n):
    msgs = chat_messages(text)
    if msgs[1][1].startswith("Say hello"):
      return '```python\nfinish("hello")\n```'
    if len(msgs) > 3:
      return '```python\nfinish("0")\n```'
    return '```python\nr = await launch_subagent("Say hello.", context="")\nprint(r)\n```'

  env = LongContextEnv(LongContextConfig(num_tasks=1, target_tokens=4_000, kinds=("count",)))
  judge_fn = _Replies(["VERDICT: yes"])
  judge = LLMJudge(engine=ScriptedTurnEngine(tok, judge_fn), tokenizer=tok)
  runner = TreeRunner(env, ScriptedTurnEngine(tok, policy), tok, LocalReplPool(),
                      RunnerConfig(context_window=8192, max_new_tokens=512), judge=judge)
  tree = asyncio.run(runner.run_tree(env.tasks("train")[0]))
  child = tree.nodes[1]
  assert child.success == 1.0 and child.success_source == R.SOURCE_JUDGE
  assert child.extras["judge"]["attempts"][0]["raw"] == "VERDICT: yes"
  assert tree.nodes[0].success_source == R.SOURCE_VERIFIER
  json.dumps(tree.to_dict() if hasattr(tree, "to_dict") else child.to_dict())
