"""The deep delegation micro-environment: verifier, splits, budgets, its scripted caps, and the
scope of a helper's task (shared with the delegation environment)."""
import re

import numpy as np
import pytest

from experiments.configs import delegation_deep as cfg_lib
from rao_jax.envs import base
from rao_jax.envs import delegation
from rao_jax.envs import delegation_deep as D


def test_goals_parse_and_split_in_halves():
  assert D.goal_digits("Finish with 3 then 1 then 2 then 0.") == ["3", "1", "2", "0"]
  assert D.goal_digits("Finish with 3.") == ["3"]
  for bad in ("Finish with 3 then.", "finish with 3.", "Finish with 12.", 7, None):
    assert D.goal_digits(bad) is None, bad
  assert D.split_goals(list("31")) == ["Finish with 3.", "Finish with 1."]
  assert D.split_goals(list("3120")) == ["Finish with 3 then 1.", "Finish with 2 then 0."]
  # One item cannot be split: its only share is itself (the split cell then forwards it).
  assert D.split_goals(["3"]) == ["Finish with 3."]


def test_budgets_fit_the_perfect_tree_with_one_spare_level():
  for k in D.SIZES:
    b, level = D.tree_budget(k), k
    while level > 1:
      # After its own turn and one spare step, two halves' budgets fit the parent's.
      assert b - 2 >= 2 * D.helper_budget(b)
      b, level = D.helper_budget(b), level // 2
    assert b == 4   # every leaf: room for one wasted level (two helpers of one step)
    assert D.helper_budget(b) == 1 and D.helper_budget(1) == 0


def test_tasks_cycle_sizes_and_config_is_validated():
  env = D.DeepDelegationEnv(num_train=8, num_test=4)
  train = env.tasks("train")
  assert [t.fields["k"] for t in train] == [1, 2, 4, 8] * 2
  for t in train:
    assert D.goal_digits(t.goal) == t.fields["digits"]
    assert t.max_steps == D.tree_budget(t.fields["k"]) and t.difficulty == f"k{t.fields['k']}"
  assert [t.goal for t in env.tasks("test")] != [t.goal for t in train[:4]]
  with pytest.raises(ValueError, match="sizes"):
    D.DeepDelegationConfig(sizes=(3,))
  with pytest.raises(ValueError, match="num_answers"):
    D.DeepDelegationConfig(num_answers=11)
  with pytest.raises(ValueError, match="'dev'"):
    env.tasks("dev")


def test_verifier_and_child_spec():
  env = D.DeepDelegationEnv()
  task = env.tasks("train")[2]   # k = 4
  ep = env.new_episode(task)
  root = base.NodeInfo("0", None, 0, task.goal, dict(task.fields), task.max_steps)
  spec = env.child_spec(ep, root, (D.split_goals(task.fields["digits"])[0],), {})
  assert spec.fields["digits"] == task.fields["digits"][:2]
  assert spec.num_steps == D.helper_budget(task.max_steps) == 10
  env.child_spec(ep, root, (task.goal,), {})   # helpers may be given any goal, even its own
  with pytest.raises(base.SubagentArgError, match="at most 2 helpers"):
    env.child_spec(ep, root, (task.goal,), {})
  with pytest.raises(base.SubagentArgError, match="takes a goal"):
    env.child_spec(env.new_episode(task), root, ("do it",), {})

  def outcome(info, msg, finished=True):
    return base.NodeOutcome(info, finished, msg, "finish", 1, 1)
  assert env.verify_root(ep, outcome(root, task.fields["answer"])) == 1.0
  assert env.verify_root(ep, outcome(root, task.fields["answer"][:-1])) == 0.0
  assert env.verify_root(ep, outcome(root, task.fields["answer"], finished=False)) == 0.0
  child = base.NodeInfo("0.1", "0", 1, spec.goal, dict(spec.fields), 10)
  assert env.verify_subtask(ep, outcome(child, spec.fields["answer"])) == 1.0
  assert env.verify_subtask(ep, outcome(child, "9")) == 0.0


def _budget(text):
  m = re.search(r"step budget \(your turns plus your helpers' turns\) is (\d+)", text)
  return int(m.group(1)) if m else 0


@pytest.fixture(scope="module")
def runtime():
  from experiments import micro_policy
  from rao_jax import experiment as X
  c = cfg_lib.get_config("")
  env = X.make_env(c)
  tok = micro_policy.tokenizer_for(env)
  return c, env, tok, env.tasks("test")[:8]


def _grow(runtime, cell_of, recursive=True):
  from experiments import micro_policy
  from rao_jax import experiment as X
  c, env, tok, tasks = runtime
  return micro_policy.grow_trees(env, tok, X.runner_config(c, recursive=recursive), tasks,
                                 lambda text, n: cell_of(micro_policy.user_goal(text), text))


def test_one_token_per_cell_and_the_scripted_caps(runtime):
  c, env, tok, tasks = runtime
  for cell in D.CELLS:
    assert len(tok.encode(cell)) == 1, cell
  # The best single agent answers its first item: it solves exactly the one-item tasks.
  single = _grow(runtime, lambda goal, text: D.single_agent_cell(goal), recursive=False)
  assert [t.nodes[0].success for t in single] == [float(t.fields["k"] == 1) for t in tasks]
  # The best recursive policy solves every task with the perfect tree of splits: 2k - 1 nodes,
  # log2(k) levels below the root, every node verified right.
  rec = _grow(runtime, lambda goal, text: D.best_cell(goal))
  for t, task in zip(rec, tasks):
    k = task.fields["k"]
    assert t.nodes[0].success == 1.0 and all(n.success == 1.0 for n in t.nodes)
    assert len(t.nodes) == 2 * k - 1 and max(n.depth for n in t.nodes) == int(np.log2(k))
    assert sum(n.depth == int(np.log2(k)) for n in t.nodes) == k   # the deepest level: k leaves
    assert max(len(n.token_ids) for n in t.nodes) < c.agent.context_window


def test_extra_helpers_are_allowed_and_cost_turns(runtime):
  c, env, tok, tasks = runtime
  # Leaves that echo while their budget allows (then the echo's helpers answer): still right,
  # with two more nodes per leaf, all of them successful.
  def echo(goal, text):
    if len(D.goal_digits(goal)) == 1 and _budget(text) >= 3:
      return D.ECHO_CELL
    return D.best_cell(goal)
  rec = _grow(runtime, echo)
  for t, task in zip(rec, tasks):
    k = task.fields["k"]
    assert t.nodes[0].success == 1.0 and len(t.nodes) == 2 * k - 1 + 2 * k
    assert all(n.success == 1.0 for n in t.nodes)
  # The budget holds one wasted level on each path from the root to a leaf, not two: echoing
  # at every one-item node starves the echo's helpers (one step: they cannot launch), and
  # every task fails; a root of 8 items that echoes still succeeds (its helpers' 22 steps hold
  # a tree of splits, with 1 + 2 * 15 nodes), one that echoes twice does not.
  always = _grow(runtime, lambda goal, text: D.ECHO_CELL if len(D.goal_digits(goal)) == 1
                 else D.best_cell(goal))
  assert [t.nodes[0].success for t in always] == [0.0] * len(tasks)
  for budgets, right in (((46,), 1.0), ((46, 22), 0.0)):
    echo8 = _grow(runtime, lambda goal, text: D.ECHO_CELL if len(D.goal_digits(goal)) == 8
                  and _budget(text) in budgets else D.best_cell(goal))
    for t, task in zip(echo8, tasks):
      assert t.nodes[0].success == (right if task.fields["k"] == 8 else 1.0)
      if task.fields["k"] == 8 and right:
        assert len(t.nodes) == 31


def test_config_builds_translates_and_its_buckets_hold_the_largest_step():
  from rao_jax import experiment as X
  c = cfg_lib.get_config("seed=3")
  c.lock()
  rc, lc = X.runner_config(c), X.learner_config(c, "/tmp/unused")
  assert rc.recursive and rc.max_steps_per_agent == 1 and rc.max_new_tokens == 1
  # The budget bounds depth before the runtime's limit does (k = 8: 46 -> 22 -> 10 -> 4 -> 1).
  assert rc.max_depth > 4 and rc.max_live_agents >= D.tree_budget(8)
  # One row per node, every tree at its largest (one node per step of its budget).
  assert max(lc.bucket_rows) >= c.rl.group_size * c.rl.tasks_per_step * D.tree_budget(8)
  assert X.make_env(c).cfg.seed == 3
  assert cfg_lib.get_config("single").agent.mode == "single"
  X.rl_config(c).check_processes(1)


_IN = {"outside_root": False, "outside_parent": False}


@pytest.mark.parametrize("env_cls", [delegation.DelegationEnv, D.DeepDelegationEnv])
def test_digit_envs_scope_is_a_contiguous_run(env_cls):
  env = env_cls()
  task = base.Task("t", env.name, "Finish with 3 then 1 then 2 then 0.",
                   {"digits": ["3", "1", "2", "0"], "answer": "3120"})
  root = base.NodeInfo("0", None, 0, task.goal, task.fields, 30)
  half = base.NodeInfo("0.1", "0", 1, "Finish with 3 then 1.", {"digits": ["3", "1"]}, 10)
  cases = [(root, "Finish with 1.", _IN), (half, "Finish with 3.", _IN),
           (half, "Finish with 2.", {"outside_root": False, "outside_parent": True}),
           (root, "Finish with 7.", {"outside_root": True, "outside_parent": True})]
  if env_cls is D.DeepDelegationEnv:   # whole-goal echoes and runs of several
    cases += [(root, task.goal, _IN), (root, "Finish with 1 then 2.", _IN),
              (root, "Finish with 3 then 2.", {"outside_root": True, "outside_parent": True})]
  for parent, goal, want in cases:
    ep = env.new_episode(task)   # deep delegation counts helpers per agent
    spec = env.child_spec(ep, parent, (goal,), {})
    assert env.subtask_scope(ep, parent, spec) == want, (parent.node_id, goal)


def test_the_warm_starts_probe_stops_only_on_a_greedy_copying_model(runtime):
  # A build that learnt one digit well and sends the others to a wrong cell reaches a mean
  # p(right) of 0.43 with the right answer the greedy one on half the one-item nodes: held-out
  # greedy success 0.25. The deep task's probe must not stop there.
  from experiments import micro_policy
  from rao_jax.envs import delegation
  _, env, _, _ = runtime
  target = micro_policy.default_target(env)
  probe = object.__new__(micro_policy.Probe)
  probe.target = target
  assert not probe.done({"delegate": 0.5, "child_right": 0.43, "child_greedy": 0.51,
                         "success": 0.1})
  assert probe.done({"delegate": 0.5, "child_right": 0.48, "child_greedy": 0.996,
                     "success": 0.1})
  # The two-part task keeps its rule (its learning test was measured with it).
  assert micro_policy.default_target(delegation.DelegationEnv()) == {"child_right": 0.4}
