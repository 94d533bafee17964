"""A micro-environment and a tiny policy that RAO measurably improves in about a minute on a CPU.

The task: the goal names a digit ("Finish with 3."); the agent must write the cell
`finish("3")`. The verifier checks the final message. The tokenizer (a byte-level BPE trained
on the environment's own text with the `tokenizers` library) has one token per answer cell,
```python\\nfinish("3")\\n```, so with `agent.max_new_tokens = 1` a turn is exactly one generated
token and the whole learning signal sits on it: a loss mask shifted by one token in either
direction misses it, a flipped advantage sign unlearns it, an engine that keeps its old
weights never samples a better one. That is what makes the micro-run a sharp test of the
loop (`tests/test_learns.py`), while every stage is the real one: chat template, embedded
engine, sandboxed REPL, verifier, rewards, packing, the jitted learner step, weight sync.

The policy (`experiments/micro_policy.py`: `build_policy`) is a tiny Llama-family model given
a short supervised warm start on scripted demonstrations, stopped early: it has learnt the
format (one answer cell) but copies the digit only partly (about 40% success with four answers,
25% by chance), which leaves RL both a signal (groups with mixed outcomes) and room to improve.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from rao_jax.envs import base

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_TOOL_DOCS = """\
Tools: none besides finish. Answer with the digit the task names, as a string.
"""
_GOAL = "Finish with {digit}."
_GOAL_RE = re.compile(r"Finish with (\d)\.")


def task_goal(digit: str) -> str:
  """The goal of the task whose answer is `digit`."""
  return _GOAL.format(digit=digit)


def goal_digit(goal: str) -> str:
  """The digit a goal names (the last one: "0" when there is none)."""
  found = _GOAL_RE.findall(goal)
  return found[-1] if found else "0"


def answer_cell(digit: str) -> str:
  """The code cell that solves the task of `digit` (one token of the micro tokenizer)."""
  return f'```python\nfinish("{digit}")\n```'


@dataclasses.dataclass(frozen=True)
class MicroConfig:
  """Tasks of the micro-environment.

  Attributes:
    num_answers: the digits 0 .. num_answers - 1 are the possible answers (2 to 10).
    num_train: tasks in the "train" split.
    num_test: tasks in the "test" split (drawn with another seed).
    seed: base seed of the task draws.
  """
  num_answers: int = 4
  num_train: int = 64
  num_test: int = 16
  seed: int = 0

  def __post_init__(self):
    if not 2 <= self.num_answers <= 10:
      raise ValueError(f"MicroConfig.num_answers={self.num_answers}: must be in [2, 10] (the "
                       "answers are single digits).")
    for name in ("num_train", "num_test"):
      if getattr(self, name) < 1:
        raise ValueError(f"MicroConfig.{name}={getattr(self, name)}: must be >= 1.")

  @property
  def digits(self) -> tuple[str, ...]:
    return tuple(str(d) for d in range(self.num_answers))


class MicroEnv(base.Environment):
  """Finish with the digit the goal names; one exact verifier, no tools, no recursion."""

  name = "micro"

  def __init__(self, **kw):
    self.cfg = MicroConfig(**kw)
    self._tasks: dict[str, list[base.Task]] = {}

  def tasks(self, split: str = "train") -> Sequence[base.Task]:
    if split not in ("train", "test"):
      raise ValueError(f"MicroEnv has the splits 'train' and 'test', not {split!r}.")
    if split not in self._tasks:
      n = self.cfg.num_train if split == "train" else self.cfg.num_test
      rng = np.random.default_rng([self.cfg.seed, 0 if split == "train" else 1])
      digits = rng.integers(0, self.cfg.num_answers, size=n)
      self._tasks[split] = [
          base.Task(task_id=f"micro.{split}.{i}", env=self.name, goal=_GOAL.format(digit=d),
                    fields={"answer": str(d)}, max_steps=1)
          for i, d in enumerate(digits)]
    return self._tasks[split]

  def tool_docs(self, recursive: bool) -> str:
    return _TOOL_DOCS

  def new_episode(self, task: base.Task) -> base.Episode:
    return base.Episode(task)

  def node_tools(self, episode: base.Episode, node: base.NodeInfo) -> dict[str, base.Tool]:
    return {}

  def child_spec(self, episode: base.Episode, parent: base.NodeInfo, args: tuple,
                 kwargs: dict) -> base.ChildSpec:
    raise base.SubagentArgError("the micro-environment has no subtasks; answer directly.")

  def verify_root(self, episode: base.Episode, outcome: base.NodeOutcome) -> float:
    answer = str(episode.task.fields["answer"])
    return float(outcome.finished and outcome.final_message.strip() == answer)
