"""The benchmarks and experiments import only names that exist.

Their imports of rao_jax are mostly inside functions (a benchmark loads what its chosen part
needs), so a rename in the package breaks them only when that part runs, possibly on a lent GPU
or hours into an experiment. This reads every `from rao_jax... import name` (and experiments',
benchmarks') in those scripts, local ones too, and checks that the module has the name.
"""
import ast
import glob
import importlib
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
                 + glob.glob(os.path.join(ROOT, "experiments", "**", "*.py"), recursive=True))
OURS = ("rao_jax", "experiments", "benchmarks")


def top_level_names(path: str) -> set[str]:
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
        names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
  return names


def missing_names(path: str) -> list[str]:
  """`module.name` of each `from module import name` in `path` that does not resolve."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  out = []
  for node in ast.walk(tree):
    if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and node.module.split(".")[0] in OURS):
      continue
    mod = None
    try:
      mod = importlib.import_module(node.module)
      names = set(dir(mod))
    except ImportError as e:
      out.append(f"{node.module} (line {node.lineno}: {e})")
      continue
    except Exception:  # pylint: disable=broad-except
      # An entry point whose flags another script's module already defined in this process
      # (absl's DuplicateFlagError): its top-level names, read without running it.
      names = top_level_names(importlib.util.find_spec(node.module).origin)
    for alias in node.names:
      # hasattr: a package's lazy names (its __getattr__) are not in dir()
      if alias.name == "*" or alias.name in names or (mod and hasattr(mod, alias.name)):
        continue
      # A submodule its package does not import (found, not run: an entry point's flags).
      try:
        found = importlib.util.find_spec(f"{node.module}.{alias.name}") is not None
      except ImportError:   # the module is not a package
        found = False
      if not found:
        out.append(f"{node.module}.{alias.name} (line {node.lineno})")
  return out


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_script_imports_resolve(path):
  assert missing_names(path) == []


def test_a_renamed_name_is_caught(tmp_path):
  script = tmp_path / "bench_x.py"
  script.write_text("def part():\n  from rao_jax.model.transformer import no_such_function\n"
                    "  from rao_jax.metrics import drift_stats\n")
  assert missing_names(str(script)) == ["rao_jax.model.transformer.no_such_function (line 2)"]
