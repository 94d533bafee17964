"""Scripted policies: engines that write the code a good agent would.

A scripted policy is an `Engine` (the rollout interface), so the runtime path is identical for a
model and a script: it decodes the node's prompt tokens, reads the goal, the limits and what
earlier observations revealed, and returns the token ids of its next turn (logprobs 0). It
drives the runtime without a model, yields demonstrations for a supervised warm start
(`demonstrations`), and, with a simulated latency per generated token, makes the runtime
benchmark deterministic.

`ScriptedTextCraftEngine` solves TextCraft and TextCraft-Synth tasks:
  * single agent: `get_info` level by level down to base materials, then one cell that crafts
    everything bottom-up and calls `finish`;
  * recursive: `get_info` on its targets, then one cell that gathers one helper per deep
    ingredient (plus one helper for the shallow craftable ones), crafts its targets from what
    they made and finishes. Helpers whose targets are shallow (depth < `delegate_min_depth`)
    work as single agents.
With a craft budget per agent (the environment's tool docs state it, `craft_budget` in the REPL),
the "program" style of a recursive node adapts its decomposition to the budget
(`budget_program_turn`): it crafts its targets and the ingredients that fit, and gives each
ingredient that does not to a helper, recursively, so every agent stays within its budget.
The "plan" style does not adapt (its helpers follow crafting depth); under a budget its single
agent is the best one possible, crafting each intermediate once.
It relies on a ChatML-style transcript only through markers it prints itself ("INFO ...").
Those lines are compact, `INFO <item> (crafting_depth, in_inventory, recipes)`: `can_craft` and
`is_base` follow from the depth and the recipes, and the model that imitates these
demonstrations reads (and the learner trains on) every observation token again.
"""
from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import re
from typing import Any, Mapping

from rao_jax.agent import records as R
from rao_jax.rollout import base as rollout
from rao_jax.rollout.scripted import ScriptedTurnEngine

_TARGETS = re.compile(r"Craft the following items: ([^\n<]*)")
_COUNT_ITEM = re.compile(r"(\d+)x ([\w:]+)")
_INFO = re.compile(r"INFO ([\w:]+) (\([^\n]*\))")
_BUDGET = re.compile(r"your step budget \(your turns plus your helpers' turns\) is (\d+)")
_DEPTH = re.compile(r"you are at depth (\d+)")
_CRAFT_BUDGET = re.compile(r"each agent may call craft at most (\d+) times")
_DONE_MARK = "# crafting plan"
STYLES = ("plan", "program")


@dataclasses.dataclass(frozen=True)
class ScriptedConfig:
  """Behaviour of the scripted TextCraft policy.

  Attributes:
    delegate_min_depth: a recursive node delegates when its deepest target has at least this
      crafting depth; shallower targets it crafts itself ("plan" style).
    style: "plan" looks recipes up and writes the crafts with their counts (what the module
      docstring describes); "program" writes one short recursive function that looks up and
      crafts each target from base materials (`program_turn`), and a recursive node with
      several targets gives each to a helper.
    token_latency_s: simulated seconds per generated token (the benchmark's clock); 0 = none.
    weight_version: reported with every generation.
  """
  delegate_min_depth: int = 3
  token_latency_s: float = 0.0
  weight_version: int | str = "scripted"
  style: str = "plan"

  def __post_init__(self):
    if self.style not in STYLES:
      raise ValueError(f"ScriptedConfig.style={self.style!r}: use one of {STYLES}.")
    if self.delegate_min_depth < 1:
      raise ValueError(f"ScriptedConfig.delegate_min_depth={self.delegate_min_depth}: must be >= 1.")
    if self.token_latency_s < 0:
      raise ValueError(f"ScriptedConfig.token_latency_s={self.token_latency_s}: must be >= 0.")


def parse_targets(text: str) -> dict[str, int]:
  """{item: count} from the first "Craft the following items: ..." in `text`."""
  m = _TARGETS.search(text)
  if not m:
    return {}
  return {item: int(n) for n, item in _COUNT_ITEM.findall(m.group(1))}


@functools.lru_cache(maxsize=65536)
def _parse_info(item: str, line: str) -> dict | None:
  """get_info's dict back from a compact `(crafting_depth, in_inventory, recipes)` line."""
  try:
    depth, held, recipes = ast.literal_eval(line)
  except (ValueError, SyntaxError, TypeError):
    return None
  if not isinstance(recipes, list):
    return None
  return {"item": item, "can_craft": bool(recipes), "is_base": depth == 0,
          "in_inventory": held, "crafting_depth": depth, "recipes": recipes}


def _knowledge(text: str) -> dict[str, dict]:
  # One "INFO ..." line per item: a cut observation loses whole lines, which are asked again.
  known: dict[str, dict] = {}
  for m in _INFO.finditer(text):
    info = _parse_info(m.group(1), m.group(2))
    if info is not None:
      known[info["item"]] = info
  return known


def _info_cell(items) -> str:
  # Keeps the answers in `info` so later cells can pass them to helpers as context.
  return ("info = {i['item']: (i['crafting_depth'], i['in_inventory'], i['recipes']) "
          f"for i in get_info({list(items)!r})}}\n"
          "for k, v in info.items(): print('INFO', k, v)")


def _ctx(group: Mapping[str, int], known: Mapping[str, dict]) -> str:
  """Context argument that hands a single-target helper the recipe this node looked up."""
  if len(group) == 1 and next(iter(group)) in known:
    item = next(iter(group))
    return f", f\"INFO {item} {{info[{item!r}]}}\""
  return ""


def _names(ing: str, per: Any) -> list[str]:
  return list(per.get("use_one_of") or []) if isinstance(per, dict) else [ing]


def _choose(info: Mapping[str, Any], known: Mapping[str, dict]) -> int | None:
  """Which recipe to use: the first whose every ingredient is held or craftable from below.

  Items with several recipes (red_dye from a poppy, a beetroot, ...) or cyclic ones
  (lapis_block <-> lapis_lazuli) need this; None means an ingredient must be looked up first.
  """
  recipes = info.get("recipes") or []
  if len(recipes) <= 1:
    return 0 if recipes else None
  depth = info.get("crafting_depth")
  missing = False
  for i, r in enumerate(recipes):
    ok = True
    for ing, per in r["ingredients"].items():
      infos = [known.get(x) for x in _names(ing, per)]
      held = any(v and v.get("in_inventory", 0) > 0 for v in infos)
      below = any(v and v.get("can_craft") and isinstance(v.get("crafting_depth"), int)
                  and isinstance(depth, int) and v["crafting_depth"] < depth for v in infos)
      if not (held or below):
        missing = missing or any(v is None for v in infos)
        ok = False
        break
    if ok:
      return i
  return None if missing else 0


def _recipe(info: Mapping[str, Any], known: Mapping[str, dict]) -> tuple[dict[str, int], int] | None:
  """(concrete ingredients per craft, result count) of the chosen recipe; tags -> best member."""
  i = _choose(info, known)
  if i is None:
    return None
  r = info["recipes"][i]
  out = {}
  for ing, per in r["ingredients"].items():
    if isinstance(per, dict):   # a tag: {"count": n, "use_one_of": [...]}
      members = per.get("use_one_of") or []
      held = sorted(members, key=lambda x: -(known.get(x, {}).get("in_inventory", 0)))
      craftable = [x for x in members if known.get(x, {}).get("can_craft")]
      best = held[0] if held and known.get(held[0], {}).get("in_inventory", 0) else (
          craftable[0] if craftable else (members[0] if members else ing))
      out[best] = out.get(best, 0) + int(per["count"])
    else:
      out[ing] = out.get(ing, 0) + int(per)
  return out, int(r["result_count"])


def _lookups(info: Mapping[str, Any], known: Mapping[str, dict]) -> list[str]:
  """Items to look up before this item's recipe can be chosen and its tags resolved."""
  recipes = info.get("recipes") or []
  i = _choose(info, known)
  if i is None:   # several recipes, undecided: look at every ingredient of every recipe
    pool = [(ing, per) for r in recipes for ing, per in r["ingredients"].items()]
  else:           # tags of the chosen recipe: which member do we hold?
    pool = [(ing, per) for ing, per in recipes[i]["ingredients"].items() if isinstance(per, dict)]
  return [x for ing, per in pool for x in _names(ing, per) if x not in known]


def plan_crafts(targets: Mapping[str, int], known: Mapping[str, dict],
                use_inventory: bool) -> tuple[list[tuple[dict, str, int]], list[str]]:
  """Bottom-up crafts for `targets` from known recipes, and the items still unknown.

  Returns:
    (steps, unknown): steps are (ingredients, item, total_count) deepest-dependency first; when
    `unknown` is not empty the plan is incomplete and those items need `get_info` first.
  """
  # Demand flows from the targets down, in order of decreasing crafting depth, so an item's
  # total demand is complete before its own ingredients are expanded.
  need: collections.Counter = collections.Counter(targets)
  unknown: list[str] = []
  seen = set()
  stack = list(targets)
  while stack:   # closure through known recipes
    x = stack.pop()
    if x in seen:
      continue
    seen.add(x)
    info = known.get(x)
    if info is None:
      unknown.append(x)
      continue
    unknown += _lookups(info, known)
    rec = _recipe(info, known)
    if rec:
      stack.extend(rec[0])
  if unknown:
    return [], sorted(set(unknown))

  def depth(x):
    d = known[x].get("crafting_depth")
    return d if isinstance(d, int) else 0

  have = {x: int(known[x].get("in_inventory", 0)) for x in known} if use_inventory else {}
  order = sorted(seen, key=lambda x: (depth(x), x), reverse=True)
  steps = []
  for x in order:
    info = known[x]
    rec = _recipe(info, known)
    if not rec or not info.get("can_craft"):
      continue
    ings, rc = rec
    short = need[x] - have.get(x, 0)
    if short <= 0:
      continue
    n = -(-short // rc)
    for ing, per in ings.items():
      need[ing] += per * n
    steps.append(({ing: per * n for ing, per in ings.items()}, x, n * rc))
  return steps[::-1], []


def _fmt(d: Mapping[str, int]) -> str:
  return "{" + ", ".join(f"{k!r}: {v}" for k, v in d.items()) + "}"


def _summary(targets: Mapping[str, int]) -> str:
  return ", ".join(f"{n}x {k}" for k, n in targets.items())


def _craft_cell(steps, targets: Mapping[str, int], head: str = "") -> str:
  lines = [head.rstrip("\n")] if head else []
  lines += [_DONE_MARK, "out = ["]
  lines += [f" craft({_fmt(ings)}, ({item!r}, {n}))," for ings, item, n in steps]
  lines += ["]", "bad = [o for o in out if o[:7] != 'Crafted']",
            "finish(str(bad) if bad else out[-1])"]
  return "\n".join(lines)


_SOLVER = """\
def make(item, n):
  i = get_info([item])[0]
  if i['is_base']:
    return
  r = i['recipes'][0]
  k = -(-n // r['result_count'])
  for x, c in r['ingredients'].items():
    make(x, c * k)
  print(craft({x: c * k for x, c in r['ingredients'].items()}, (item, k * r['result_count'])))"""


_BUDGET_SOLVER = """\
def make(item, n, dry=False):
  i = get_info([item])[0]
  if i['is_base']:
    return 0
  r = i['recipes'][0]
  k = -(-n // r['result_count'])
  m = sum(make(x, c * k, dry) for x, c in r['ingredients'].items())
  if not dry:
    print(craft({x: c * k for x, c in r['ingredients'].items()}, (item, k * r['result_count'])))
  return m + 1"""

_BUDGET_MAIN = """\
left, tops, big = craft_budget - len(targets), [], []
for item, n in targets.items():
  r = get_info([item])[0]['recipes'][0]
  k = -(-n // r['result_count'])
  ings = {x: c * k for x, c in r['ingredients'].items()}
  tops.append((ings, (item, k * r['result_count'])))
  for x, c in ings.items():
    s = make(x, c, True)
    if s <= left:
      left -= s
      make(x, c)
    elif s:
      big.append((x, c, s))
total = sum(s for x, c, s in big) or 1
print(await asyncio.gather(*[launch_subagent({x: c}, max(1, STEPS * s // total)) for x, c, s in big]))
for t in tops:
  print(craft(*t))
finish('done')"""


def budget_program_turn(prompt_text: str, targets: Mapping[str, int]) -> str:
  """A recursive "program" turn under a craft budget: one generic cell, adapted to the budget.

  The node crafts its targets itself (one craft each). Their ingredients are handled in order:
  an ingredient whose recipe tree fits what is left of `craft_budget` is crafted here (`make`,
  one craft per occurrence, which `make(..., dry=True)` counts without crafting). Each other
  ingredient goes to a helper, and the helpers share this node's step budget in proportion to
  their sizes. A helper runs the same cell, so the decomposition recurses until each agent's
  part fits its own budget. A goal that fits the budget needs no helper. Only the goal and the
  step budget (copied from the prompt) change between demonstrations, so a small model has one
  program to learn (a cell of ~380 SmolLM2 tokens). The targets are never written in the cell:
  it reads the node's REPL variable `targets` (what a helper's `launch_subagent` passed), so a
  model that imitates it has nothing to retype and no item to invent.
  """
  if "[turns left: " in prompt_text:   # the cell ran and did not finish: give up cleanly
    return _GIVE_UP
  m = _BUDGET.search(prompt_text)
  # This turn is already counted when the cell runs, and launch_subagent keeps one step back.
  # Written as the prompt's number minus 2: a model copies the number, no arithmetic.
  steps = f"({m.group(1)} - 2)" if m and int(m.group(1)) > 2 else "1"
  return ("Craft my targets and what fits my craft budget; helpers craft the rest.\n```python\n"
          + _BUDGET_SOLVER + "\n" + _BUDGET_MAIN.replace("STEPS", steps) + "\n```")


# The failure message names the targets from the REPL variable too (nothing is retyped).
_GIVE_UP = "It did not finish.\n```python\nfinish(f'Failed to craft {targets}.')\n```"


def program_turn(prompt_text: str, targets: Mapping[str, int]) -> str:
  """A "program" style turn: one generic cell instead of a plan with computed counts.

  SmolLM2-135M imitating "plan" demonstrations learned their format but not the arithmetic
  of a plan (0 of 50 held-out easy tasks after a warm start; it crafted top-down with invented
  counts). The same function solves every TextCraft-Synth task (one recipe per item, and the
  initial inventory covers each ingredient occurrence crafted on its own), so what a small
  model must learn is to reproduce it and to pass the goal's targets, or, with several
  targets, to give each to a helper: mistakes RL can find and fix. The cell iterates over the
  REPL variable `targets` instead of writing them out, so nothing is retyped.
  `targets` (parsed from the goal) only chooses between the single- and multi-target cells.
  """
  if "[turns left: " in prompt_text:   # the cell ran and did not finish: give up cleanly
    return _GIVE_UP
  launch = can_launch(prompt_text)
  if launch and _CRAFT_BUDGET.search(prompt_text):
    return budget_program_turn(prompt_text, targets)
  if launch and len(targets) > 1:
    return ("One helper per target.\n```python\nprint(await asyncio.gather(*[\n"
            " launch_subagent({item: n}, 20) for item, n in targets.items()]))\n"
            "finish('done')\n```")
  return ("Craft each target from base items.\n```python\n" + _SOLVER + "\n"
          "for item, n in targets.items():\n  make(item, n)\nfinish('done')\n```")


def can_launch(prompt_text: str) -> bool:
  """Whether the node's prompt offers helpers (its tool docs document `launch_subagent`; at the
  depth limit and in single-agent mode they do not)."""
  return ("await launch_subagent(" in prompt_text
          and "you cannot launch helpers" not in prompt_text)


def textcraft_turn(prompt_text: str, cfg: ScriptedConfig = ScriptedConfig()) -> str:
  """The next turn (reasoning + one code block) of a good TextCraft agent, from its transcript."""
  targets = parse_targets(prompt_text)
  if not targets:
    return "I cannot read the targets.\n```python\nfinish(\"Could not parse the goal.\")\n```"
  if cfg.style == "program":
    return program_turn(prompt_text, targets)
  if _DONE_MARK in prompt_text:
    # The crafting cell ran but did not finish (an error stopped it): give up cleanly.
    return ("The crafting cell did not complete.\n```python\n"
            f"finish(\"Failed to craft {_summary(targets)}.\")\n```")
  known = _knowledge(prompt_text)
  launch = can_launch(prompt_text)
  missing = [t for t in targets if t not in known]
  if missing:
    return "Look up my targets.\n```python\n" + _info_cell(missing) + "\n```"
  depth = max((known[t].get("crafting_depth") or 0) for t in targets)
  turns_taken = prompt_text.count("[turns left: ")
  # A delegating node looks up its targets, then their ingredients (so it neither delegates
  # base materials nor misjudges budgets), then delegates; a node that started to work alone
  # keeps going alone.
  if launch and depth >= cfg.delegate_min_depth and turns_taken <= 2:
    pending = sorted({x for t in targets for x in _lookups(known[t], known)})
    ings = sorted({i for t in targets for i in ((_recipe(known[t], known) or ({}, 1))[0])})
    if pending or any(i not in known for i in ings):
      return ("Look up ingredients.\n```python\n"
              + _info_cell(sorted(set(pending) | set(ings))) + "\n```")
    turn = _delegate_turn(prompt_text, targets, known, cfg, depth, turns_taken)
    if turn is not None:
      return turn
  # A helper shares the inventory with concurrent siblings: it must not count on items it did
  # not make (a sibling may be about to use them), so only the root plans with the inventory.
  m = _DEPTH.search(prompt_text)
  steps, unknown = plan_crafts(targets, known, use_inventory=not (m and int(m.group(1)) > 0))
  if unknown:
    return "Look up ingredients.\n```python\n" + _info_cell(unknown) + "\n```"
  return "Craft bottom-up.\n```python\n" + _craft_cell(steps, targets) + "\n```"


def _leaf_steps(depth: int) -> int:
  """Turns a single agent needs for a target of this depth: get_info per level, one craft cell."""
  return depth + 2


def _estimate_steps(depth: int, delegate_min_depth: int) -> float:
  """Rough steps of a subtree rooted at a target of this depth (for sharing a budget)."""
  if depth < delegate_min_depth:
    return float(_leaf_steps(depth))
  return 3.0 + 2.0 * _estimate_steps(depth - 1, delegate_min_depth)


def _delegate_turn(prompt_text: str, targets, known, cfg: ScriptedConfig,
                   depth: int, turns_taken: int) -> str | None:
  """The delegating cell, or None when the budget is too small to delegate."""
  # What the targets need, per ingredient, for the crafts of the targets themselves.
  need: collections.Counter = collections.Counter()
  crafts = []
  for t, count in targets.items():
    rec, rc = _recipe(known[t], known) or ({}, 1)
    n = -(-count // rc)
    for ing, per in rec.items():
      need[ing] += per * n
    crafts.append(({ing: per * n for ing, per in rec.items()}, t, n * rc))
  deep, shallow = {}, {}
  for ing, n in need.items():
    info = known.get(ing)
    d = info.get("crafting_depth") if info else None
    if info is not None and (info.get("is_base") or not info.get("can_craft")):
      continue   # base materials come from the inventory
    if d is None or d >= max(cfg.delegate_min_depth - 2, 1):
      deep[ing] = n
    else:
      shallow[ing] = n
  groups = [{ing: n} for ing, n in deep.items()] + ([shallow] if shallow else [])
  m = _BUDGET.search(prompt_text)
  budget = int(m.group(1)) if m else 0
  avail = budget - turns_taken - 2   # turns taken, this turn, and one spare

  def group_depth(g):
    # Ingredients are not looked up yet: assume one level below the target.
    return max((known.get(i, {}).get("crafting_depth") or max(depth - 1, 1)) for i in g)

  ests = [_estimate_steps(group_depth(g), cfg.delegate_min_depth) for g in groups]
  if not groups or avail < sum(_leaf_steps(group_depth(g)) for g in groups):
    return None   # not enough budget to delegate well: do it myself
  shares = [max(_leaf_steps(group_depth(g)), int(avail * e / sum(ests)))
            for g, e in zip(groups, ests)]
  while sum(shares) > avail:   # the floors of small groups pushed it over: trim the largest
    i = shares.index(max(shares))
    if shares[i] <= _leaf_steps(group_depth(groups[i])):
      return None
    shares[i] -= 1
  calls = [f" launch_subagent({_fmt(g)}, {s}{_ctx(g, known)})," for g, s in zip(groups, shares)]
  head = "print(await asyncio.gather(\n" + "\n".join(calls) + "\n))\n"
  if len(crafts) == 1:   # one target: its craft result is the final message
    ings, item, n = crafts[0]
    code = head + f"{_DONE_MARK}\nfinish(craft({_fmt(ings)}, ({item!r}, {n})))"
  else:
    code = _craft_cell(crafts, targets, head=head)
  return "Delegate, then craft.\n```python\n" + code + "\n```"


class ScriptedTextCraftEngine(ScriptedTurnEngine):
  """The scripted TextCraft policy as an `Engine` (see the module docstring).

  Args:
    tokenizer: the runtime's tokenizer (decodes prompts, encodes turns).
    cfg: policy behaviour and simulated latency.
  """

  def __init__(self, tokenizer: Any, cfg: ScriptedConfig = ScriptedConfig()):
    super().__init__(tokenizer, lambda text, n: textcraft_turn(text, cfg), cfg.token_latency_s,
                     cfg.weight_version)
    self.cfg = cfg


def demonstrations(trees: list[R.TreeRecord], min_success: float = 1.0) -> list[dict[str, Any]]:
  """Supervised warm-start examples from (scripted) trees: every node of a successful tree.

  Each example is `{"token_ids", "loss_mask", "tree_id", "node_id", "depth"}`, where
  `loss_mask` marks the generated tokens (the learner's SFT loss trains on exactly those).
  """
  out = []
  for t in trees:
    if (t.root.success or 0.0) < min_success:
      continue
    for n in t.nodes:
      if (n.success or 0.0) < min_success:
        continue
      out.append({"token_ids": list(n.token_ids), "loss_mask": list(n.gen_mask),
                  "tree_id": t.tree_id, "node_id": n.node_id, "depth": n.depth})
  return out
