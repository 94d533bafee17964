"""Imports point down: every module of rao_jax imports only its own package and lower layers.

Every import statement is checked, the function-local ones too (a local import is still a
dependency; it only hides it until the function runs). The layers are data below; a new package
must be placed in them before its first import passes.
"""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Low to high. A module may import modules of its own entry and of entries in LOWER layers;
# entries of one layer are independent of each other. An entry names a package or a module
# (the longest entry that contains a module is its own); "rao_jax" is the root module alone.
LAYERS = [
    # Leaves: the package root (docs), the logical-axis sharding table (kernels and model both
    # place arrays by it), the tree schema (plain data the agent writes and the learner reads),
    # the host allocator setting, the statistics of results (numpy only).
    ["rao_jax", "rao_jax.model.sharding", "rao_jax.agent.records", "rao_jax.host_memory",
     "rao_jax.stats"],
    ["rao_jax.kernels"],                      # platform kernels
    ["rao_jax.model"],                        # the policy model, weights, tokenizer
    # Generation, the REPL sandbox and the learner: each needs the model at most, and none of
    # them knows the others.
    ["rao_jax.rollout", "rao_jax.sandbox_host", "rao_jax.learner"],
    # The HTTP server: the engine behind SGLang's API, serving models or a run's checkpoint
    # (read with the learner's checkpoint module).
    ["rao_jax.rollout.serve"],
    ["rao_jax.envs"],                         # tasks, verifiers, judges (a judge generates)
    ["rao_jax.agent"],                        # the recursive runtime: envs + an engine + REPLs
    ["rao_jax.metrics", "rao_jax.hooks"],     # metrics files, plots, tree pages; loop hooks
    ["rao_jax.run_parts"],                    # the typed parts of a run: settings and specs
    ["rao_jax.experiment"],                   # a loose config -> the typed parts of a run
    ["rao_jax.collection"],                   # a step's trees under the fault rules, progress
    ["rao_jax.trainer", "rao_jax.sft", "rao_jax.evaluation"],   # the runs
    ["rao_jax.testing"],                      # test fixtures over any of the above
    ["rao_jax.cli"],                          # console entry points (rao-train, ...) over the runs
    ["experiments"],                          # configs and entry points (not part of rao_jax)
]

# (importer, imported, why): the only imports allowed to point up. Each names an entry or a
# module; keep the reason honest and remove the line when the import goes.
EXCEPTIONS: list[tuple[str, str, str]] = []


def _entries():
  return {e: i for i, layer in enumerate(LAYERS) for e in layer}


def _entry(module: str, entries) -> str | None:
  """The longest entry holding `module` ("rao_jax" holds only itself), or None."""
  best = None
  for e in entries:
    inside = module == e or (e != "rao_jax" and module.startswith(e + "."))
    if inside and (best is None or len(e) > len(best)):
      best = e
  return best


def _modules() -> dict[str, str]:
  """module name -> file, for every module of rao_jax."""
  out = {}
  for d, dirs, files in os.walk(os.path.join(ROOT, "rao_jax")):
    dirs[:] = [x for x in dirs if x != "__pycache__"]
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(d, f)
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
  return out


def imports(path: str, module: str, known) -> list[tuple[int, str]]:
  """(line, imported module) of every import in the file, at any depth; `from p import x`
  counts as p.x where that is a module of `known`, else as p."""
  package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      for a in node.names:
        full = f"{base}.{a.name}"
        out.append((node.lineno, full if full in known else base))
  return out


def violations(modules: dict[str, str]) -> list[str]:
  entries = _entries()
  bad = []
  for module, path in sorted(modules.items()):
    own = _entry(module, entries)
    if own is None:
      bad.append(f"{module} is in no layer of tests/test_layers.py: add its package to LAYERS")
      continue
    for line, target in imports(path, module, modules):
      if target.split(".")[0] not in ("rao_jax", "experiments"):
        continue
      theirs = _entry(target, entries)
      if theirs is None:
        bad.append(f"{module}:{line} imports {target}, which is in no layer")
        continue
      if theirs == own or entries[theirs] < entries[own]:
        continue
      if any(_entry(module, [imp]) and _entry(target, [dep]) for imp, dep, _ in EXCEPTIONS):
        continue
      how = "its own layer" if entries[theirs] == entries[own] else "a higher layer"
      bad.append(f"{module}:{line} imports {target} ({theirs}: {how} than {own})")
  return bad


def test_imports_point_down():
  bad = violations(_modules())
  assert not bad, "imports that point up or sideways:\n  " + "\n  ".join(bad)


def test_every_exception_is_still_needed():
  # A listed exception whose import is gone must leave the list (it would hide a new one).
  modules = _modules()
  for importer, imported, _ in EXCEPTIONS:
    used = any(_entry(target, [imported])
               for module, path in modules.items() if _entry(module, [importer])
               for _, target in imports(path, module, modules))
    assert used, f"EXCEPTIONS lists {importer} -> {imported}, which no longer happens"


def test_the_check_catches_an_upward_import_local_or_not(tmp_path):
  # The model may not import the learner, not even inside a function; a relative import
  # resolves like an absolute one.
  model = tmp_path / "rao_jax" / "model"
  model.mkdir(parents=True)
  (model / "__init__.py").write_text("")
  (model / "a.py").write_text("def f():\n  from rao_jax.learner import step\n")
  (model / "b.py").write_text("from ..learner import config\nfrom . import a\n")
  (model / "c.py").write_text("import experiments.configs.base\n")
  found = violations({"rao_jax.model": str(model / "__init__.py"),
                      **{f"rao_jax.model.{n}": str(model / f"{n}.py") for n in "abc"}})
  assert [v.split(" (")[0] for v in found] == [
      "rao_jax.model.a:2 imports rao_jax.learner",
      "rao_jax.model.b:1 imports rao_jax.learner",
      "rao_jax.model.c:1 imports experiments.configs.base"], found
  assert "a higher layer than rao_jax.model" in found[0]


@pytest.mark.parametrize("module", ["rao_jax.rollout.base", "rao_jax.rollout", "rao_jax.learner",
                                    "rao_jax.model", "rao_jax.kernels", "rao_jax.agent.runner",
                                    "rao_jax.envs.registry", "rao_jax.experiment",
                                    "rao_jax.run_parts",
                                    "rao_jax.rollout.serve.schema",
                                    "rao_jax.rollout.serve.openai_schema"])
def test_light_modules_do_not_load_jax(module):
  # Host-side code (the agent runtime, a server's request shapes, reward arithmetic, config
  # building) imports these; package re-exports are lazy so that they do not load JAX, Flax or
  # aiohttp until a name that needs them is used.
  code = (f"import sys, {module}\n"
          "heavy = sorted(m for m in ('jax', 'flax', 'aiohttp', 'optax') if m in sys.modules)\n"
          "print(','.join(heavy))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=True).stdout.strip()
  assert out == "", f"import {module} loaded {out}"


# ---- a run is assembled in one place -----------------------------------------------------------
# `experiment.assemble` reads a training run's config, once, into typed parts (rao_jax.run_parts);
# the Trainer takes those parts and hands them down, so that following the config from its
# constructor goes down the layers only. The Trainer therefore reads no config (no name or
# attribute `config`), and of rao_jax.experiment it uses only these per-step helpers of typed
# values; `Trainer.from_config` may pass its config to `experiment.assemble`, and to nothing else.
TRAINER_USES_OF_EXPERIMENT = {
    "train_tasks_for_step": "each step's draw from the assembled tasks (seed, step, weights)",
    "success_rate": "a metric of trees",
    "RolloutStats": "what a step's rollouts report",
}


def _experiment_names(tree) -> tuple[set[str], dict[str, str]]:
  """(aliases of the module rao_jax.experiment, {local name: its name in rao_jax.experiment})."""
  aliases, names = {"rao_jax.experiment"}, {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module == "rao_jax":
      aliases |= {a.asname or a.name for a in node.names if a.name == "experiment"}
    elif isinstance(node, ast.ImportFrom) and node.module == "rao_jax.experiment":
      names.update({a.asname or a.name: a.name for a in node.names})
    elif isinstance(node, ast.Import):
      aliases |= {a.asname for a in node.names if a.name == "rao_jax.experiment" and a.asname}
  return aliases, names


def trainer_reads_of_the_config(source: str) -> list[str]:
  """Where the class Trainer of `source` reads a run's config itself, or assembles a part of
  the run from rao_jax.experiment, instead of taking it from its parts."""
  tree = ast.parse(source)
  aliases, imported = _experiment_names(tree)
  cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
  bad = []
  for fn in cls.body:
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    where = f"Trainer.{fn.name}"
    allowed = set(TRAINER_USES_OF_EXPERIMENT)
    if fn.name == "from_config":
      allowed.add("assemble")
    passed = set()   # the config given to experiment.assemble (from_config's one use of it)
    for node in ast.walk(fn):
      used = None
      if isinstance(node, ast.Attribute) and ast.unparse(node.value) in aliases:
        used = node.attr
      elif isinstance(node, ast.Name) and node.id in imported:
        used = imported[node.id]
      if used is not None and used not in allowed:
        bad.append(f"{where}:{node.lineno} calls experiment.{used} (a part of the run: take it "
                   "from RunParts, made by experiment.assemble)")
      if isinstance(node, ast.Call) and fn.name == "from_config" and (
          ast.unparse(node.func).split(".")[-1] == "assemble"):
        passed |= {id(a) for a in node.args if isinstance(a, ast.Name) and a.id == "config"}
    for node in ast.walk(fn):
      if isinstance(node, ast.Name) and node.id == "config" and id(node) not in passed:
        bad.append(f"{where}:{node.lineno} reads `config`")
      elif isinstance(node, ast.Attribute) and node.attr == "config":
        bad.append(f"{where}:{node.lineno} reads `{ast.unparse(node)}`")
      elif isinstance(node, ast.arg) and node.arg == "config" and fn.name != "from_config":
        bad.append(f"{where}:{fn.lineno} takes a `config`")
  return bad


def test_the_trainer_takes_the_assembled_parts_of_its_run():
  with open(os.path.join(ROOT, "rao_jax", "trainer.py")) as f:
    bad = trainer_reads_of_the_config(f.read())
  assert not bad, "the Trainer reads its config instead of its parts:\n  " + "\n  ".join(bad)


def test_the_check_catches_a_trainer_that_assembles_its_run_again():
  # The callbacks the Trainer made before runs were assembled in one place.
  source = (
      "from rao_jax import experiment as X\n"
      "from rao_jax.experiment import make_mesh\n"
      "class Trainer:\n"
      "  def __init__(self, config, workdir):\n"
      "    self.rl = X.rl_config(config)\n"
      "    self.mesh = make_mesh(self.parts.mesh_spec)\n"
      "  def run(self):\n"
      "    return X.success_rate(self.trees), self.config.eval.every\n"
      "  @classmethod\n"
      "  def from_config(cls, config, workdir):\n"
      "    return cls(X.assemble(config, workdir), X.load_policy(config))\n")
  found = trainer_reads_of_the_config(source)
  assert sorted(b.split(" (")[0] for b in found) == sorted([
      "Trainer.__init__:4 takes a `config`",
      "Trainer.__init__:5 calls experiment.rl_config",
      "Trainer.__init__:5 reads `config`",
      "Trainer.__init__:6 calls experiment.make_mesh",
      "Trainer.run:8 reads `self.config`",
      "Trainer.from_config:11 calls experiment.load_policy",
      "Trainer.from_config:11 reads `config`"]), found
