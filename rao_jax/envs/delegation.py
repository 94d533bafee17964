"""A micro-environment where recursion is necessary: k-part tasks, one part per agent.

A task names k >= 2 digits ("Finish with 3 then 1."); the answer is their concatenation
("31"). Every agent's budget is one turn of one generated token (`agent.max_steps_per_agent
= 1`, `agent.max_new_tokens = 1`), and the tokenizer has one token per answer cell:
`finish("d")` for each digit, and the delegation cell

    finish("".join(await asyncio.gather(*map(launch_subagent, parts))))

which launches one helper per part (the REPL variable `parts` holds the parts' goals, "Finish
with 3.") and finishes with their answers joined. So one agent can answer at most one part
(1/k of a task, never the whole task), and a task is solved only through delegation: the root
emits the delegation cell and each child, given one part, emits its digit. This is the micro
analogue of a task that one context window cannot hold, with each decision one token so that
credit assignment is sharp: the root's choice to delegate and each child's answer are single
tokens whose log-probabilities the learner must move in the right direction.

A child that emits the delegation cell launches a grandchild at `max_depth` (an error string
comes back and it finishes with it: wrong), and a root that answers one digit directly gets
1/k of the parts and success 0. Root success is exact (the whole answer); every child's
success is exact too (its own digit), so RAO's success chain never needs the proxy here.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from rao_jax.envs import base
from rao_jax.envs import micro

DELEGATE_CELL = ('```python\nfinish("".join(await asyncio.gather(*map(launch_subagent, parts))))'
                 '\n```')

_TOOL_DOCS_SINGLE = """\
Tools: none besides finish. A task names digits; answer with all of them in order, as one \
string (for "Finish with 3 then 1." finish("31")). A task naming one digit: finish with it.
"""
_TOOL_DOCS_RECURSIVE = _TOOL_DOCS_SINGLE + """\
The REPL variable `parts` lists the task's parts as goals ("Finish with 3."); each helper \
answers one part with its digit.
"""
_PART_GOAL = "Finish with {digit}."
_PART_RE = re.compile(r"^Finish with (\d)\.$")


def task_goal(digits: Sequence[str]) -> str:
  """The goal of a task whose answer is `digits` joined: "Finish with 3 then 1."."""
  return "Finish with " + " then ".join(digits) + "."


def part_goal(digit: str) -> str:
  """The goal of one part (what a helper is given): "Finish with 3."."""
  return _PART_GOAL.format(digit=digit)


def digits_scope(root_digits: Sequence[str], parent_digits: Sequence[str],
                 child_digits: Sequence[str]) -> dict[str, bool]:
  """Whether a helper's items lie outside its root's and its parent's task.

  A helper's task is part of a task when its digits are a contiguous run of that task's
  digits (a half, one part, or the whole task): the answers join in order, so nothing else
  contributes to the task's answer.
  """
  def part_of(task: Sequence[str]) -> bool:
    c, t = list(child_digits), list(task)
    return any(t[i:i + len(c)] == c for i in range(len(t) - len(c) + 1))

  return {"outside_root": not part_of(root_digits), "outside_parent": not part_of(parent_digits)}


def node_digits(fields) -> list[str]:
  """A node's digits from its task fields (a task's `digits`, a part's single `answer`)."""
  if "digits" in fields:
    return [str(d) for d in fields["digits"]]
  return [str(fields["answer"])] if fields.get("answer") is not None else []


def parts_right(answer: str, digits: Sequence[str]) -> float:
  """The share of parts an answer gets right, position by position (1/k per digit)."""
  return sum(a == d for a, d in zip(answer, digits)) / len(digits)


@dataclasses.dataclass(frozen=True)
class DelegationConfig:
  """Tasks of the delegation micro-environment.

  Attributes:
    num_parts: k, the digits a task names (>= 2: one agent answers one).
    num_answers: the digits 0 .. num_answers - 1 are the possible parts (2 to 10).
    num_train: tasks in the "train" split.
    num_test: tasks in the "test" split (drawn with another seed; never trained on).
    seed: base seed of the task draws.
  """
  num_parts: int = 2
  num_answers: int = 4
  num_train: int = 64
  num_test: int = 32
  seed: int = 0

  def __post_init__(self):
    if not 2 <= self.num_parts <= 6:
      raise ValueError(f"DelegationConfig.num_parts={self.num_parts}: must be in [2, 6] (one "
                       "agent answers one part, so a task needs at least 2).")
    if not 2 <= self.num_answers <= 10:
      raise ValueError(f"DelegationConfig.num_answers={self.num_answers}: must be in [2, 10] "
                       "(the parts are single digits).")
    for name in ("num_train", "num_test"):
      if getattr(self, name) < 1:
        raise ValueError(f"DelegationConfig.{name}={getattr(self, name)}: must be >= 1.")


class _Episode(base.Episode):

  def __init__(self, task: base.Task):
    super().__init__(task)
    self.root_answer = ""

  def node_finished(self, outcome: base.NodeOutcome) -> None:
    if outcome.node.parent_id is None:
      self.root_answer = outcome.final_message if outcome.finished else ""

  def summary(self):
    digits = list(self.task.fields["digits"])
    return {"parts_right": parts_right(self.root_answer, digits)}


class DelegationEnv(base.Environment):
  """k-part digit tasks; one part fits one agent, so the whole task needs helpers."""

  name = "delegation"
  task_variables = ("parts",)

  def __init__(self, **kw):
    self.cfg = DelegationConfig(**kw)
    self._tasks: dict[str, list[base.Task]] = {}

  def tasks(self, split: str = "train") -> Sequence[base.Task]:
    if split not in ("train", "test"):
      raise ValueError(f"DelegationEnv has the splits 'train' and 'test', not {split!r}.")
    if split not in self._tasks:
      n = self.cfg.num_train if split == "train" else self.cfg.num_test
      rng = np.random.default_rng([self.cfg.seed, 0 if split == "train" else 1, 7])
      draws = rng.integers(0, self.cfg.num_answers, size=(n, self.cfg.num_parts))
      # The root's turn, one per helper, and one spare: the runtime keeps a step for the
      # parent while it launches (see TreeRunner's launch_subagent).
      steps = self.cfg.num_parts + 2
      self._tasks[split] = [
          base.Task(task_id=f"delegation.{split}.{i}", env=self.name,
                    goal=task_goal([str(d) for d in row]),
                    fields={"digits": [str(d) for d in row], "answer": "".join(map(str, row))},
                    max_steps=steps)
          for i, row in enumerate(draws)]
    return self._tasks[split]

  def tool_docs(self, recursive: bool) -> str:
    return _TOOL_DOCS_RECURSIVE if recursive else _TOOL_DOCS_SINGLE

  def new_episode(self, task: base.Task) -> base.Episode:
    return _Episode(task)

  def node_tools(self, episode: base.Episode, node: base.NodeInfo) -> dict[str, base.Tool]:
    return {}

  def node_variables(self, episode: base.Episode, node: base.NodeInfo) -> dict:
    if node.parent_id is None:
      return {"parts": [part_goal(d) for d in episode.task.fields["digits"]]}
    return {"parts": [node.goal]}

  def child_spec(self, episode: base.Episode, parent: base.NodeInfo, args: tuple,
                 kwargs: dict) -> base.ChildSpec:
    goal = args[0] if args else kwargs.get("goal")
    m = _PART_RE.match(goal.strip()) if isinstance(goal, str) else None
    if m is None:
      raise base.SubagentArgError(f"launch_subagent(goal) takes one part's goal such as "
                                  f"'Finish with 3.', got {goal!r}.")
    return base.ChildSpec(goal=part_goal(m.group(1)), fields={"answer": m.group(1)}, num_steps=1)

  def format_child_result(self, episode: base.Episode, spec: base.ChildSpec,
                          outcome: base.NodeOutcome) -> str:
    # The helper's answer alone, so that the parent's join is the task's answer. A failed
    # helper's "" stays: the parent's one one-token turn has already been spent on the join,
    # so a failure note could not be acted on, and either way the joined answer is wrong.
    return outcome.final_message if outcome.finished else ""

  def subtask_scope(self, episode: base.Episode, parent: base.NodeInfo,
                    spec: base.ChildSpec) -> dict[str, bool]:
    return digits_scope(node_digits(episode.task.fields), node_digits(parent.fields),
                        node_digits(spec.fields))

  def verify_root(self, episode: base.Episode, outcome: base.NodeOutcome) -> float:
    answer = str(episode.task.fields["answer"])
    return float(outcome.finished and outcome.final_message.strip() == answer)

  def verify_subtask(self, episode: base.Episode, outcome: base.NodeOutcome) -> float | None:
    answer = outcome.node.fields.get("answer")
    if answer is None:
      return None
    return float(outcome.finished and outcome.final_message.strip() == str(answer))


# -- what the micro tokenizer and the warm start need ----------------------------------------

ANSWER_CELLS = tuple(micro.answer_cell(str(d)) for d in range(10))
CELLS = ANSWER_CELLS + (DELEGATE_CELL,)


def corpus_texts(cfg: DelegationConfig) -> list[str]:
  """Goals of both levels, for the micro tokenizer's BPE (the prompts come from the runtime)."""
  digits = [str(d) for d in range(10)]
  return ([part_goal(d) for d in digits] + [task_goal([a, b]) for a in digits for b in digits[:3]]
          + [_TOOL_DOCS_RECURSIVE])


def demonstration(goal: str, rng: np.random.Generator, p_delegate: float) -> str:
  """The scripted warm-start policy's cell for a node whose goal is `goal`.

  A part's goal gets its digit. A task's goal gets the delegation cell with probability
  `p_delegate`, else the single agent's best move: the first digit (1/k of the parts).
  """
  m = _PART_RE.match(goal.strip())
  if m is not None:
    return micro.answer_cell(m.group(1))
  digits = re.findall(r"\d", goal)
  if rng.random() < p_delegate:
    return DELEGATE_CELL
  return micro.answer_cell(digits[0] if digits else "0")
