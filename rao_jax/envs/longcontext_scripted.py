"""Scripted policies for the long-context environment, as rollout `Engine`s.

Like the scripted TextCraft policy (`rao_jax.agent.policies`), a scripted policy stands in for the
MODEL only: it decodes the node's prompt tokens, reads its goal, its limits and what earlier
observations showed, and emits the next turn (a short thought and one code block). Everything
it knows about the document it read from observations in its own prompt, so its context window
binds it exactly as it binds a model.

Recursive policy:
  * root: one cell cuts `context` at line ends into chunks that fit a helper's window, asks one
    helper per chunk the structured sub-question that the question needs (all concurrently with
    `asyncio.gather`), sums their JSON counts and prints them; next turn it answers.
  * helper: prints its `context` slice by slice (each turn a line-aligned slice under the
    observation limit), classifies every record it has read by its text, and finishes with the
    JSON counts.
Single agent (no `launch_subagent`): reads the document from the start like a helper until its
context window cannot hold another slice, then answers from what it read, extrapolating counts
by the fraction read (its honest best guess).

The label of an instance is inferred from its wording with a hand-written cue list
(`classify_instance`): the stand-in for a model's reading comprehension.

Prompts are parsed as ChatML (`<|im_start|>role ... <|im_end|>`), the format of SmolLM2 and of the
runtime's byte tokenizer.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from rao_jax.envs import longcontext_data as data
from rao_jax.rollout.scripted import ScriptedTurnEngine  # noqa: F401  (re-exported)

_MSG = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)(?=<\|im_end\|>|<\|im_start\|>|$)",
                  re.S)
_WINDOW = re.compile(r"your context window is (\d+) tokens")
_READ = re.compile(r"^READ (\d+) OF (\d+)$", re.M)
_TOTALS = re.compile(r"^TOTALS (\{.*\}) HELPERS (\d+) FAILED (\d+)$", re.M)


def chat_messages(prompt_text: str) -> list[tuple[str, str]]:
  """(role, content) of each ChatML message in a decoded prompt."""
  return [(m.group(1), m.group(2)) for m in _MSG.finditer(prompt_text)]


def can_launch(system: str) -> bool:
  return "await launch_subagent(" in system and "you cannot launch helpers" not in system


def context_window(system: str, default: int = 8192) -> int:
  m = _WINDOW.search(system)
  return int(m.group(1)) if m else default


# The policy's reading comprehension: the opening words that reveal what answer a question seeks.
_CUES = (
    ("abbreviation", r"What does \S+ stand for|What is the full form of|What is \S+ short for"
                     r"|Expand the acronym"),
    ("entity", r"What kind of|Which instrument|What breed of|Name the ship|What type of tree"),
    ("description", r"Why do|How does a|What is the meaning of|Explain the rules"
                    r"|What is the difference between"),
    ("human", r"Who |Which person"),
    ("location", r"Where |In which country|What city hosts|Which river"),
    ("numeric", r"How many|When was|What year|How much|How far"),
)
_CUE_RES = tuple((label, re.compile(rf"^(?:{rx})")) for label, rx in _CUES)


def classify_instance(text: str) -> str | None:
  """The label a reader infers from an instance's wording (None: no idea)."""
  for label, rx in _CUE_RES:
    if rx.match(text):
      return label
  return None


@dataclasses.dataclass(frozen=True)
class LongContextPolicyConfig:
  """Behaviour of the scripted long-context policy.

  Attributes:
    read_chars: characters printed per reading turn; keep it below the runner's
      `observation_max_chars` (longer observations are cut, and a cut slice is misread).
    chars_per_token: the policy's estimate for sizing chunks (SmolLM2 on these logs: 2.5).
    chunk_fill: fraction of a helper's context window its chunk may take.
    token_latency_s: simulated seconds per generated token (0: none).
    weight_version: reported with every generation.
  """
  read_chars: int = 3800
  chars_per_token: float = data.CHARS_PER_TOKEN
  chunk_fill: float = 0.6
  token_latency_s: float = 0.0
  weight_version: int | str = "scripted-longcontext"

  def __post_init__(self):
    if self.read_chars < 200:
      raise ValueError(f"LongContextPolicyConfig.read_chars={self.read_chars}: must be >= 200.")
    if not 0 < self.chunk_fill < 1:
      raise ValueError(f"LongContextPolicyConfig.chunk_fill={self.chunk_fill}: must be in (0, 1).")
    if self.chars_per_token <= 0:
      raise ValueError(
          f"LongContextPolicyConfig.chars_per_token={self.chars_per_token}: must be > 0.")


def _code(thought: str, code: str) -> str:
  return f"{thought}\n```python\n{code.strip()}\n```"


def _finish(thought: str, answer: str) -> str:
  return _code(thought, f"finish({answer!r})")


def _read_cell(read_chars: int) -> str:
  return f"""
try:
    _pos
except NameError:
    _pos = 0
_end = context.rfind("\\n", _pos, _pos + {read_chars}) + 1
if _end <= _pos:
    _end = min(len(context), _pos + {read_chars})
print(context[_pos:_end], end="")
_pos = _end
print(f"\\nREAD {{_pos}} OF {{len(context)}}")
"""


def _records_read(messages: list[tuple[str, str]]) -> tuple[list[tuple[Any, str, str]], int, int]:
  """Records seen in observations, and the last (position, length) the reading cell printed."""
  recs = []
  pos, total = 0, -1
  for role, content in messages[2:]:
    if role != "user":
      continue
    for line in content.split("\n"):
      r = data.parse_record_line(line)
      if r is not None:
        recs.append(r)
    for m in _READ.finditer(content):
      pos, total = int(m.group(1)), int(m.group(2))
  return recs, pos, total


def longcontext_turn(prompt_text: str, prompt_tokens: int,
                     cfg: LongContextPolicyConfig = LongContextPolicyConfig()) -> str:
  """The next turn of the scripted long-context policy, from its decoded prompt."""
  msgs = chat_messages(prompt_text)
  if len(msgs) < 2:
    return _finish("I cannot read my task.", "Could not parse the prompt.")
  system, goal = msgs[0][1], msgs[1][1]
  subq = data.parse_subquestion(goal)
  question = data.parse_question(goal) if subq is None else None
  if subq is None and question is None:
    return _finish("I do not understand this goal.", "I cannot answer this goal.")
  if subq is None and can_launch(system):
    return _root_turn(msgs, system, prompt_tokens, question, cfg)
  return _reader_turn(msgs, system, prompt_tokens, subq, question, cfg)


def _root_turn(msgs, system: str, prompt_tokens: int, question,
               cfg: LongContextPolicyConfig) -> str:
  kind, params = question
  last = msgs[-2][1] if len(msgs) >= 3 and msgs[-2][0] == "user" else ""
  m = _TOTALS.search(last)
  if m is not None:
    counts = json.loads(m.group(1))
    answer = data.answer_from_counts(kind, params, counts)
    return _finish(f"My helpers counted {m.group(2)} chunks ({m.group(3)} failed); the answer "
                   "follows from the totals.", answer)
  if len(msgs) > 3:
    return _finish("Delegation did not give me totals; I give up.", "unknown")
  subq = data.subquestion_for_kind(kind, params)
  # A helper's fixed cost (system prompt, goal, reading code) is about twice this prompt; the
  # chunk takes a fraction of what is left of its window.
  free = max(context_window(system) - 2 * prompt_tokens, context_window(system) // 4)
  chunk_chars = int(free * cfg.chunk_fill * cfg.chars_per_token)
  # A helper reads its chunk slice by slice, then answers; two turns spare.
  steps = -(-chunk_chars // cfg.read_chars) + 3
  code = f"""
import json, re
_lines = context.splitlines(keepends=True)
chunks, cur, size = [], [], 0
for ln in _lines:
    if cur and size + len(ln) > {chunk_chars}:
        chunks.append("".join(cur))
        cur, size = [], 0
    cur.append(ln)
    size += len(ln)
if cur:
    chunks.append("".join(cur))
subq = {subq.text()!r}
answers = await asyncio.gather(
    *[launch_subagent(subq, context=c, num_steps={steps}) for c in chunks])
totals, failed = {{}}, 0
for a in answers:
    m = re.search(r"\\{{.*\\}}", a, re.S)
    try:
        part = json.loads(m.group(0)) if m else None
    except ValueError:
        part = None
    if not isinstance(part, dict):
        failed += 1
        continue
    for k, v in part.items():
        totals[k] = totals.get(k, 0) + int(v)
print("TOTALS", json.dumps(totals, sort_keys=True), "HELPERS", len(chunks), "FAILED", failed)
"""
  return _code("The document is too long for my window: I split it into chunks at line ends, "
               "give each chunk to a helper with a counting sub-question, and add up their counts.",
               code)


_MONTH_NAMES = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def _seek_cell(month: str) -> str:
  year, mon = month.split("-")
  return f"""
import re
_m = re.search(r"^Date: {_MONTH_NAMES[int(mon) - 1]} \\d\\d, {year} ", context, re.M)
_pos = _m.start() if _m else len(context)
print("SEEK", _pos)
"""


def _reader_turn(msgs, system: str, prompt_tokens: int, subq, question,
                 cfg: LongContextPolicyConfig) -> str:
  recs, pos, total = _records_read(msgs)
  window = context_window(system)
  # Tokens the next reading turn would add: the slice, the code and the chat wrappers.
  next_cost = int(cfg.read_chars / cfg.chars_per_token * 1.3) + 200
  done = total >= 0 and pos >= total
  month = question[1]["month"] if subq is None and question[0] == "month_count" else None
  if month is not None:
    # The log is chronological: a single agent asked about one month jumps to it and reads
    # until the month is over (its best strategy when the whole log does not fit).
    if not any("SEEK" in c for r, c in msgs[2:] if r == "user"):
      return _code(f"The log is sorted by date: I jump to {month}.", _seek_cell(month))
    done = done or any(f"{d.year:04d}-{d.month:02d}" > month for d, _, _ in recs)
  room = prompt_tokens + next_cost <= window
  if not done and room:
    return _code("I read the next slice of `context`.", _read_cell(cfg.read_chars))
  if subq is not None:
    labels = [classify_instance(text) or "unknown" for _, _, text in recs]
    counts = subq.answer(recs, labels)
    note = "" if done else " (my window is full: partial)"
    return _finish(f"I have read and classified {len(recs)} records{note}.",
                   json.dumps(counts, sort_keys=True))
  # Single agent: answer the root question from what fitted in the window.
  kind, params = question
  qsubq = data.subquestion_for_kind(kind, params)
  labels = [classify_instance(text) or "unknown" for _, _, text in recs]
  counts = qsubq.answer(recs, labels)
  frac = pos / total if total > 0 else 0.0
  if month is not None:
    note = f"all of {month}" if done else f"part of {month} before my context window filled up"
    return _finish(f"I read {note}; this is my answer.",
                   data.answer_from_counts(kind, params, counts))
  if not done and frac > 0 and kind in ("count", "user_count", "labels_above"):
    # Counts over the whole log, extrapolated from the fraction read.
    counts = {k: int(round(v / frac)) for k, v in counts.items()}
  answer = data.answer_from_counts(kind, params, counts)
  note = "all of it" if done else f"only {frac:.0%} of it before my context window filled up"
  return _finish(f"I read {note}; this is my answer.", answer)


class ScriptedLongContextEngine(ScriptedTurnEngine):
  """The scripted long-context policy (recursive or single, as each node's prompt allows)."""

  def __init__(self, tokenizer: Any, cfg: LongContextPolicyConfig = LongContextPolicyConfig()):
    super().__init__(tokenizer, lambda text, n: longcontext_turn(text, n, cfg),
                     cfg.token_latency_s, cfg.weight_version)
    self.cfg = cfg


def make_longcontext_engine(tokenizer: Any, cfg: LongContextPolicyConfig = LongContextPolicyConfig()
                            ) -> ScriptedLongContextEngine:
  """The scripted long-context policy as an `Engine`."""
  return ScriptedLongContextEngine(tokenizer, cfg)
