"""RAO rewards, leave-one-out advantages and depth-level inverse-frequency weights (numpy).

Implements RAO_SPEC:

  s(v)  success from the first available source: verifier, judge, else the proxy s(root).
  R(v)  = s(v) + lambda * mean_{c in C(v)} s(c)   (= s(v) for a leaf)
  b_k   = (1 / (K - 1)) * sum_{j != k} s(r_j)     default "loo_success", over the K trees of a
                                                  group (the paper's "loo" uses R(r_j))
  A(v)  = R(v) - b_k                              for every node of tree k
  w_d   = N / (D' * n_d)                          over the whole learner batch
  A group whose K roots all got the same R contributes no term (`drop_equal_groups`).

The baseline's scale (RAO_SPEC, "The baseline's scale when lambda > 0"). The paper's baseline
averages the other roots' R, which reaches 1 + lambda when their helpers succeed, while a leaf
can earn at most 1: in a group where every tree succeeds, every successful leaf then gets
A = -lambda and only launching helpers escapes it. The default "loo_success" subtracts the
leave-one-out mean of the other roots' SUCCESS s(r_j), the part of R that every node can earn,
whether it delegates or not; the bonus lambda * mean s(c) is left uncentred, so it is paid
exactly to nodes whose helpers succeeded. Properties (tests/test_learner_rewards.py):
  - unbiased: b_k is built from the other trees of the group only, which are sampled
    independently of tree k, so E[grad log pi(tau_v) * b_k] = 0 for every node v of tree k and
    the expected gradient is that of the objective sum_v R(v), bonus included. The variance it
    leaves: the bonus term is not centred, so delegation that pays is pushed up even in a group
    where every tree delegated alike (lambda sets how hard);
  - when every root of a group succeeded, b_k = 1 and no successful leaf has A < 0;
  - a successful root whose helpers succeeded gets lambda * mean s(c) more than one that
    worked alone, in the same group;
  - at lambda = 0, s(r_j) = R(r_j) and it is the paper's estimator;
  - K alike trees (same shapes, same successes) have equal root rewards, so their group is
    dropped (`drop_equal_groups`) and every node gets A = 0.
Dropping equal groups is what the RAO authors' code does. It is the one departure from the
leave-one-out property: whether a group is kept looks at every tree of it, tree k included.
At a root it changes nothing (an equal group's roots have A = 0 under either baseline); for a
descendant it drops a term R(v) - b_k whose expectation, with b_k = R(root) in such a group,
is not a comparison between trees. A learner batch whose kept nodes all have A = 0 carries no
signal (`Advantages.has_signal`): the trainer then applies no optimizer update (Adam normalises
each coordinate, so a near-zero gradient would still move every weight by about the learning
rate).

Host-side only: trees are Python records, the result is numpy arrays aligned with the flat node
order (tree order, then node order inside each tree, root first) that `pack_trees` consumes.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import zlib
from typing import Any, Sequence

import numpy as np

SOURCES = ("verifier", "judge", "proxy")

# The paper's ablations of the credit assignment, as options (RAO is the first of each):
#   advantage "node": A(v) = R(v) - b_k (RAO);  "tree": every node gets its root's advantage
#     A(root_k) = R(root_k) - b_k (plain per-tree GRPO: a child is credited with the whole tree).
#   train_nodes "all": every node is a term of the loss (RAO);  "root": only the roots are
#     (children still shape R(root) through the delegation bonus and s(root)).
#   depth_weights True: w_d = N / (D' n_d) (RAO);  False: w = 1 for every node.
#   bonus "rate": lambda * mean_{c in C(v)} s(c) (RAO);  "count": lambda * sum_{c in C(v)} s(c),
#     the number of successful children (the paper's Fig. 9 variant that the policy hacked by
#     spawning more helpers).
#   baseline "loo_success": b_k = (1/(K-1)) sum_{j != k} s(r_j) (the default: on the scale of
#     what a leaf can earn, see the module docstring);  "loo": b_k = (1/(K-1)) sum_{j != k}
#     R(r_j) (the paper's);  "group_mean": b_k = (1/K) sum_j R(r_j), the tree's own root
#     included (GRPO's mean).
#   drop_equal_groups True: a group whose roots all got the same R contributes no term (the
#     RAO authors' filter);  False: its nodes keep A(v) = R(v) - b_k (RAO as first specified).
#   node_rewards "dense": s(v) per node (RAO);  "root": s(v) := s(root) for every node, so a
#     node's reward says only how its tree ended (the paper's root-only rewards, Fig. 8).
#   pass_through_gate False (RAO as specified);  True: a node whose only child was given the
#     node's own goal gets R(v) = 0, no success and no bonus (the RAO authors' code gates such
#     forwarding, which the rate bonus otherwise pays lambda for).
#   child_keep_prob 1.0 (RAO);  p < 1: each non-root node stays in the learner batch with
#     probability p, every root stays, and the kept children are not reweighted by 1/p (the
#     RAO authors' code keeps child data with p = 0.25). Depth weights are then those of the
#     batch that remains.
ADVANTAGES = ("node", "tree")
TRAIN_NODES = ("all", "root")
BONUSES = ("rate", "count")
BASELINES = ("loo_success", "loo", "group_mean")
NODE_REWARDS = ("dense", "root")


@dataclasses.dataclass(frozen=True)
class Advantages:
  """Per-node RAO quantities for a learner batch, in flat node order.

  Attributes:
    tree_ids: tree id of each node (length N).
    node_ids: node id of each node (length N).
    tree_index_N: index of each node's tree in the input sequence.
    depth_N: d(v).
    success_N: resolved s(v) (proxy filled in).
    source_N: the source that produced s(v): "verifier" | "judge" | "proxy".
    reward_N: R(v).
    baseline_N: b_k of the node's tree.
    advantage_N: A(v) = R(v) - b_k (0 in a dropped group).
    weight_N: w_{d(v)} (0 for nodes that are not trained, see `train_N`).
    train_N: whether the node is a term of the loss (all nodes, or the roots only; never the
      nodes of a dropped equal group).
    stats: flat dict of logging scalars (see `compute_rewards_and_advantages`).
  """
  tree_ids: tuple[str, ...]
  node_ids: tuple[str, ...]
  tree_index_N: np.ndarray
  depth_N: np.ndarray
  success_N: np.ndarray
  source_N: tuple[str, ...]
  reward_N: np.ndarray
  baseline_N: np.ndarray
  advantage_N: np.ndarray
  weight_N: np.ndarray
  stats: dict[str, float]
  train_N: np.ndarray | None = None

  @property
  def num_train_nodes(self) -> int:
    """N of RAO_SPEC's loss: the nodes in the learner batch (the normalizer's count)."""
    return self.num_nodes if self.train_N is None else int(np.sum(self.train_N))

  @property
  def num_nodes(self) -> int:
    return len(self.node_ids)

  @property
  def has_signal(self) -> bool:
    """Whether some node of the learner batch has w_d * A(v) != 0 (else no update is due)."""
    return bool(np.any(self.weight_N * self.advantage_N != 0))

  @property
  def weighted_advantage_N(self) -> np.ndarray:
    """w_{d(v)} * A(v): the per-node scale of the policy-gradient term."""
    return self.weight_N * self.advantage_N

  def index(self, tree_id: str, node_id: str) -> int:
    """Flat index of node `node_id` of tree `tree_id`."""
    for i, (t, n) in enumerate(zip(self.tree_ids, self.node_ids)):
      if t == tree_id and n == node_id:
        return i
    raise KeyError(f"Advantages: no node {node_id!r} in tree {tree_id!r}.")


def _check_success(value: Any, where: str) -> float:
  try:
    s = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{where}: success={value!r} is not a number; expected s(v) in [0, 1] or "
                     "None (then the root's success is used as the proxy).") from None
  if not math.isfinite(s) or not 0.0 <= s <= 1.0:
    raise ValueError(f"{where}: success={value!r} is outside [0, 1]; the environment's verifier "
                     "or judge must return a score in [0, 1].")
  return s


def _resolve_tree(tree) -> tuple[list[float], list[str], list[float], list[int]]:
  """Resolved successes, sources, rewards (without lambda yet) and depths of one tree."""
  nodes = list(tree.nodes)
  if not nodes:
    raise ValueError(f"Tree {tree.tree_id!r} has no nodes; a tree needs at least its root.")
  root = nodes[0]
  if root.parent_id is not None or int(root.depth) != 0:
    raise ValueError(f"Tree {tree.tree_id!r}: the first node ({root.node_id!r}) must be the root "
                     f"(parent_id None, depth 0), got parent_id={root.parent_id!r}, "
                     f"depth={root.depth!r}.")
  if root.success is None:
    raise ValueError(
        f"Tree {tree.tree_id!r}: the root node {root.node_id!r} has success None; the root's "
        "success is the proxy for every unscored node, so the environment's verifier (or the "
        "judge) must score the root before the learner sees the tree.")
  root_s = _check_success(root.success, f"Tree {tree.tree_id!r} node {root.node_id!r}")
  succ, src, depth = [], [], []
  for node in nodes:
    where = f"Tree {tree.tree_id!r} node {node.node_id!r}"
    if node.success is None:
      succ.append(root_s)
      src.append("proxy")
    else:
      succ.append(_check_success(node.success, where))
      source = node.success_source or "verifier"
      if source not in SOURCES:
        raise ValueError(f"{where}: success_source={source!r}, expected one of {SOURCES}.")
      src.append(source)
    depth.append(int(node.depth))
  return succ, src, depth, root_s


def is_pass_through(node, by_id: dict) -> bool:
  """Whether `node` launched exactly one child and gave it the node's own goal (forwarding).

  Goals are compared after stripping surrounding whitespace; a node without a goal text (or a
  child missing from `by_id`) is never a pass-through.
  """
  kids = list(node.children or ())
  if len(kids) != 1 or kids[0] not in by_id:
    return False
  goal, child_goal = getattr(node, "goal", None), getattr(by_id[kids[0]], "goal", None)
  return isinstance(goal, str) and isinstance(child_goal, str) and bool(goal.strip()) and (
      goal.strip() == child_goal.strip())


def _keep_seed(trees, seed: int) -> list[int]:
  """A seed for child subsampling that differs per batch (tree ids are unique per sample)."""
  return [int(seed), zlib.crc32("|".join(t.tree_id for t in trees).encode())]


def compute_rewards_and_advantages(trees: Sequence[Any], lam: float = 0.5, *,
                                   advantage: str = "node", train_nodes: str = "all",
                                   depth_weights: bool = True, bonus: str = "rate",
                                   baseline: str = "loo_success",
                                   drop_equal_groups: bool = True, node_rewards: str = "dense",
                                   pass_through_gate: bool = False,
                                   child_keep_prob: float = 1.0,
                                   seed: int = 0) -> Advantages:
  """Computes R(v), the leave-one-out advantage A(v) and depth weights w_d for a batch of trees.

  Args:
    trees: TreeRecord-like objects (attributes tree_id, group_id, nodes; each node has node_id,
      parent_id, depth, children, success, success_source). The K trees of one root task share
      group_id; every group needs K >= 2.
    lam: the delegation bonus lambda >= 0 of RAO_SPEC.
    advantage: "node" (RAO: A(v) = R(v) - b_k) or "tree" (every node gets its root's advantage:
      per-tree GRPO, an ablation).
    train_nodes: "all" (RAO) or "root" (children leave the learner batch: an ablation).
    depth_weights: RAO's inverse-frequency depth weights (True) or w = 1 (an ablation).
    bonus: "rate" (RAO: lambda * mean of the children's s) or "count" (lambda * their sum).
    baseline: "loo_success" (the leave-one-out mean of the other roots' success s(r_j): the
      default, on a leaf's scale), "loo" (the paper's leave-one-out mean of the other roots'
      R) or "group_mean" (the mean of all K roots' R, the tree's own included).
    drop_equal_groups: a group whose roots all got the same R contributes no term: its nodes
      get A = 0 and leave the learner batch (the RAO authors' filter).
    node_rewards: "dense" (RAO: each node's own s(v)) or "root" (every node takes s(root)).
    pass_through_gate: R(v) = 0 for a node that only forwarded its own goal to one child.
    child_keep_prob: in (0, 1]: the probability that a non-root node stays in the learner
      batch (roots always stay; no 1/p reweighting).
    seed: seeds the child subsampling (with the batch's tree ids).

  Returns:
    Advantages, whose `stats` holds (flat keys, float values): `num_trees`, `num_groups`,
    `num_nodes`, `nodes/depth_d`, `reward/depth_d`, `success/depth_d`, `weight/depth_d`,
    `source_frac/<source>`, `groups_all_equal` and `groups_all_equal_frac` (groups whose root
    rewards are all equal: dropped with `drop_equal_groups`, else every advantage in them is
    R(v) - R(root), zero at the roots), `groups_dropped`, `signal` (1 when some trained node
    has w_d * A != 0),
    `root_reward_mean`, `advantage_abs_mean` (over every node, dropped ones at 0),
    `advantage_abs_mean_trained` (over the nodes in the learner batch), `max_depth`, `pass_through_nodes` (nodes that
    only forwarded their own goal to one child) and `train_nodes` (nodes in the learner batch).

  Raises:
    ValueError: a group with fewer than 2 trees, a success outside [0, 1], an unscored root,
      an unknown success source, a child id missing from its tree, lam < 0, an unknown
      option value or child_keep_prob outside (0, 1].
  """
  if advantage not in ADVANTAGES:
    raise ValueError(f"advantage={advantage!r}: use one of {ADVANTAGES} (\"node\" is RAO).")
  if train_nodes not in TRAIN_NODES:
    raise ValueError(f"train_nodes={train_nodes!r}: use one of {TRAIN_NODES} (\"all\" is RAO).")
  for name, value, allowed in (("bonus", bonus, BONUSES), ("baseline", baseline, BASELINES),
                               ("node_rewards", node_rewards, NODE_REWARDS)):
    if value not in allowed:
      raise ValueError(f"{name}={value!r}: use one of {allowed} ({allowed[0]!r} is RAO).")
  if not isinstance(drop_equal_groups, bool):
    raise ValueError(f"drop_equal_groups={drop_equal_groups!r}: must be True or False.")
  if not (isinstance(child_keep_prob, (int, float)) and 0 < child_keep_prob <= 1):
    raise ValueError(f"child_keep_prob={child_keep_prob!r}: must be in (0, 1] (1 keeps every "
                     "node; the RAO authors' code keeps children with 0.25).")
  if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
    raise ValueError(f"lam={lam!r}: the delegation bonus lambda must be a finite number >= 0 "
                     "(RAO_SPEC uses 0.5).")
  trees = list(trees)
  if not trees:
    raise ValueError("compute_rewards_and_advantages got no trees; a learner batch needs at least "
                     "one group of K >= 2 trees.")

  tree_ids, node_ids, tree_index, depths, succs, sources, rewards = [], [], [], [], [], [], []
  root_reward, root_success = [], []
  passes = []   # per node: it only forwarded its own goal to one child
  seen_tree_ids = set()
  for k, tree in enumerate(trees):
    if tree.tree_id in seen_tree_ids:
      raise ValueError(f"Tree id {tree.tree_id!r} appears twice in the batch; tree ids must be "
                       "unique (each sampled tree once).")
    seen_tree_ids.add(tree.tree_id)
    succ, src, depth, root_s = _resolve_tree(tree)
    index_of = {node.node_id: i for i, node in enumerate(tree.nodes)}
    if len(index_of) != len(tree.nodes):
      raise ValueError(f"Tree {tree.tree_id!r} has duplicate node ids.")
    # The success that rewards see: each node's own, or the root's for every node.
    reward_s = succ if node_rewards == "dense" else [root_s] * len(succ)
    by_id = {node.node_id: node for node in tree.nodes}
    for i, node in enumerate(tree.nodes):
      kids = list(node.children or ())
      for c in kids:
        if c not in index_of:
          raise ValueError(f"Tree {tree.tree_id!r} node {node.node_id!r} lists child {c!r}, "
                           "which is not a node of the tree; the record is incomplete.")
      # The delegation bonus uses the children's resolved successes (proxy filled in).
      kid_s = [reward_s[index_of[c]] for c in kids]
      extra = 0.0
      if kids:
        extra = lam * float(np.mean(kid_s) if bonus == "rate" else np.sum(kid_s))
      passes.append(is_pass_through(node, by_id))
      rewards.append(0.0 if pass_through_gate and passes[-1] else reward_s[i] + extra)
      tree_ids.append(tree.tree_id)
      node_ids.append(node.node_id)
      tree_index.append(k)
    root_reward.append(rewards[len(rewards) - len(tree.nodes)])
    root_success.append(reward_s[0])
    depths.extend(depth)
    succs.extend(succ)
    sources.extend(src)

  # Leave-one-out baseline from the ROOT rewards of the other trees of the same group.
  groups: dict[Any, list[int]] = collections.OrderedDict()
  for k, tree in enumerate(trees):
    groups.setdefault(tree.group_id, []).append(k)
  baseline_tree = np.zeros(len(trees))
  dropped_tree = np.zeros(len(trees), bool)
  groups_all_equal = 0
  for gid, members in groups.items():
    if len(members) < 2:
      raise ValueError(
          f"Group {gid!r} has {len(members)} tree(s); the leave-one-out baseline needs K >= 2 "
          "trees per root task. Fix: set the group size (config rl.group_size) to >= 2 and keep "
          "all K trees of a task in the same learner batch.")
    roots = np.array([root_reward[k] for k in members])
    # What the baseline averages: the roots' successes (on a leaf's scale) or their rewards.
    base = np.array([root_success[k] for k in members]) if baseline == "loo_success" else roots
    total = base.sum()
    for k, r in zip(members, base):
      baseline_tree[k] = (total / len(members) if baseline == "group_mean"
                          else (total - r) / (len(members) - 1))
    if np.all(roots == roots[0]):
      groups_all_equal += 1
      dropped_tree[members] = drop_equal_groups

  tree_index_N = np.asarray(tree_index, np.int32)
  depth_N = np.asarray(depths, np.int32)
  reward_N = np.asarray(rewards, np.float64)
  baseline_N = baseline_tree[tree_index_N]
  advantage_N = reward_N - baseline_N
  if advantage == "tree":
    first = {}
    for i, k in enumerate(tree_index):   # a tree's root is its first node
      first.setdefault(k, i)
    root_index_N = np.asarray([first[k] for k in tree_index], np.int64)
    advantage_N = advantage_N[root_index_N]
  train_N = np.ones(len(depth_N), bool) if train_nodes == "all" else depth_N == 0
  dropped_N = dropped_tree[tree_index_N]
  advantage_N = np.where(dropped_N, 0.0, advantage_N)
  train_N &= ~dropped_N
  if child_keep_prob < 1:
    # One draw per node in flat order, roots included, so a node's draw does not depend on
    # how many children came before it in other trees.
    keep_N = np.random.default_rng(_keep_seed(trees, seed)).random(len(depth_N)) < child_keep_prob
    train_N &= (depth_N == 0) | keep_N

  # Depth-level inverse-frequency weights over the learner batch (the trained nodes):
  # w_d = N / (D' * n_d).
  n = len(depth_N)
  levels, counts = np.unique(depth_N, return_counts=True)
  t_levels, t_counts = np.unique(depth_N[train_N], return_counts=True)
  # Every node dropped: no level is populated and no weight is due (the batch has no signal).
  n_train = int(train_N.sum())
  w_of_depth = {int(d): (n_train / (len(t_levels) * c) if depth_weights else 1.0)
                for d, c in zip(t_levels, t_counts)}
  weight_N = np.asarray([w_of_depth.get(int(d), 0.0) if keep else 0.0
                         for d, keep in zip(depth_N, train_N)], np.float64)
  success_N = np.asarray(succs, np.float64)

  stats: dict[str, float] = {
      "num_trees": float(len(trees)),
      "num_groups": float(len(groups)),
      "num_nodes": float(n),
      "max_depth": float(depth_N.max()),
      "groups_all_equal": float(groups_all_equal),
      "groups_all_equal_frac": groups_all_equal / len(groups),
      "groups_dropped": float(groups_all_equal if drop_equal_groups else 0),
      "root_reward_mean": float(np.mean(root_reward)),
      "advantage_abs_mean": float(np.mean(np.abs(advantage_N))),
      "advantage_abs_mean_trained": (float(np.mean(np.abs(advantage_N[train_N])))
                                     if n_train else 0.0),
      "pass_through_nodes": float(sum(passes)),
      "train_nodes": float(n_train),
  }
  for d, c in zip(levels, counts):
    sel = depth_N == d
    stats[f"nodes/depth_{d}"] = float(c)
    stats[f"reward/depth_{d}"] = float(reward_N[sel].mean())
    stats[f"success/depth_{d}"] = float(success_N[sel].mean())
    stats[f"weight/depth_{d}"] = float(w_of_depth.get(int(d), 0.0))
  for s in SOURCES:
    stats[f"source_frac/{s}"] = sum(1 for x in sources if x == s) / n

  out = Advantages(
      tree_ids=tuple(tree_ids), node_ids=tuple(node_ids), tree_index_N=tree_index_N,
      depth_N=depth_N, success_N=success_N, source_N=tuple(sources), reward_N=reward_N,
      baseline_N=baseline_N, advantage_N=advantage_N, weight_N=weight_N, stats=stats,
      train_N=train_N)
  stats["signal"] = float(out.has_signal)
  return out
