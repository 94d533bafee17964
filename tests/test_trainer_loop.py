"""The RL loop's parts without a model: `Trainer.rl_step` (collect -> prepare -> learner step ->
sync, overlap and staleness) on a recording learner and engine, and the every-n hooks."""
import asyncio
import collections
import types

import pytest

from rao_jax import experiment as X
from rao_jax import hooks as hooks_lib
from rao_jax import trainer as tr
from rao_jax.learner import compute_rewards_and_advantages
from rao_jax.learner import testing as lt


# ---- hooks ----------------------------------------------------------------------------------------
def test_hooks_run_every_n_steps_and_after_the_last():
  calls = []

  async def later(step, m):
    await asyncio.sleep(0)
    calls.append(("async", step, m["x"]))

  hooks = [hooks_lib.Hook("each", 1, lambda s, m: calls.append(("each", s))),
           hooks_lib.Hook("five", 5, later),
           hooks_lib.Hook("five_no_end", 5, lambda s, m: calls.append(("no_end", s)), at_end=False),
           hooks_lib.Hook("never", 0, lambda s, m: calls.append(("never", s)))]
  for step in range(1, 8):   # a 7-step run
    asyncio.run(hooks_lib.run_hooks(hooks, step, 7, {"x": step * 10}))
  assert [c for c in calls if c[0] == "async"] == [("async", 5, 50), ("async", 7, 70)]
  assert [c[1] for c in calls if c[0] == "no_end"] == [5]
  assert [c[1] for c in calls if c[0] == "each"] == list(range(1, 8))
  assert not [c for c in calls if c[0] == "never"]
  # In list order within a step.
  assert [c[0] for c in calls if c[1] == 5] == ["each", "async", "no_end"]
  closed = []
  hooks_lib.close_hooks([hooks_lib.Hook("a", 1, print, close=lambda: closed.append("a")),
                         hooks_lib.Hook("b", 1, print)])
  assert closed == ["a"]
  with pytest.raises(ValueError, match=r"Hook 'eval': every=2.5 must be an integer"):
    hooks_lib.Hook("eval", 2.5, print)


# ---- rl_step ---------------------------------------------------------------------------------------
def _trees(version, group="g"):
  trees = lt.synthetic_trees(num_groups=1, group_size=2, vocab=64, seed=version)
  for t in trees:
    t.group_id = group
    for n in t.nodes:
      n.weight_version = version
  return trees


class _Learner:
  """Prepares real advantages; records the batches it steps on."""

  def __init__(self, nonfinite=False):
    self.steps, self.step_count, self.nonfinite = [], 0, nonfinite
    self.cfg = types.SimpleNamespace(ckpt_every=2, ckpt_dir="/ckpt")

  def prepare(self, trees):
    adv = compute_rewards_and_advantages(trees, lam=0.5)
    return types.SimpleNamespace(trees=trees, stats={"nodes_packed": 3, "real_tokens": 30.0}), adv

  def step(self, batch):
    from rao_jax.learner import NonFiniteUpdateError
    self.steps.append(batch.trees)
    if self.nonfinite:
      raise NonFiniteUpdateError("loss is nan")
    self.step_count += 1
    return {"loss": 0.25}


def _trainer(tmp_path, *, overlap=False, total=3, max_staleness=1, learner=None):
  t = object.__new__(tr.Trainer)
  t.rl = X.RLConfig(total_steps=total, group_size=2, overlap=overlap,
                    loss="ppo_clip" if overlap else "rao", max_staleness=max_staleness)
  t.parts = types.SimpleNamespace(train_difficulty="easy",
                                  train_runner=types.SimpleNamespace(max_depth=2),
                                  progress=False)
  t.main, t.trees_dir = True, str(tmp_path)
  t.learner = learner or _Learner()
  t.collected, t.synced = [], []

  async def collect(runner, step, version=None):
    t.collected.append(step)
    trees = _trees(step if version is None else version)
    return trees, X.RolloutStats(1.0, 50), trees, {"infra_retries": 1.0}
  t.collect = collect

  async def sync_weights(version):
    t.synced.append(version)
    return 0.5
  t.sync_weights = sync_weights
  return t


def _state(t, step=0):
  return tr.RunState(step=step, guard=tr.NonFiniteGuard(t.rl.max_nonfinite_steps))


def test_rl_step_collects_trains_syncs_and_reports(tmp_path):
  t = _trainer(tmp_path)
  state = _state(t)
  m = asyncio.run(t.rl_step(None, state))
  assert state.step == 1 and t.collected == [0] and t.synced == [1]
  assert len(t.learner.steps) == 1 and state.next_batch is None
  for key in ("reward", "success", "success_easy", "time/rollout_s", "time/learner_s",
              "time/sync_s", "time/step_s", "rollout/tokens_per_s", "learner/tokens_per_s",
              "learner/loss", "learner/applied_updates", "rl/num_nodes", "tree_depth",
              "faults/infra_retries", "faults/total_infra_retries", "faults/nonfinite_steps",
              "rollout/staleness_max"):
    assert key in m, (key, sorted(m))
  assert m["time/sync_s"] == 0.5 and m["rollout/generated_tokens"] == 50
  assert m["learner/applied_updates"] == 1.0 and m["learner/loss"] == 0.25
  m = asyncio.run(t.rl_step(None, state))
  assert m["faults/total_infra_retries"] == 2.0 and m["faults/infra_retries"] == 1.0
  assert (tmp_path / "step_000001.jsonl").exists()


def test_rl_step_skips_an_update_without_trees(tmp_path):
  t = _trainer(tmp_path)

  async def nothing(runner, step):
    return [], X.RolloutStats(1.0, 0), [], {"groups_dropped": 1.0}
  t.collect = nothing
  state = _state(t)
  m = asyncio.run(t.rl_step(None, state))
  assert m["learner/update_applied"] == 0.0 and m["learner/no_signal"] == 1.0
  assert m["drift/update_applied"] == 0.0 and m["reward"] == 0.0 and not t.learner.steps
  assert state.step == 1 and t.synced == [1]   # the engine still gets the version


def _alike_group(group, root_s, child_s, depth_limit_child=False):
  """Two trees of one group with the same shape and successes: root -> helper -> (helper)."""
  trees = []
  for k in range(2):
    nodes = [lt.make_node("0", None, 0, ["0.1"], root_s, "verifier", [1, 2, 3], [0, 1, 1]),
             lt.make_node("0.1", "0", 1, ["0.1.1"] if depth_limit_child else [], child_s,
                          "verifier", [1, 2, 3], [0, 1, 1])]
    if depth_limit_child:
      nodes.append(lt.make_node("0.1.1", "0.1", 2, [], child_s, "verifier", [1, 2], [0, 1]))
    nodes[1].extras["scope"] = {"outside_root": k == 0, "outside_parent": False}
    trees.append(lt.make_tree(f"{group}.{k}", group, nodes))
  return trees


def test_a_step_without_signal_applies_no_update_and_says_so(tmp_path):
  # Every group's roots got equal rewards: the groups are dropped, no node carries signal, and
  # the learner is not stepped (an Adam step would move every weight by about lr).
  t = _trainer(tmp_path)
  trees = _alike_group("a", 1.0, 1.0, depth_limit_child=True) + _alike_group("b", 0.0, 0.0)

  async def alike(runner, step):
    return trees, X.RolloutStats(1.0, 10), trees, {}
  t.collect = alike
  state = _state(t)
  m = asyncio.run(t.rl_step(None, state))
  assert not t.learner.steps and t.learner.step_count == 0
  assert m["learner/update_applied"] == 0.0 and m["learner/no_signal"] == 1.0
  assert m["rl/signal"] == 0.0 and m["rl/groups_dropped"] == 2.0
  # The drift metrics of the step: 2 of 10 nodes sit at the depth limit (2); of the 4 helpers
  # the environment checked at launch (the grandchildren carry no flags), the 2 of each group's
  # first tree were flagged outside their root's task.
  assert m["drift/groups_all_equal"] == 1.0 and m["drift/update_applied"] == 0.0
  assert m["drift/at_depth_limit"] == pytest.approx(2 / 10)
  assert m["drift/helpers_outside_root"] == pytest.approx(2 / 4)
  assert m["drift/helpers_outside_parent"] == 0.0
  # One group with a comparison is enough for an update.
  trees = _alike_group("a", 1.0, 1.0) + [lt.make_tree("c.0", "c", [lt.make_node(
      "0", None, 0, [], 1.0, "verifier", [1, 2, 3], [0, 1, 1])]), lt.make_tree("c.1", "c", [
          lt.make_node("0", None, 0, [], 0.0, "verifier", [1, 2, 3], [0, 1, 1])])]
  m = asyncio.run(t.rl_step(None, state))
  assert len(t.learner.steps) == 1 and m["learner/no_signal"] == 0.0
  assert m["drift/update_applied"] == 1.0 and m["drift/groups_all_equal"] == 0.5


def test_overlap_trains_on_the_collection_started_during_the_last_update(tmp_path):
  t = _trainer(tmp_path, overlap=True, total=3)
  state = _state(t)

  async def run(n):
    out = []
    for _ in range(n):
      out.append(await t.rl_step(None, state))
    return out
  asyncio.run(run(3))
  # Step 0 collects its own trees and starts step 1's; step 1 starts step 2's; the last
  # step starts none.
  assert t.collected == [0, 1, 2] and state.next_batch is None and t.synced == [1, 2, 3]
  assert [trees[0].nodes[0].weight_version for trees in t.learner.steps] == [0, 1, 2]


def test_a_batch_staler_than_max_staleness_is_collected_again(tmp_path):
  t = _trainer(tmp_path, overlap=True, total=3, max_staleness=1)
  state = _state(t, step=2)

  async def old():
    return (_trees(0), X.RolloutStats(1.0, 5), _trees(0), {})   # sampled at version 0
  async def go():
    state.next_batch = asyncio.ensure_future(old())
    return await t.rl_step(None, state)
  m = asyncio.run(go())
  assert t.collected == [2]                                   # re-collected at step 2
  assert t.learner.steps[0][0].nodes[0].weight_version == 2
  assert m["rollout/staleness_max"] == 0.0


def test_divergence_hook_stops_after_the_metrics_are_written(tmp_path):
  t = _trainer(tmp_path, learner=_Learner(nonfinite=True), total=5)
  t.rl = X.RLConfig(total_steps=5, group_size=2, max_nonfinite_steps=2)
  written = []
  t.metrics = types.SimpleNamespace(write=lambda step, m, prefix: written.append((step, prefix)))
  t.learner.save = lambda step, extra: written.append((step, "ckpt"))
  t.main = False          # no evaluation hook
  state = _state(t)
  hooks = t.hooks(None, None, state)
  assert [h.name for h in hooks] == ["metrics", "divergence", "checkpoint", "progress"]

  async def loop():
    while state.step < 5:
      m = await t.rl_step(None, state)
      await hooks_lib.run_hooks(hooks, state.step, 5, m)
  with pytest.raises(tr.TrainingDivergedError, match=r"2 non-finite updates in a row \(steps 0 to 1"):
    asyncio.run(loop())
  hooks_lib.close_hooks(hooks)
  # Step 1: metrics; step 2: metrics, then the stop (before step 2's checkpoint hook).
  assert written == [(1, "train/"), (2, "train/")] and state.step == 2
  assert state.guard.total == 2 and isinstance(state.fault_totals, collections.Counter)


def test_update_without_signal_steps_anyway_when_asked(tmp_path):
  t = _trainer(tmp_path)
  t.rl = X.RLConfig(total_steps=3, group_size=2, update_without_signal=True)
  trees = _alike_group("a", 0.0, 0.0)

  async def alike(runner, step):
    return trees, X.RolloutStats(1.0, 10), trees, {}
  t.collect = alike
  t.learner.prepare = lambda tr: (types.SimpleNamespace(trees=tr, stats={"nodes_packed": 3}),
                                  compute_rewards_and_advantages(tr, drop_equal_groups=False))
  m = asyncio.run(t.rl_step(None, _state(t)))
  assert len(t.learner.steps) == 1 and m["learner/no_signal"] == 1.0
