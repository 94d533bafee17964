"""TextCraft: a crafting world (Minecraft recipes) with a shared, concurrency-safe inventory.

Tool semantics follow the RAO authors' definition (see ENVIRONMENTS.md):
`craft(ingredients, target)`, `get_info(items)`, `view_inventory()`, and for recursive agents
`await launch_subagent(targets, num_steps, context="")`. Every node of a tree acts on ONE
inventory (the tree's `TextCraftEpisode`); crafts are atomic under a lock, so concurrent children
can interleave but never corrupt it.

Optionally each agent (node) may call `craft` at most `craft_budget` times (0 = no limit),
counted per node on the trusted side; past it `craft` changes nothing and says that this
agent's budget is spent and that helpers have their own (see `textcraft_synth` for why). The
episode records every node's tool calls (`summary()["tool_calls"]`).

The recipe data (``data/textcraft/``, MIT licence in ``LICENSE.platoon``) holds Minecraft recipe
JSON files: shaped and shapeless crafting recipes whose ingredients are items, tags
(``tag:planks``: any concrete item of that kind). Other recipe types
(smelting, stonecutting, special recipes) are not part of TextCraft and are skipped.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import threading
from typing import Any, Iterable, Mapping, Sequence

from rao_jax.envs import base
# Re-exported: a node's targets and the scope of a helper's task are TextCraft's own notions.
from rao_jax.envs.textcraft_scope import recipe_closure, subtask_scope, task_targets  # noqa: F401

DATA_DIR = os.path.join(os.path.dirname(__file__), "data", "textcraft")
TAG_PREFIX = "tag:"
_WOODS = ("oak", "spruce", "birch", "jungle", "acacia", "dark_oak")
_STEMS = ("crimson", "warped")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """One way to craft `result`: per craft, consume `ingredients` and produce `result_count`.

  Ingredient keys are concrete item names or tags (``"tag:planks"``).
  """
  result: str
  ingredients: Mapping[str, int]
  result_count: int = 1


def _strip_ns(name: str) -> str:
  return name.split(":", 1)[1] if ":" in name else name


def _tag_members_rule(tag: str, item: str) -> bool:
  """Whether `item` belongs to Minecraft tag `tag` (the data ships recipes but no tag files)."""
  def is_log(w: str) -> bool:
    return item in (f"{w}_log", f"{w}_wood", f"stripped_{w}_log", f"stripped_{w}_wood")

  def is_stem(w: str) -> bool:
    return item in (f"{w}_stem", f"{w}_hyphae", f"stripped_{w}_stem", f"stripped_{w}_hyphae")

  if tag == "planks":
    return item.endswith("_planks")
  if tag == "logs_that_burn":
    return any(is_log(w) for w in _WOODS)
  if tag == "logs":
    return any(is_log(w) for w in _WOODS) or any(is_stem(w) for w in _STEMS)
  if tag.endswith("_logs") and tag[:-5] in _WOODS:
    return is_log(tag[:-5])
  if tag.endswith("_stems") and tag[:-6] in _STEMS:
    return is_stem(tag[:-6])
  if tag == "wooden_slabs":
    return item in {f"{w}_slab" for w in _WOODS + _STEMS}
  if tag == "wool":
    return item.endswith("_wool")
  if tag == "coals":
    return item in ("coal", "charcoal")
  if tag == "sand":
    return item in ("sand", "red_sand")
  if tag in ("stone_tool_materials", "stone_crafting_materials"):
    return item in ("cobblestone", "blackstone")
  if tag == "gold_ores":
    return item in ("gold_ore", "nether_gold_ore")
  if tag == "soul_fire_base_blocks":
    return item in ("soul_sand", "soul_soil")
  return False


class RecipeBook:
  """Recipes by result item, tag membership, base items and crafting depths."""

  def __init__(self, recipes: Iterable[Recipe], tags: Mapping[str, Sequence[str]] | None = None,
               extra_items: Iterable[str] = ()):
    self.recipes: dict[str, list[Recipe]] = collections.defaultdict(list)
    for r in recipes:
      self.recipes[r.result].append(r)
    self.recipes = dict(self.recipes)
    self.tags: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in (tags or {}).items()}
    items = set(self.recipes) | set(extra_items)
    for rs in self.recipes.values():
      for r in rs:
        items.update(i for i in r.ingredients if not i.startswith(TAG_PREFIX))
    for members in self.tags.values():
      items.update(members)
    self.items = frozenset(items)
    self._depth = self._compute_depths()

  def _compute_depths(self) -> dict[str, int]:
    # Minecraft recipes have cycles (ingot <-> block), so relax to a fixed point instead of
    # recursing: depth = 0 for base items, else min over recipes of 1 + max ingredient depth.
    inf = float("inf")
    depth = {i: (inf if i in self.recipes else 0) for i in self.items}
    changed = True
    while changed:
      changed = False
      for item, rs in self.recipes.items():
        best = depth[item]
        for r in rs:
          d = 0
          for ing in r.ingredients:
            if ing.startswith(TAG_PREFIX):
              members = self.tag_members(ing)
              d = max(d, min((depth.get(m, inf) for m in members), default=inf))
            else:
              d = max(d, depth.get(ing, inf))
          best = min(best, d + 1)
        if best < depth[item]:
          depth[item] = best
          changed = True
    return {k: int(v) for k, v in depth.items() if v != inf}

  def tag_members(self, tag: str) -> tuple[str, ...]:
    """Concrete items that satisfy `tag` (with or without the ``tag:`` prefix)."""
    name = tag[len(TAG_PREFIX):] if tag.startswith(TAG_PREFIX) else tag
    return self.tags.get(name, ())

  def concrete(self, ingredient: str) -> tuple[str, ...]:
    """The concrete items that can fill a recipe slot: a tag's members, or the item itself."""
    return self.tag_members(ingredient) if ingredient.startswith(TAG_PREFIX) else (ingredient,)

  def can_craft(self, item: str) -> bool:
    return item in self.recipes

  def is_base(self, item: str) -> bool:
    return item in self.items and item not in self.recipes

  def depth(self, item: str) -> int | None:
    """Crafting depth (0 = base item), None for unknown or uncraftable-by-cycle items."""
    return self._depth.get(item)

  @classmethod
  def from_minecraft_dir(cls, recipes_dir: str) -> "RecipeBook":
    """Loads shaped/shapeless crafting recipes from Minecraft-format JSON files."""
    raw = []
    for path in sorted(glob.glob(os.path.join(recipes_dir, "*.json"))):
      with open(path) as f:
        raw.append(json.load(f))
    tag_names, names = set(), set()
    recipes = []
    for d in raw:
      kind = d.get("type", "")
      if kind == "minecraft:crafting_shaped":
        slots = [d["key"][ch] for row in d["pattern"] for ch in row if ch != " "]
      elif kind == "minecraft:crafting_shapeless":
        slots = list(d["ingredients"])
      else:
        continue
      res = d["result"]
      result = _strip_ns(res["item"])
      count = int(res.get("count", 1))
      names.add(result)
      # A slot is an item or a tag. A slot given as a list of alternatives is left out of the
      # recipe, as in the original TextCraft (its gold trajectories craft e.g. torches from a
      # stick alone); a recipe left with no ingredient is dropped.
      ings: collections.Counter = collections.Counter()
      for s in slots:
        if isinstance(s, list):
          continue
        if "tag" in s:
          tag_names.add(_strip_ns(s["tag"]))
          ings[TAG_PREFIX + _strip_ns(s["tag"])] += 1
        else:
          ings[_strip_ns(s["item"])] += 1
          names.add(_strip_ns(s["item"]))
      if ings:
        recipes.append(Recipe(result, dict(ings), count))
    universe = set(names)
    for w in _WOODS:
      universe.update({f"{w}_log", f"{w}_wood", f"stripped_{w}_log", f"stripped_{w}_wood"})
    for w in _STEMS:
      universe.update({f"{w}_stem", f"{w}_hyphae", f"stripped_{w}_stem", f"stripped_{w}_hyphae"})
    universe.update({"coal", "charcoal", "sand", "red_sand", "cobblestone", "blackstone",
                     "gold_ore", "nether_gold_ore", "soul_sand", "soul_soil"})
    tags = {t: sorted(i for i in universe if _tag_members_rule(t, i)) for t in sorted(tag_names)}
    return cls(recipes, tags, extra_items=universe)


def _fmt_counts(d: Mapping[str, int]) -> str:
  return ", ".join(f"{n}x {k}" for k, n in d.items())


class TextCraftEpisode(base.Episode):
  """One tree's world: the shared inventory, what each node crafted, and who finished.

  Thread-safe: every mutation holds `lock`, so crafts from concurrent children (even from
  worker threads) are atomic.
  """

  def __init__(self, task: base.Task, book: RecipeBook, craft_budget: int = 0):
    super().__init__(task)
    self.book = book
    # Calls of `craft` each node may make (0 = unlimited); a call past it is refused.
    self.craft_budget = int(craft_budget)
    self.initial_inventory = dict(task.fields.get("initial_inventory", {}))
    self.inventory: dict[str, int] = dict(self.initial_inventory)
    self.lock = threading.Lock()
    # node_id -> item -> count produced by that node's own crafts (for the subtask verifier).
    self.crafted: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    self.num_crafts = 0
    # node_id -> tool name -> calls (refused crafts under "craft_refused", not under "craft").
    self.tool_calls: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

  # -- tools -----------------------------------------------------------------------------------

  def count_call(self, node_id: str, tool: str) -> None:
    """Records one call of `tool` by `node_id` (for the tree record)."""
    with self.lock:
      self.tool_calls[node_id][tool] += 1

  def craft(self, ingredients: Any, target: Any, node_id: str = "0",
            can_launch: bool = True) -> str:
    """Consumes `ingredients` and produces `target = (item, total_count)`; see tool docs.

    With a craft budget every call spends one unit of `node_id`'s budget, whatever it returns
    (as every observation fills a window); a call past the budget changes nothing, and its
    message points to helpers only when `can_launch`.
    """
    with self.lock:   # check and spend atomically: concurrent calls of one node cannot both pass
      calls = self.tool_calls[node_id]
      if self.craft_budget and calls["craft"] >= self.craft_budget:
        calls["craft_refused"] += 1
        # Helpers are pointed to only where this agent may launch them (not at the depth limit).
        helpers = (f" Helpers (launch_subagent) each have their own {self.craft_budget}."
                   if can_launch else "")
        return (f"Error: craft budget spent: this agent has used all {self.craft_budget} of its "
                f"craft calls; nothing was crafted and nothing changed.{helpers}")
      calls["craft"] += 1
      left = self.craft_budget - calls["craft"] if self.craft_budget else None
    msg = self._craft(ingredients, target, node_id)
    if left is not None and not msg.startswith("Error"):
      msg += f" ({left} of {self.craft_budget} crafts left)"
    return msg

  def _craft(self, ingredients: Any, target: Any, node_id: str) -> str:
    if not isinstance(ingredients, dict):
      return f"Error: ingredients must be a dict, got {type(ingredients).__name__}."
    # The REPL forwards arguments as JSON, which turns tuples into lists: accept both.
    if not isinstance(target, (tuple, list)) or len(target) != 2:
      return "Error: target must be a tuple (item_name, total_count)."
    item, count = target
    if not isinstance(item, str):
      return f"Error: target item must be a string, got {type(item).__name__}."
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
      return f"Error: target count must be a positive int, got {count!r}."
    for k, v in ingredients.items():
      if not isinstance(k, str):
        return f"Error: ingredient names must be strings, got {k!r}."
      if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        return f"Error: ingredient count for {k} must be a positive int, got {v!r}."
      if k.startswith(TAG_PREFIX):
        return (f"Error: {k} is a tag; pass a concrete item of that kind "
                f"(one of {list(self.book.tag_members(k))}).")
    recipes = self.book.recipes.get(item)
    if not recipes:
      what = "a base item" if self.book.is_base(item) else "an unknown item"
      return f"Error: no recipe for {item} ({what})."
    errors = []
    with self.lock:
      for idx, r in enumerate(recipes):
        err = self._try_recipe(r, ingredients, count, node_id)
        if err is None:
          return f"Crafted {count} {item}."
        errors.append(f"recipe {idx + 1}: {err}")
    return f"Error: could not craft {count} {item}; nothing changed.\n" + "\n".join(errors)

  def _try_recipe(self, r: Recipe, provided: Mapping[str, int], count: int, node_id: str) -> str | None:
    if count % r.result_count:
      return f"count {count} is not a multiple of the result count {r.result_count}"
    n = count // r.result_count
    use: dict[str, int] = {}
    # Concrete ingredients first, so that a tag never claims an item the recipe names itself.
    for ing, per in r.ingredients.items():
      if ing.startswith(TAG_PREFIX):
        continue
      need = per * n
      if ing not in provided:
        return f"missing ingredient {ing} (needs {need})"
      if provided[ing] != need:
        return f"wrong amount of {ing}: needs {need}, got {provided[ing]}"
      use[ing] = need
    for ing, per in r.ingredients.items():
      if not ing.startswith(TAG_PREFIX):
        continue
      need = per * n
      members = self.book.tag_members(ing)
      # Several concrete members may be mixed (e.g. 5 acacia_planks + 1 spruce_planks).
      match = {m: provided[m] for m in provided if m in members and m not in use}
      if not match:
        return f"needs {need} of {ing} (one or more of {list(members)})"
      if sum(match.values()) != need:
        return f"wrong amount for {ing}: needs {need}, got {sum(match.values())} ({match})"
      use.update(match)
    extra = [k for k in provided if k not in use]
    if extra:
      return f"extra ingredients not in the recipe: {extra}"
    short = [f"{k} (need {v}, have {self.inventory.get(k, 0)})" for k, v in use.items()
             if self.inventory.get(k, 0) < v]
    if short:
      return "not enough in inventory: " + ", ".join(short)
    for k, v in use.items():
      self.inventory[k] -= v
      if self.inventory[k] == 0:
        del self.inventory[k]
    self.inventory[r.result] = self.inventory.get(r.result, 0) + count
    self.crafted[node_id][r.result] += count
    self.num_crafts += 1
    return None

  def get_info(self, items: Any) -> Any:
    """Per item: whether it can be crafted, is base, how many we hold, depth, recipes."""
    if isinstance(items, str):
      items = [items]
    if not isinstance(items, (list, tuple)):
      return f"Error: items must be a list of item names, got {type(items).__name__}."
    out = []
    with self.lock:
      inv = dict(self.inventory)
    for item in items:
      if not isinstance(item, str):
        out.append({"item": item, "error": "item names must be strings"})
        continue
      info = {"item": item, "can_craft": self.book.can_craft(item),
              "is_base": self.book.is_base(item), "in_inventory": inv.get(item, 0),
              "crafting_depth": self.book.depth(item), "recipes": []}
      if item not in self.book.items:
        info["error"] = "unknown item"
      for r in self.book.recipes.get(item, []):
        ings = {}
        for ing, per in r.ingredients.items():
          if ing.startswith(TAG_PREFIX):
            ings[ing] = {"count": per, "use_one_of": list(self.book.tag_members(ing))}
          else:
            ings[ing] = per
        info["recipes"].append({"ingredients": ings, "result_count": r.result_count})
      out.append(info)
    return out

  def view_inventory(self) -> dict[str, int]:
    with self.lock:
      return dict(self.inventory)

  # -- attribution -----------------------------------------------------------------------------

  def crafted_by_subtree(self, node_id: str) -> collections.Counter:
    """Items produced by crafts of `node_id` and all its descendants."""
    total = collections.Counter()
    prefix = node_id + "."
    with self.lock:
      for nid, c in self.crafted.items():
        if nid == node_id or nid.startswith(prefix):
          total.update(c)
    return total

  def summary(self) -> dict[str, Any]:
    """Final inventory, crafts, and per node its tool calls (and the craft budget, if any)."""
    with self.lock:
      out = {"inventory": dict(self.inventory), "num_crafts": self.num_crafts,
             "tool_calls": {nid: dict(c) for nid, c in sorted(self.tool_calls.items())}}
      if self.craft_budget:
        out["craft_budget_per_agent"] = self.craft_budget
      return out


# Terse on purpose: the docs are in every node's prompt (see agent/prompts.py).
_TOOL_DOCS = """\
Your targets are the REPL variable `targets` (dict item -> count): use it, never retype them.
Tools (on the shared inventory):
- craft(ingredients: dict, target: tuple[str, int]) -> str
    e.g. craft({"oak_planks": 2}, ("stick", 4)). The count is a multiple of the recipe's
    result_count; ingredients = recipe amounts x count // result_count. A failed craft
    changes nothing and says why.
- get_info(items: list[str]) -> list[dict]
    Per item: item, can_craft, is_base, in_inventory, crafting_depth (0 = base), recipes
    [{"ingredients": {...}, "result_count": n}]. For a "tag:X" ingredient pass one concrete
    item of "use_one_of".
- view_inventory() -> dict[str, int]
"""

_SUBAGENT_DOCS = """\
- await launch_subagent(targets: dict[str, int], num_steps: int, context: str = "") -> str
    A helper crafts `targets` (a part of yours, e.g. {item: n} for item, n in
    targets.items()) into the shared inventory with `num_steps` steps of your budget; says
    whether it finished and crafted them, and its message. `context` passes what you know.
"""


def _budget_docs(budget: int, recursive: bool) -> str:
  helpers = (f" Each helper has its own {budget}: give a helper the parts you cannot craft."
             if recursive else "")
  return (f"Craft budget: each agent may call craft at most {budget} times (the REPL variable "
          f"`craft_budget`); further calls fail and change nothing.{helpers}\n")


def targets_goal(targets: Mapping[str, int], context: str = "") -> str:
  """The goal text of a crafting task (same wording as the data sets)."""
  goal = "Craft the following items: " + _fmt_counts(targets)
  if context:
    goal += "\n\nContext from the parent agent: " + context
  return goal


HELD_OUT_EVERY = 10


class TextCraftEnv(base.Environment):
  """TextCraft on the Minecraft recipes and the 1,000 tasks of ``textcraft_train.jsonl``.

  Splits: "test" (the held-out split) is every 10th task of the file (lines 10, 20, ...,
  ids ``textcraft.train.9``, ``.19``, ...: 100 tasks), "train" the other 900, so evaluation
  never sees a task training used; "all" is the 1,000. The RAO authors' own task files (any
  split) replace these with ``config.env.task_files.<split>=PATH`` (see
  ``registry.with_task_files``).
  """

  name = "textcraft"
  task_variables = ("targets",)

  def __init__(self, data_dir: str = DATA_DIR, book: RecipeBook | None = None,
               tasks_by_split: Mapping[str, Sequence[base.Task]] | None = None,
               craft_budget_per_agent: int = 0):
    if (isinstance(craft_budget_per_agent, bool) or not isinstance(craft_budget_per_agent, int)
        or craft_budget_per_agent < 0):
      raise ValueError(f"craft_budget_per_agent={craft_budget_per_agent!r}: must be an int >= 0 "
                       "(0: no limit on craft calls per agent).")
    self.craft_budget_per_agent = craft_budget_per_agent
    self.data_dir = data_dir
    self.book = book if book is not None else RecipeBook.from_minecraft_dir(
        os.path.join(data_dir, "recipes"))
    self._tasks = dict(tasks_by_split) if tasks_by_split is not None else None

  def tasks(self, split: str = "train") -> Sequence[base.Task]:
    if self._tasks is None:
      every = load_textcraft_jsonl(os.path.join(self.data_dir, "textcraft_train.jsonl"),
                                   env=self.name)
      held = [i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 for i in range(len(every))]
      self._tasks = {"train": [t for t, h in zip(every, held) if not h],
                     "test": [t for t, h in zip(every, held) if h], "all": every}
    if split not in self._tasks:
      raise ValueError(f"TextCraftEnv.tasks(split={split!r}): known splits {sorted(self._tasks)}.")
    return self._tasks[split]

  def tool_docs(self, recursive: bool) -> str:
    budget = self.craft_budget_per_agent
    return (_TOOL_DOCS + (_SUBAGENT_DOCS if recursive else "")
            + (_budget_docs(budget, recursive) if budget else ""))

  def new_episode(self, task: base.Task) -> TextCraftEpisode:
    return TextCraftEpisode(task, self.book, craft_budget=self.craft_budget_per_agent)

  def node_tools(self, episode: base.Episode, node: base.NodeInfo) -> dict[str, base.Tool]:
    ep = episode
    assert isinstance(ep, TextCraftEpisode)
    nid, can_launch = node.node_id, node.can_launch

    # Closures over this node's id: the budget and the counts are per agent, on the host side,
    # so nothing the agent's code does in its REPL can reset or share them.
    def craft(ingredients, target):
      return ep.craft(ingredients, target, node_id=nid, can_launch=can_launch)

    def get_info(items):
      ep.count_call(nid, "get_info")
      return ep.get_info(items)

    def view_inventory():
      ep.count_call(nid, "view_inventory")
      return ep.view_inventory()

    return {"craft": craft, "get_info": get_info, "view_inventory": view_inventory}

  def node_variables(self, episode: base.Episode, node: base.NodeInfo) -> dict[str, Any]:
    # The node's own targets, so a program iterates over them instead of retyping them: agents
    # after RL wrote goals with invented or repeated items when they copied targets by hand.
    # The budget as a number a program can use (it is also stated in the tool docs).
    out: dict[str, Any] = {"targets": task_targets(node.fields)}
    if self.craft_budget_per_agent:
      out["craft_budget"] = self.craft_budget_per_agent
    return out

  def child_spec(self, episode, parent, args, kwargs) -> base.ChildSpec:
    names = ("targets", "num_steps", "context")
    if len(args) > len(names):
      raise base.SubagentArgError(
          "launch_subagent(targets: dict, num_steps: int, context: str = '') takes at most 3 "
          f"arguments, got {len(args)}.")
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
      if k not in names:
        raise base.SubagentArgError(f"launch_subagent: unexpected argument {k!r}.")
      if k in bound:
        raise base.SubagentArgError(f"launch_subagent: argument {k!r} given twice.")
      bound[k] = v
    targets = bound.get("targets")
    if not isinstance(targets, dict) or not targets:
      raise base.SubagentArgError("launch_subagent: targets must be a non-empty dict {item: count}.")
    for k, v in targets.items():
      if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise base.SubagentArgError(
            f"launch_subagent: targets must map item names to positive ints, got {k!r}: {v!r}.")
    num_steps = bound.get("num_steps")
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps <= 0:
      raise base.SubagentArgError(
          f"launch_subagent: num_steps must be a positive int, got {num_steps!r}.")
    context = bound.get("context", "") or ""
    if not isinstance(context, str):
      raise base.SubagentArgError("launch_subagent: context must be a string.")
    return base.ChildSpec(goal=targets_goal(targets, context),
                          fields={"targets": dict(targets), "context": context},
                          num_steps=num_steps)

  def format_child_result(self, episode, spec, outcome) -> str:
    # Said plainly, first: whether the helper finished and whether its subtree crafted its
    # targets (checked now, as verify_subtask does); its own message could claim "done" either
    # way. The parent could read the same from the inventory, so nothing hidden is revealed.
    ep = episode
    assert isinstance(ep, TextCraftEpisode)
    targets = task_targets(outcome.node.fields)
    made = ep.crafted_by_subtree(outcome.node.node_id)
    missing = {k: v - made.get(k, 0) for k, v in targets.items() if made.get(k, 0) < v}
    crafted = ("it crafted its targets" if not missing
               else f"its targets were NOT crafted (missing {_fmt_counts(missing)})")
    used = f"(used {outcome.subtree_steps_used} of {outcome.node.max_steps} steps)"
    if outcome.finished:
      return f"Subagent finished; {crafted} {used}. Its message: {outcome.final_message}"
    return f"Subagent did NOT finish ({outcome.end_reason}); {crafted} {used}."

  def subtask_scope(self, episode, parent, spec) -> dict[str, bool] | None:
    targets = task_targets(spec.fields)
    if not targets:
      return None
    return subtask_scope(self.book, task_targets(episode.task.fields),
                         task_targets(parent.fields), targets)

  def verify_root(self, episode, outcome) -> float | None:
    ep = episode
    assert isinstance(ep, TextCraftEpisode)
    targets = ep.task.fields.get("target_items") or {}
    if not targets:
      return None
    inv = ep.view_inventory()
    gained = all(inv.get(k, 0) - ep.initial_inventory.get(k, 0) >= v for k, v in targets.items())
    return 1.0 if (gained and outcome.finished) else 0.0

  def verify_subtask(self, episode, outcome) -> float | None:
    ep = episode
    assert isinstance(ep, TextCraftEpisode)
    targets = outcome.node.fields.get("targets")
    if not isinstance(targets, Mapping) or not targets:
      return None
    made = ep.crafted_by_subtree(outcome.node.node_id)
    ok = all(made.get(k, 0) >= v for k, v in targets.items())
    return 1.0 if (ok and outcome.finished) else 0.0


def load_textcraft_jsonl(path: str, env: str = "textcraft", difficulty: str | None = None,
                         max_steps: int | None = None) -> list[base.Task]:
  """Loads tasks in the TextCraft JSONL format (`goal`, `id`, `max_steps`, `misc`)."""
  tasks = []
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      d = json.loads(line)
      try:
        misc = d["misc"]
        fields = {"target_items": misc["target_items"],
                  "initial_inventory": misc.get("initial_inventory", {}),
                  "gold_trajectory": misc.get("gold_trajectory", [])}
        # Other misc keys (e.g. the synth generator's crafting_depth) are kept as they are.
        fields.update({k: v for k, v in misc.items() if k not in fields and k != "difficulty"})
      except (KeyError, TypeError) as e:
        raise ValueError(f"{path}:{lineno}: not a TextCraft task ({e}); expected "
                         "{'goal', 'id', 'max_steps', 'misc': {'target_items', ...}}.") from e
      tasks.append(base.Task(
          task_id=str(d["id"]), env=env, goal=d["goal"], fields=fields,
          difficulty=difficulty or misc.get("difficulty"),
          max_steps=max_steps or int(d.get("max_steps") or base.DEFAULT_MAX_STEPS)))
  return tasks


def save_textcraft_jsonl(path: str, tasks: Sequence[base.Task]) -> None:
  """Writes tasks in the TextCraft JSONL format."""
  with open(path, "w") as f:
    for t in tasks:
      misc = dict(t.fields)
      if t.difficulty is not None:
        misc["difficulty"] = t.difficulty
      f.write(json.dumps({"goal": t.goal, "id": t.task_id, "max_steps": t.max_steps,
                          "misc": misc}) + "\n")


def replay_gold(env: TextCraftEnv, task: base.Task) -> tuple[TextCraftEpisode, list[str]]:
  """Replays a task's gold trajectory through the `craft` tool; returns episode and messages.

  Messages of extra crafts the replay had to add start with "top-up:" (see `_top_up_tag`).

  Gold steps name tag ingredients (``tag:planks``); replay covers them with the concrete
  members the inventory holds, as an agent would.
  """
  ep = env.new_episode(task)
  msgs = []
  steps = task.fields.get("gold_trajectory", [])
  needs = [_gold_step_need(env.book, step) for step in steps]
  for i, step in enumerate(steps):
    item = step["target"][0]
    need = needs[i]
    # Concrete items later steps ask for by name (e.g. acacia_planks for an acacia fence gate):
    # a tag filled now takes other members first, so those steps are not starved.
    later: dict[str, int] = {}
    for n in needs[i + 1:]:
      for k, v in n.items():
        if not k.startswith(TAG_PREFIX):
          later[k] = later.get(k, 0) + v
    ings: dict[str, int] = {}
    inv = ep.view_inventory()
    for k, v in need.items():
      if not k.startswith(TAG_PREFIX):
        ings[k] = ings.get(k, 0) + v
        continue
      left = v
      for attempt in range(2):
        # First what later steps do not need, then (only if that is short) the rest.
        for reserve in (True, False):
          for m in env.book.tag_members(k):
            spare = inv.get(m, 0) - ings.get(m, 0) - need.get(m, 0)
            take = min(left, spare - (later.get(m, 0) if reserve else 0))
            if take > 0:
              ings[m] = ings.get(m, 0) + take
              left -= take
        if not left or attempt:
          break
        # A few gold steps (3 of the 1,000 training tasks) use one more tag item than the
        # inventory can hold at that point; top up by crafting a member from raw materials.
        top_up = _top_up_tag(ep, env.book, k, left)
        if top_up is None:
          break
        msgs.append(top_up)
        inv = ep.view_inventory()
      if left:
        ings[k] = left   # not enough of the tag: let craft() explain
    msgs.append(ep.craft(ings, (item, int(step["result_count"]))))
  return ep, msgs


def _gold_step_need(book: RecipeBook, step: Mapping[str, Any]) -> dict[str, int]:
  """A gold step's ingredients, with concrete names standing for a recipe tag mapped back.

  Gold steps sometimes name a concrete member where the recipe takes a tag (and the inventory
  then holds a mix of members): such names count as the recipe's tag.
  """
  item = step["target"][0]
  recipe_tags = [i for r in book.recipes.get(item, []) for i in r.ingredients
                 if i.startswith(TAG_PREFIX)]
  need: dict[str, int] = {}
  for k, v in step["ingredients"].items():
    if not k.startswith(TAG_PREFIX):
      k = next((t for t in recipe_tags if k in book.tag_members(t)), k)
    need[k] = need.get(k, 0) + v
  return need


def _top_up_tag(ep: TextCraftEpisode, book: RecipeBook, tag: str, amount: int) -> str | None:
  """Crafts at least `amount` of some member of `tag` from concrete inventory items."""
  inv = ep.view_inventory()
  for m in book.tag_members(tag):
    for r in book.recipes.get(m, []):
      n = -(-amount // r.result_count)
      ings = {}
      for i, per in r.ingredients.items():
        if i.startswith(TAG_PREFIX):   # e.g. planks from tag:acacia_logs: one member that suffices
          i = next((x for x in book.tag_members(i) if inv.get(x, 0) >= per * n), i)
        ings[i] = per * n
      if all(inv.get(i, 0) >= c for i, c in ings.items()):
        msg = ep.craft(ings, (m, n * r.result_count))
        if not msg.startswith("Error"):
          return f"top-up: {msg}"
  return None
