"""What the documentation generators share: the repository's paths, the committed results'
reader, and how a figure is printed (k/n with a Wilson interval, signed effects, links).

`RESULTS` is read at call time, so a test can point every generator at other results by
setting it here.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:   # the statistics (numpy only) come from the package
  sys.path.insert(0, ROOT)
# pylint: disable-next=wrong-import-position
from rao_jax.stats import wilson_ci95  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")


def count(rate: float, n: int) -> int:
  """The number of successes behind a success rate of n tasks (the JSONs store rates)."""
  k = round(rate * n)
  if abs(k - rate * n) > 1e-6:
    raise ValueError(f"a rate of {rate} over {n} tasks is not a whole number of tasks.")
  return k


def frac(rate: float, n: int) -> str:
  """'k/n [lo, hi]' with the Wilson interval."""
  k = count(rate, n)
  lo, hi = wilson_ci95(k, n)
  return f"{k}/{n} [{lo:.2f}, {hi:.2f}]"


def signed(x: float) -> str:
  return f"{x:+.2f}"


def delta_ci(d: dict) -> str:
  """'+0.34 [0.23, 0.46]' from {"delta", "ci95"}."""
  lo, hi = d["ci95"]
  return f"{signed(d['delta'])} [{lo:.2f}, {hi:.2f}]"


def rel(path: str, page: str) -> str:
  """A link target for `path` (repository-relative) from the page at `page`."""
  return os.path.relpath(os.path.join(ROOT, path), os.path.dirname(os.path.join(ROOT, page)))


def load_json(name: str) -> dict | None:
  """A result file under benchmarks/results/; of a JSON-lines file (a benchmark appends one
  line a run), its last run. None when the file is not there."""
  path = os.path.join(RESULTS, name)
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    text = f.read()
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return json.loads([ln for ln in text.splitlines() if ln.strip()][-1])
