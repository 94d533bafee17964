"""Sandbox: one agent's REPL as the agent runtime sees it; CellResult: what a cell produced."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any, Awaitable, Callable, Mapping, Optional

from rao_jax.sandbox_host.config import SandboxConfig
from rao_jax.sandbox_host.process import ReplProcess, SandboxDied

log = logging.getLogger(__name__)

Spawner = Callable[[], Awaitable[ReplProcess]]


@dataclasses.dataclass(frozen=True)
class CellResult:
  """The outcome of one cell.

  Attributes:
    output: captured stdout+stderr (fd-level writes included), truncated to
      cfg.max_output_chars with a note; host notes (timeout, crash, restart) are appended.
    error: short traceback of an exception the cell raised, or None; after a timeout or a
      crash a one-line summary ("CellTimeout: ...", "SandboxCrashed: ...").
    timed_out: the cell exceeded cfg.cell_timeout_s; the sandbox was killed.
    crashed: the sandbox process died during the cell (os._exit, a signal, a protocol
      violation).
    sandbox_restarted: a fresh sandbox replaced the old one; the agent's own variables are
      gone (variables bound with set_variables are bound again).
    duration_s: wall-clock seconds of the cell, as seen by the host.
  """
  output: str
  error: Optional[str]
  timed_out: bool
  crashed: bool
  sandbox_restarted: bool
  duration_s: float

  @property
  def observation(self) -> str:
    """Output followed by the traceback: the text an agent usually gets back."""
    if not self.error:
      return self.output
    sep = "" if not self.output or self.output.endswith("\n") else "\n"
    return f"{self.output}{sep}{self.error}"


class Sandbox:
  """One agent's persistent REPL in its own jailed process.

  Obtain it from SandboxPool.acquire() (pre-started, fast) or `await Sandbox.start(cfg)`.
  Cells run one at a time; the namespace persists across cells until a timeout or a crash
  replaces the process.
  """

  def __init__(self, cfg: SandboxConfig, process: ReplProcess,
               spawner: Optional[Spawner] = None):
    self.cfg = cfg
    self._proc: Optional[ReplProcess] = process
    self._spawner = spawner or (lambda: ReplProcess(cfg).spawn())
    self._vars: dict[str, Any] = {}
    self._busy = False
    self._closed = False
    self.restarts = 0
    self.cells_run = 0

  @classmethod
  async def start(cls, cfg: SandboxConfig) -> "Sandbox":
    """Starts a standalone sandbox (cold spawn)."""
    return cls(cfg, await ReplProcess(cfg).spawn())

  @property
  def pid(self) -> int:
    """Host pid of the sandbox's direct child (bwrap, or the REPL in process mode)."""
    return self._proc.pid if self._proc is not None else 0

  @property
  def repl_pid(self) -> int:
    """Host pid of the process that runs the agent's code (the REPL inside the jail)."""
    return self._proc.repl_pid if self._proc is not None else 0

  @property
  def closed(self) -> bool:
    return self._closed

  async def __aenter__(self) -> "Sandbox":
    return self

  async def __aexit__(self, *exc) -> None:
    await self.close()

  async def set_variables(self, variables: Mapping[str, Any]) -> None:
    """Binds REPL variables (JSON values), e.g. {"context": long_text}.

    They are kept on the host and bound again in any replacement sandbox.
    """
    self._check_usable()
    bad = [k for k in variables if not isinstance(k, str) or not k.isidentifier()]
    if bad:
      raise ValueError(f"set_variables: names must be Python identifiers, got {bad!r}")
    try:
      json.dumps(dict(variables))
    except (TypeError, ValueError) as e:
      raise ValueError(f"set_variables: values must be JSON-serialisable: {e}") from None
    self._vars.update(variables)
    await self._ensure_process()
    try:
      await self._proc.set_vars(variables, self.cfg.spawn_timeout_s)
    except (SandboxDied, asyncio.TimeoutError) as e:
      # The next cell starts from a fresh sandbox holding these variables.
      log.warning("sandbox died while binding variables (%s); it will be replaced", e)
      await self._discard_process()

  async def run_cell(self, code: str,
                     tools: Optional[Mapping[str, Callable]] = None) -> CellResult:
    """Runs one cell of Python in the sandbox.

    Args:
      code: the cell's source; top-level `await` is allowed.
      tools: host callables (sync or async) bound by name in the REPL for this cell. They
        get the JSON values the code passed and must return a JSON value; an exception
        becomes a ToolError with its message inside the sandbox.

    Returns:
      A CellResult. A timeout or crash never raises here: the result says what happened
      and the sandbox is already replaced by a fresh one.
    """
    self._check_usable()
    if not isinstance(code, str):
      raise TypeError(f"run_cell: code must be str, got {type(code).__name__}")
    tools = dict(tools or {})
    for name, fn in tools.items():
      if not isinstance(name, str) or not name.isidentifier() or not callable(fn):
        raise ValueError(f"run_cell: tool {name!r} must be an identifier bound to a callable")
    if self._busy:
      raise RuntimeError("run_cell: a cell is already running in this sandbox")
    self._busy = True
    t0 = time.perf_counter()
    try:
      notes = []
      restarted = False
      if self._proc is None or not self._proc.alive:
        # The previous sandbox died between cells (or could not be replaced before).
        await self._ensure_process()
        restarted = True
        notes.append("[note: the previous sandbox had died; this cell runs in a fresh one, "
                     "your earlier variables are gone]")
      try:
        reply = await self._proc.run(code, tools, self.cfg.max_output_chars,
                                     self.cfg.cell_timeout_s)
      except asyncio.CancelledError:
        # The caller gave up on this cell (e.g. its agent was cancelled): the REPL may still
        # be running it, so the process is discarded; the next cell starts a fresh one.
        await asyncio.shield(self._discard_process())
        raise
      except asyncio.TimeoutError:
        own = "" if self.cfg.timeout_counts_tool_time else " (not counting tool calls)"
        msg = (f"[the cell did not finish within {self.cfg.cell_timeout_s:g} s{own} and was "
               f"stopped: the sandbox was killed and replaced by a fresh one; all variables "
               f"you defined are gone{self._rebound_note()}]")
        return await self._after_failure(
            t0, notes + [msg], timed_out=True, crashed=False,
            error=f"CellTimeout: the cell ran longer than {self.cfg.cell_timeout_s:g} s")
      except SandboxDied as e:
        msg = (f"[the sandbox process died during the cell ({e}); a fresh sandbox replaced "
               f"it; all variables you defined are gone{self._rebound_note()}]")
        return await self._after_failure(t0, notes + [msg], timed_out=False, crashed=True,
                                         error=f"SandboxCrashed: {e}")
      self.cells_run += 1
      output = _truncate(str(reply.get("output") or ""), self.cfg.max_output_chars)
      if notes:
        output = "\n".join(notes) + "\n" + output
      error = reply.get("error")
      error = _truncate(str(error), 8000) if error else None
      return CellResult(output=output, error=error, timed_out=False, crashed=False,
                        sandbox_restarted=restarted, duration_s=time.perf_counter() - t0)
    finally:
      self._busy = False

  def mark_closed(self) -> None:
    """Makes the Sandbox unusable at once (its process is killed by close())."""
    self._closed = True

  async def close(self) -> None:
    """Kills the sandbox process; the Sandbox cannot be used afterwards."""
    self._closed = True
    await self._discard_process()

  # ---- internals ------------------------------------------------------------------------------

  def _check_usable(self):
    if self._closed:
      raise RuntimeError("this Sandbox was closed (or released to its pool); acquire another")

  def _rebound_note(self) -> str:
    if not self._vars:
      return ""
    return "; the provided variables (" + ", ".join(sorted(self._vars)) + ") are bound again"

  async def _after_failure(self, t0, notes, *, timed_out, crashed, error) -> CellResult:
    await self._discard_process()
    restarted = not self._closed  # released or closed meanwhile: nothing to replace
    try:
      if restarted:
        await self._ensure_process()
    except Exception as e:  # pylint: disable=broad-except
      restarted = False
      notes.append(f"[a fresh sandbox could not be started yet ({e}); the next cell tries "
                   f"again]")
    self.cells_run += 1
    return CellResult(output="\n".join(notes), error=error, timed_out=timed_out,
                      crashed=crashed, sandbox_restarted=restarted,
                      duration_s=time.perf_counter() - t0)

  async def _discard_process(self):
    proc, self._proc = self._proc, None
    if proc is not None:
      await proc.kill()

  async def _ensure_process(self):
    if self._proc is not None and self._proc.alive:
      return
    await self._discard_process()
    proc = await self._spawner()
    if self._closed:  # closed while we waited for the spawn
      await proc.kill()
      return
    self._proc = proc
    self.restarts += 1
    if self._vars:
      await proc.set_vars(self._vars, self.cfg.spawn_timeout_s)


def _truncate(text: str, limit: int) -> str:
  # The REPL truncates already; this is the host's own guarantee against a tampered REPL.
  if len(text) <= limit + 200:
    return text
  return (text[:limit] + f"\n[output truncated by the host: {len(text) - limit} more "
          f"characters were not shown]")
