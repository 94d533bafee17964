"""Multi-hop search data (DeepDive style): a seeded knowledge graph, its corpus, a BM25 index,
blurred-description questions from random walks, and answer normalisation.

World: people, cities, universities, companies and books with attributes (occupation, hobby,
birth year, founding year, industry, genre, ...) and single-valued relations (born in, studied
at, works for, located in, headquartered in, founded by, written by, set in, mayor). Each entity
gets one page: a first sentence stating what it is, an infobox of exact attributes, its
OUTGOING relations by name only (no document ids), and filler sentences that mention other
entities (distractors for retrieval, as on real web pages).

Questions follow a random walk of `hops` edges from an anchor entity. The anchor is described
by blurred attributes (decades instead of years, categories instead of names) that identify it
uniquely; every later entity is described by its relation to the previous one (plus a blurred
attribute when needed for uniqueness). Since pages name neighbours but never link their ids,
and incoming relations are not listed at all, every hop needs a `search`.

Descriptions are built from a small clause grammar and parsed back (`parse_description`), so a
subtask goal "Find <description>." can be verified exactly against the graph.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import string
from typing import Any

import numpy as np

TYPES = ("person", "city", "university", "company", "book")

OCCUPATIONS = ("marine biologist", "architect", "violinist", "cartographer", "surgeon",
               "novelist", "glassblower", "astronomer", "pastry chef", "civil engineer",
               "botanist", "pilot", "sculptor", "translator", "geologist", "journalist",
               "economist", "beekeeper", "photographer", "chess coach")
HOBBIES = ("falconry", "fencing", "origami", "rowing", "birdwatching", "pottery", "chess",
           "sailing", "calligraphy", "beekeeping", "archery", "knitting", "climbing",
           "woodcarving", "stargazing", "kite flying", "tango", "gardening")
FEATURES = ("coastal", "mountain", "river", "desert", "island", "lakeside")
COUNTRIES = ("Veloria", "Dunmark", "Ostravia", "Kelmora", "Brindal", "Tarsene", "Quillan",
             "Morvath")
FIELDS = ("engineering", "medicine", "law", "music", "agriculture", "mathematics", "oceanography",
          "architecture", "linguistics", "economics")
INDUSTRIES = ("shipping", "textile", "software", "brewing", "mining", "publishing", "aerospace",
              "pharmaceutical", "furniture", "insurance", "robotics", "fishing")
GENRES = ("mystery", "poetry", "history", "science fiction", "cookbook", "travel", "biography",
          "fantasy", "thriller", "philosophy")

_SYL = ("ka", "lor", "ven", "mi", "dra", "sel", "tor", "an", "bel", "quis", "ra", "no", "vik",
        "el", "mar", "su", "den", "ha", "zor", "li", "ost", "ber", "cal", "fin", "gri", "wen")

# Relations: name -> (subject type, object type, forward clause, inverse clause). The forward
# clause describes the SUBJECT given the object's name; the inverse clause the OBJECT given the
# subject's name. Every relation is single-valued on its subject.
RELATIONS: dict[str, tuple[str, str, str, str]] = {
    "born_in": ("person", "city", "born in {X}", "where {X} was born"),
    "studied_at": ("person", "university", "who studied at {X}", "that {X} attended"),
    "works_for": ("person", "company", "who works for {X}", "that employs {X}"),
    "located_in": ("university", "city", "located in {X}", "where {X} is located"),
    "headquartered_in": ("company", "city", "headquartered in {X}", "where {X} is headquartered"),
    "founded_by": ("company", "person", "founded by {X}", "who founded {X}"),
    "written_by": ("book", "person", "written by {X}", "who wrote {X}"),
    "set_in": ("book", "city", "set in {X}", "where {X} is set"),
    "mayor": ("city", "person", "whose mayor is {X}", "who is the mayor of {X}"),
}
# How a page states an outgoing relation: the parser of the scripted policies reads this.
RELATION_LINES = {
    "born_in": "Born in", "studied_at": "Studied at", "works_for": "Works for",
    "located_in": "Located in", "headquartered_in": "Headquartered in",
    "founded_by": "Founded by", "written_by": "Written by", "set_in": "Set in", "mayor": "Mayor",
}
# Attribute clauses (blurred): name -> (types, clause template). `{V}` is the blurred value.
ATTR_CLAUSES: dict[str, tuple[tuple[str, ...], str]] = {
    "birth_decade": (("person",), "born in the {V}"),
    "hobby": (("person",), "who enjoys {V}"),
    "founded_decade": (("city", "university", "company"), "founded in the {V}"),
    "country": (("city",), "in the country of {V}"),
    "field": (("university",), "known for {V}"),
    "published_decade": (("book",), "published in the {V}"),
}
# The head noun carries one categorical attribute: "the coastal city", "the shipping company".
HEAD_ATTR = {"person": "occupation", "city": "feature", "university": None,
             "company": "industry", "book": "genre"}


@dataclasses.dataclass
class Entity:
  eid: str                      # the document id of its page
  etype: str
  name: str
  aliases: tuple[str, ...]
  attrs: dict[str, Any]         # exact values (years are ints)
  rels: dict[str, str]          # relation -> object eid

  def blurred(self, attr: str) -> str:
    """The blurred value of an attribute as descriptions state it."""
    if attr.endswith("_decade"):
      year = self.attrs[attr.replace("_decade", "_year")]
      return f"{year // 10 * 10}s"
    return str(self.attrs[attr])


@dataclasses.dataclass(frozen=True)
class WorldConfig:
  """Size of a generated world.

  Attributes:
    seed: generator seed.
    num_people, num_cities, num_universities, num_companies, num_books: entity counts.
    filler_sentences: filler sentences per page (mentions of other entities); pages grow by
      roughly 20 tokens per sentence, like the boilerplate of real web pages.
  """
  seed: int = 0
  num_people: int = 400
  num_cities: int = 60
  num_universities: int = 50
  num_companies: int = 120
  num_books: int = 200
  filler_sentences: int = 24

  def __post_init__(self):
    for f in ("num_people", "num_cities", "num_universities", "num_companies", "num_books"):
      if getattr(self, f) < 4:
        raise ValueError(f"WorldConfig.{f}={getattr(self, f)}: must be >= 4.")
    if self.filler_sentences < 0:
      raise ValueError(f"WorldConfig.filler_sentences={self.filler_sentences}: must be >= 0.")


def normalize(s: str) -> str:
  """Answer normalisation: case folded, punctuation and a leading article removed, spaces
  collapsed."""
  s = s.casefold().strip()
  s = s.translate(str.maketrans({c: " " for c in string.punctuation}))
  words = s.split()
  if words and words[0] in ("the", "a", "an"):
    words = words[1:]
  return " ".join(words)


def answer_matches(answer: str, entity: Entity) -> bool:
  """Exact match of the normalised answer against the entity's name or an alias."""
  a = normalize(answer)
  return bool(a) and a in {normalize(n) for n in (entity.name, *entity.aliases)}


class World:
  """A knowledge graph, its rendered corpus and a BM25 index over it."""

  def __init__(self, config: WorldConfig):
    self.config = config
    rng = np.random.default_rng([config.seed, 0x5EA2C4])
    self.entities: dict[str, Entity] = {}
    self._by_type: dict[str, list[str]] = {t: [] for t in TYPES}
    used_names: set[str] = set()

    def fresh(n_syl: tuple[int, int]) -> str:
      while True:
        n = "".join(_SYL[i] for i in rng.integers(0, len(_SYL), 
            int(rng.integers(n_syl[0], n_syl[1] + 1))))
        n = n.capitalize()
        if n not in used_names:
          used_names.add(n)
          return n

    def add(etype: str, name: str, aliases: tuple[str, ...], attrs: dict[str, Any]) -> Entity:
      eid = f"{etype}-{len(self._by_type[etype]):04d}"
      e = Entity(eid, etype, name, aliases, attrs, {})
      self.entities[eid] = e
      self._by_type[etype].append(eid)
      return e

    for _ in range(config.num_cities):
      n = fresh((2, 4))
      add("city", n, (f"City of {n}",), {
          "feature": FEATURES[int(rng.integers(len(FEATURES)))],
          "country": COUNTRIES[int(rng.integers(len(COUNTRIES)))],
          "founded_year": int(rng.integers(1100, 1900)),
          "population": int(rng.integers(20, 3000)) * 1000})
    for _ in range(config.num_universities):
      n = fresh((2, 3))
      add("university", f"{n} University", (f"University of {n}",), {
          "field": FIELDS[int(rng.integers(len(FIELDS)))],
          "founded_year": int(rng.integers(1300, 1990)),
          "students": int(rng.integers(2, 60)) * 1000})
    for _ in range(config.num_people):
      first, last = fresh((2, 3)), fresh((2, 4))
      add("person", f"{first} {last}", (f"{first[0]}. {last}", f"{last}, {first}"), {
          "occupation": OCCUPATIONS[int(rng.integers(len(OCCUPATIONS)))],
          "hobby": HOBBIES[int(rng.integers(len(HOBBIES)))],
          "birth_year": int(rng.integers(1900, 2000))})
    for _ in range(config.num_companies):
      n = fresh((2, 3))
      add("company", f"{n} {['Industries', 'Works', 'Group', 'Labs'][int(rng.integers(4))]}",
          (n,), {"industry": INDUSTRIES[int(rng.integers(len(INDUSTRIES)))],
                 "founded_year": int(rng.integers(1800, 2020)),
                 "employees": int(rng.integers(10, 50000))})
    for _ in range(config.num_books):
      n = fresh((2, 3))
      # No alias: normalisation already drops the leading article ("Tides" == "The Tides").
      kind = ("Chronicle", "Letters", "Atlas", "Tides", "Garden")[int(rng.integers(5))]
      add("book", f"The {n} {kind}", (), {"genre": GENRES[int(rng.integers(len(GENRES)))],
           "published_year": int(rng.integers(1850, 2024))})
    for rel, (st, ot, _, _) in RELATIONS.items():
      objs = self._by_type[ot]
      for sid in self._by_type[st]:
        self.entities[sid].rels[rel] = objs[int(rng.integers(len(objs)))]
    self.pages: dict[str, str] = {eid: self._render(e, rng) for eid, e in self.entities.items()}
    self.doc_ids: list[str] = list(self.pages)
    self._alias_index: dict[str, list[str]] = {}
    for eid, e in self.entities.items():
      for n in (e.name, *e.aliases):
        self._alias_index.setdefault(normalize(n), []).append(eid)
    self._build_index()

  # -- corpus ----------------------------------------------------------------------------------

  def first_sentence(self, e: Entity) -> str:
    a = e.attrs
    if e.etype == "person":
      return f"{e.name} is a {a['occupation']} born in {a['birth_year']}."
    if e.etype == "city":
      return f"{e.name} is a {a['feature']} city in {a['country']}, founded in {a['founded_year']}."
    if e.etype == "university":
      return f"{e.name} is a university known for {a['field']}, founded in {a['founded_year']}."
    if e.etype == "company":
      return f"{e.name} is a {a['industry']} company founded in {a['founded_year']}."
    return f"{e.name} is a {a['genre']} book published in {a['published_year']}."

  def _render(self, e: Entity, rng: np.random.Generator) -> str:
    lines = [e.name, "", self.first_sentence(e)]
    if e.aliases:
      lines.append(f"Also known as: {'; '.join(e.aliases)}.")
    lines.append("")
    lines.append("Facts:")
    lines.append(f"- Type: {e.etype}")
    for k, v in e.attrs.items():
      lines.append(f"- {k.replace('_', ' ').capitalize()}: {v}")
    for rel, oid in e.rels.items():
      lines.append(f"- {RELATION_LINES[rel]}: {self.entities[oid].name}")
    lines.append("")
    others = list(self.entities.values())
    verbs = ("was mentioned in a report about", "hosted a delegation from",
             "was compared in a newspaper column with", "appeared in a documentary about",
             "exchanged letters with", "sponsored an exhibition on", "was reviewed alongside")
    filler = []
    for _ in range(self.config.filler_sentences):
      o = others[int(rng.integers(len(others)))]
      # No years in filler: they would drown the one year that describes the entity.
      filler.append(f"{e.name.split()[0] if e.etype == 'person' else e.name} "
                    f"{verbs[int(rng.integers(len(verbs)))]} {o.name}.")
    lines.append("History: " + " ".join(filler))
    return "\n".join(lines) + "\n"

  def _build_index(self) -> None:
    import bm25s  # local: bm25s is only needed once a world is built
    corpus = [self.pages[d] for d in self.doc_ids]
    self._stopwords = "en"
    tokens = bm25s.tokenize(corpus, stopwords=self._stopwords, show_progress=False)
    self._bm25 = bm25s.BM25()
    self._bm25.index(tokens, show_progress=False)

  def search(self, query: str, k: int = 10) -> list[dict[str, str]]:
    """BM25 top-k pages: `[{"id", "title", "snippet"}]` (snippet: the page's first sentence)."""
    import bm25s
    k = max(1, min(int(k), 50, len(self.doc_ids)))
    q = bm25s.tokenize([query], stopwords=self._stopwords, show_progress=False)
    if not q.vocab or all(len(ids) == 0 for ids in q.ids):
      return []
    docs, scores = self._bm25.retrieve(q, k=k, show_progress=False, backend_selection="numpy",
                                       n_threads=0)
    out = []
    for i, s in zip(docs[0], scores[0]):
      if s <= 0:
        continue
      e = self.entities[self.doc_ids[int(i)]]
      out.append({"id": e.eid, "title": e.name, "snippet": self.first_sentence(e)})
    return out

  def open(self, doc_id: str) -> str:
    """The page text of `doc_id`, or an error message naming the problem."""
    page = self.pages.get(str(doc_id).strip())
    if page is None:
      return f"Error: no document with id {doc_id!r}; use an id returned by search()."
    return page

  # -- graph queries ---------------------------------------------------------------------------

  def by_type(self, etype: str) -> list[Entity]:
    return [self.entities[i] for i in self._by_type[etype]]

  def resolve_name(self, name: str) -> list[Entity]:
    return [self.entities[i] for i in self._alias_index.get(normalize(name), [])]

  def matches(self, desc: "Description", e: Entity) -> bool:
    """Whether entity `e` satisfies every clause of `desc`."""
    if e.etype != desc.etype:
      return False
    if desc.head is not None and str(e.attrs.get(HEAD_ATTR[e.etype])) != desc.head:
      return False
    for attr, v in desc.attrs:
      if attr not in e.attrs and attr.replace("_decade", "_year") not in e.attrs:
        return False
      if e.blurred(attr) != v:
        return False
    for rel, direction, name in desc.rels:
      st, ot, _, _ = RELATIONS[rel]
      if direction == "fwd":   # e -rel-> named entity
        if rel not in e.rels or normalize(self.entities[e.rels[rel]].name) not in {
            normalize(x.name) for x in self.resolve_name(name)}:
          return False
      else:                    # named entity -rel-> e
        if not any(x.rels.get(rel) == e.eid for x in self.resolve_name(name)):
          return False
    return True

  def find(self, desc: "Description") -> list[Entity]:
    return [e for e in self.by_type(desc.etype) if self.matches(desc, e)]


# -- descriptions ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Description:
  """A noun phrase that identifies an entity: `the <head> <type> <clause>, <clause> and <clause>`.

  Attributes:
    etype: entity type.
    head: the categorical head attribute value ("marine biologist", "coastal", ...) or None.
    attrs: (attribute, blurred value) clauses.
    rels: (relation, "fwd" | "inv", entity name) clauses.
  """
  etype: str
  head: str | None = None
  attrs: tuple[tuple[str, str], ...] = ()
  rels: tuple[tuple[str, str, str], ...] = ()

  def text(self) -> str:
    if self.etype == "person":
      noun = self.head or "person"
    elif self.head is not None:
      noun = f"{self.head} {self.etype}"
    else:
      noun = self.etype
    clauses = []
    for rel, direction, name in self.rels:
      clauses.append(RELATIONS[rel][2 if direction == "fwd" else 3].format(X=name))
    for attr, v in self.attrs:
      clauses.append(ATTR_CLAUSES[attr][1].format(V=v))
    if not clauses:
      return f"the {noun}"
    body = clauses[0] if len(clauses) == 1 else ", ".join(clauses[:-1]) + " and " + clauses[-1]
    return f"the {noun} {body}"


def _clause_patterns() -> list[tuple[re.Pattern, Any]]:
  # Attribute clauses first, with decade values pinned to "NNNNs": "born in the 1930s" is the
  # birth decade, never a relation to a city called "the 1930s".
  pats = []
  for attr, (_, tmpl) in ATTR_CLAUSES.items():
    value = r"(?P<V>\d{4}s)" if attr.endswith("_decade") else r"(?P<V>.+?)"
    rx = "^" + re.escape(tmpl).replace(re.escape("{V}"), value) + "$"
    pats.append((re.compile(rx), ("attr", attr)))
  for rel, (_, _, fwd, inv) in RELATIONS.items():
    for direction, tmpl in (("fwd", fwd), ("inv", inv)):
      rx = "^" + re.escape(tmpl).replace(re.escape("{X}"), r"(?P<X>.+?)") + "$"
      pats.append((re.compile(rx), ("rel", rel, direction)))
  return pats


_CLAUSES = _clause_patterns()


def _parse_clause(c: str) -> tuple | None:
  for rx, kind in _CLAUSES:
    m = rx.match(c)
    if m:
      return (kind[1], kind[2], m.group("X")) if kind[0] == "rel" else (kind[1], m.group("V"))
  return None


def parse_description(text: str) -> Description | None:
  """Inverse of `Description.text` (None when `text` is not in the clause grammar)."""
  text = text.strip().rstrip(".")
  if not text.startswith("the "):
    return None
  rest = text[4:]
  head, etype = None, None
  heads = ([(o, "person") for o in OCCUPATIONS] + [("person", "person")]
           + [(f"{f} city", "city") for f in FEATURES]
           + [(f"{i} company", "company") for i in INDUSTRIES]
           + [(f"{g} book", "book") for g in GENRES]
           + [(t, t) for t in TYPES if t != "person"])
  for noun, t in sorted(heads, key=lambda x: -len(x[0])):
    if rest == noun or rest.startswith(noun + " "):
      etype = t
      head = None if noun == t else (noun if t == "person" else noun[:-len(t) - 1])
      rest = rest[len(noun):].strip()
      break
  if etype is None:
    return None
  attrs, rels = [], []
  if rest:
    # Clauses are joined by ", " and a final " and "; names and values never contain either.
    parts = rest.split(", ")
    last = parts[-1].split(" and ")
    pieces = parts[:-1] + last
    if len(pieces) > 1 and len(last) != 2:
      return None
    for p in pieces:
      c = _parse_clause(p)
      if c is None:
        return None
      if len(c) == 3:
        rels.append(c)
      else:
        if etype not in ATTR_CLAUSES[c[0]][0]:
          return None
        attrs.append(c)
  return Description(etype, head, tuple(attrs), tuple(rels))


# -- questions -------------------------------------------------------------------------------

HOP_NAMES = "ABCDEFG"


@dataclasses.dataclass(frozen=True)
class SearchQuestion:
  """A multi-hop question: an anchor description and one relational step per hop.

  Attributes:
    anchor: the anchor's description (blurred attributes only).
    steps: per hop, the next entity's description with the previous entity's name replaced by
      its letter (e.g. "the city where A was born"), as Description objects naming the letter.
    path: entity ids along the walk (anchor first; the last is the answer).
    text: the question as shown to the agent.
    answer: the answer entity's name; aliases: its aliases.
  """
  anchor: Description
  steps: tuple[Description, ...]
  path: tuple[str, ...]
  text: str
  answer: str
  aliases: tuple[str, ...]

  @property
  def hops(self) -> int:
    return len(self.steps)


def _anchor_description(world: World, e: Entity, rng: np.random.Generator) -> Description | None:
  attrs = [a for a, (types, _) in ATTR_CLAUSES.items() if e.etype in types]
  rng.shuffle(attrs)
  head_attr = HEAD_ATTR[e.etype]
  head = str(e.attrs[head_attr]) if head_attr else None
  chosen: list[tuple[str, str]] = []
  for a in [None] + attrs:
    if a is not None:
      chosen.append((a, e.blurred(a)))
    d = Description(e.etype, head, tuple(chosen))
    if len(world.find(d)) == 1:
      return d
  return None


def _step_description(world: World, prev: Entity, nxt: Entity, rel: str, direction: str,
                      rng: np.random.Generator) -> Description | None:
  """Describes `nxt` through its relation with `prev` (named), uniquely."""
  rels = ((rel, direction, prev.name),)
  d = Description(nxt.etype, None, (), rels)
  if len(world.find(d)) == 1:
    return d
  head_attr = HEAD_ATTR[nxt.etype]
  attrs = [a for a, (types, _) in ATTR_CLAUSES.items() if nxt.etype in types]
  rng.shuffle(attrs)
  options = ([("head", None)] if head_attr else []) + [(a, None) for a in attrs]
  head, chosen = None, []
  for kind, _ in options:
    if kind == "head":
      head = str(nxt.attrs[head_attr])
    else:
      chosen.append((kind, nxt.blurred(kind)))
    d = Description(nxt.etype, head, tuple(chosen), rels)
    if len(world.find(d)) == 1:
      return d
  return None


def make_question(world: World, hops: int, rng: np.random.Generator) -> SearchQuestion | None:
  """A question from a random walk of `hops` edges, or None when this walk gives no unique one."""
  if not 1 <= hops <= len(HOP_NAMES) - 1:
    raise ValueError(f"make_question(hops={hops}): must be in [1, {len(HOP_NAMES) - 1}].")
  etype = TYPES[int(rng.integers(len(TYPES)))]
  cur = world.by_type(etype)[int(rng.integers(len(world.by_type(etype))))]
  anchor = _anchor_description(world, cur, rng)
  if anchor is None:
    return None
  path, steps = [cur.eid], []
  for h in range(hops):
    moves = [(rel, "inv", world.entities[oid]) for rel, oid in cur.rels.items()]
    for rel, (st, ot, _, _) in RELATIONS.items():
      if ot == cur.etype:
        subs = [x for x in world.by_type(st) if x.rels.get(rel) == cur.eid]
        moves += [(rel, "fwd", x) for x in subs]
    moves = [m for m in moves if m[2].eid not in path]
    if not moves:
      return None
    rel, direction, nxt = moves[int(rng.integers(len(moves)))]
    d = _step_description(world, cur, nxt, rel, direction, rng)
    if d is None:
      return None
    # The question names the previous entity by its letter, not its name.
    letter = HOP_NAMES[h]
    steps.append(dataclasses.replace(d, rels=((rel, direction, letter),)))
    path.append(nxt.eid)
    cur = nxt
  lines = [f"Let A be {anchor.text()}."]
  for h, d in enumerate(steps):
    lines.append(f"Let {HOP_NAMES[h + 1]} be {d.text()}.")
  last = HOP_NAMES[hops]
  lines.append(f"What is the name of {last}? Use search(query) and open(doc_id) to find out, "
               "and call finish with only the name.")
  ans = world.entities[path[-1]]
  return SearchQuestion(anchor, tuple(steps), tuple(path), "\n".join(lines), ans.name, ans.aliases)


def step_goal(desc: Description, name: str | None = None, letter: str | None = None) -> str:
  """A child's goal for one hop: `Find <description>. Reply with only its name.`

  With `letter` and `name`, the previous entity's letter in `desc` is replaced by its name.
  """
  if letter is not None:
    desc = dataclasses.replace(desc, rels=tuple((r, d, name if n == letter else n)
                                                for r, d, n in desc.rels))
  return f"Find {desc.text()}. Reply with only its name."


_GOAL_RE = re.compile(r"^Find (?P<desc>the .+?)\. Reply with only its name\.?$", re.S)


def parse_step_goal(goal: str) -> Description | None:
  m = _GOAL_RE.match(goal.strip())
  return None if m is None else parse_description(m.group("desc"))


@functools.lru_cache(maxsize=4)
def get_world(config: WorldConfig) -> World:
  """The world of `config`, built once per process (index building takes ~1 s)."""
  return World(config)
