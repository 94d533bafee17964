"""Metrics sinks: a JSONL file (always), TensorBoard (optional) and the end-of-run plot.

Every record is flat `{name: float}` plus `step`; the JSONL file is the source of truth that
the plot and external tools read, so a crashed run still leaves every metric it logged.
"""
from __future__ import annotations

import json
import math
import os
from typing import Mapping

from rao_jax.agent import view


class MetricsWriter:
  """Appends metrics to `workdir/metrics.jsonl` and, optionally, TensorBoard event files."""

  def __init__(self, workdir: str, tensorboard: bool = True, filename: str = "metrics.jsonl"):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, filename)
    # Line-buffered append: a crash loses at most the line being written.
    self._f = open(self.path, "a", buffering=1, encoding="utf-8")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
    clean = {}
    for k, v in metrics.items():
      try:
        v = float(v)
      except (TypeError, ValueError):
        continue
      clean[prefix + k] = v if math.isfinite(v) else None
    self._f.write(json.dumps({"step": int(step), **clean}) + "\n")
    if self._tb is not None:
      for k, v in clean.items():
        if v is not None:
          self._tb.add_scalar(k, v, int(step))

  def close(self) -> None:
    self._f.close()
    if self._tb is not None:
      self._tb.close()


def read_metrics(path: str) -> list[dict]:
  """Reads a metrics JSONL file, skipping a torn last line left by a crash."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows


def plot_metrics(path: str, out_png: str, keys: tuple[str, ...] | None = None) -> str | None:
  """Plots reward and success curves over steps from a metrics JSONL file into a PNG.

  Returns the PNG path, or None when there is nothing to plot.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  rows = read_metrics(path)
  if keys is None:
    keys = sorted({k for r in rows for k in r
                   if k != "step" and ("reward" in k or "success" in k or
                                       k.endswith("delegating_share")) and "depth" not in k})
  series = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in keys}
  series = {k: v for k, v in series.items() if v}
  if not series:
    return None
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for k, pts in series.items():
    xs, ys = zip(*pts)
    ax.plot(xs, ys, marker="o", markersize=3, label=k)
  ax.set_xlabel("step")
  ax.set_ylabel("value")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="best")
  fig.tight_layout()
  fig.savefig(out_png, dpi=120)
  plt.close(fig)
  return out_png


def tree_stats(trees) -> dict[str, float]:
  """Shape statistics of a batch of execution trees (records of `rao_jax.agent.records`).

  Returns means over trees of: max depth, nodes, fan-out of nodes that delegated, generated
  tokens per tree, wall-clock seconds; the share of trees whose root delegated (launched at
  least one helper); and the share of child launches that ran in parallel with a sibling
  (their [start, end] intervals overlap), the signature of `asyncio.gather`.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  if not trees:
    return {}
  depth, nodes, fanout, tokens, wall = [], [], [], [], []
  children_total, children_parallel = 0, 0
  for t in trees:
    depth.append(max(n.depth for n in t.nodes))
    nodes.append(len(t.nodes))
    tokens.append(sum(n.num_generated_tokens for n in t.nodes))
    wall.append(float(t.meta.get("wall_s", t.root.timings.get("end", 0.0))))
    by_id = {n.node_id: n for n in t.nodes}
    for n in t.nodes:
      if not n.children:
        continue
      fanout.append(len(n.children))
      spans = [(by_id[c].timings.get("start", 0.0), by_id[c].timings.get("end", 0.0))
               for c in n.children if c in by_id]
      for i, (s0, e0) in enumerate(spans):
        children_total += 1
        if any(j != i and s0 < e1 and s1 < e0 for j, (s1, e1) in enumerate(spans)):
          children_parallel += 1
  return {
      "tree_depth": float(np.mean(depth)),
      "tree_nodes": float(np.mean(nodes)),
      "tree_fanout": float(np.mean(fanout)) if fanout else 0.0,
      "delegating_share": float(np.mean([bool(t.nodes[0].children) for t in trees])),
      "tree_tokens": float(np.mean(tokens)),
      "tree_wall_s": float(np.mean(wall)),
      "parallel_launch_share": children_parallel / children_total if children_total else 0.0,
  }


def write_html(trees, path: str, title: str = "RAO execution trees") -> str:
  """Writes the self-contained HTML tree view of `trees` (see `rao_jax.agent.view`)."""
  with open(path, "w", encoding="utf-8") as f:
    f.write(view.render_html(trees, title=title))
  return path
