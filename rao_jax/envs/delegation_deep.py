"""A delegation micro-environment with depth: k items, at most two helpers per agent.

A task names k digits, k drawn from {1, 2, 4, 8} ("Finish with 3 then 1 then 2 then 0."); the
answer is their concatenation ("3120"). As in `rao_jax/envs/delegation.py`, every agent has one
turn of one generated token (`agent.max_steps_per_agent = 1`, `agent.max_new_tokens = 1`) and
the tokenizer has one token per answer cell, so an agent answers at most one item itself:

    finish("d")                                               one token per digit d
    finish("".join(await asyncio.gather(*map(launch_subagent, parts))))          the split
    finish((await asyncio.gather(launch_subagent(task), launch_subagent(task)))[0])  the echo

The REPL variable `parts` holds the node's split: the goals of the first and the second half of
its items (its own goal when it holds one item, which cannot be split), and `task` its own
goal. So the split launches at most two helpers, each seeing only its share, and a task of k
items is solved by the tree of splits log2(k) levels deep whose k leaves answer one item each
(k = 8: three levels below the root, and the deepest level holds eight of the fifteen nodes).

Helpers beyond what the split needs are allowed and cost turns: a one-item agent may split
anyway (one helper given its own goal: a pass-through) or echo (two helpers given its own goal;
it keeps the first answer), and a larger agent may echo its whole goal to two helpers instead
of splitting it. Each helper is one more turn of the tree's step budget, and the budget is
finite: a tree of k items has 6k - 2 steps, a helper is granted floor((b - 2) / 2) of its
parent's b (so the two halves of a split fit, with one step of the parent to spare), which
gives the perfect tree of splits its turns plus room for one wasted level on each path from
the root to a leaf (k = 1: 4 steps, an echo's helpers 1 each; k = 8: a root that echoes gives
each helper 22 steps, enough for its splits but for no more waste). A second wasted level
starves the helpers below it, and a third helper of one agent is refused (an error string
comes back). A count-based
delegation bonus therefore has something to buy (an echoing leaf has two successful children
where an answering leaf has none), and the budget and the verifiers set its price.

Every node is verified exactly (its answer against its own goal's digits), so RAO's success
chain never needs the proxy. `max_depth` of the runtime is set above what the budget allows, so
the depth of a tree is what the policy's splits make it, not a limit it is told.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from rao_jax.envs import base
from rao_jax.envs import delegation
from rao_jax.envs import micro

SIZES = (1, 2, 4, 8)
MAX_HELPERS = 2            # helpers one agent may launch
SPLIT_CELL = delegation.DELEGATE_CELL   # one helper per entry of `parts`, answers joined
ECHO_CELL = ('```python\nfinish((await asyncio.gather(launch_subagent(task), '
             'launch_subagent(task)))[0])\n```')

_TOOL_DOCS_SINGLE = """\
Tools: none besides finish. A task names digits; answer with all of them in order, as one \
string (for "Finish with 3 then 1." finish("31")). A task naming one digit: finish with it.
"""
_TOOL_DOCS_RECURSIVE = _TOOL_DOCS_SINGLE + """\
The REPL variable `parts` holds your task split in two halves, as goals ("Finish with 3."); \
`task` holds your own goal. Each helper answers the goal it is given; at most 2 helpers.
"""
_GOAL_RE = re.compile(r"^Finish with (\d(?: then \d)*)\.$")


def task_goal(digits: Sequence[str]) -> str:
  """The goal of the items `digits`: "Finish with 3 then 1." ("Finish with 3." for one)."""
  return delegation.task_goal(digits)


def goal_digits(goal: str) -> list[str] | None:
  """The digits a goal names, in order, or None when `goal` is not a task's goal."""
  m = _GOAL_RE.match(goal.strip()) if isinstance(goal, str) else None
  return m.group(1).split(" then ") if m else None


def split_goals(digits: Sequence[str]) -> list[str]:
  """The split of a node's items: the goals of its two halves (its own goal for one item)."""
  if len(digits) < 2:
    return [task_goal(digits)]
  half = (len(digits) + 1) // 2
  return [task_goal(digits[:half]), task_goal(digits[half:])]


def tree_budget(k: int) -> int:
  """Steps of a task of k items: the perfect split tree's 2k - 1 turns, each of its k - 1
  splitting agents' spare step, and 3 more per leaf (one wasted level on each path)."""
  return 6 * k - 2


def helper_budget(parent_budget: int) -> int:
  """Steps a helper asks for: half of what its parent holds after its own turn and spare."""
  return max((parent_budget - 2) // 2, 0)


@dataclasses.dataclass(frozen=True)
class DeepDelegationConfig:
  """Tasks of the deep delegation micro-environment.

  Attributes:
    sizes: the k a task may hold (each in {1, 2, 4, 8}), drawn uniformly per task.
    num_answers: the digits 0 .. num_answers - 1 are the possible items (2 to 10).
    num_train: tasks in the "train" split.
    num_test: tasks in the "test" split (drawn with another seed; never trained on).
    seed: base seed of the task draws.
  """
  sizes: tuple[int, ...] = SIZES
  num_answers: int = 4
  num_train: int = 64
  num_test: int = 32
  seed: int = 0

  def __post_init__(self):
    sizes = tuple(int(k) for k in self.sizes)
    object.__setattr__(self, "sizes", sizes)
    if not sizes or any(k not in SIZES for k in sizes) or len(set(sizes)) != len(sizes):
      raise ValueError(f"DeepDelegationConfig.sizes={self.sizes!r}: must be distinct values of "
                       f"{SIZES} (powers of two: every split halves evenly).")
    if not 2 <= self.num_answers <= 10:
      raise ValueError(f"DeepDelegationConfig.num_answers={self.num_answers}: must be in "
                       "[2, 10] (the items are single digits).")
    for name in ("num_train", "num_test"):
      if getattr(self, name) < 1:
        raise ValueError(f"DeepDelegationConfig.{name}={getattr(self, name)}: must be >= 1.")


class _Episode(base.Episode):

  def __init__(self, task: base.Task):
    super().__init__(task)
    self.root_answer = ""
    self.helpers: dict[str, int] = {}   # node id -> helpers it launched

  def node_finished(self, outcome: base.NodeOutcome) -> None:
    if outcome.node.parent_id is None:
      self.root_answer = outcome.final_message if outcome.finished else ""

  def summary(self):
    digits = list(self.task.fields["digits"])
    return {"parts_right": delegation.parts_right(self.root_answer, digits), "k": len(digits)}


class DeepDelegationEnv(base.Environment):
  """k-item digit tasks (k in {1, 2, 4, 8}); an agent answers one item or splits in two."""

  name = "delegation_deep"
  task_variables = ("parts", "task")

  def __init__(self, **kw):
    self.cfg = DeepDelegationConfig(**kw)
    self._tasks: dict[str, list[base.Task]] = {}

  def tasks(self, split: str = "train") -> Sequence[base.Task]:
    if split not in ("train", "test"):
      raise ValueError(f"DeepDelegationEnv has the splits 'train' and 'test', not {split!r}.")
    if split not in self._tasks:
      n = self.cfg.num_train if split == "train" else self.cfg.num_test
      rng = np.random.default_rng([self.cfg.seed, 0 if split == "train" else 1, 11])
      tasks = []
      for i in range(n):
        # Sizes in turn, so that every split holds each k equally often.
        k = self.cfg.sizes[i % len(self.cfg.sizes)]
        digits = [str(d) for d in rng.integers(0, self.cfg.num_answers, size=k)]
        tasks.append(base.Task(
            task_id=f"delegation_deep.{split}.{i}", env=self.name, goal=task_goal(digits),
            fields={"digits": digits, "answer": "".join(digits), "k": k},
            difficulty=f"k{k}", max_steps=tree_budget(k)))
      self._tasks[split] = tasks
    return self._tasks[split]

  def tool_docs(self, recursive: bool) -> str:
    return _TOOL_DOCS_RECURSIVE if recursive else _TOOL_DOCS_SINGLE

  def new_episode(self, task: base.Task) -> base.Episode:
    return _Episode(task)

  def node_tools(self, episode: base.Episode, node: base.NodeInfo) -> dict[str, base.Tool]:
    return {}

  def node_variables(self, episode: base.Episode, node: base.NodeInfo) -> dict:
    return {"parts": split_goals(list(node.fields["digits"])), "task": node.goal}

  def child_spec(self, episode: base.Episode, parent: base.NodeInfo, args: tuple,
                 kwargs: dict) -> base.ChildSpec:
    goal = args[0] if args else kwargs.get("goal")
    digits = goal_digits(goal)
    if digits is None:
      raise base.SubagentArgError(f"launch_subagent(goal) takes a goal such as 'Finish with 3 "
                                  f"then 1.', got {goal!r}.")
    launched = episode.helpers.get(parent.node_id, 0)
    if launched >= MAX_HELPERS:
      raise base.SubagentArgError(f"at most {MAX_HELPERS} helpers per agent; this is your "
                                  f"helper {launched + 1}.")
    episode.helpers[parent.node_id] = launched + 1
    return base.ChildSpec(goal=task_goal(digits),
                          fields={"digits": digits, "answer": "".join(digits), "k": len(digits)},
                          num_steps=helper_budget(parent.max_steps))

  def format_child_result(self, episode: base.Episode, spec: base.ChildSpec,
                          outcome: base.NodeOutcome) -> str:
    # The helper's answer alone, so that the parent's join is its items' answer ("" for a
    # failed helper: the parent's one-token turn cannot act on a note; see delegation.py).
    return outcome.final_message if outcome.finished else ""

  def subtask_scope(self, episode: base.Episode, parent: base.NodeInfo,
                    spec: base.ChildSpec) -> dict[str, bool]:
    return delegation.digits_scope(delegation.node_digits(episode.task.fields),
                                   delegation.node_digits(parent.fields),
                                   delegation.node_digits(spec.fields))

  def verify_root(self, episode: base.Episode, outcome: base.NodeOutcome) -> float:
    answer = str(episode.task.fields["answer"])
    return float(outcome.finished and outcome.final_message.strip() == answer)

  def verify_subtask(self, episode: base.Episode, outcome: base.NodeOutcome) -> float | None:
    answer = outcome.node.fields.get("answer")
    if answer is None:
      return None
    return float(outcome.finished and outcome.final_message.strip() == str(answer))


# -- what the micro tokenizer and the warm start need ----------------------------------------

ANSWER_CELLS = delegation.ANSWER_CELLS
CELLS = ANSWER_CELLS + (SPLIT_CELL, ECHO_CELL)


def corpus_texts(cfg: DeepDelegationConfig) -> list[str]:
  """Goals of every size, for the micro tokenizer's BPE (the prompts come from the runtime)."""
  rng = np.random.default_rng(0)
  goals = [task_goal([str(d) for d in rng.integers(0, 10, size=k)])
           for k in SIZES for _ in range(40)]
  return goals + [_TOOL_DOCS_RECURSIVE]


def best_cell(goal: str) -> str:
  """The best recursive policy's cell: split a goal of several items, answer a single one."""
  digits = goal_digits(goal) or ["0"]
  return micro.answer_cell(digits[0]) if len(digits) == 1 else SPLIT_CELL


def single_agent_cell(goal: str) -> str:
  """The best single agent's cell: the first item (it solves exactly the one-item tasks)."""
  return micro.answer_cell((goal_digits(goal) or ["0"])[0])


def demonstration(goal: str, rng: np.random.Generator, p_delegate: float,
                  p_extra: float) -> str:
  """The scripted warm-start policy's cell for a node whose goal is `goal`.

  Several items: the echo with probability `p_extra`, the split with `p_delegate`, else the
  first item (the single agent's best move). One item: the echo or a pass-through (the split of
  one item) with probability `p_extra` each, else its digit. So the warm start delegates only
  part of the time, and helpers beyond the split's needs are sampled now and then.
  """
  digits = goal_digits(goal) or ["0"]
  r = rng.random()
  if r < p_extra:
    return ECHO_CELL
  if len(digits) == 1:
    return SPLIT_CELL if r < 2 * p_extra else micro.answer_cell(digits[0])
  return SPLIT_CELL if r < p_extra + p_delegate else micro.answer_cell(digits[0])
