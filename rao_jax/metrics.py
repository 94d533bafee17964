"""Metrics sinks: a JSONL file (always), TensorBoard (optional) and the end-of-run plot.

Every record is flat `{name: float}` plus `step`; the JSONL file is the source of truth that
the plot and external tools read, so a crashed run still leaves every metric it logged.
"""
from __future__ import annotations

import json
import math
import os
import re
import textwrap
import time
import uuid
from typing import Mapping

from rao_jax.agent import view


# JAX's duration events of one compilation: tracing, lowering, XLA's compile, and loading the
# executable from the persistent cache instead.
COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                  "/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/compilation_cache/cache_retrieval_time_sec")


class CompileClock:
  """Seconds this process spent compiling, from JAX's monitoring events (any thread).

  ``compile_clock()`` gives the process's one clock (a JAX listener cannot be removed, so it is
  registered once). ``between(a, b)`` sums compilations that ended in [a, b] (perf_counter).
  """

  def __init__(self):
    import jax  # pylint: disable=g-import-not-at-top
    self.events: list[tuple[float, float]] = []
    jax.monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, event, duration, **kwargs):
    del kwargs
    if event in COMPILE_EVENTS:
      self.events.append((time.perf_counter(), float(duration)))

  def between(self, a: float, b: float) -> float:
    return sum(d for t, d in self.events if a <= t <= b)


_CLOCK: list[CompileClock] = []


def compile_clock() -> CompileClock:
  if not _CLOCK:
    _CLOCK.append(CompileClock())
  return _CLOCK[0]


class MetricsWriter:
  """Appends metrics to `workdir/metrics.jsonl` and, optionally, TensorBoard event files."""

  def __init__(self, workdir: str, tensorboard: bool = True, filename: str = "metrics.jsonl",
               purge_step: int | None = None):
    """`purge_step`: a resumed run's first step; TensorBoard hides the events an earlier attempt
    logged from that step on (the JSONL file is rewound by `set_aside_superseded`)."""
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, filename)
    # Line-buffered append: a crash loses at most the line being written.
    self._f = open(self.path, "a", buffering=1, encoding="utf-8")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=purge_step)

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


def _fsync_dir(path: str) -> None:
  """Makes a rename in directory `path` durable (the entry, not only the file, on disk)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_atomically(path: str, data: bytes) -> None:
  """Replaces `path` by `data` so that a crash leaves either the old file or the new one: a
  temporary file beside it, fsynced, renamed over it, and the directory fsynced."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _dedupe_key(row: dict) -> str:
  return json.dumps({k: v for k, v in row.items() if k != "superseded"}, sort_keys=True)


def set_aside_superseded(workdir: str, step: int, step_entries: Mapping[str, int] = (),
                         metrics_file: str = "metrics.jsonl") -> dict[str, int]:
  """Moves what an abandoned attempt wrote after `step` out of a run's records, keeping it aside.

  A run that resumes from its checkpoint of `step` redoes the steps after it; the rows and files
  the killed attempt wrote for them would otherwise sit beside the new attempt's (a step twice
  in metrics.jsonl). Rows of `metrics_file` with a step > `step` (and a torn last line) move to
  `<name>.superseded.jsonl`, each marked with ``"superseded": {"at", "resumed_from_step"}``;
  entries named ``step_NNNNNN`` (files or folders) of each directory in `step_entries` numbered
  at or after its given first number move to ``superseded/<time>-step<step>/<directory>/``.

  Crash-safe: the aside file is rewritten first (a temporary file, fsync, rename), then the
  metrics file the same way, and each entry moves by one rename; a crash between two of these
  leaves every row at least once, and the next resume finishes the job without writing a row
  aside twice.

  Args:
    workdir: the run's directory.
    step: the step the run resumes from (rows up to it stay).
    step_entries: {directory relative to `workdir`: its first superseded number}.
    metrics_file: the metrics file's name in `workdir`.

  Returns:
    {"metrics": rows moved, <directory>: entries moved, ...}.
  """
  moved = {"metrics": 0}
  stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
  marker = {"at": stamp, "resumed_from_step": int(step)}
  path = os.path.join(workdir, metrics_file)
  if os.path.exists(path):
    with open(path, "rb") as f:
      data = f.read()
    keep, aside = [], []
    for raw in data.splitlines(keepends=True):
      if not raw.strip():
        continue
      try:
        row = json.loads(raw)
        past = int(row["step"]) > step
      except (ValueError, KeyError, TypeError):   # a line torn by the crash: kept aside too
        row, past = {"unreadable_line": raw.decode("utf-8", "replace").rstrip("\n")}, True
      if past:
        aside.append(dict(row, superseded=marker))
      else:   # the last line may lack its newline; the next row would be glued to it
        keep.append(raw if raw.endswith(b"\n") else raw + b"\n")
    if aside or b"".join(keep) != data:
      aside_path = os.path.join(workdir, metrics_file.rsplit(".jsonl", 1)[0] + ".superseded.jsonl")
      old = open(aside_path, "rb").read() if os.path.exists(aside_path) else b""
      if old and not old.endswith(b"\n"):
        old += b"\n"
      seen = {_dedupe_key(r) for r in read_metrics(aside_path)} if old else set()
      new = [r for r in aside if _dedupe_key(r) not in seen]
      if new:
        write_atomically(aside_path, old + b"".join(json.dumps(r).encode() + b"\n" for r in new))
      write_atomically(path, b"".join(keep))
      moved["metrics"] = len(aside)
  attempt = None
  for sub, first in dict(step_entries).items():
    d = os.path.join(workdir, sub)
    names = sorted(n for n in (os.listdir(d) if os.path.isdir(d) else [])
                   if (m := re.fullmatch(r"step_(\d+)(\.jsonl)?", n)) and int(m[1]) >= first)
    if names:
      if attempt is None:   # one new folder per resume: nothing there is ever overwritten
        base = attempt = os.path.join(workdir, "superseded", f"{stamp}-step{int(step):06d}")
        while os.path.exists(attempt):
          attempt = f"{base}-{uuid.uuid4().hex[:6]}"
      dest = os.path.join(attempt, sub)
      os.makedirs(dest, exist_ok=True)
      for n in names:
        os.rename(os.path.join(d, n), os.path.join(dest, n))
      _fsync_dir(d)
      _fsync_dir(dest)
    moved[sub] = len(names)
  return moved


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


_NAMES = {"success": "success", "reward": "root reward", "rl/root_reward_mean": "root reward",
          "delegating_share": "share of trees delegating",
          "drift/at_depth_limit": "nodes at the depth limit",
          "drift/helpers_outside_root": "helpers outside their root's task",
          "drift/helpers_outside_parent": "helpers outside their parent's task",
          "drift/groups_all_equal": "groups with equal root rewards",
          "drift/update_applied": "update applied (1 = yes)"}
_SOURCES = {"train": "sampled trees", "eval": "held-out, greedy"}


def metric_label(key: str) -> str:
  """A readable name for a metric key: "train/success_medium" -> "success on medium (sampled
  trees)"."""
  src, _, name = key.partition("/")
  where = _SOURCES.get(src)
  if where is None:
    src, name, where = "", key, ""
  if name in _NAMES:
    text = _NAMES[name]
  elif name.startswith("success_"):
    text = f"success on {name[len('success_'):].replace('_', ' ')}"
  else:
    text = name.replace("/", " ").replace("_", " ")
  return f"{text} ({where})" if where else text


def plot_series(rows: list[dict], keys: tuple[str, ...] | None = None
                ) -> list[tuple[str, list[tuple[int, float]]]]:
  """(label, points) of each curve to draw. Curves with the same points are drawn once, under
  a label naming all of them ("a = b"), so none hides under another; a metric identical to its
  own split by difficulty is named by the split alone."""
  if keys is None:
    keys = sorted({k for r in rows for k in r
                   if k != "step" and ("reward" in k or "success" in k or
                                       k.endswith("delegating_share")) and "depth" not in k
                   and "/drift/" not in k})
  merged: dict[tuple, list[str]] = {}
  for k in keys:
    pts = tuple((r["step"], r[k]) for r in rows if r.get(k) is not None)
    if pts:
      merged.setdefault(pts, []).append(k)
  out = []
  for pts, ks in merged.items():
    # A metric and its one split ("train/success" and "train/success_easy" when every task is
    # easy) are the same curve: name it once, by the split, not "success = success on easy".
    ks = [k for k in ks if not any(o.startswith(k + "_") for o in ks)]
    labels = list(dict.fromkeys(metric_label(k) for k in ks))
    # Curves from one source say it once: "success = root reward (sampled trees)".
    wheres = {lb[lb.rfind(" ("):] for lb in labels if lb.endswith(")") and " (" in lb}
    if len(labels) > 1 and len(wheres) == 1 and all(lb.endswith(next(iter(wheres)))
                                                    for lb in labels):
      where = next(iter(wheres))
      labels = [" = ".join(lb[:-len(where)] for lb in labels) + where]
    out.append((" = ".join(labels), list(pts)))
  return out


def plot_metrics(path: str, out_png: str, keys: tuple[str, ...] | None = None) -> str | None:
  """Plots reward and success curves over steps from a metrics JSONL file into a PNG, and, when
  the run logged them, its drift shares (`drift_stats`) in a second panel under them.

  Returns the PNG path, or None when there is nothing to plot.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top

  rows = read_metrics(path)
  series = plot_series(rows, keys)
  if not series:
    return None
  drift = plot_series(rows, tuple(f"train/{k}" for k in DRIFT_KEYS)) if keys is None else []
  fig, axes = plt.subplots(2 if drift else 1, 1, figsize=(8, 7.5 if drift else 4.5),
                           sharex=True, squeeze=False)
  styles = ("-", "--", ":", "-.")
  for ax, curves, ylabel in ((axes[0][0], series, "value"),
                             (axes[-1][0] if drift else None, drift, "share of the step")):
    if ax is None:
      continue
    for i, (label, pts) in enumerate(curves):
      xs, ys = zip(*pts)
      # Wrapped, so a legend naming several identical curves stays inside its panel.
      ax.plot(xs, ys, marker="o", markersize=3, linestyle=styles[i % len(styles)],
              label=textwrap.fill(label, 60))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole numbers
  axes[-1][0].set_xlabel("RL step")
  if drift:
    axes[-1][0].set_title("drift: what moves before success does", fontsize=9)
  fig.tight_layout()
  fig.savefig(out_png, dpi=120)
  plt.close(fig)
  return out_png


# The per-step signs of a policy drifting away from its task (`drift_stats` and the trainer).
DRIFT_KEYS = ("drift/at_depth_limit", "drift/helpers_outside_root",
              "drift/helpers_outside_parent", "drift/task_retyped", "drift/groups_all_equal",
              "drift/update_applied")


def drift_stats(trees, max_depth: int) -> dict[str, float]:
  """Shares that show a policy drifting, per RL step, before held-out success does.

  Args:
    trees: the step's tree records.
    max_depth: the recursion depth limit (a node there may launch no helper).

  Returns:
    `drift/at_depth_limit`: the share of nodes at depth >= max_depth (helpers sent where they
      can delegate no further; a policy that over-delegates fills this level first);
    `drift/helpers_outside_root` and `drift/helpers_outside_parent`: of the helpers whose
      environment checked their task at launch (`NodeRecord.extras["scope"]`), the share whose
      task names something outside their root's task, and outside their parent's own task
      (TextCraft: items outside the recipe closure, or a target at a higher count): a goal
      retyped with invented or repeated items. Absent when no helper was checked (an
      environment that cannot tell), 0 when there was no helper.
    `drift/task_retyped`: of the nodes given their task as REPL variables
      (`NodeRecord.extras["task_vars"]`), the share whose code rebinds or mutates one of them
      (`code_rewrites`): a node working from its own copy of its task. Absent when no node had
      one.
    The trainer adds `drift/groups_all_equal` (groups whose roots got equal rewards, which carry
    no signal) and `drift/update_applied`.
  """
  nodes = [n for t in trees for n in t.nodes]
  if not nodes:
    return {}
  out = {"drift/at_depth_limit": sum(int(n.depth) >= max_depth for n in nodes) / len(nodes)}
  helpers = [n for n in nodes if int(n.depth) > 0]
  scopes = [n.extras.get("scope") for n in helpers]
  scopes = [sc for sc in scopes if isinstance(sc, dict)]
  if scopes or not helpers:
    for key in ("outside_root", "outside_parent"):
      out[f"drift/helpers_{key}"] = (sum(bool(sc.get(key)) for sc in scopes) / len(scopes)
                                     if scopes else 0.0)
  given = [n for n in nodes if n.extras.get("task_vars")]
  if given:
    out["drift/task_retyped"] = sum(
        any(code_rewrites(t.get("code"), n.extras["task_vars"]) for t in n.extras.get("turns", []))
        for n in given) / len(given)
  return out


# Methods that change a dict or list in place: calling one on a task variable rewrites it.
_MUTATING = frozenset({"update", "pop", "popitem", "clear", "setdefault", "append", "extend",
                       "insert", "remove", "sort", "reverse", "__setitem__", "__delitem__"})


def code_rewrites(code, names) -> bool:
  """Whether a cell's code rebinds or mutates any of `names`: `targets = {...}`,
  `targets["x"] = 2`, `targets |= {...}`, `del targets["x"]`, `targets.update(...)`, a `for`,
  `with` or walrus target of that name. Reading the variable (`targets.items()`,
  `dict(targets)`) is not. Code that does not parse (the REPL rejected it too) is not."""
  import ast  # pylint: disable=g-import-not-at-top
  if not isinstance(code, str) or not code.strip():
    return False
  try:
    tree = ast.parse(code)
  except (SyntaxError, ValueError):
    return False
  names = set(names)

  def root_name(node):
    while isinstance(node, (ast.Subscript, ast.Attribute, ast.Starred)):
      node = node.value
    return node.id if isinstance(node, ast.Name) else None

  for node in ast.walk(tree):
    if isinstance(node, (ast.Assign, ast.Delete)):
      targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
      targets = [node.target]
    elif isinstance(node, ast.withitem):
      targets = [node.optional_vars] if node.optional_vars is not None else []
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
      if node.func.attr in _MUTATING and root_name(node.func.value) in names:
        return True
      continue
    else:
      continue
    for t in targets:
      for leaf in ast.walk(t):
        # A store into the variable or into a part of it (not `x[targets["a"]] = 1`).
        if (isinstance(getattr(leaf, "ctx", None), (ast.Store, ast.Del))
            and root_name(leaf) in names):
          return True
  return False


def tree_stats(trees) -> dict[str, float]:
  """Shape statistics of a batch of execution trees (records of `rao_jax.agent.records`).

  Returns means over trees of: max depth, nodes, fan-out of nodes that delegated, generated
  tokens per tree, wall-clock seconds; the share of trees whose root delegated (launched at
  least one helper); and the share of child launches that ran in parallel with a sibling
  (their [start, end] intervals overlap), the signature of `asyncio.gather`; and the
  pass-through share: of all children, those whose goal equals their parent's (a helper given
  the whole task it was asked to do rather than a part of it).
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  if not trees:
    return {}
  depth, nodes, fanout, tokens, wall = [], [], [], [], []
  children_total, children_parallel, children_same_goal = 0, 0, 0
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
      children_same_goal += sum(
          c in by_id and isinstance(n.goal, str) and isinstance(by_id[c].goal, str)
          and by_id[c].goal.strip() == n.goal.strip() for c in n.children)
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
      "pass_through_share": children_same_goal / children_total if children_total else 0.0,
  }


def write_html(trees, path: str, title: str = "RAO execution trees") -> str:
  """Writes the self-contained HTML tree view of `trees` (see `rao_jax.agent.view`)."""
  with open(path, "w", encoding="utf-8") as f:
    f.write(view.render_html(trees, title=title))
  return path
