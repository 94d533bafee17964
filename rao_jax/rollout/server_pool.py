"""ServerPool: which of SGLangEngine's servers take new requests, and how a failed one returns.

A server that fails a request (connection refused or reset, a timeout, HTTP 5xx) is marked
down at once, so that no new request pays a failed connection and a backoff on it. While it is
down a background probe asks its ``GET /health`` every ``health_interval`` seconds; once that
answers 200 the pool calls ``resync(url)`` (the client brings the server to the run's current
weights, the same pause -> flush -> update_weights_from_disk -> continue recipe weight sync
uses) and only then marks it up: a restarted server never generates with its start-up weights.

When every server is down, callers wait for one to return (``wait_for_any``) until the last
one has been down for ``retry_timeout`` seconds; past that the pool raises
EngineUnavailableError naming every URL and its last error (the trainer stops the run there,
with a checkpoint). Probes go on after that, so a server that returns later is used again.

Times are ``time.monotonic()`` (not an event loop's clock): the client may be driven from more
than one event loop over its life, and a probe belongs to the loop that started it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Callable, Sequence

from rao_jax.rollout.base import EngineUnavailableError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ServerStats:
  """Counters of one server, as the client saw it.

  Attributes:
    generate: /generate requests sent to it (each one a connection attempt).
    failures: requests that failed on it (connection errors, timeouts, 5xx).
    marked_down: times it was marked down.
    probes: health checks sent while it was down.
    resyncs: weight updates sent to it when it came back.
    recovered: times it was marked up again.
  """
  generate: int = 0
  failures: int = 0
  marked_down: int = 0
  probes: int = 0
  resyncs: int = 0
  recovered: int = 0


class ServerPool:
  """Up/down state of each server, with background health probes of the down ones.

  Args:
    urls: the servers' base URLs.
    retry_timeout: seconds every server may be down before ``wait_for_any`` raises.
    health_interval: seconds between two health probes of a down server.
    health: ``health(url) -> bool``: one health check (raises or returns False when not up).
    resync: ``resync(url) -> version``: brings a returning server to the run's weights and
      returns the version it serves; raises when it cannot (the server then stays down and is
      probed again).
  """

  def __init__(self, urls: Sequence[str], *, retry_timeout: float, health_interval: float,
               health: Callable[[str], Awaitable[bool]],
               resync: Callable[[str], Awaitable[str | None]]):
    self.urls = list(urls)
    self.retry_timeout = retry_timeout
    self.health_interval = health_interval
    self._health, self._resync = health, resync
    self.up = {u: True for u in self.urls}
    self.down_since: dict[str, float] = {}
    self.last_error: dict[str, str] = {}
    self.stats = {u: ServerStats() for u in self.urls}
    # (url, "down" | "resynced" | "up", detail, its /generate count then): what tests and logs
    # read to see that a returning server was re-synced before it was given work.
    self.events: list[tuple[str, str, str, int]] = []
    self._probes: dict[str, asyncio.Task] = {}

  # ---- state ----------------------------------------------------------------------------------
  def healthy(self) -> list[str]:
    """The servers that take new requests, in the order given."""
    return [u for u in self.urls if self.up[u]]

  def _event(self, url: str, kind: str, detail: str = "") -> None:
    self.events.append((url, kind, detail, self.stats[url].generate))

  def mark_down(self, url: str, error: str) -> None:
    """Takes ``url`` out of rotation after a failure and starts probing it."""
    self.stats[url].failures += 1
    self.last_error[url] = error
    if self.up[url]:
      self.up[url] = False
      self.down_since[url] = time.monotonic()
      self.stats[url].marked_down += 1
      self._event(url, "down", error)
      left = len(self.healthy())
      log.warning("rollout server %s marked down (%s); %d of %d servers left", url, error, left,
                  len(self.urls))
    self.ensure_probes()

  def _mark_up(self, url: str) -> None:
    self.up[url] = True
    self.down_since.pop(url, None)
    self.stats[url].recovered += 1
    self._event(url, "up")
    log.warning("rollout server %s is back (%d of %d servers up)", url, len(self.healthy()),
                len(self.urls))

  def all_down_for(self) -> float | None:
    """Seconds since the last server went down when every one is down; else None."""
    if any(self.up.values()):
      return None
    return time.monotonic() - max(self.down_since.values())

  def unavailable_error(self) -> EngineUnavailableError | None:
    """The error to raise when every server has been down past ``retry_timeout``, else None."""
    gone = self.all_down_for()
    if gone is None or gone < self.retry_timeout:
      return None
    detail = "; ".join(f"{u} ({self.last_error.get(u, 'down')})" for u in self.urls)
    return EngineUnavailableError(
        f"no rollout server answered for {gone:.1f} s (retry_timeout={self.retry_timeout:g} s): "
        f"{detail}", urls=tuple(self.urls))

  async def wait_for_any(self) -> None:
    """Returns once a server is up; raises EngineUnavailableError when every server has been
    down for ``retry_timeout`` seconds."""
    while not any(self.up.values()):
      err = self.unavailable_error()
      if err is not None:
        raise err
      self.ensure_probes()
      # A short poll, not an event: an asyncio.Event belongs to one loop, the pool may not.
      await asyncio.sleep(min(0.05, self.health_interval))

  # ---- probes ---------------------------------------------------------------------------------
  def ensure_probes(self) -> None:
    """Starts a probe for each down server that has none running on the current loop."""
    try:
      loop = asyncio.get_running_loop()
    except RuntimeError:
      return          # no loop: the next async call starts them
    for url in self.urls:
      task = self._probes.get(url)
      if not self.up[url] and (task is None or task.done() or task.get_loop() is not loop):
        self._probes[url] = loop.create_task(self._probe(url))

  async def _probe(self, url: str) -> None:
    while not self.up[url]:
      await asyncio.sleep(self.health_interval)
      self.stats[url].probes += 1
      try:
        if not await self._health(url):
          continue
        version = await self._resync(url)
      except asyncio.CancelledError:
        raise
      except Exception as e:  # noqa: BLE001 - any failure leaves it down, to probe again
        self.last_error[url] = f"{type(e).__name__}: {e}"
        log.info("rollout server %s not back yet: %s", url, self.last_error[url])
        continue
      # No await between the re-sync's last check and this: nothing can change the weights
      # the server should hold before it is back in rotation.
      self._event(url, "resynced", str(version))
      self._mark_up(url)

  async def close(self) -> None:
    """Stops the probes running on the current loop (others died with their loops)."""
    try:
      loop = asyncio.get_running_loop()
    except RuntimeError:
      loop = None
    mine = [t for t in self._probes.values() if not t.done() and t.get_loop() is loop]
    for t in mine:
      t.cancel()
    await asyncio.gather(*mine, return_exceptions=True)
    self._probes.clear()

  def metrics(self) -> dict[str, float]:
    """Pool-wide counters for the trainer's metrics (``rollout/servers_*``)."""
    tot = lambda name: float(sum(getattr(s, name) for s in self.stats.values()))
    return {"servers_up": float(len(self.healthy())),
            "servers_down": float(len(self.urls) - len(self.healthy())),
            "server_failures": tot("failures"), "server_marked_down": tot("marked_down"),
            "server_resyncs": tot("resyncs"), "server_recovered": tot("recovered")}
