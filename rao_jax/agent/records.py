"""Tree records: the ONE schema handed from rollouts to the learner, the HTML view and SFT.

A `TreeRecord` holds the nodes of one execution tree, root first. Each `NodeRecord` carries the
node's exact token sequence as the model saw it (prompt, generated turns, observations): the
learner trains on `token_ids` masked by `gen_mask` with the rollout `logprobs`, so what was
sampled and what is trained on are the same tokens by construction.

Saved as JSON lines: one tree per line (`save_trees_jsonl` / `load_trees_jsonl`).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Mapping

# Values of NodeRecord.end_reason.
END_FINISH = "finish"          # the agent called finish(...)
END_MAX_STEPS = "max_steps"    # the node used all the steps it was granted
END_CONTEXT = "context"        # the node's context window (tokens) is full
END_BUDGET = "budget"          # the tree's step budget ran out
END_ERROR = "error"            # a fatal error (sandbox crash, aborted rollout, ...)
END_TIMEOUT = "timeout"        # the node's wall-clock limit passed
END_REASONS = (END_FINISH, END_MAX_STEPS, END_CONTEXT, END_BUDGET, END_ERROR, END_TIMEOUT)

# Keys of NodeRecord.extras that say a node ended through no fault of the policy (the trainer
# re-runs such trees and never scores them as the agent's failure).
INFRA_ERROR = "infra_error"      # any infrastructure failure: engine, sandbox (the message)
ENGINE_ERROR = "engine_error"    # the engine's device step failed (FinishReason.ERROR)
ENGINE_FAILED = "engine_failed"  # the engine stopped serving for good (EngineFailedError)

# Values of NodeRecord.success_source (RAO_SPEC success chain, in order).
SOURCE_VERIFIER = "verifier"
SOURCE_JUDGE = "judge"
SOURCE_PROXY = "proxy"
SUCCESS_SOURCES = (SOURCE_VERIFIER, SOURCE_JUDGE, SOURCE_PROXY)


@dataclasses.dataclass
class NodeRecord:
  """One agent (node) of an execution tree.

  Attributes:
    node_id: unique in the tree; root "0", children "0.1", "0.2", grandchildren "0.1.1", ...
    parent_id: None for the root.
    depth: 0 for the root.
    children: node ids of the immediate children, in launch order.
    goal: the node's goal text.
    task_fields: the node's structured task fields (root: the task's fields; child: what the
      environment parsed from `launch_subagent`).
    token_ids: the exact token sequence: prompt, then per turn the generated tokens followed by
      the observation tokens.
    gen_mask: 1 where the policy generated the token, 0 for prompt / observation tokens.
    logprobs: rollout logprob of each generated token, 0.0 elsewhere.
    turn_starts: index in `token_ids` where each generated turn begins.
    final_message: the `finish(...)` message, "" when the node did not finish.
    end_reason: one of END_REASONS.
    success: s(v) in [0, 1], or None before scoring.
    success_source: "verifier" | "judge" | "proxy" (None before scoring).
    weight_version: engine weight version of the node's generations (the first turn's; a
      differing later version is listed in `extras["weight_versions"]`).
    timings: seconds: "start", "end" (relative to the tree start), "generate", "execute".
    num_generated_tokens: sum(gen_mask).
    num_steps: REPL turns this node took.
    extras: free-form JSON data: code of each turn, observations text, judge log, errors
      (infrastructure failures under INFRA_ERROR, ENGINE_ERROR, ENGINE_FAILED).
  """
  node_id: str
  parent_id: str | None
  depth: int
  goal: str
  task_fields: dict[str, Any] = dataclasses.field(default_factory=dict)
  children: list[str] = dataclasses.field(default_factory=list)
  token_ids: list[int] = dataclasses.field(default_factory=list)
  gen_mask: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  turn_starts: list[int] = dataclasses.field(default_factory=list)
  final_message: str = ""
  end_reason: str = ""
  success: float | None = None
  success_source: str | None = None
  weight_version: int | str | None = None
  timings: dict[str, float] = dataclasses.field(default_factory=dict)
  num_generated_tokens: int = 0
  num_steps: int = 0
  extras: dict[str, Any] = dataclasses.field(default_factory=dict)

  def validate(self) -> None:
    """Raises ValueError when the token arrays disagree (a learner would train on garbage)."""
    n = len(self.token_ids)
    if len(self.gen_mask) != n or len(self.logprobs) != n:
      raise ValueError(
          f"NodeRecord {self.node_id}: token_ids ({n}), gen_mask ({len(self.gen_mask)}) and "
          f"logprobs ({len(self.logprobs)}) must have equal lengths.")
    if sum(self.gen_mask) != self.num_generated_tokens:
      raise ValueError(
          f"NodeRecord {self.node_id}: num_generated_tokens={self.num_generated_tokens} but "
          f"gen_mask has {sum(self.gen_mask)} ones.")
    if any(not 0 <= s < max(n, 1) for s in self.turn_starts):
      raise ValueError(f"NodeRecord {self.node_id}: turn_starts {self.turn_starts} out of range.")
    if self.success is not None and not 0.0 <= self.success <= 1.0:
      raise ValueError(f"NodeRecord {self.node_id}: success={self.success!r} not in [0, 1].")
    if self.success_source is not None and self.success_source not in SUCCESS_SOURCES:
      raise ValueError(
          f"NodeRecord {self.node_id}: success_source={self.success_source!r}, expected one of "
          f"{SUCCESS_SOURCES}.")

  def to_dict(self) -> dict[str, Any]:
    # Field by field: dataclasses.asdict deep-copies every token id, which is slow for
    # thousands of tokens per node. Lists are copied shallowly (their items are immutable).
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    for k, v in d.items():
      if isinstance(v, list):
        d[k] = list(v)
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "NodeRecord":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass
class TreeRecord:
  """One execution tree.

  Attributes:
    tree_id: unique id of the tree.
    group_id: shared by the K trees sampled for one root task (the LOO baseline's group).
    task_id: the root task's id.
    env: the environment's name.
    nodes: every node, root first, then in creation order.
    meta: free-form JSON data: mode ("recursive" | "single"), limits, wall-clock seconds,
      difficulty, episode summary (e.g. final inventory), errors.
  """
  tree_id: str
  group_id: str
  task_id: str
  env: str
  nodes: list[NodeRecord] = dataclasses.field(default_factory=list)
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def root(self) -> NodeRecord:
    return self.nodes[0]

  def node(self, node_id: str) -> NodeRecord:
    for n in self.nodes:
      if n.node_id == node_id:
        return n
    raise KeyError(f"TreeRecord {self.tree_id}: no node {node_id!r}.")

  def validate(self) -> None:
    """Checks every node and the parent/children links."""
    if not self.nodes or self.nodes[0].parent_id is not None or self.nodes[0].depth != 0:
      raise ValueError(f"TreeRecord {self.tree_id}: the first node must be the root (depth 0).")
    ids = {n.node_id: n for n in self.nodes}
    if len(ids) != len(self.nodes):
      raise ValueError(f"TreeRecord {self.tree_id}: duplicate node ids.")
    for n in self.nodes:
      n.validate()
      for c in n.children:
        if c not in ids or ids[c].parent_id != n.node_id or ids[c].depth != n.depth + 1:
          raise ValueError(f"TreeRecord {self.tree_id}: bad child link {n.node_id} -> {c}.")

  def to_dict(self) -> dict[str, Any]:
    return {"tree_id": self.tree_id, "group_id": self.group_id, "task_id": self.task_id,
            "env": self.env, "nodes": [n.to_dict() for n in self.nodes], "meta": self.meta}

  def to_json(self) -> str:
    """One JSON line (no newline)."""
    return json.dumps(self.to_dict(), separators=(",", ":"))

  @classmethod
  def from_json(cls, data: str | Mapping[str, Any]) -> "TreeRecord":
    """Parses `to_json()` output (a string) or its dict."""
    d = json.loads(data) if isinstance(data, (str, bytes)) else data
    return cls(tree_id=d["tree_id"], group_id=d["group_id"], task_id=d["task_id"], env=d["env"],
               nodes=[NodeRecord.from_dict(n) for n in d["nodes"]], meta=dict(d.get("meta", {})))


def save_trees_jsonl(path: str, trees: Iterable[TreeRecord], append: bool = False) -> None:
  """Writes trees as JSON lines, one tree per line."""
  with open(path, "a" if append else "w") as f:
    for t in trees:
      f.write(t.to_json() + "\n")


def load_trees_jsonl(path: str) -> list[TreeRecord]:
  """Reads trees written by `save_trees_jsonl`."""
  with open(path) as f:
    return [TreeRecord.from_json(line) for line in f if line.strip()]
