"""The multi-hop search environment (DeepDive style).

Tools (host side): `search(query, k=10) -> list[{id, title, snippet}]` over a BM25 index of the
world's pages and `open(doc_id) -> str`. Root success: the normalised final answer equals the
answer entity's name or one of its aliases. A helper whose goal is "Find <description>. Reply
with only its name." (the grammar of `search_data.Description`) is verified exactly when the
description picks out exactly one entity of the graph; other goals go to the judge or proxy.

Data (graph, corpus, index, questions) lives in `search_data`; this module is the `Environment`.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

import numpy as np

from rao_jax.envs import base
from rao_jax.envs import search_data as data


@dataclasses.dataclass(frozen=True)
class SearchConfig:
  """Task generation of the search environment.

  Attributes:
    num_tasks: tasks per split.
    hops: the walk lengths to draw from (2 to 6 in DeepDive's range).
    world: the knowledge graph's size and seed.
    seed: question seed; splits use disjoint question streams over the same world.
    max_steps: step budget of each tree.
    child_steps: a helper's step budget when `launch_subagent` is not given `num_steps`.
    max_results: the most results one `search` returns.
  """
  num_tasks: int = 50
  hops: tuple[int, ...] = (4,)
  world: data.WorldConfig = data.WorldConfig()
  seed: int = 0
  max_steps: int = base.DEFAULT_MAX_STEPS
  child_steps: int = 12
  max_results: int = 30

  def __post_init__(self):
    if self.num_tasks < 1:
      raise ValueError(f"SearchConfig.num_tasks={self.num_tasks}: must be >= 1.")
    if not self.hops or any(not 1 <= h <= len(data.HOP_NAMES) - 1 for h in self.hops):
      raise ValueError(f"SearchConfig.hops={self.hops!r}: use values in [1, "
                       f"{len(data.HOP_NAMES) - 1}] (DeepDive: 2 to 6).")
    for f in ("max_steps", "child_steps", "max_results"):
      if getattr(self, f) < 1:
        raise ValueError(f"SearchConfig.{f}={getattr(self, f)}: must be >= 1.")


_SPLIT_OFFSETS = {"train": 0, "test": 1_000_003, "val": 2_000_003}


def make_tasks(cfg: SearchConfig, split: str = "train") -> list[base.Task]:
  """`cfg.num_tasks` seeded questions over the world of `cfg.world`."""
  if split not in _SPLIT_OFFSETS:
    raise ValueError(f"make_tasks(split={split!r}): expected one of {sorted(_SPLIT_OFFSETS)}.")
  world = data.get_world(cfg.world)
  tasks = []
  for i in range(cfg.num_tasks):
    rng = np.random.default_rng([cfg.seed, _SPLIT_OFFSETS[split], i])
    hops = cfg.hops[int(rng.integers(len(cfg.hops)))]
    q = None
    while q is None:
      q = data.make_question(world, hops, rng)
    fields = {"world": dataclasses.asdict(cfg.world), "hops": hops, "path": list(q.path),
              "answer": q.answer, "aliases": list(q.aliases), "answer_id": q.path[-1],
              "anchor": q.anchor.text(), "steps": [s.text() for s in q.steps]}
    tasks.append(base.Task(task_id=f"search.{split}.{i}", env=SearchEnv.name, goal=q.text,
                           fields=fields, difficulty=f"{hops}-hop", max_steps=cfg.max_steps))
  return tasks


_TOOL_DOCS = """\
- search(query: str, k: int = 10) -> list[dict]
    BM25 search over the document collection; returns up to k results (k <= {max_results}), \
best first, as {{"id", "title", "snippet"}} (the snippet is the page's first sentence).
- open(doc_id: str) -> str
    The full text of a page. Pages name related entities but do not link their ids: \
search for a name to find its page.
"""

_LAUNCH_DOCS = """\
- await launch_subagent(goal: str, num_steps: int = {child_steps}) -> str
    Starts a helper with the same tools and a budget of `num_steps` turns, and returns its \
final message. Goals of the form "Find <description>. Reply with only its name." (e.g. "Find \
the city where Ana Lopez was born. Reply with only its name.") are checked exactly.
"""


class SearchEpisode(base.Episode):
  """Per-tree state: the (shared, read-only) world and tool-use counters."""

  def __init__(self, task: base.Task, max_results: int):
    super().__init__(task)
    self.world = data.get_world(data.WorldConfig(**task.fields["world"]))
    self.max_results = max_results
    self._lock = threading.Lock()
    self.searches = 0
    self.opens = 0

  def search(self, query: Any, k: Any = 10) -> Any:
    if not isinstance(query, str) or not query.strip():
      return "Error: search(query) needs a non-empty str query."
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
      return f"Error: search(query, k): k must be an int >= 1, got {k!r}."
    with self._lock:
      self.searches += 1
    return self.world.search(query, min(k, self.max_results))

  def open(self, doc_id: Any) -> str:
    if not isinstance(doc_id, str):
      return f"Error: open(doc_id) needs a str id from search(), got {type(doc_id).__name__}."
    with self._lock:
      self.opens += 1
    return self.world.open(doc_id)

  def summary(self) -> dict[str, Any]:
    return {"searches": self.searches, "opens": self.opens}


class SearchEnv(base.Environment):
  """DeepDive-style multi-hop search (see the module docstring)."""

  name = "search"

  def __init__(self, cfg: SearchConfig | None = None, **options: Any):
    """Args: `cfg`, or `SearchConfig` fields as keywords (`hops` may be one int; `world` a dict)."""
    if cfg is not None and options:
      raise ValueError(f"SearchEnv: pass `cfg` or keyword options, not both ({options}).")
    if "hops" in options:
      h = options["hops"]
      options["hops"] = (int(h),) if isinstance(h, (int, str)) else tuple(int(x) for x in h)
    if isinstance(options.get("world"), dict):
      options["world"] = data.WorldConfig(**options["world"])
    names = {f.name for f in dataclasses.fields(SearchConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
      raise ValueError(f"SearchEnv: unknown options {unknown}; known: {sorted(names)}.")
    self.cfg = cfg if cfg is not None else SearchConfig(**options)
    self._tasks: dict[str, list[base.Task]] = {}

  def tasks(self, split: str = "train") -> Sequence[base.Task]:
    """Tasks of "train" / "test" / "val"; "split/<difficulty>" (e.g. "test/4-hop") filters."""
    if split not in self._tasks:
      name, _, difficulty = split.partition("/")
      tasks = make_tasks(self.cfg, name)
      self._tasks[split] = [t for t in tasks if not difficulty or t.difficulty == difficulty]
    return self._tasks[split]

  def tool_docs(self, recursive: bool) -> str:
    docs = _TOOL_DOCS.format(max_results=self.cfg.max_results)
    return docs + (_LAUNCH_DOCS.format(child_steps=self.cfg.child_steps) if recursive else "")

  def new_episode(self, task: base.Task) -> SearchEpisode:
    return SearchEpisode(task, self.cfg.max_results)

  def node_tools(self, episode: base.Episode, node: base.NodeInfo) -> dict[str, base.Tool]:
    assert isinstance(episode, SearchEpisode)
    return {"search": episode.search, "open": episode.open}

  def child_spec(self, episode: base.Episode, parent: base.NodeInfo, args: tuple,
                 kwargs: dict) -> base.ChildSpec:
    kwargs = dict(kwargs)
    if len(args) > 2:
      raise base.SubagentArgError(f"launch_subagent takes (goal, num_steps=None); got "
                                  f"{len(args)} positional arguments.")
    goal = args[0] if args else kwargs.pop("goal", None)
    num_steps = args[1] if len(args) > 1 else kwargs.pop("num_steps", None)
    unknown = sorted(set(kwargs) - {"goal", "num_steps"})
    if unknown:
      raise base.SubagentArgError(f"launch_subagent: unknown arguments {unknown}; it takes "
                                  "(goal: str, num_steps: int | None = None).")
    if not isinstance(goal, str) or not goal.strip():
      raise base.SubagentArgError("launch_subagent: `goal` must be a non-empty str.")
    if num_steps is None:
      num_steps = self.cfg.child_steps
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
      raise base.SubagentArgError(
          f"launch_subagent: `num_steps` must be an int >= 1, got {num_steps!r}.")
    desc = data.parse_step_goal(goal)
    return base.ChildSpec(goal=goal, fields={"description": None if desc is None else desc.text()},
                          num_steps=num_steps)

  def format_child_result(self, episode, spec, outcome) -> str:
    if outcome.finished:
      return outcome.final_message
    return f"Subagent did not finish (ended by {outcome.end_reason})."

  def verify_root(self, episode: base.Episode, outcome: base.NodeOutcome) -> float | None:
    assert isinstance(episode, SearchEpisode)
    if not outcome.finished:
      return 0.0
    answer = episode.world.entities[episode.task.fields["answer_id"]]
    return float(data.answer_matches(outcome.final_message, answer))

  def verify_subtask(self, episode: base.Episode, outcome: base.NodeOutcome) -> float | None:
    assert isinstance(episode, SearchEpisode)
    desc = data.parse_step_goal(outcome.node.goal)
    if desc is None:
      return None
    found = episode.world.find(desc)
    if len(found) != 1:
      return None   # the description does not pick out one entity: not exactly checkable
    if not outcome.finished:
      return 0.0
    return float(data.answer_matches(outcome.final_message, found[0]))
