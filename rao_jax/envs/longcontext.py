"""The long-context aggregation environment (OOLONG style).

The root agent's REPL has the document bound to `context` (a str of up to ~1 MB); it never
enters a prompt whole: agents print slices to read them, and hand slices to helpers with
`await launch_subagent(goal, context=slice)`. Root success is OOLONG's score of the final answer
(`longcontext_data.oolong_score`). A helper whose goal is one of the structured sub-questions
(`longcontext_data.SubQuestion`) over a slice made of whole document records is verified
exactly: its JSON counts must equal the true counts of that slice. Any other helper goal is left
to the judge or the proxy (the verifier returns None).

Data, questions and scoring live in `longcontext_data`; this module is the `Environment`.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

import numpy as np

from rao_jax.envs import base
from rao_jax.envs import longcontext_data as data


@dataclasses.dataclass(frozen=True)
class LongContextConfig:
  """Task generation of the long-context environment.

  Attributes:
    num_tasks: tasks per split.
    target_tokens: document length in SmolLM2 tokens (4_000 to >= 256_000).
    questions_per_doc: tasks that share one document (different questions about it).
    kinds: question kinds to draw from (`longcontext_data.QUESTION_KINDS`).
    num_users: distinct users per document.
    num_months: months a document spans.
    seed: base seed; splits use disjoint document seeds.
    max_steps: step budget of each tree.
    child_steps: a helper's step budget when `launch_subagent` is not given `num_steps` (so
      that concurrent helpers share the tree budget instead of the first taking it all).
  """
  num_tasks: int = 50
  target_tokens: int = 175_000
  questions_per_doc: int = 5
  kinds: tuple[str, ...] = data.QUESTION_KINDS
  num_users: int = 40
  num_months: int = 12
  seed: int = 0
  max_steps: int = base.DEFAULT_MAX_STEPS
  child_steps: int = 20

  def __post_init__(self):
    if self.num_tasks < 1:
      raise ValueError(f"LongContextConfig.num_tasks={self.num_tasks}: must be >= 1.")
    if self.questions_per_doc < 1:
      raise ValueError(
          f"LongContextConfig.questions_per_doc={self.questions_per_doc}: must be >= 1.")
    bad = [k for k in self.kinds if k not in data.QUESTION_KINDS]
    if bad or not self.kinds:
      raise ValueError(f"LongContextConfig.kinds={self.kinds!r}: use a non-empty subset of "
                       f"{data.QUESTION_KINDS}.")
    if self.max_steps < 1:
      raise ValueError(f"LongContextConfig.max_steps={self.max_steps}: must be >= 1.")
    if self.child_steps < 1:
      raise ValueError(f"LongContextConfig.child_steps={self.child_steps}: must be >= 1.")
    # Validates target_tokens, num_users and num_months with their own messages.
    self.doc_config(0)

  def doc_config(self, doc_seed: int) -> data.DocConfig:
    return data.DocConfig(seed=doc_seed, target_tokens=self.target_tokens,
                          num_users=self.num_users, num_months=self.num_months)


_SPLIT_OFFSETS = {"train": 0, "test": 1_000_003, "val": 2_000_003}


def make_tasks(cfg: LongContextConfig, split: str = "train") -> list[base.Task]:
  """`cfg.num_tasks` seeded tasks; documents are regenerated from `fields["doc"]` on demand."""
  if split not in _SPLIT_OFFSETS:
    raise ValueError(f"make_tasks(split={split!r}): expected one of {sorted(_SPLIT_OFFSETS)}.")
  tasks = []
  for i in range(cfg.num_tasks):
    doc_seed = cfg.seed * 10_007 + _SPLIT_OFFSETS[split] + i // cfg.questions_per_doc
    doc_cfg = cfg.doc_config(doc_seed)
    doc = data.generate_document(doc_cfg)
    rng = np.random.default_rng([cfg.seed, _SPLIT_OFFSETS[split], i])
    q = None
    while q is None:
      q = data.make_question(doc, cfg.kinds[int(rng.integers(len(cfg.kinds)))], rng)
    fields = {"doc": dataclasses.asdict(doc_cfg), "question": q.to_dict(),
              "doc_chars": len(doc.text), "doc_tokens_estimate": doc.approx_tokens}
    tasks.append(base.Task(task_id=f"longcontext.{split}.{i}", env=LongContextEnv.name,
                           goal=data.goal_text(q, doc.approx_tokens), fields=fields,
                           difficulty=f"{cfg.target_tokens // 1000}k", max_steps=cfg.max_steps))
  return tasks


_TOOL_DOCS = """\
Your REPL variable `context` (a str) holds your input text. It may be far longer than your \
context window: never print it whole. Read it in slices, e.g. `print(context[i:j])`; long \
outputs are cut.
"""

_LAUNCH_DOCS = """\
- await launch_subagent(goal: str, context: str = "", num_steps: int = 20) -> str
    Starts a helper whose REPL variable `context` is the string you pass (e.g. a slice of \
yours, cut at line ends) with a budget of `num_steps` turns, and returns its final message. \
Helpers answer structured sub-questions exactly: "Count the records in `context` [with label 'L'] [by user U] [dated in \
month YYYY-MM] grouped by label|user|month. Reply with only a JSON object mapping each \
label|user|month to its count." (bracketed filters are optional).
"""


class LongContextEpisode(base.Episode):
  """Per-tree state: the task's document (shared, read-only) and the question."""

  def __init__(self, task: base.Task):
    super().__init__(task)
    self.doc = data.generate_document(data.DocConfig(**task.fields["doc"]))
    self.question = data.Question.from_dict(task.fields["question"])
    self._lock = threading.Lock()
    self.subquestions = 0

  def slice_gold(self, subq: data.SubQuestion, text: str) -> tuple[dict[str, int] | None, int]:
    """Exact answer of `subq` over `text`, or (None, n) when `text` is not whole document records.

    Returns:
      (gold counts or None, number of records in the slice).
    """
    parsed, labels = [], []
    label_by_line = self.doc.label_by_line
    for line in text.split("\n"):
      if not line.strip():
        continue
      rec = data.parse_record_line(line)
      label = label_by_line.get(line.strip())
      if rec is None or label is None:
        return None, len(parsed)
      parsed.append(rec)
      labels.append(label)
    return subq.answer(parsed, labels), len(parsed)

  def summary(self) -> dict[str, Any]:
    return {"doc_chars": len(self.doc.text), "records": len(self.doc.records),
            "subquestions": self.subquestions}


class LongContextEnv(base.Environment):
  """OOLONG-style long-context aggregation (see the module docstring)."""

  name = "longcontext"

  def __init__(self, cfg: LongContextConfig | None = None, **options: Any):
    """Args: `cfg`, or `LongContextConfig` fields as keywords (`doc_tokens` = `target_tokens`)."""
    if cfg is not None and options:
      raise ValueError(f"LongContextEnv: pass `cfg` or keyword options, not both ({options}).")
    if "doc_tokens" in options:
      options["target_tokens"] = int(options.pop("doc_tokens"))
    if "kinds" in options:
      options["kinds"] = tuple(options["kinds"])
    names = {f.name for f in dataclasses.fields(LongContextConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
      raise ValueError(f"LongContextEnv: unknown options {unknown}; known: doc_tokens, "
                       f"{sorted(names)}.")
    self.cfg = cfg if cfg is not None else LongContextConfig(**options)
    self._tasks: dict[str, list[base.Task]] = {}

  def tasks(self, split: str = "train") -> Sequence[base.Task]:
    """Tasks of "train" / "test" / "val"; "split/<difficulty>" keeps that difficulty's only."""
    if split not in self._tasks:
      name, _, difficulty = split.partition("/")
      tasks = make_tasks(self.cfg, name)
      self._tasks[split] = [t for t in tasks if not difficulty or t.difficulty == difficulty]
    return self._tasks[split]

  def tool_docs(self, recursive: bool) -> str:
    return _TOOL_DOCS + (_LAUNCH_DOCS if recursive else "")

  def new_episode(self, task: base.Task) -> LongContextEpisode:
    return LongContextEpisode(task)

  def node_tools(self, episode: base.Episode, node: base.NodeInfo) -> dict[str, base.Tool]:
    # The data is the REPL variable; reading it needs no tool.
    return {}

  def node_variables(self, episode: base.Episode, node: base.NodeInfo) -> dict[str, Any]:
    # Children get their `context` from `launch_subagent` (ChildSpec.variables).
    assert isinstance(episode, LongContextEpisode)
    return {"context": episode.doc.text} if node.parent_id is None else {}

  def child_spec(self, episode: base.Episode, parent: base.NodeInfo, args: tuple,
                 kwargs: dict) -> base.ChildSpec:
    assert isinstance(episode, LongContextEpisode)
    kwargs = dict(kwargs)
    if len(args) > 3:
      raise base.SubagentArgError(f"launch_subagent takes (goal, context='', num_steps=None); "
                                  f"got {len(args)} positional arguments.")
    goal = args[0] if args else kwargs.pop("goal", None)
    context = args[1] if len(args) > 1 else kwargs.pop("context", "")
    num_steps = args[2] if len(args) > 2 else kwargs.pop("num_steps", None)
    unknown = sorted(set(kwargs) - {"goal", "context", "num_steps"})
    if unknown:
      raise base.SubagentArgError(f"launch_subagent: unknown arguments {unknown}; it takes "
                                  "(goal: str, context: str = '', num_steps: int | None = None).")
    if num_steps is None:
      num_steps = self.cfg.child_steps
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
      raise base.SubagentArgError(
          f"launch_subagent: `num_steps` must be an int >= 1, got {num_steps!r}.")
    if not isinstance(goal, str) or not goal.strip():
      raise base.SubagentArgError("launch_subagent: `goal` must be a non-empty str.")
    if not isinstance(context, str):
      raise base.SubagentArgError(
          f"launch_subagent: `context` must be a str, got {type(context).__name__}.")
    fields: dict[str, Any] = {"context_chars": len(context), "subquestion": None,
                              "gold_counts": None}
    subq = data.parse_subquestion(goal)
    if subq is not None:
      gold, n = episode.slice_gold(subq, context)
      fields.update(subquestion=subq.to_dict(), gold_counts=gold, slice_records=n)
      with episode._lock:
        episode.subquestions += 1
    return base.ChildSpec(goal=goal, fields=fields, variables={"context": context},
                          num_steps=num_steps)

  def format_child_result(self, episode, spec, outcome) -> str:
    # The parent parses helpers' answers (JSON counts): no step note appended to them.
    if outcome.finished:
      return outcome.final_message
    return f"Subagent did not finish (ended by {outcome.end_reason})."

  def verify_root(self, episode: base.Episode, outcome: base.NodeOutcome) -> float | None:
    assert isinstance(episode, LongContextEpisode)
    if not outcome.finished:
      return 0.0
    q = episode.question
    return data.oolong_score(q.gold, q.answer_type, outcome.final_message)

  def verify_subtask(self, episode: base.Episode, outcome: base.NodeOutcome) -> float | None:
    gold = outcome.node.fields.get("gold_counts")
    if gold is None:
      return None   # a free-form goal, or a slice that is not whole records: judge or proxy
    if not outcome.finished:
      return 0.0
    return float(data.parse_count_json(outcome.final_message) == dict(gold))
