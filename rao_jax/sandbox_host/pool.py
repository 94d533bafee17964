"""SandboxPool: pre-started sandboxes, so an agent never waits for a spawn.

Every sandbox serves ONE agent: release() kills it (it is never handed to another agent,
whatever its code left behind) and the pool starts a replacement in the background.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import weakref

from rao_jax.sandbox_host import jail
from rao_jax.sandbox_host.config import SandboxConfig
from rao_jax.sandbox_host.process import ReplProcess
from rao_jax.sandbox_host.sandbox import Sandbox

log = logging.getLogger(__name__)


class SandboxPool:
  """Keeps `size` started sandboxes ready.

  Usage:
    pool = SandboxPool(cfg, size=8); await pool.start()
    sb = await pool.acquire(); ...; await pool.release(sb)
    await pool.close()
  """

  def __init__(self, cfg: SandboxConfig, size: int):
    if not isinstance(cfg, SandboxConfig):
      raise TypeError(f"SandboxPool: cfg must be a SandboxConfig, got {type(cfg).__name__}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
      raise ValueError(f"SandboxPool: size={size!r} must be an int >= 0 (sandboxes kept "
                       f"ready)")
    self.cfg = cfg
    self.size = size
    self._ready: collections.deque[ReplProcess] = collections.deque()
    self._refills: set[asyncio.Task] = set()
    self._background: set[asyncio.Task] = set()
    self._out: weakref.WeakSet[Sandbox] = weakref.WeakSet()
    self._sem: asyncio.Semaphore | None = None
    self._started = False
    self._closed = False
    self.spawned = 0
    self.cold_acquires = 0
    self.spawn_errors = 0

  async def start(self) -> None:
    """Starts `size` sandboxes and waits until they are ready.

    Raises:
      SandboxUnavailableError: bubblewrap is missing (the message names the fix).
      SandboxSpawnError: a sandbox failed to start.
    """
    if self._closed:
      raise RuntimeError("SandboxPool.start: the pool is closed")
    if self.cfg.isolation == "bwrap":
      jail.require_bwrap()
    self._sem = asyncio.Semaphore(self.cfg.max_concurrent_spawns)
    self._started = True
    results = await asyncio.gather(*(self._spawn() for _ in range(self.size)),
                                   return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    for r in results:
      if isinstance(r, ReplProcess):
        self._ready.append(r)
    if errors:
      await self.close()
      raise errors[0]

  async def acquire(self) -> Sandbox:
    """A started sandbox for one agent (from the ready set when possible)."""
    if not self._started or self._closed:
      raise RuntimeError("SandboxPool.acquire: call `await pool.start()` first (and not "
                         "after close())")
    proc = await self._take_process()
    sb = Sandbox(self.cfg, proc, spawner=self._take_process)
    self._out.add(sb)
    return sb

  async def release(self, sb: Sandbox) -> None:
    """Discards the agent's sandbox (never reused); the pool refills in the background."""
    self._out.discard(sb)
    sb.mark_closed()  # unusable from now on, even before the kill below has happened
    task = asyncio.create_task(sb.close())
    self._background.add(task)
    task.add_done_callback(self._background.discard)
    self._refill()

  async def close(self) -> None:
    """Kills every sandbox of the pool, ready or handed out."""
    self._closed = True
    for t in list(self._refills):
      t.cancel()
    await asyncio.gather(*self._refills, return_exceptions=True)
    procs = list(self._ready)
    self._ready.clear()
    outs = list(self._out)
    await asyncio.gather(*(p.kill() for p in procs), *(sb.close() for sb in outs),
                         *self._background, return_exceptions=True)

  @property
  def ready_count(self) -> int:
    return len(self._ready)

  async def wait_full(self) -> None:
    """Waits until the background refills are done (tests and benchmarks)."""
    while self._refills:
      await asyncio.gather(*list(self._refills), return_exceptions=True)

  # ---- internals ----------------------------------------------------------------------------

  async def _take_process(self) -> ReplProcess:
    while self._ready:
      proc = self._ready.popleft()
      self._refill()
      if proc.alive:
        return proc
      await proc.kill()
    # Nothing ready (a burst of acquires, or size=0): start one for this caller now.
    self.cold_acquires += 1
    proc = await self._spawn()
    self._refill()
    return proc

  async def _spawn(self) -> ReplProcess:
    async with self._sem:
      proc = await ReplProcess(self.cfg).spawn()
    self.spawned += 1
    return proc

  def _refill(self) -> None:
    if self._closed:
      return
    for _ in range(self.size - len(self._ready) - len(self._refills)):
      task = asyncio.create_task(self._refill_one())
      self._refills.add(task)
      task.add_done_callback(self._refills.discard)

  async def _refill_one(self) -> None:
    try:
      proc = await self._spawn()
    except asyncio.CancelledError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      # Keep the pool going; acquire() falls back to a direct spawn with a clear error.
      self.spawn_errors += 1
      log.warning("sandbox pool: a background spawn failed: %s", e)
      return
    if self._closed:
      await proc.kill()
    else:
      self._ready.append(proc)
