"""Scripted policies for the multi-hop search environment, as rollout `Engine`s.

They stand in for the MODEL only (see `longcontext_scripted`): each turn is computed from the
decoded prompt, and everything the policy knows about the world it read from `search` results
and pages printed in its own observations.

Resolving one entity (a "hop"): the policy reads the description, then
  * if the entity is named on a known entity's page ("the city where X was born"): search X's
    name, open X's page, read the relation line;
  * else (the anchor, or "the university located in X"): search the description's words, keep
    the results whose snippet fits (type, category, decade), open them one per turn and check
    the page's facts against every clause; a second, wider search if none fits.
Recursive root: one cell resolves A, B, ... sequentially, one helper per hop (each hop needs the
previous name), then it answers with the last name. Single agent: resolves every hop itself in
its one context, marking each resolved name.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import re
from typing import Any

from rao_jax.envs import search_data as data
from rao_jax.envs.longcontext_scripted import ScriptedTurnEngine, can_launch, chat_messages

_LET = re.compile(r"^Let ([A-G]) be (the .+)\.$", re.M)
_LAST = re.compile(r"What is the name of ([A-G])\?")
_RESULTS = re.compile(r"^RESULTS (\[.*\])$", re.M)
_PAGE = re.compile(r"^PAGE (\S+)\n(.*?)\nENDPAGE$", re.M | re.S)
_RESOLVED = re.compile(r"^RESOLVED ([A-G]) = (.*)$", re.M)
_SNIPPET = (
    ("person", re.compile(r" is an? (?P<head>.+) born in (?P<year>\d{4})\.$")),
    ("city", re.compile(r" is an? (?P<head>\w+) city in (?P<country>\w+), founded in "
                        r"(?P<year>\d{4})\.$")),
    ("university", re.compile(r" is a university known for (?P<field>.+), founded in "
                              r"(?P<year>\d{4})\.$")),
    ("company", re.compile(r" is an? (?P<head>.+) company founded in (?P<year>\d{4})\.$")),
    ("book", re.compile(r" is an? (?P<head>.+) book published in (?P<year>\d{4})\.$")),
)
_YEAR_ATTR = {"person": "birth_decade", "city": "founded_decade", "university": "founded_decade",
              "company": "founded_decade", "book": "published_decade"}


@dataclasses.dataclass(frozen=True)
class SearchPolicyConfig:
  """Behaviour of the scripted search policy.

  Attributes:
    k: results per first search; the second search asks for `k_wide`.
    k_wide: results of the wider second search.
    max_opens: pages one hop may open before giving up.
    child_steps: the budget the recursive root gives each helper.
    token_latency_s: simulated seconds per generated token.
    weight_version: reported with every generation.
  """
  k: int = 10
  k_wide: int = 20
  max_opens: int = 12
  child_steps: int = 16
  token_latency_s: float = 0.0
  weight_version: int | str = "scripted-search"

  def __post_init__(self):
    for f in ("k", "k_wide", "max_opens", "child_steps"):
      if getattr(self, f) < 1:
        raise ValueError(f"SearchPolicyConfig.{f}={getattr(self, f)}: must be >= 1.")


def _code(thought: str, code: str) -> str:
  return f"{thought}\n```python\n{code.strip()}\n```"


def _search_cell(query: str, k: int) -> str:
  return f"import json\nprint('RESULTS', json.dumps(search({query!r}, k={k})))"


def _open_cell(doc_id: str) -> str:
  return f"print('PAGE {doc_id}'); print(open({doc_id!r})); print('ENDPAGE')"


def _page_facts(page: str) -> dict[str, str]:
  facts = {"name": page.split("\n", 1)[0].strip()}
  for line in page.split("\n"):
    if line.startswith("- ") and ": " in line:
      k, v = line[2:].split(": ", 1)
      facts[k.strip().lower()] = v.strip()
  return facts


def _decade(year: str) -> str:
  return f"{int(year) // 10 * 10}s"


def _page_fits(desc: data.Description, facts: dict[str, str]) -> bool:
  """Whether a page's facts satisfy every clause of `desc` (the policy reading the page)."""
  if facts.get("type") != desc.etype:
    return False
  head_attr = data.HEAD_ATTR[desc.etype]
  if desc.head is not None and facts.get(head_attr) != desc.head:
    return False
  for attr, v in desc.attrs:
    if attr.endswith("_decade"):
      year = facts.get(attr.replace("_decade", "_year").replace("_", " "))
      if year is None or _decade(year) != v:
        return False
    elif facts.get(attr) != v:
      return False
  for rel, direction, name in desc.rels:
    if direction == "fwd":
      if data.normalize(facts.get(data.RELATION_LINES[rel].lower(), "")) != data.normalize(name):
        return False
  return True


def _snippet_fits(desc: data.Description, result: dict[str, str]) -> bool:
  for etype, rx in _SNIPPET:
    m = rx.search(result.get("snippet", ""))
    if m is None:
      continue
    if etype != desc.etype:
      return False
    g = m.groupdict()
    if desc.head is not None and g.get("head") != desc.head:
      return False
    for attr, v in desc.attrs:
      if attr == _YEAR_ATTR[etype] and _decade(g["year"]) != v:
        return False
      if attr in ("country", "field") and g.get(attr) != v:
        return False
    return True
  return False


def _query(desc: data.Description) -> str:
  words = [desc.head or "", desc.etype]
  words += [v for a, v in desc.attrs if not a.endswith("_decade")]
  # Pages state exact years: a decade is searched as its ten years.
  words += [" ".join(str(int(v[:4]) + i) for i in range(10)) for a, v in desc.attrs
            if a.endswith("_decade")]
  words += [f"{data.RELATION_LINES[r]} {n}" for r, d, n in desc.rels if d == "fwd"]
  return " ".join(w for w in words if w)


def resolve_step(desc: data.Description, segment: str, cfg: SearchPolicyConfig
                 ) -> tuple[str, str]:
  """The next action to resolve `desc` given what this hop's observations show.

  Returns:
    ("code", turn text) to act, or ("answer", name) once resolved ("" when it gave up).
  """
  searches = [json.loads(m.group(1)) for m in _RESULTS.finditer(segment)]
  pages = {m.group(1): m.group(2) for m in _PAGE.finditer(segment)}
  inv = [(r, n) for r, d, n in desc.rels if d == "inv"]
  if inv:
    rel, name = inv[0]
    for page in pages.values():
      facts = _page_facts(page)
      if data.normalize(facts["name"]) == data.normalize(name):
        target = facts.get(data.RELATION_LINES[rel].lower())
        return ("answer", target or "")
    if not searches:
      return ("code", _code(f"The answer is named on {name}'s page; I look for that page.",
                            _search_cell(name, cfg.k)))
    hits = [r for s in searches for r in s
            if data.normalize(r["title"]) == data.normalize(name) and r["id"] not in pages]
    if hits:
      return ("code", _code(f"I open {name}'s page.", _open_cell(hits[0]["id"])))
    return ("answer", "")
  for page in pages.values():
    facts = _page_facts(page)
    if _page_fits(desc, facts):
      return ("answer", facts["name"])
  seen = set(pages)
  cands = [r for s in searches for r in s if _snippet_fits(desc, r) and r["id"] not in seen]
  cands = list({r["id"]: r for r in cands}.values())
  if cands and len(pages) < cfg.max_opens:
    return ("code", _code(f"{cands[0]['title']} may fit; I check its page.",
                          _open_cell(cands[0]["id"])))
  if len(searches) == 0:
    return ("code", _code("I search for the description's words.",
                          _search_cell(_query(desc), cfg.k)))
  if len(searches) == 1 and len(pages) < cfg.max_opens:
    return ("code", _code("No result fits yet; I search wider.",
                          _search_cell(_query(desc), cfg.k_wide)))
  return ("answer", "")


def _observations(msgs: list[tuple[str, str]]) -> str:
  return "\n".join(c for r, c in msgs[2:] if r == "user")


def search_turn(prompt_text: str, prompt_tokens: int,
                cfg: SearchPolicyConfig = SearchPolicyConfig()) -> str:
  """The next turn of the scripted search policy, from its decoded prompt."""
  msgs = chat_messages(prompt_text)
  if len(msgs) < 2:
    return _code("I cannot read my task.", "finish('Could not parse the prompt.')")
  system, goal = msgs[0][1], msgs[1][1]
  obs = _observations(msgs)
  step = data.parse_step_goal(goal)
  if step is not None:   # a helper resolving one hop
    kind, out = resolve_step(step, obs, cfg)
    if kind == "code":
      return out
    return _code("Resolved." if out else "I could not find it.", f"finish({out or 'unknown'!r})")
  lets = _LET.findall(goal)
  last = _LAST.search(goal)
  if not lets or last is None:
    return _code("I do not understand this goal.", "finish('I cannot answer this goal.')")
  descs = {}
  for letter, text in lets:
    d = data.parse_description(text)
    if d is None:
      return _code("I cannot read a clue.", "finish('I cannot parse the question.')")
    descs[letter] = d
  if can_launch(system):
    return _root_turn(descs, last.group(1), obs, cfg)
  return _single_turn(descs, last.group(1), obs, cfg)


def _root_turn(descs, last: str, obs: str, cfg: SearchPolicyConfig) -> str:
  resolved = {m.group(1): ast.literal_eval(m.group(2)) for m in _RESOLVED.finditer(obs)}
  if last in resolved or obs:
    return _code("The last hop gives the answer.", f"finish({resolved.get(last, 'unknown')!r})")
  goals = []
  for letter, d in descs.items():
    # The previous letter becomes a format field filled with the helper's answer.
    d = dataclasses.replace(d, rels=tuple((r, dr, "{" + n + "}" if n in descs else n)
                                          for r, dr, n in d.rels))
    goals.append((letter, data.step_goal(d)))
  code = f"""
names = {{}}
for letter, goal in {goals!r}:
    answer = await launch_subagent(goal.format(**names), num_steps={cfg.child_steps})
    names[letter] = answer.strip()
    print("RESOLVED", letter, "=", repr(names[letter]))
"""
  return _code("Each hop needs the previous one's name, so I resolve them in order, one helper "
               "per hop.", code)


def _single_turn(descs, last: str, obs: str, cfg: SearchPolicyConfig) -> str:
  parts = _RESOLVED.split(obs)
  resolved = {}
  for i in range(1, len(parts) - 1, 3):
    resolved[parts[i]] = ast.literal_eval(parts[i + 1])
  segment = parts[-1]
  pending = [l for l in descs if l not in resolved]
  if not pending:
    return _code("All hops are resolved.", f"finish({resolved[last]!r})")
  letter = pending[0]
  d = descs[letter]
  d = dataclasses.replace(d, rels=tuple((r, dr, resolved.get(n, n)) for r, dr, n in d.rels))
  kind, out = resolve_step(d, segment, cfg)
  if kind == "code":
    return out
  if not out:
    return _code(f"I could not resolve {letter}.", "finish('unknown')")
  if letter == last:
    return _code(f"{letter} is {out}.", f"finish({out!r})")
  # Mark the hop and start the next one in the same cell.
  nxt = pending[1]
  d2 = descs[nxt]
  resolved[letter] = out
  d2 = dataclasses.replace(d2, rels=tuple((r, dr, resolved.get(n, n)) for r, dr, n in d2.rels))
  kind2, out2 = resolve_step(d2, "", cfg)
  first = out2.split("```python\n", 1)[1].rsplit("\n```", 1)[0] if kind2 == "code" else ""
  return _code(f"{letter} is {out}; next I resolve {nxt}.",
               f"print('RESOLVED {letter} =', {out!r}.__repr__())\n{first}")


class ScriptedSearchEngine(ScriptedTurnEngine):
  """The scripted search policy (recursive or single, as each node's prompt allows)."""

  def __init__(self, tokenizer: Any, cfg: SearchPolicyConfig = SearchPolicyConfig()):
    super().__init__(tokenizer, lambda text, n: search_turn(text, n, cfg),
                     cfg.token_latency_s, cfg.weight_version)
    self.cfg = cfg


def make_search_engine(tokenizer: Any, cfg: SearchPolicyConfig = SearchPolicyConfig()
                       ) -> ScriptedSearchEngine:
  """The scripted search policy as an `Engine`."""
  return ScriptedSearchEngine(tokenizer, cfg)
