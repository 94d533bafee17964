"""The environment interface the agent runtime drives.

An environment supplies, for the runtime in `rao_jax.agent`:

* tasks (`Task`: goal text, structured fields, difficulty, step budget);
* tool documentation for the system prompt, with and without `launch_subagent`;
* a per-tree episode state (`Episode`), shared by all nodes of one execution tree (TextCraft's
  inventory, a corpus handle, a long document);
* per-node tools (host-side callables the sandboxed REPL reaches by name) and REPL variables to
  bind in the node's sandbox (e.g. the long-context `context`);
* the mapping from `launch_subagent(*args, **kwargs)` to a child's goal, fields, variables and
  requested step budget (`ChildSpec`), and from a finished child back to the string the parent's
  `await` returns;
* a root verifier and a subtask verifier (the exact-verification source of RAO_SPEC's success
  chain; the subtask verifier returns None when it cannot parse the goal).

The runtime owns everything else: `finish`, `launch_subagent` itself, all limits (depth, steps,
tree budget, live agents, context window), the judge and proxy fallbacks of the success chain.

Tools run on the trusted side. They may be plain functions or coroutines; sync tools are called
on the event loop thread (they must be quick), so state shared by concurrent children is only
ever mutated between awaits; episodes still guard shared state with a lock so that a sandbox
host that calls sync tools from a worker thread cannot corrupt it either.
"""
from __future__ import annotations

import abc
import dataclasses
import json
from typing import Any, Awaitable, Callable, Mapping, Sequence

Tool = Callable[..., Any] | Callable[..., Awaitable[Any]]

# The step budget of a task when its data does not set one (RAO paper, TextCraft-Synth).
DEFAULT_MAX_STEPS = 200


@dataclasses.dataclass(frozen=True)
class Task:
  """One root task.

  Attributes:
    task_id: unique id within its data set (e.g. "textcraft.train.0").
    env: name of the environment that owns the task (`Environment.name`).
    goal: the natural-language goal shown to the root agent.
    fields: structured fields the environment's tools and verifiers read (TextCraft:
      `target_items`, `initial_inventory`, `gold_trajectory`; long context: the document and
      the gold answer). Must be JSON-serialisable so tasks round-trip through JSONL files.
    difficulty: a label ("easy", "medium", "hard", "extreme") or None.
    max_steps: the tree's step budget: total REPL turns over all its nodes.
  """
  task_id: str
  env: str
  goal: str
  fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  difficulty: str | None = None
  max_steps: int = DEFAULT_MAX_STEPS

  def __post_init__(self):
    if not isinstance(self.task_id, str) or not self.task_id:
      raise ValueError(f"Task.task_id={self.task_id!r}: must be a non-empty string.")
    if not isinstance(self.goal, str) or not self.goal.strip():
      raise ValueError(f"Task.goal={self.goal!r} (task {self.task_id}): must be a non-empty string.")
    if not isinstance(self.max_steps, int) or self.max_steps < 1:
      raise ValueError(f"Task.max_steps={self.max_steps!r} (task {self.task_id}): must be an int >= 1.")

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self) | {"fields": dict(self.fields)}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Task":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def save_tasks_jsonl(path: str, tasks: Sequence[Task]) -> None:
  """Writes tasks as JSON lines (one `Task.to_dict()` per line)."""
  with open(path, "w") as f:
    for t in tasks:
      f.write(json.dumps(t.to_dict()) + "\n")


def load_tasks_jsonl(path: str) -> list[Task]:
  """Reads tasks written by `save_tasks_jsonl`."""
  with open(path) as f:
    return [Task.from_dict(json.loads(line)) for line in f if line.strip()]


@dataclasses.dataclass(frozen=True)
class NodeInfo:
  """What an environment knows about one node (agent) of a tree.

  Attributes:
    node_id: unique within the tree; the root is "0", children "0.1", "0.1.2", ...
    parent_id: None for the root.
    depth: 0 for the root.
    goal: the node's goal text.
    fields: the node's structured fields (the task's for the root, `ChildSpec.fields` else).
    max_steps: the steps this node may take (granted from the tree budget).
    can_launch: whether this node may launch helpers (recursive mode, above the depth limit);
      the runtime sets it so that nothing an environment shows the node (its tools' messages)
      offers helpers the node cannot have. True for nodes built by hand.
  """
  node_id: str
  parent_id: str | None
  depth: int
  goal: str
  fields: Mapping[str, Any]
  max_steps: int
  can_launch: bool = True


@dataclasses.dataclass(frozen=True)
class ChildSpec:
  """A child agent to launch, as the environment parsed `launch_subagent(...)`.

  Attributes:
    goal: the child's goal text (shown in its prompt).
    fields: structured fields of the child's task (TextCraft: `{"targets": {...}}`); the subtask
      verifier reads them.
    variables: REPL variables to bind in the child's sandbox (long context: `context`).
    num_steps: requested step budget; None lets the runtime choose (the parent's remaining
      steps, capped by the tree budget). The runtime grants at most what the tree has left.
  """
  goal: str
  fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  variables: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  num_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class NodeOutcome:
  """How a node ended; handed to verifiers and to `format_child_result`.

  Attributes:
    node: the node's `NodeInfo`.
    finished: True iff the agent called `finish(...)`.
    final_message: the `finish` message ("" when it did not finish).
    end_reason: "finish" | "max_steps" | "context" | "budget" | "error" | ...
    steps_used: REPL turns this node took (its own, not its children's).
    subtree_steps_used: steps of this node and all its descendants.
  """
  node: NodeInfo
  finished: bool
  final_message: str
  end_reason: str
  steps_used: int
  subtree_steps_used: int


class SubagentArgError(ValueError):
  """`launch_subagent` was called with arguments the environment cannot use.

  The runtime turns it into the string the parent's `await` returns (failures are data).
  """


class Episode:
  """Per-tree state, shared by every node of the tree.

  Environments subclass it to hold their world (an inventory, a corpus, a document). The
  runtime calls `node_started` / `node_finished` around every node so that environments can
  attribute effects to nodes (e.g. what a child crafted) for the subtask verifier.
  """

  def __init__(self, task: Task):
    self.task = task

  def node_started(self, node: NodeInfo) -> None:
    """Called before a node's first turn."""

  def node_finished(self, outcome: NodeOutcome) -> None:
    """Called once a node has ended (before verification)."""

  def summary(self) -> dict[str, Any]:
    """A small JSON-serialisable summary stored in the tree record (e.g. final inventory)."""
    return {}


class Environment(abc.ABC):
  """An environment: tasks, tools, episode state, child mapping and verifiers."""

  name: str = "env"
  # The variables of `node_variables` that hold the node's own task (TextCraft: "targets"). A
  # program that rebinds or mutates one works from its own copy of its task, a drift signal
  # (`rao_jax.metrics.drift_stats`: `drift/task_retyped`); the runtime records the names it
  # bound in `NodeRecord.extras["task_vars"]`.
  task_variables: tuple[str, ...] = ()

  # -- tasks ---------------------------------------------------------------------------------

  @abc.abstractmethod
  def tasks(self, split: str = "train") -> Sequence[Task]:
    """The tasks of a split ("train", "test", or an environment-defined name)."""

  # -- prompt --------------------------------------------------------------------------------

  @abc.abstractmethod
  def tool_docs(self, recursive: bool) -> str:
    """Documentation of the environment's tools for the system prompt.

    Args:
      recursive: True when the agent may call `launch_subagent`; the text then documents the
        environment's `launch_subagent` signature and what it returns. `finish` and the limits
        are described by the runtime, not here.
    """

  def task_prompt(self, node: NodeInfo) -> str:
    """The user message that states the node's task; the default is its goal."""
    return node.goal

  # -- episode and per-node tools ------------------------------------------------------------

  @abc.abstractmethod
  def new_episode(self, task: Task) -> Episode:
    """A fresh world state for one tree of `task`."""

  @abc.abstractmethod
  def node_tools(self, episode: Episode, node: NodeInfo) -> dict[str, Tool]:
    """Host-side tools the node's REPL may call by name (not `finish`/`launch_subagent`)."""

  def node_variables(self, episode: Episode, node: NodeInfo) -> dict[str, Any]:
    """REPL variables to bind in the node's sandbox before its first cell (JSON-able values)."""
    return {}

  # -- recursion -----------------------------------------------------------------------------

  @abc.abstractmethod
  def child_spec(self, episode: Episode, parent: NodeInfo, args: tuple, kwargs: dict) -> ChildSpec:
    """Parses `launch_subagent(*args, **kwargs)` called by `parent`.

    Raises:
      SubagentArgError: bad arguments; its message becomes the call's return value.
    """

  def format_child_result(self, episode: Episode, spec: ChildSpec, outcome: NodeOutcome) -> str:
    """What the parent's `await launch_subagent(...)` returns for a child that has ended.

    It must not hide a failure: a parent that reads a failed helper's reply as done builds on
    nothing (the default says "did NOT finish" and why).
    """
    used = f"[subagent used {outcome.subtree_steps_used} steps]"
    if outcome.finished:
      return f"Subagent finished: {outcome.final_message} {used}"
    return f"Subagent did NOT finish ({outcome.end_reason}). {used}"

  def subtask_scope(self, episode: Episode, parent: NodeInfo, spec: ChildSpec
                    ) -> dict[str, bool] | None:
    """Whether a child's task lies outside its root's and its parent's tasks, at launch.

    Returns `{"outside_root": bool, "outside_parent": bool}` (a drift signal: a helper sent
    after something no ancestor asked for), or None when the environment cannot tell (free-text
    goals). The runtime stores it in the child's `NodeRecord.extras["scope"]`.
    """
    return None

  # -- verification --------------------------------------------------------------------------

  @abc.abstractmethod
  def verify_root(self, episode: Episode, outcome: NodeOutcome) -> float | None:
    """s(root) in [0, 1] from exact verification, or None when the task has no verifier."""

  def verify_subtask(self, episode: Episode, outcome: NodeOutcome) -> float | None:
    """s(child) in [0, 1] from exact verification, or None when the goal cannot be parsed."""
    return None


# -- the judge (second source of RAO_SPEC's success chain) -----------------------------------


@dataclasses.dataclass(frozen=True)
class JudgeRequest:
  """What the judge scores: a node's answer against its goal.

  Attributes:
    env: environment name.
    task: the tree's root task (for context).
    node: the node being judged.
    answer: the node's final message ("" if it did not finish).
    end_reason: how the node ended.
  """
  env: str
  task: Task
  node: NodeInfo
  answer: str
  end_reason: str


@dataclasses.dataclass(frozen=True)
class JudgeVerdict:
  """A judge's answer.

  Attributes:
    score: in [0, 1], or None when the judge could not decide (the chain then falls through
      to the proxy).
    log: JSON-serialisable details stored with the node (prompt, raw response, latency, ...).
  """
  score: float | None
  log: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.score is not None and not 0.0 <= self.score <= 1.0:
      raise ValueError(f"JudgeVerdict.score={self.score!r}: must be in [0, 1] or None.")


class Judge(abc.ABC):
  """A pluggable success signal for nodes that no verifier covers.

  The runtime awaits `judge(request)` after the tree has ended, for every node whose verifier
  returned None; a judge that raises is logged and treated as undecided.
  """

  @abc.abstractmethod
  async def __call__(self, request: JudgeRequest) -> JudgeVerdict:
    ...
