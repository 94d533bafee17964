"""TextCraft-Synth: seeded synthetic crafting worlds, much deeper than Minecraft's recipes.

Five material domains (metal ``m``, crystal ``c``, organic ``o``, arcane ``a``, tech ``t``) with
generic item names ``<domain><index>_i<tier>`` (``m0_i1``) so an agent must call `get_info`
instead of guessing recipes from names. Tier 0 items are base materials; an item of tier k has
one ingredient of tier k - 1 (so its crafting depth is exactly k), often a second one of tier
k - 1 or k - 2 and a base material; low tiers yield several items per craft, high tiers combine
2-4 ingredients, and tiers 10-12 mix in another domain. Difficulty is the target's crafting depth: easy 2-3, medium 4-6,
hard 7-9, extreme 10-12. Tasks use the TextCraft JSONL format (`textcraft.load_textcraft_jsonl`)
with a 200-step budget.

The initial inventory covers the "tree expansion" of the targets: every ingredient occurrence
costed separately, rounded up per occurrence. That is at least what any plan following the
recipe tree needs (a single agent merging equal intermediates needs less), so a recursive agent
whose children each craft their own sub-targets from raw materials is never starved by a
sibling, whatever the interleaving.

A craft budget per agent (`SynthConfig.craft_budget_per_agent`, 0 = off) makes recursion
necessary. Without it one agent's program crafts every target in one cell (a 135M model's warm
start already solved 64 of 64 held-out easy tasks that way), so no task needs a helper however
small the context window. A budget of turns or tokens does not close that route: a program in one
cell spends one turn and prints nothing. The budget counts `craft` calls, each agent its own, on
the trusted side (`textcraft.TextCraftEpisode.craft`), and a program in one cell still spends one
unit per call. Each distinct intermediate of a target needs a craft call of its own: the initial
inventory holds only base materials, and a call crafts one item. So the number of distinct
craftable items in a task's recipe closure (`closure_crafts`) is a lower bound on the crafts of
any single agent, whatever its plan or program, and a budget below it means no single agent can
solve the task. A recursive agent stays within the budget. It crafts what fits and hands the
rest to helpers, each with a budget of its own, in the same way that children get fresh context
windows in the paper. Counting `get_info` instead would not bound anything: one call takes a
list, and the generic item names can be enumerated. The budget is sized like a window: at
`craft_budget_per_agent=8` the closure of 95% of the medium and all the hard tasks is larger
(`closure_crafts`; benchmarks/results/recursion_caps.json measures it), while any sub-target
whose recipe tree has at most 8 crafts fits one helper.
"""
from __future__ import annotations

import collections
import dataclasses
import random
from typing import Any, Mapping, Sequence

from rao_jax.envs import base
from rao_jax.envs import textcraft as tc

DOMAINS = ("m", "c", "o", "a", "t")
MAX_TIER = 12
DIFFICULTY_DEPTHS = {"easy": (2, 3), "medium": (4, 6), "hard": (7, 9), "extreme": (10, 12)}
SYNTH_MAX_STEPS = 200
# Probability that a recipe of tier >= 2 has a second craftable ingredient.
BRANCH_PROB = 0.85


@dataclasses.dataclass(frozen=True)
class SynthConfig:
  """TextCraft-Synth world and task generation.

  Attributes:
    seed: seeds the recipe world; task splits derive their own seeds from it.
    items_per_tier: items per domain at tier 0 (tier k has k fewer, at least 2).
    tasks_per_difficulty: tasks per difficulty in each of the "train" and "test" splits.
    max_targets: most distinct target items per task.
    max_count: most units of one target item.
    max_steps: the tree step budget of every task.
    inventory_slack: extra fraction of each base material (0.1 = up to 10% more).
    craft_budget_per_agent: most `craft` calls of one agent (node), each node its own; 0 = no
      limit. See the module docstring for why this, not a turn or token budget, forces
      recursion.
  """
  seed: int = 0
  items_per_tier: int = 200
  tasks_per_difficulty: int = 50
  max_targets: int = 2
  max_count: int = 2
  max_steps: int = SYNTH_MAX_STEPS
  inventory_slack: float = 0.1
  craft_budget_per_agent: int = 0

  def __post_init__(self):
    if self.items_per_tier < 3:
      raise ValueError(f"SynthConfig.items_per_tier={self.items_per_tier}: use >= 3 so recipes "
                       "can pick distinct ingredients.")
    for name in ("tasks_per_difficulty", "max_targets", "max_count", "max_steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"SynthConfig.{name}={getattr(self, name)}: must be >= 1.")
    if not 0 <= self.inventory_slack <= 10:
      raise ValueError(f"SynthConfig.inventory_slack={self.inventory_slack}: must be in [0, 10].")
    b = self.craft_budget_per_agent
    if isinstance(b, bool) or not isinstance(b, int) or b < 0:
      raise ValueError(f"SynthConfig.craft_budget_per_agent={b!r}: must be an int >= 0 (0: no "
                       "limit; e.g. 8 so that medium tasks need helpers).")


def _tier_count(items_per_tier: int, tier: int) -> int:
  return max(2, items_per_tier - tier)


def generate_world(seed: int = 0, items_per_tier: int = 200) -> tc.RecipeBook:
  """A deterministic synthetic recipe world (one recipe per craftable item).

  An item of tier k >= 2 takes one or two craftable ingredients (one of tier k - 1, the other
  of tier k - 1 or k - 2; two with probability `BRANCH_PROB`, so a target's recipe tree
  branches almost two ways per level) plus, often, a base material; tiers 10-12 add a craftable ingredient of
  another domain. Wide tiers (`items_per_tier`) keep sub-trees of one target mostly disjoint,
  which is what makes deep targets both long for one agent and parallelisable across helpers.
  """
  rng = random.Random(f"textcraft-synth-world-{seed}")
  by_tier: dict[str, list[list[str]]] = {
      d: [[f"{d}{i}_i{k}" for i in range(_tier_count(items_per_tier, k))]
          for k in range(MAX_TIER + 1)] for d in DOMAINS}
  recipes = []
  for d in DOMAINS:
    for k in range(1, MAX_TIER + 1):
      for item in by_tier[d][k]:
        if k == 1:
          chosen = rng.sample(by_tier[d][0], rng.randint(1, 2))
        else:
          chosen = [rng.choice(by_tier[d][k - 1])]   # pins the crafting depth to k
          if rng.random() < BRANCH_PROB:
            t = k - 1 if (k == 2 or rng.random() < 0.6) else k - 2
            chosen.append(rng.choice([x for x in by_tier[d][t] if x not in chosen]))
          if k >= 10:   # top tiers mix domains
            other = rng.choice([x for x in DOMAINS if x != d])
            chosen.append(rng.choice(by_tier[other][k - rng.choice((1, 2))]))
          if rng.random() < 0.6:
            chosen.append(rng.choice(by_tier[d][0]))
        ings = {x: (rng.randint(1, 2) if k <= 3 else 1) for x in chosen}
        rc = rng.randint(2, 4) if k == 1 else rng.randint(1, 2) if k <= 3 else 1
        recipes.append(tc.Recipe(item, ings, rc))
  base_items = [x for d in DOMAINS for x in by_tier[d][0]]
  return tc.RecipeBook(recipes, tags={}, extra_items=base_items)


def tree_expansion_needs(book: tc.RecipeBook, targets: Mapping[str, int]) -> collections.Counter:
  """Base materials needed when every ingredient occurrence is crafted on its own."""
  need: collections.Counter = collections.Counter()

  def expand(item: str, count: int):
    rs = book.recipes.get(item)
    if not rs:
      need[item] += count
      return
    r = rs[0]
    n = -(-count // r.result_count)
    for ing, per in r.ingredients.items():
      expand(ing, per * n)

  for item, count in targets.items():
    expand(item, count)
  return need


def merged_plan(book: tc.RecipeBook, targets: Mapping[str, int],
                inventory: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
  """The bottom-up plan of a single agent: each intermediate crafted once, deepest last.

  Returns gold-trajectory steps `{"action": "craft", "target": [item, crafts],
  "ingredients": {...totals}, "result_count": produced}` (the TextCraft data format).
  """
  inventory = dict(inventory or {})
  order = sorted(_closure(book, targets), key=lambda x: (book.depth(x) or 0, x), reverse=True)
  need: collections.Counter = collections.Counter(targets)
  plan = []
  for item in order:   # deepest first: an item's total demand is known before its ingredients'
    r = book.recipes.get(item, [None])[0]
    if r is None:
      continue
    short = need[item] - inventory.get(item, 0)
    if short <= 0:
      continue
    n = -(-short // r.result_count)
    for ing, per in r.ingredients.items():
      need[ing] += per * n
    plan.append({"action": "craft", "target": [item, n],
                 "ingredients": {ing: per * n for ing, per in r.ingredients.items()},
                 "result_count": n * r.result_count})
  return plan[::-1]


def closure_crafts(book: tc.RecipeBook, targets: Mapping[str, int]) -> int:
  """Distinct craftable items in the targets' recipe closure: the fewest `craft` calls any
  single agent needs when it starts from base materials (each call crafts one item)."""
  return sum(1 for x in _closure(book, targets) if book.can_craft(x))


def _closure(book: tc.RecipeBook, targets: Mapping[str, int]) -> set[str]:
  seen, stack = set(), list(targets)
  while stack:
    x = stack.pop()
    if x in seen:
      continue
    seen.add(x)
    for r in book.recipes.get(x, [])[:1]:
      stack.extend(r.ingredients)
  return seen


def generate_tasks(book: tc.RecipeBook, difficulty: str, n: int, seed: int,
                   cfg: SynthConfig = SynthConfig(), split: str = "train",
                   exclude: set | None = None) -> list[base.Task]:
  """`n` distinct tasks of one difficulty, deterministic in `seed`."""
  if difficulty not in DIFFICULTY_DEPTHS:
    raise ValueError(f"difficulty={difficulty!r}: expected one of {sorted(DIFFICULTY_DEPTHS)}.")
  lo, hi = DIFFICULTY_DEPTHS[difficulty]
  candidates = sorted(x for x in book.recipes if lo <= (book.depth(x) or 0) <= hi)
  rng = random.Random(f"textcraft-synth-tasks-{seed}-{split}-{difficulty}")
  exclude = exclude if exclude is not None else set()
  tasks, tries = [], 0
  while len(tasks) < n:
    tries += 1
    if tries > 100 * n:
      raise ValueError(f"generate_tasks: could not find {n} distinct {difficulty} tasks; lower "
                       "SynthConfig.tasks_per_difficulty or raise max_targets / max_count.")
    k = rng.randint(1, min(cfg.max_targets, len(candidates)))
    items = rng.sample(candidates, k)
    # The first target sets the difficulty; keep the others no deeper.
    targets = {x: rng.randint(1, cfg.max_count) for x in items}
    key = tuple(sorted(targets.items()))
    if key in exclude:
      continue
    exclude.add(key)
    need = tree_expansion_needs(book, targets)
    inv = {x: c + rng.randint(0, int(c * cfg.inventory_slack)) for x, c in sorted(need.items())}
    base_items = sorted(x for x in book.items if book.is_base(x) and x not in inv)
    for x in rng.sample(base_items, min(len(base_items), rng.randint(1, 3))):
      inv[x] = rng.randint(1, 5)   # distractors
    depth = max(book.depth(x) for x in targets)
    tasks.append(base.Task(
        task_id=f"textcraft_synth.{split}.{difficulty}.{len(tasks)}", env="textcraft_synth",
        goal=tc.targets_goal(targets), difficulty=difficulty, max_steps=cfg.max_steps,
        fields={"target_items": targets, "initial_inventory": inv,
                "gold_trajectory": merged_plan(book, targets, inv), "crafting_depth": depth}))
  return tasks


class TextCraftSynthEnv(tc.TextCraftEnv):
  """TextCraft tools and verifiers on a generated world.

  Splits: "train", "test" (all difficulties) and "train/<difficulty>", "test/<difficulty>".
  Train and test tasks never share a (targets, counts) combination.
  """

  name = "textcraft_synth"

  def __init__(self, cfg: SynthConfig = SynthConfig(),
               tasks_by_split: Mapping[str, Sequence[base.Task]] | None = None):
    self.cfg = cfg
    super().__init__(book=generate_world(cfg.seed, cfg.items_per_tier),
                     tasks_by_split=tasks_by_split,
                     craft_budget_per_agent=cfg.craft_budget_per_agent)

  def tasks(self, split: str = "train") -> Sequence[base.Task]:
    """Tasks of a split, generated on first use (a split asks only for what it needs)."""
    if self._tasks is None:
      self._tasks = {}
    if split in self._tasks:
      return self._tasks[split]
    which, _, diff = split.partition("/")
    if which not in ("train", "test") or (diff and diff not in DIFFICULTY_DEPTHS):
      raise ValueError(f"TextCraftSynthEnv.tasks(split={split!r}): use 'train', 'test', or "
                       f"'train/<difficulty>', 'test/<difficulty>' with a difficulty in "
                       f"{list(DIFFICULTY_DEPTHS)}.")
    if not diff:
      self._tasks[split] = [t for d in DIFFICULTY_DEPTHS for t in self.tasks(f"{which}/{d}")]
      return self._tasks[split]
    # Test tasks never repeat a train task of the same difficulty (same targets and counts).
    seen: set = set()
    train = generate_tasks(self.book, diff, self.cfg.tasks_per_difficulty, self.cfg.seed,
                           self.cfg, split="train", exclude=seen)
    self._tasks.setdefault(f"train/{diff}", train)
    if which == "test":
      self._tasks[split] = generate_tasks(self.book, diff, self.cfg.tasks_per_difficulty,
                                          self.cfg.seed, self.cfg, split="test", exclude=seen)
    return self._tasks[split]
