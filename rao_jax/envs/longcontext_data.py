"""Long-context aggregation data (OOLONG style): seeded documents, questions, gold answers, scoring.

The document is a log of dated utterances, one record a line, in OOLONG-synth's layout:

    Date: Mar 03, 2023 || User: 48213 || Instance: Where is the Ravenport clock tower located?

Each instance is a question a user asked; its label (the kind of answer it seeks, after TREC's
coarse classes as OOLONG-synth uses them) is never written in the document: a reader must infer
it from the text. Aggregation questions ask for counts, most / least common labels, comparisons
between labels, per-user and per-month counts, and lists; their gold answers are computed from
the generator's own labels.

Scoring follows OOLONG (abertsch72/oolong, src/eval/eval_helpers.py): numeric answers earn
0.75 ** |gold - pred|; strings match exactly after case folding; lists earn |overlap| / |gold|;
comparison answers ("more common", "less common", "same frequency") match exactly.

Everything here is pure and deterministic in its seed; `rao_jax.envs.longcontext` wraps it into
an `Environment`.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import json
import re
from typing import Any, Mapping, Sequence

import numpy as np

LABELS = ("abbreviation", "entity", "description", "human", "location", "numeric")

# Characters per SmolLM2 token on these documents, measured with the SmolLM2-135M tokenizer on
# generated documents of 4K-256K tokens (tests/test_envs_longcontext.py re-measures it when the
# tokenizer is available). Used to size documents without tokenising 1 MB of text per task.
CHARS_PER_TOKEN = 2.50

ANSWER_NUMERIC = "numeric"
ANSWER_STRING = "string"
ANSWER_LIST = "list"
ANSWER_COMPARISON = "comparison"
ANSWER_TYPES = (ANSWER_NUMERIC, ANSWER_STRING, ANSWER_LIST, ANSWER_COMPARISON)
COMPARISON_WORDS = ("more common", "less common", "same frequency")

# -- vocabulary for the utterance templates ----------------------------------------------------

_SYL = ("ra", "ven", "dor", "mel", "ka", "tis", "lo", "bar", "quin", "sha", "tor", "el", "vi",
        "nor", "gal", "der", "mo", "ru", "fen", "ash", "bel", "cor", "dal", "isk", "jun", "lor")
_THINGS = ("beavers", "lighthouses", "glaciers", "bicycles", "libraries", "vineyards", "bridges",
           "owls", "trams", "orchards", "windmills", "ferries", "bakeries", "canals", "dolphins")
_DEVICES = ("barometer", "sextant", "loom", "telescope", "metronome", "compass", "kiln",
            "turbine", "phonograph", "hygrometer", "seismograph", "printing press")
_FIELDS = ("chemistry", "aviation", "banking", "medicine", "law", "shipping", "astronomy",
           "linguistics", "geology", "music theory")
_GAMES = ("cricket", "go", "backgammon", "curling", "mahjong", "fencing", "polo", "bridge")
_ANIMAL_CLASSES = ("bird", "fish", "reptile", "mammal", "insect", "amphibian")
_WORDS = ("saudade", "hiraeth", "sonder", "petrichor", "apricity", "komorebi", "vellichor",
          "meraki", "hygge", "ubuntu", "wabi-sabi", "sisu")
_EVENTS = ("harvest fair", "regatta", "lantern festival", "chess open", "film week",
           "marathon", "jazz summit", "book fair", "flower show", "air show")

# Templates per label. Each opening phrase belongs to exactly one label (so the label is a
# function of the text, which `label_of_text` relies on); the vocabulary inside varies.
_TEMPLATES: dict[str, tuple[str, ...]] = {
    "abbreviation": (
        "What does {abbr} stand for?",
        "What is the full form of {abbr} in {field}?",
        "What is {abbr} short for when people talk about {field}?",
        "Expand the acronym {abbr} used by the {org}.",
    ),
    "entity": (
        "What kind of {animal_class} is the {creature}?",
        "Which instrument did {person} play in the {org}?",
        "What breed of dog won the {event} in {city}?",
        "Name the ship that sank near {city}.",
        "What type of tree grows beside the {landmark}?",
    ),
    "description": (
        "Why do {things} gather near {city} in winter?",
        "How does a {device} work?",
        "What is the meaning of the word {word}?",
        "Explain the rules of {game} as played in {city}.",
        "What is the difference between a {device} and a {device2}?",
    ),
    "human": (
        "Who wrote the book {book}?",
        "Who was the first mayor of {city}?",
        "Which person founded the {org}?",
        "Who painted the mural in the {landmark}?",
        "Who won the {event} in {city} last year?",
    ),
    "location": (
        "Where is the {landmark} located?",
        "In which country is {city}?",
        "What city hosts the {event}?",
        "Where did {person} grow up?",
        "Which river flows through {city}?",
    ),
    "numeric": (
        "How many {things} are there in {city}?",
        "When was the {org} founded?",
        "What year did the {event} in {city} start?",
        "How much does a {device} cost in {city}?",
        "How far is {city} from {city2}?",
    ),
}


def _name(rng: np.random.Generator, n_syl: int) -> str:
  return "".join(_SYL[i] for i in rng.integers(0, len(_SYL), n_syl)).capitalize()


@dataclasses.dataclass(frozen=True)
class DocConfig:
  """Parameters of one generated document.

  Attributes:
    seed: generator seed; equal configs give byte-identical documents.
    target_tokens: document length in SmolLM2 tokens (estimated with CHARS_PER_TOKEN); the
      generator stops at the first record that reaches it.
    num_users: distinct user ids in the log.
    num_months: the log spans this many calendar months, starting in `start_year` January.
    start_year: first year of the log.
  """
  seed: int = 0
  target_tokens: int = 175_000
  num_users: int = 40
  num_months: int = 12
  start_year: int = 2023

  def __post_init__(self):
    if self.target_tokens < 1_000:
      raise ValueError(f"DocConfig.target_tokens={self.target_tokens}: must be >= 1000 (use 4_000 "
                       "to 256_000 for OOLONG-style lengths).")
    if not 2 <= self.num_users <= 10_000:
      raise ValueError(f"DocConfig.num_users={self.num_users}: must be in [2, 10000].")
    if not 1 <= self.num_months <= 120:
      raise ValueError(f"DocConfig.num_months={self.num_months}: must be in [1, 120].")


@dataclasses.dataclass(frozen=True)
class Record:
  date: datetime.date
  user: str
  text: str
  label: str

  @property
  def month(self) -> str:
    return f"{self.date.year:04d}-{self.date.month:02d}"

  def line(self) -> str:
    return f"Date: {self.date.strftime('%b %d, %Y')} || User: {self.user} || Instance: {self.text}"


@dataclasses.dataclass(frozen=True)
class Document:
  """A generated document: its text, its records (with the hidden labels) and its config."""
  config: DocConfig
  text: str
  records: tuple[Record, ...]

  @functools.cached_property
  def label_by_line(self) -> dict[str, str]:
    return {r.line(): r.label for r in self.records}

  @property
  def approx_tokens(self) -> int:
    return estimate_tokens(self.text)


_RECORD_RE = re.compile(r"^Date: (\w{3} \d{2}, \d{4}) \|\| User: (\d+) \|\| Instance: (.+)$")


def estimate_tokens(text: str) -> int:
  """SmolLM2 token count estimated from the character count (see CHARS_PER_TOKEN)."""
  return int(round(len(text) / CHARS_PER_TOKEN))


def _make_vocab(rng: np.random.Generator) -> dict[str, list[str]]:
  cities = sorted({_name(rng, int(rng.integers(2, 4))) for _ in range(60)})
  people = sorted({f"{_name(rng, 2)} {_name(rng, 3)}" for _ in range(80)})
  orgs = sorted({f"{_name(rng, 2)} {s}" for s in ("Society", "Guild", "Orchestra", "Institute",
                                                   "Company", "Union", "Academy", "Club")
                 for _ in range(6)})
  landmarks = sorted({f"{_name(rng, 2)} {s}" for s in ("Tower", "Bridge", "Gallery", "Palace",
                                                        "Market", "Chapel", "Gardens")
                      for _ in range(6)})
  books = sorted({f"The {_name(rng, 2)} {s}" for s in ("Winter", "Letters", "Garden", "Voyage",
                                                        "Archive", "Lantern") for _ in range(8)})
  creatures = sorted({f"{_name(rng, 2).lower()} {s}"
                      for s in ("finch", "eel", "gecko", "lynx", "beetle", "newt")
                      for _ in range(6)})
  abbrs = sorted({"".join(chr(65 + int(i)) for i in rng.integers(0, 26, int(rng.integers(2, 5))))
                  for _ in range(80)})
  return dict(city=cities, city2=cities, person=people, org=orgs, landmark=landmarks, book=books,
              creature=creatures, abbr=abbrs, things=list(_THINGS), device=list(_DEVICES),
              device2=list(_DEVICES), field=list(_FIELDS), game=list(_GAMES),
              animal_class=list(_ANIMAL_CLASSES), word=list(_WORDS), event=list(_EVENTS))


_SLOT_RE = re.compile(r"\{(\w+)\}")


@functools.lru_cache(maxsize=8)
def generate_document(config: DocConfig) -> Document:
  """Generates the seeded document of `config` (cached: tasks share documents)."""
  rng = np.random.default_rng([config.seed, 0x00010106])
  vocab = _make_vocab(rng)
  # Skewed label and user frequencies, as in real logs, so that most / least common are
  # meaningful; a Dirichlet with a small concentration keeps the labels well apart.
  label_p = rng.dirichlet(np.full(len(LABELS), 1.5))
  users = sorted({str(u) for u in rng.integers(10_000, 99_999, config.num_users * 2)})
  users = [users[i] for i in rng.permutation(len(users))[:config.num_users]]
  user_p = rng.dirichlet(np.full(len(users), 1.0))
  start = datetime.date(config.start_year, 1, 1)
  end_month = config.num_months
  end = datetime.date(config.start_year + end_month // 12, end_month % 12 + 1, 1)
  span_days = (end - start).days
  target_chars = config.target_tokens * CHARS_PER_TOKEN
  records: list[Record] = []
  n_chars = 0
  batch = 512
  while n_chars < target_chars:
    labels = rng.choice(len(LABELS), size=batch, p=label_p)
    user_idx = rng.choice(len(users), size=batch, p=user_p)
    for li, ui in zip(labels, user_idx):
      label = LABELS[int(li)]
      templates = _TEMPLATES[label]
      template = templates[int(rng.integers(0, len(templates)))]
      text = _SLOT_RE.sub(lambda m: vocab[m.group(1)][int(rng.integers(0, len(vocab[m.group(1)])))],
                          template)
      records.append(Record(date=start, user=users[int(ui)], text=text, label=label))
      n_chars += len(records[-1].line()) + 1
      if n_chars >= target_chars:
        break
  # Dates are drawn afterwards and sorted so the log reads chronologically.
  days = np.sort(rng.integers(0, span_days, len(records)))
  records = [dataclasses.replace(r, date=start + datetime.timedelta(days=int(d)))
             for r, d in zip(records, days)]
  text = "\n".join(r.line() for r in records) + "\n"
  return Document(config=config, text=text, records=tuple(records))


_MONTHS = {m: i + 1 for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug",
                                           "Sep", "Oct", "Nov", "Dec"))}


def parse_record_line(line: str) -> tuple[datetime.date, str, str] | None:
  """(date, user, text) of a record line, or None when the line is not a whole record."""
  m = _RECORD_RE.match(line.strip())
  if m is None:
    return None
  # By hand: strptime costs ~50 us a call and documents have thousands of records.
  mon, day, year = m.group(1).replace(",", "").split()
  try:
    date = datetime.date(int(year), _MONTHS[mon], int(day))
  except (KeyError, ValueError):
    return None
  return date, m.group(2), m.group(3)


# -- questions ---------------------------------------------------------------------------------

QUESTION_KINDS = ("count", "most_common", "least_common", "compare", "user_count", "top_user",
                  "month_count", "top_month", "labels_above")


@dataclasses.dataclass(frozen=True)
class Question:
  """An aggregation question with its gold answer.

  Attributes:
    kind: one of QUESTION_KINDS.
    params: the question's parameters (label, other label, user, month, threshold).
    text: the question as shown to the agent.
    answer_type: one of ANSWER_TYPES.
    gold: the gold answer (int, str or list[str]).
  """
  kind: str
  params: Mapping[str, Any]
  text: str
  answer_type: str
  gold: Any

  def to_dict(self) -> dict[str, Any]:
    return {"kind": self.kind, "params": dict(self.params), "text": self.text,
            "answer_type": self.answer_type, "gold": self.gold}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Question":
    return cls(kind=d["kind"], params=dict(d["params"]), text=d["text"],
               answer_type=d["answer_type"], gold=d["gold"])


def _unique_argext(counter: Mapping[str, int], keys: Sequence[str], largest: bool) -> str | None:
  """The key with the largest (smallest) count, or None when it is tied (no unique gold)."""
  vals = sorted(((counter.get(k, 0), k) for k in keys), reverse=largest)
  if len(vals) > 1 and vals[0][0] == vals[1][0]:
    return None
  return vals[0][1]


def make_question(doc: Document, kind: str, rng: np.random.Generator) -> Question | None:
  """A question of `kind` about `doc`, or None when the drawn parameters give no unique answer."""
  recs = doc.records
  by_label = collections.Counter(r.label for r in recs)
  label = LABELS[int(rng.integers(0, len(LABELS)))]
  users = sorted({r.user for r in recs})
  months = sorted({r.month for r in recs})
  lq = f"the label '{label}'"
  if kind == "count":
    return Question(kind, {"label": label}, f"How many records have {lq}?", ANSWER_NUMERIC,
                    by_label[label])
  if kind in ("most_common", "least_common"):
    largest = kind == "most_common"
    gold = _unique_argext(by_label, LABELS, largest)
    if gold is None:
      return None
    word = "most" if largest else "least"
    return Question(kind, {}, f"Which label is the {word} common among all records?",
                    ANSWER_STRING, gold)
  if kind == "compare":
    other = LABELS[int(rng.integers(0, len(LABELS)))]
    if other == label:
      return None
    a, b = by_label[label], by_label[other]
    gold = "more common" if a > b else "less common" if a < b else "same frequency"
    return Question(kind, {"label": label, "other": other},
                    f"Is {lq} more common, less common, or the same frequency as the label "
                    f"'{other}'?", ANSWER_COMPARISON, gold)
  if kind == "user_count":
    user = users[int(rng.integers(0, len(users)))]
    gold = sum(1 for r in recs if r.user == user and r.label == label)
    return Question(kind, {"label": label, "user": user},
                    f"How many records by user {user} have {lq}?", ANSWER_NUMERIC, gold)
  if kind == "top_user":
    c = collections.Counter(r.user for r in recs if r.label == label)
    gold = _unique_argext(c, users, True)
    if gold is None:
      return None
    return Question(kind, {"label": label}, f"Which user has the most records with {lq}? "
                    "Answer with the user id.", ANSWER_STRING, gold)
  if kind == "month_count":
    month = months[int(rng.integers(0, len(months)))]
    gold = sum(1 for r in recs if r.month == month and r.label == label)
    return Question(kind, {"label": label, "month": month},
                    f"How many records dated in month {month} have {lq}?", ANSWER_NUMERIC, gold)
  if kind == "top_month":
    c = collections.Counter(r.month for r in recs if r.label == label)
    gold = _unique_argext(c, months, True)
    if gold is None:
      return None
    return Question(kind, {"label": label}, f"In which month do records with {lq} occur most "
                    "often? Answer with the month as YYYY-MM.", ANSWER_STRING, gold)
  if kind == "labels_above":
    # A threshold strictly between two label counts so that the list is unambiguous.
    counts = sorted(set(by_label.values()))
    if len(counts) < 2:
      return None
    i = int(rng.integers(0, len(counts) - 1))
    threshold = (counts[i] + counts[i + 1]) // 2
    gold = sorted(l for l in LABELS if by_label[l] > threshold)
    return Question(kind, {"threshold": threshold},
                    f"Which labels occur in more than {threshold} records? Answer with a "
                    "comma-separated list of labels.", ANSWER_LIST, gold)
  raise ValueError(f"make_question(kind={kind!r}): unknown kind; expected one of {QUESTION_KINDS}.")


def goal_text(question: Question, doc_tokens: int) -> str:
  """The root goal: what the data is, the label set, the question and the answer format."""
  return (
      f"The REPL variable `context` holds a log of about {doc_tokens} tokens, one record a "
      "line: 'Date: <Mon DD, YYYY> || User: <id> || Instance: <question text>'. Each instance "
      "is a question someone asked; its label is the kind of answer it seeks, one of: "
      f"{', '.join(LABELS)}. Labels are not written in the log: infer each one from the "
      f"instance text.\nQuestion: {question.text}\nCall finish with only the answer.")


# -- structured sub-questions (exactly verifiable subtasks) -----------------------------------

SUBQ_GROUP_KEYS = ("label", "user", "month")
_SUBQ_RE = re.compile(
    r"^Count the records in `context`"
    r"(?: with label '(?P<label>[a-z]+)')?"
    r"(?: by user (?P<user>\d+))?"
    r"(?: dated in month (?P<month>\d{4}-\d{2}))?"
    r" grouped by (?P<key>label|user|month)\. Reply with only a JSON object mapping each "
    r"(?:label|user|month) to its count\.")


@dataclasses.dataclass(frozen=True)
class SubQuestion:
  """`Count the records in context [with label L] [by user U] [dated in month M] grouped by K`."""
  group_by: str
  label: str | None = None
  user: str | None = None
  month: str | None = None

  def __post_init__(self):
    if self.group_by not in SUBQ_GROUP_KEYS:
      raise ValueError(
          f"SubQuestion.group_by={self.group_by!r}: expected one of {SUBQ_GROUP_KEYS}.")
    if self.label is not None and self.label not in LABELS:
      raise ValueError(f"SubQuestion.label={self.label!r}: expected one of {LABELS}.")

  def text(self) -> str:
    s = "Count the records in `context`"
    if self.label is not None:
      s += f" with label '{self.label}'"
    if self.user is not None:
      s += f" by user {self.user}"
    if self.month is not None:
      s += f" dated in month {self.month}"
    return (f"{s} grouped by {self.group_by}. Reply with only a JSON object mapping each "
            f"{self.group_by} to its count. Labels ({', '.join(LABELS)}) are not written in the "
            "log: infer each from the instance text.")

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def answer(self, records: Sequence[tuple[datetime.date, str, str]],
             labels: Sequence[str]) -> dict[str, int]:
    """Exact answer over parsed records `(date, user, text)` with their true labels."""
    c: collections.Counter[str] = collections.Counter()
    for (date, user, _), label in zip(records, labels):
      month = f"{date.year:04d}-{date.month:02d}"
      if self.label is not None and label != self.label:
        continue
      if self.user is not None and user != self.user:
        continue
      if self.month is not None and month != self.month:
        continue
      c[{"label": label, "user": user, "month": month}[self.group_by]] += 1
    return dict(sorted(c.items()))


def parse_subquestion(goal: str) -> SubQuestion | None:
  """The structured sub-question a goal states, or None when it is free-form."""
  m = _SUBQ_RE.match(goal.strip())
  if m is None:
    return None
  try:
    return SubQuestion(group_by=m.group("key"), label=m.group("label"), user=m.group("user"),
                       month=m.group("month"))
  except ValueError:
    return None


def subquestion_for(question: Question) -> SubQuestion:
  """The per-slice sub-question whose answers, summed over slices, answer `question`."""
  p = question.params
  if question.kind == "user_count":
    return SubQuestion("label", user=p["user"])
  if question.kind == "month_count":
    return SubQuestion("label", month=p["month"])
  if question.kind == "top_user":
    return SubQuestion("user", label=p["label"])
  if question.kind == "top_month":
    return SubQuestion("month", label=p["label"])
  return SubQuestion("label")


def parse_count_json(answer: str) -> dict[str, int] | None:
  """A `{key: count}` JSON object from an answer (the first {...} span), or None."""
  m = re.search(r"\{.*\}", answer, re.S)
  if m is None:
    return None
  try:
    obj = json.loads(m.group(0))
  except json.JSONDecodeError:
    return None
  if not isinstance(obj, dict):
    return None
  out = {}
  for k, v in obj.items():
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
      return None
    if int(v) != 0:
      out[str(k)] = int(v)
  return out


# -- OOLONG scoring ----------------------------------------------------------------------------


def extract_answer(output: str) -> str:
  """The answer part of a model's output, as OOLONG's parsers take it.

  `\\boxed{...}` wins; otherwise the text after the last ':' (OOLONG-synth's convention, e.g.
  "Answer: 12"), with the markdown bold / brackets models add stripped.
  """
  m = (re.search(r"\\boxed\{\\text\{([^}]*)\}\}", output)
       or re.search(r"\\boxed\{+([^}]*)\}+", output))
  if m:
    s = m.group(1)
  else:
    s = output.split(":")[-1] if ":" in output else output
  s = s.replace("*", "").replace("[", "").replace("]", "").strip()
  return s.strip().strip("'\"`").rstrip(".").strip()


def _to_int(s: str) -> int | None:
  try:
    return int(s.replace(",", "").strip())
  except ValueError:
    try:
      f = float(s.strip())
    except ValueError:
      return None
    return int(f) if f == int(f) else None


def oolong_score(gold: Any, answer_type: str, output: str) -> float:
  """OOLONG's score of a model output against the gold answer.

  Args:
    gold: int (numeric), str (string / comparison) or list[str] (list).
    answer_type: one of ANSWER_TYPES.
    output: the model's final answer text.

  Returns:
    numeric: 0.75 ** |gold - pred| (0 when no integer parses); string: 1 iff equal after case
    folding; comparison: 1 iff the same comparison phrase; list: |overlap| / |gold| of the
    case-folded, comma-separated items.
  """
  if answer_type not in ANSWER_TYPES:
    raise ValueError(f"oolong_score(answer_type={answer_type!r}): expected one of {ANSWER_TYPES}.")
  pred = extract_answer(output)
  if answer_type == ANSWER_NUMERIC:
    p = _to_int(pred)
    return 0.0 if p is None else float(0.75 ** abs(int(gold) - p))
  if answer_type == ANSWER_COMPARISON:
    # OOLONG accepts the phrase inside a longer answer ("more common than X").
    low = pred.casefold()
    found = [w for w in COMPARISON_WORDS if w in low]
    return float(len(found) == 1 and found[0] == str(gold).casefold())
  if answer_type == ANSWER_STRING:
    return float(pred.casefold() == str(gold).strip().casefold())
  gold_set = {str(g).strip().casefold() for g in gold}
  if not gold_set:
    return 0.0
  pred_set = {x.strip().casefold() for x in pred.split(",") if x.strip()}
  return len(gold_set & pred_set) / len(gold_set)


_QUESTION_PATTERNS = (
    ("count", re.compile(r"How many records have the label '(?P<label>\w+)'\?")),
    ("most_common", re.compile(r"Which label is the most common among all records\?")),
    ("least_common", re.compile(r"Which label is the least common among all records\?")),
    ("compare", re.compile(r"Is the label '(?P<label>\w+)' more common, less common, or the same "
                           r"frequency as the label '(?P<other>\w+)'\?")),
    ("user_count", re.compile(r"How many records by user (?P<user>\d+) have the label "
                              r"'(?P<label>\w+)'\?")),
    ("top_user", re.compile(r"Which user has the most records with the label '(?P<label>\w+)'\?")),
    ("month_count", re.compile(r"How many records dated in month (?P<month>\d{4}-\d{2}) have the "
                               r"label '(?P<label>\w+)'\?")),
    ("top_month", re.compile(r"In which month do records with the label '(?P<label>\w+)' occur "
                             r"most often\?")),
    ("labels_above", re.compile(r"Which labels occur in more than (?P<threshold>\d+) records\?")),
)


def parse_question(text: str) -> tuple[str, dict[str, Any]] | None:
  """(kind, params) of a question generated by `make_question`, found anywhere in `text`."""
  for kind, rx in _QUESTION_PATTERNS:
    m = rx.search(text)
    if m:
      params: dict[str, Any] = dict(m.groupdict())
      if "threshold" in params:
        params["threshold"] = int(params["threshold"])
      return kind, params
  return None


def answer_from_counts(kind: str, params: Mapping[str, Any], counts: Mapping[str, int]) -> str:
  """The final answer to a question from the summed counts of `subquestion_for` its kind."""
  c = collections.Counter({k: int(v) for k, v in counts.items()})
  if kind in ("count", "user_count", "month_count"):
    return str(c[params["label"]])
  if kind in ("most_common", "least_common"):
    ranked = sorted(LABELS, key=lambda l: c[l], reverse=kind == "most_common")
    return ranked[0]
  if kind == "compare":
    a, b = c[params["label"]], c[params["other"]]
    return "more common" if a > b else "less common" if a < b else "same frequency"
  if kind in ("top_user", "top_month"):
    return max(sorted(c), key=lambda k: c[k]) if c else ""
  if kind == "labels_above":
    return ", ".join(sorted(l for l in LABELS if c[l] > int(params["threshold"])))
  raise ValueError(f"answer_from_counts(kind={kind!r}): unknown kind; expected one of "
                   f"{QUESTION_KINDS}.")


def subquestion_for_kind(kind: str, params: Mapping[str, Any]) -> SubQuestion:
  """`subquestion_for` from a parsed question (kind, params)."""
  return subquestion_for(Question(kind, dict(params), "", ANSWER_STRING, ""))
