"""An in-process REPL with the sandbox's interface, for TRUSTED code only.

The agent runtime talks to REPLs through `acquire()` / `release()` on a pool and
`set_variables()` / `run_cell(code, tools)` on a REPL, the API of `rao_jax.sandbox_host`.
This pool runs cells in the host process with no isolation at all: it exists so that the
scripted policies (whose code is ours) can drive the runtime fast and deterministically in tests
and the runtime benchmark. Model-written code must run in `rao_jax.sandbox_host.SandboxPool`.

Cells may use top-level `await` (`await launch_subagent(...)`, `asyncio.gather`); many cells
run concurrently on one event loop, each printing into its own buffer.
"""
from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import traceback
from typing import Any, Mapping


@dataclasses.dataclass
class CellResult:
  """What one cell produced (same fields as the sandbox host's result)."""
  output: str = ""
  error: str | None = None
  timed_out: bool = False
  sandbox_restarted: bool = False
  crashed: bool = False


class LocalRepl:
  """One persistent namespace."""

  def __init__(self, cell_timeout_s: float | None, max_output_chars: int):
    self.cell_timeout_s = cell_timeout_s
    self.max_output_chars = max_output_chars
    self.ns: dict[str, Any] = {}
    self.reset()

  def reset(self) -> None:
    self.ns = {"__name__": "__agent__", "asyncio": asyncio}

  async def set_variables(self, variables: Mapping[str, Any]) -> None:
    self.ns.update(variables)

  async def run_cell(self, code: str, tools: Mapping[str, Any] | None = None) -> CellResult:
    out: list[str] = []

    def _print(*args, sep=" ", end="\n", file=None, flush=False):
      out.append(sep.join(str(a) for a in args) + end)

    self.ns["print"] = _print
    self.ns.update(tools or {})
    res = CellResult()
    try:
      obj = compile(code, "<cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                    dont_inherit=True)
      ret = eval(obj, self.ns)  # noqa: S307 -- trusted scripted code only (see module doc)
      if inspect.iscoroutine(ret):
        await asyncio.wait_for(ret, self.cell_timeout_s)
    except asyncio.TimeoutError:
      res.timed_out = True
      res.error = f"TimeoutError: the cell ran longer than {self.cell_timeout_s} s."
    except SyntaxError as e:
      res.error = f"SyntaxError: {e.msg} (line {e.lineno})"
    except Exception as e:  # failures are data: the agent sees the traceback
      tb = traceback.extract_tb(e.__traceback__)
      frames = [f for f in tb if f.filename == "<cell>"]
      lines = "".join(f"  line {f.lineno}\n" for f in frames)
      res.error = f"Traceback (most recent call last):\n{lines}{type(e).__name__}: {e}"
    text = "".join(out)
    if len(text) > self.max_output_chars:
      text = text[:self.max_output_chars] + f"\n[output cut at {self.max_output_chars} characters]"
    res.output = text
    return res


class LocalReplPool:
  """A pool of `LocalRepl`s; unbounded (in-process namespaces cost nothing)."""

  def __init__(self, cell_timeout_s: float | None = 60.0, max_output_chars: int = 20_000):
    self.cell_timeout_s = cell_timeout_s
    self.max_output_chars = max_output_chars

  async def start(self) -> None:
    """Nothing to start (the sandbox pool's API)."""

  async def acquire(self) -> LocalRepl:
    return LocalRepl(self.cell_timeout_s, self.max_output_chars)

  async def release(self, repl: LocalRepl) -> None:
    repl.reset()

  async def close(self) -> None:
    """Nothing to close."""
