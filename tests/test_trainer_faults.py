"""The trainer's fault rules on the real runtime with scripted policies (the model is not under
test): infrastructure failures retried then excluded, the rollout deadline and its two rules,
tree_step_budget, a selectable judge; non-finite updates skipped and counted on a real learner
whose learning-rate schedule counts applied updates; unknown config keys rejected."""
import asyncio
import time

import numpy as np
import pytest

from experiments.configs import base as base_cfg
from rao_jax import collection
from rao_jax import experiment as X
from rao_jax import trainer as tr
from rao_jax.agent import chat, local_exec, runner as rn
from rao_jax.envs import base
from rao_jax.envs import textcraft_synth as ts
from rao_jax.rollout import base as rollout

TOK = chat.ByteChatTokenizer()
_ENV = []


def env():
  if not _ENV:
    _ENV.append(ts.TextCraftSynthEnv(ts.SynthConfig(tasks_per_difficulty=4, items_per_tier=40)))
  return _ENV[0]


def task(max_steps=200):
  t = env().tasks("test/easy")[0]
  return base.Task(task_id=t.task_id, env=t.env, goal=t.goal, fields=t.fields,
                   difficulty=t.difficulty, max_steps=max_steps)


def code(body):
  return f"Working.\n```python\n{body}\n```"


class Scripted(rollout.Engine):
  """Writes `fn(session_id, turn)`'s text; raises for None (an engine failure)."""

  def __init__(self, fn, delay=0.0):
    self.fn, self.delay, self.calls = fn, delay, 0

  @property
  def weight_version(self):
    return 3

  async def generate(self, request):
    self.calls += 1
    if self.delay:
      await asyncio.sleep(self.delay)
    turn = TOK.decode(request.prompt_ids).count("[turns left: ")
    out = self.fn(request.session_id, turn)
    if out is None:
      raise RuntimeError("engine lost its device for the test")
    ids = TOK.encode(out) + [TOK.stop_token_ids[0]]
    return rollout.GenerateResult(ids, [-0.5] * len(ids), rollout.FinishReason.STOP, 3)


def runner(engine, judge=None, **cfg):
  return rn.TreeRunner(env(), engine, TOK, local_exec.LocalReplPool(),
                       rn.RunnerConfig(recursive=False, **cfg), judge=judge)


def test_infra_failure_is_retried_once_then_left_out_of_the_group():
  # Tree ".../1" fails on its first try only; tree ".../2" fails every time.
  def fn(session, turn):
    tree = session.split("/")[-2]
    if tree.startswith("2") or tree == "1":
      return None
    return code("finish('done')")

  trees, every, stats = asyncio.run(collection.collect_group(runner(Scripted(fn)), task(), 3))
  # 1 and 2 failed, were retried ("1.retry1" succeeds, "2.retry1" fails): 0 and 1.retry1 kept.
  assert stats["infra_failed_trees"] == 2 and stats["infra_retries"] == 2
  assert stats["infra_excluded_trees"] == 1 and stats["groups_dropped"] == 0
  assert [t.tree_id.split("/")[-1] for t in trees] == ["0", "1.retry1"]
  assert len({t.group_id for t in trees}) == 1
  # Every run tree is recorded; the excluded ones say why and were never scored as the agent's.
  assert len(every) == 5
  excluded = [t for t in every if "excluded" in t.meta]
  assert len(excluded) == 3 and all("infrastructure" in t.meta["excluded"] for t in excluded)
  assert all(collection.infra_error(t) for t in excluded)
  # The learner never sees an infra-failed tree: advantages come from the kept ones only.
  from rao_jax.learner.rewards import compute_rewards_and_advantages
  adv = compute_rewards_and_advantages(trees, drop_equal_groups=False)
  assert set(adv.tree_ids) == {t.tree_id for t in trees}

  # With retries off and only one usable tree, the group has no baseline and is dropped.
  trees, every, stats = asyncio.run(
      collection.collect_group(runner(Scripted(fn)), task(), 3, infra_retries=0))
  assert trees == [] and stats["groups_dropped"] == 1 and stats["infra_retries"] == 0
  assert all("excluded" in t.meta for t in every)


def test_a_long_rollout_reports_its_finished_trees_while_it_runs(caplog):
  # Trees 0 and 1 finish at once; tree 2 takes 0.5 s.
  def fn(session, turn):
    return code("finish('done')")

  class Slow(Scripted):
    async def generate(self, request):
      if request.session_id.split("/")[-2] == "2":
        await asyncio.sleep(0.5)
      return await super().generate(request)

  async def main():
    progress = collection.RolloutProgress(runner(Slow(fn), max_steps_per_agent=1), 7, 3, every_s=0.2)
    reporter = asyncio.ensure_future(progress.report())
    try:
      return await collection.collect_group(progress, task(), 3), progress
    finally:
      reporter.cancel()

  with caplog.at_level("INFO", logger="rao_jax.collection"):
    (trees, _, _), progress = asyncio.run(main())
  lines = [r.getMessage() for r in caplog.records if "rollouts:" in r.getMessage()]
  assert lines and lines[0].startswith("step 7 rollouts: 2/3 trees done (0 solved), 2 agents,")
  assert progress.trees == 3 and progress.agents == 3
  assert progress.succeeded == sum(t.nodes[0].success == 1.0 for t in trees)
  assert progress.tokens == sum(n.num_generated_tokens for t in trees for n in t.nodes) > 0


def test_a_crashed_sandbox_and_an_aborted_generation_are_infra_failures():
  class Abort(Scripted):
    async def generate(self, request):
      return rollout.GenerateResult([], [], rollout.FinishReason.ABORT, 3, message="engine closed")

  (tree,) = asyncio.run(runner(Abort(None)).run_tasks([task()]))
  assert tree.root.end_reason == "error" and "aborted" in collection.infra_error(tree)
  # A sandbox that cannot be acquired (the pool failed to start one) is one too.
  class BrokenPool(local_exec.LocalReplPool):
    async def acquire(self):
      raise RuntimeError("sandbox did not start")

  r = rn.TreeRunner(env(), Scripted(lambda s, t: code("finish('x')")), TOK, BrokenPool(),
                    rn.RunnerConfig(recursive=False))
  (tree,) = asyncio.run(r.run_tasks([task()]))
  assert "sandbox did not start" in collection.infra_error(tree)
  # An agent's own error (bad code, a raising tool) is not an infrastructure failure.
  bodies = ["no code", code("1 / 0"), code("finish('x')")]
  (tree,) = asyncio.run(runner(Scripted(lambda s, t: bodies[min(t, 2)])).run_tasks([task()]))
  assert collection.infra_error(tree) is None and tree.root.end_reason == "finish"


@pytest.mark.parametrize("rule", ["unfinished", "drop_group"])
def test_rollout_deadline_cuts_stragglers(rule):
  # Tree 0 finishes at once; tree 1's cells take 0.05 s each, for up to 200 turns.
  def fn(session, turn):
    if session.split("/")[-2] == "0":
      return code("finish('done')")
    return code("import asyncio\nawait asyncio.sleep(0.05)")

  t0 = time.perf_counter()
  trees, every, stats = asyncio.run(collection.collect_group(
      runner(Scripted(fn)), task(), 2, deadline=time.perf_counter() + 0.6, deadline_rule=rule))
  assert time.perf_counter() - t0 < 5.0
  assert stats["deadline_cut_trees"] == 1
  slow = [t for t in every if t.tree_id.endswith("/1")][0]
  assert collection.deadline_cut(slow) and slow.meta["deadline_cut"]
  assert slow.root.end_reason == "timeout"
  assert slow.root.extras["deadline"] == "cut at a turn boundary"
  if rule == "unfinished":
    assert len(trees) == 2 and stats["groups_dropped"] == 0
    assert slow.root.success == 0.0 and slow.root.success_source == "verifier"
  else:
    assert trees == [] and stats["groups_dropped"] == 1
    assert "deadline" in slow.meta["excluded"]


def test_deadline_cuts_a_generation_in_flight():
  class Hang(Scripted):
    async def generate(self, request):
      await asyncio.sleep(30)

  t0 = time.perf_counter()
  (tree,) = asyncio.run(runner(Hang(None)).run_tasks([task()], deadline=time.perf_counter() + 0.3))
  assert time.perf_counter() - t0 < 5.0
  assert tree.root.end_reason == "timeout"
  assert tree.root.extras["deadline"] == "cut during a generation"
  assert collection.infra_error(tree) is None


def test_tree_step_budget_caps_the_task_budget():
  loop = lambda s, t: code("print(1)")   # never finishes
  (tree,) = asyncio.run(runner(Scripted(loop), tree_step_budget=3).run_tasks([task(200)]))
  assert tree.root.num_steps == 3 and tree.root.end_reason == "budget"
  assert tree.meta["step_budget"] == 3
  # A task's own smaller budget still wins; the config key reaches the runner.
  (tree,) = asyncio.run(runner(Scripted(loop), tree_step_budget=50).run_tasks([task(2)]))
  assert tree.root.num_steps == 2
  c = base_cfg.base_config()
  c.agent.tree_step_budget = 7
  assert X.runner_config(c).tree_step_budget == 7
  c.agent.tree_step_budget = 0
  assert X.runner_config(c).tree_step_budget is None
  with pytest.raises(ValueError, match="tree_step_budget"):
    rn.RunnerConfig(tree_step_budget=0)


def test_judge_is_selectable_and_its_source_is_recorded():
  from rao_jax.envs import judge as judge_lib
  c = base_cfg.base_config()
  assert X.make_judge(c, "train", None, TOK) is None
  c.judge.train, c.judge.eval = "rule", "model"
  assert isinstance(X.make_judge(c, "train", None, TOK), judge_lib.RuleJudge)
  eng = Scripted(lambda s, t: "VERDICT: yes")
  model_judge = X.make_judge(c, "eval", eng, TOK)
  assert isinstance(model_judge, judge_lib.LLMJudge) and model_judge.engine is eng
  c.judge.url = "http://127.0.0.1:9"
  assert X.make_judge(c, "eval", eng, TOK).url == "http://127.0.0.1:9"
  c.judge.train = "oracle"
  with pytest.raises(ValueError, match="config.judge.train='oracle'"):
    X.make_judge(c, "train", None, TOK)

  # A child no verifier covers gets the rule judge's score, recorded with its source.
  class NoSubVerifier(ts.TextCraftSynthEnv):
    def verify_subtask(self, episode, outcome):
      return None

  sub_env = NoSubVerifier(ts.SynthConfig(tasks_per_difficulty=4, items_per_tier=40))
  target = next(iter(task().fields["target_items"]))

  def fn(session, turn):
    if session.endswith("/0") and turn == 0:
      return code(f"print(await launch_subagent({{{target!r}: 1}}, 3))")
    if session.endswith("/0.1"):
      return code("finish('report')")
    return code("finish('gave up')")

  r = rn.TreeRunner(sub_env, Scripted(fn), TOK, local_exec.LocalReplPool(),
                    rn.RunnerConfig(recursive=True, max_depth=1), judge=judge_lib.RuleJudge())
  (tree,) = asyncio.run(r.run_tasks([task()]))
  child = tree.nodes[1]
  assert child.success == 1.0 and child.success_source == "judge"
  assert child.extras["judge"]["rule"] == judge_lib.RuleJudge.RULE
  assert tree.root.success_source == "verifier"


def test_unknown_config_keys_are_rejected_with_the_valid_ones():
  c = base_cfg.base_config()
  base_cfg.check_keys(c)
  c.env.kwargs.anything = 1          # environment options are free-form
  base_cfg.check_keys(c)
  c.rl.grup_size = 4
  with pytest.raises(ValueError, match=r"config.rl.grup_size .*'group_size'"):
    base_cfg.check_keys(c)
  c = base_cfg.base_config()
  c.evaluation = 3
  with pytest.raises(ValueError, match="config.evaluation .*'eval'"):
    base_cfg.check_keys(c)
  c = base_cfg.base_config()
  c.rl.group_size = 2
  c.rl.deadline_rule = "wait"
  with pytest.raises(ValueError, match="deadline_rule"):
    tr.Trainer.from_config(c, "/nonexistent/never-created")


@pytest.mark.slow
def test_nonfinite_update_is_skipped_counted_and_the_schedule_counts_applied_updates():
  from rao_jax.learner import Learner, LearnerConfig
  from rao_jax.learner import testing as lt
  from rao_jax.model import ModelConfig
  cfg = ModelConfig(vocab_size=97, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                    mlp_dim=32, tie_embeddings=True, dtype="float32", param_dtype="float32")
  # The group's two roots got the same reward: kept (drop_equal_groups=False) so that the
  # batch has nodes to step on.
  learner = Learner(LearnerConfig(row_len=64, micro_batch_rows=1, bucket_rows=(1, 2, 4, 8, 16),
                                  lr=1e-2, warmup_steps=4, drop_equal_groups=False), cfg)
  trees = lt.synthetic_trees(1, 2, vocab=97, seed=1, max_len=60, mean_len=30)
  good = learner.prepare(trees)[0]
  bad = dict(good.arrays())
  bad["coef_BxT"] = np.full_like(bad["coef_BxT"], np.nan)
  guard = tr.NonFiniteGuard(max_in_row=2)
  lrs = []
  for step, batch in enumerate([good, bad, good, bad, bad]):
    m = guard.step(learner, batch, step)
    if m.get("update_applied") == 1.0:
      lrs.append(m["lr"])
  assert guard.total == 3 and guard.in_row == 2 and guard.diverged
  # 2 updates applied: the warm-up went lr/4 -> 2 lr/4, not to the trainer's step count.
  assert learner.step_count == 2
  np.testing.assert_allclose(lrs, [1e-2 / 4, 2e-2 / 4], rtol=1e-6)
  learner.close()
