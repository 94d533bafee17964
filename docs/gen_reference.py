"""The reference pages generated from the code: `docs/config.md` (every config field with its
default, valid values and source comment; the embedded engine's fields; the shipped experiment
configs) and `docs/api.md` (the public entry points' signatures and docstrings, read with `ast`
so that no JAX import is needed). `docs/gen_docs.py` writes them with the rest of the generated
docs; this module only renders text.
"""
from __future__ import annotations

import ast
import dataclasses
import glob
import importlib.util
import os
import re
import sys
import textwrap
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_CONFIG = os.path.join(ROOT, "experiments", "configs", "base.py")
ENGINE_CONFIG = os.path.join(ROOT, "rao_jax", "rollout", "engine", "config.py")


@dataclasses.dataclass
class Field:
  path: str
  default: Any
  comment: str


# Fields whose line in base.py carries no comment; the source's comment wins once it has one.
FALLBACK_MEANING = {
    "model.lora.rank": "adapter rank; 0 = full fine-tuning",
    "model.lora.targets": "projections that get an adapter, any of q,k,v,o,gate,up,down",
    "model.lora.dropout": "dropout on the adapter's input (training only)",
    "agent.top_p": "nucleus sampling of rollouts (1.0 = off)",
    "optim.weight_decay": "AdamW decoupled weight decay",
    "optim.b1": "AdamW first-moment decay",
    "optim.b2": "AdamW second-moment decay",
    "log.tensorboard": "also write TensorBoard event files beside metrics.jsonl",
    "sft.lr": "peak learning rate of the supervised warm start",
}


def _source_comments(path: str) -> dict[str, str]:
  """The comment of each `c.a.b = ...` line of base_config(): the comment block just above it
  (a section's note) and the comment beside it with its continuation lines."""
  text = open(path, encoding="utf-8").read()
  fn = next(n for n in ast.parse(text).body
            if isinstance(n, ast.FunctionDef) and n.name == "base_config")
  # Only base_config's own lines: smoke() and env_config() assign the same fields later.
  lines = text.splitlines()[fn.lineno:fn.end_lineno]
  out, above = {}, []
  i = 0
  assign = re.compile(r"^(\s*)c\.([\w.]+)\s*=\s*(.*)$")
  while i < len(lines):
    line = lines[i]
    stripped = line.strip()
    m = assign.match(line)
    if stripped.startswith("#"):
      above.append(stripped.lstrip("#").strip())
      i += 1
      continue
    if not m:
      above = []
      i += 1
      continue
    rest = m.group(3)
    beside, col = "", None
    if "#" in rest:
      code, _, beside = rest.partition("#")
      col = line.index("#", len(m.group(1)) + len(m.group(2)) + 2)
    parts = [" ".join(above)] if above else []
    if beside:
      parts.append(beside.strip())
    i += 1
    # A beside-comment goes on in comment lines indented past the code; a comment line at the
    # code's indent starts the next field's block.
    while col is not None and i < len(lines) and lines[i].strip().startswith("#") and \
        lines[i].index("#") > len(m.group(1)):
      parts[-1] += " " + lines[i].strip().lstrip("#").strip()
      i += 1
    out[m.group(2)] = " ".join(p for p in parts if p) or FALLBACK_MEANING.get(m.group(2), "")
    above = []
  return out


def _options(comment: str, default: Any) -> list[str]:
  """The choices a comment lists as `a | b | c` (quoted or bare), if the default is one."""
  if not isinstance(default, str) or "|" not in comment:
    return []
  segs = comment.split("|")
  opts = []
  for i, seg in enumerate(segs):
    quoted = re.findall(r'"([\w.-]*)"', seg)
    if i == 0:
      text = seg.rsplit(":", 1)[-1] if not quoted else seg
    else:
      text = seg
    if i > 0 and not text.strip().startswith('"'):
      quoted = []
    words = re.findall(r"[\w.-]+", text)
    opt = quoted[0] if quoted else (words[0] if words else "")
    opts.append(opt)
  return opts if default in opts and all(opts) else []


def _valid(default: Any, options: list[str]) -> str:
  if options:
    return ", ".join(f"`{o}`" for o in options)
  if isinstance(default, bool):
    return "`True`, `False`"
  if isinstance(default, int):
    return "integer"
  if isinstance(default, float):
    return "number"
  if isinstance(default, tuple):
    return "tuple"
  if isinstance(default, str):
    return "string"
  return type(default).__name__


def md_cell(text: str) -> str:
  return text.replace("|", "\\|").replace("\n", " ")


def _import_path(path: str, name: str):
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def config_fields() -> list[Field]:
  """Every leaf of base_config() in source order, with its source comment."""
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  from experiments.configs import base  # pylint: disable=g-import-not-at-top
  comments = _source_comments(BASE_CONFIG)
  cfg = base.base_config()
  out = []

  def walk(node, prefix):
    for key in node.keys():
      val = node[key]
      path = prefix + key
      if hasattr(val, "keys") and path not in base.FREE_FORM:
        walk(val, path + ".")
      else:
        out.append(Field(path, val.to_dict() if hasattr(val, "to_dict") else val,
                         comments.get(path, "")))
  walk(cfg, "")
  order = list(comments)
  return sorted(out, key=lambda f: order.index(f.path) if f.path in order else len(order))


def engine_fields() -> list[tuple[str, str, str]]:
  """(name, default, description) of EngineConfig, from its dataclass fields and docstring."""
  tree = ast.parse(open(ENGINE_CONFIG, encoding="utf-8").read())
  cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineConfig")
  doc = ast.get_docstring(cls) or ""
  attrs = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
  desc, cur = {}, None
  for line in attrs.splitlines():
    m = re.match(r"^  (\w+): (.*)$", line)
    if m:
      cur = m.group(1)
      desc[cur] = m.group(2).strip()
    elif cur and line.strip():
      desc[cur] += " " + line.strip()
  out = []
  for node in cls.body:
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      default = ast.unparse(node.value) if node.value is not None else "(required)"
      out.append((node.target.id, default, desc.get(node.target.id, "")))
  return out


def shipped_configs() -> list[tuple[str, str, list[str]]]:
  """(file, first docstring line, usage lines) of each experiment config with get_config."""
  out = []
  for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "configs", "*.py"))):
    tree = ast.parse(open(path, encoding="utf-8").read())
    if not any(isinstance(n, ast.FunctionDef) and n.name == "get_config" for n in tree.body):
      continue
    doc = ast.get_docstring(tree) or ""
    usage = [" ".join(ln.split("#")[0].split()) for ln in doc.splitlines()
             if ln.strip().startswith(("--config", "python"))]
    out.append((os.path.relpath(path, ROOT), doc.splitlines()[0] if doc else "", usage))
  return out


def gen_config_md() -> str:
  lines = [
      "# Configuration reference",
      "",
      "<!-- Generated by docs/gen_docs.py from experiments/configs/base.py and "
      "rao_jax/rollout/engine/config.py; edit those, then run `python docs/gen_docs.py`. -->",
      "",
      "A run is configured by a Python config file (an `ml_collections.ConfigDict`): "
      "`--config=experiments/configs/textcraft_synth.py:recursive,smoke` picks a file and its "
      "argument, and `--config.rl.group_size=8` overrides one field. Every file starts from "
      "`base_config()`, whose fields are below; a key it does not know is refused with the "
      "valid keys of its section. `env.kwargs`, `env.task_files` and `rollout.embedded` are "
      "free-form.",
      "",
      "## Shipped configs",
      "",
      "| file | what | usage |",
      "|---|---|---|",
  ]
  for path, what, usage in shipped_configs():
    use = "<br>".join(f"`{u.replace(chr(96), chr(39))}`" for u in usage)
    lines.append(f"| [{os.path.basename(path)}](../{path}) | {md_cell(what)} | {use} |")
  section = None
  notes = _source_comments(BASE_CONFIG)
  for f in config_fields():
    top = f.path.split(".")[0] if "." in f.path else ""
    if top != section:
      section = top
      lines += ["", f"## `{section}`" if section else "## Top level", ""]
      subs = sorted({p for p in notes if p == top or (p.startswith(top + ".") and
                     any(g.path.startswith(p + ".") for g in config_fields()))}) if top else []
      lines += [f"`{p}`: {notes[p]}" + "\n" for p in subs if notes[p]]
      lines += ["| field | default | valid values | meaning |", "|---|---|---|---|"]
    opts = _options(f.comment, f.default)
    lines.append(f"| `{f.path}` | `{f.default!r}` | {_valid(f.default, opts)} | "
                 f"{md_cell(f.comment)} |")
  lines += ["", "## `rollout.embedded`: the embedded engine", "",
            "Any field of `EngineConfig` (`rao_jax/rollout/engine/config.py`); unset fields keep "
            "these defaults. `rollout.num_slots`, `rollout.max_cache_len` and "
            "`rollout.share_prefix_min` above set the first three that runs change most.", "",
            "| field | default | meaning |", "|---|---|---|"]
  for name, default, desc in engine_fields():
    lines.append(f"| `{name}` | `{md_cell(default)}` | {md_cell(desc)} |")
  return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------- API reference

# (module file, object names): the entry points a user calls from Python.
API = [
    ("rao_jax/trainer.py", ["train", "Trainer"]),
    ("rao_jax/experiment.py", ["assemble"]),
    ("rao_jax/run_parts.py", ["RunParts"]),
    ("rao_jax/sft.py", ["run_sft"]),
    ("rao_jax/evaluation.py", ["evaluate_checkpoint", "evaluate_model"]),
    ("rao_jax/model/weights.py", ["load_pretrained", "export_hf"]),
    ("rao_jax/model/peft.py", ["save_adapter", "load_adapter"]),
    ("rao_jax/rollout/base.py", ["Engine", "SamplingParams"]),
    ("rao_jax/rollout/engine/frontend.py", ["EmbeddedEngine"]),
    ("rao_jax/rollout/sglang_client.py", ["SGLangEngine"]),
]


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef, skip_self: bool) -> str:
  args = fn.args
  if skip_self and args.args and args.args[0].arg in ("self", "cls"):
    args = ast.arguments(posonlyargs=args.posonlyargs, args=args.args[1:], vararg=args.vararg,
                         kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults,
                         kwarg=args.kwarg, defaults=args.defaults)
  ret = f" -> {ast.unparse(fn.returns)}" if fn.returns else ""
  return f"({ast.unparse(args)}){ret}"


def _doc(node) -> str:
  return textwrap.dedent(ast.get_docstring(node) or "(no docstring)").strip()


def _inherited_docs() -> dict[str, str]:
  """First paragraph of each documented method of the API's classes, by method name: an
  engine's override without a docstring is described by the interface it implements."""
  out = {}
  for path, names in API:
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    for node in tree.body:
      if isinstance(node, ast.ClassDef) and node.name in names:
        for mth in node.body:
          if isinstance(mth, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
              ast.get_docstring(mth):
            out.setdefault(mth.name, (node.name, _doc(mth).split("\n\n")[0]))
  return out


def gen_api_md() -> str:
  inherited = _inherited_docs()
  lines = ["# API reference", "",
           "<!-- Generated by docs/gen_docs.py from the docstrings; edit the code, then run "
           "`python docs/gen_docs.py`. -->", "",
           "The Python entry points behind the commands. The model's contract (`Transformer`, "
           "`token_logprobs`, the KV cache) is in [CONTRIBUTING.md](../CONTRIBUTING.md).", ""]
  for path, names in API:
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    module = path[:-3].replace("/", ".")
    found = {n.name: n for n in tree.body
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for name in names:
      if name not in found:
        raise KeyError(f"docs/gen_docs.py API: {module}.{name} no longer exists; update API.")
      node = found[name]
      if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                     and n.name == "__init__"), None)
        sig = _signature(init, True) if init else "()"
        lines += [f"## `{module}.{name}{sig}`", "", "```text", _doc(node), "```", ""]
        methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and not n.name.startswith("_")]
        if methods:
          lines.append("| method | what |")
          lines.append("|---|---|")
          for mth in methods:
            first = _doc(mth).split("\n\n")[0].replace("\n", " ")
            if not ast.get_docstring(mth):
              owner, text = inherited.get(mth.name, (None, ""))
              first = (f"as `{owner}.{mth.name}`: " + text.replace("\n", " ")
                       if owner and owner != name else "")
            pre = "async " if isinstance(mth, ast.AsyncFunctionDef) else ""
            lines.append(f"| `{pre}{mth.name}{md_cell(_signature(mth, True))}` | "
                         f"{md_cell(first)} |")
          lines.append("")
      else:
        lines += [f"## `{module}.{name}{_signature(node, False)}`", "", "```text", _doc(node),
                  "```", ""]
  return "\n".join(lines).rstrip() + "\n"
