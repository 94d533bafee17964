"""One running REPL process and the host end of its fd protocol.

The frames are those of ``rao_jax/sandbox_host/guest/wire.py`` (a length header + JSON), which
the REPL uses too, on a UNIX socketpair whose far end is the REPL's only channel to the host.
Everything that comes from the sandbox is untrusted and any breach of the protocol ends the
sandbox: a frame must start with `{"op": "<known op>"`, within that op's size limit, checked
before the rest of the frame is read or parsed (so a frame costs the event loop at most one
parse of a bounded size); a completion must answer the request in flight; nothing may follow
the ready message before the host asks. Tool calls in flight are bounded in number and in bytes.

Between requests the REPL process is stopped (SIGSTOP through a pidfd; it is continued right
before the next request is written), so nothing the agent's code left behind (a thread, or
code still running behind a completion it forged with the nonce it read from the REPL's
memory) runs while no cell is running. The host learns the REPL's pid (and uid) from the
kernel, as SCM_CREDENTIALS of the ready message.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import struct
import tempfile
import time
from typing import Any, Callable, Mapping

from rao_jax.sandbox_host import jail
from rao_jax.sandbox_host import procfs
from rao_jax.sandbox_host.config import SandboxConfig
from rao_jax.sandbox_host.guest import wire

log = logging.getLogger(__name__)

_STDERR_KEEP = 8192
# How long the REPL's threads may take to stop between cells before it counts as broken.
_STOP_WAIT_S = 5.0
# After SIGKILL: how long the exit may take before the stderr pipe is closed from our side,
# then how long before kill() gives up on the process (only a process stuck in the kernel).
_EXIT_GRACE_S = 2.0
_EXIT_WAIT_S = 10.0
_warned_process_mode = False
# Frames other than tool calls are small; "done" carries the cell's output (max_output_chars
# characters, up to 4 bytes each in UTF-8, JSON escapes up to 6) plus a short traceback.
_SMALL_FRAME = 64 * 1024


class SandboxSpawnError(RuntimeError):
  """A sandbox could not be started (the message carries bwrap's / Python's own words)."""


class SandboxDied(Exception):
  """The REPL process ended or broke the protocol while the host waited for it."""


def is_async_callable(fn: Any) -> bool:
  """True for async functions, including objects whose __call__ is one and partials of one."""
  while hasattr(fn, "func") and hasattr(fn, "args"):  # functools.partial
    fn = fn.func
  return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
      getattr(fn, "__call__", None))


class ReplProcess:
  """A started REPL: spawn it, run cells, forward its tool calls, kill it."""

  # Stop the REPL between requests (see the module docstring). Only bench_sandbox turns it
  # off, to measure what the stop/continue pair costs a cell in alternating rounds.
  stop_between_requests = True

  def __init__(self, cfg: SandboxConfig):
    self.cfg = cfg
    self.proc: asyncio.subprocess.Process | None = None
    self.pid = 0
    self.spawn_s = 0.0
    self.info: dict = {}
    self._reader: asyncio.StreamReader | None = None
    self._writer: asyncio.StreamWriter | None = None
    self._tasks: list[asyncio.Task] = []
    self._waiter: asyncio.Future | None = None  # the reply the host is waiting for
    self._waiter_id = ""
    self._cell_id = ""
    self._tools: Mapping[str, Callable] = {}
    self._tool_tasks: dict[str, asyncio.Task] = {}
    self._tool_bytes: dict[str, int] = {}  # frame size of each call in flight
    self.repl_pid = 0   # host pid of the process that runs agents' code (from the kernel)
    self.repl_uid = -1  # its host uid at ready
    self._pidfd: int | None = None
    self._stopped = False
    # The cell clock: a deadline timer that is paused while a host tool call is in flight
    # (unless cfg.timeout_counts_tool_time), so a parent awaiting long subagents is not
    # killed for time spent on the host.
    self._count_tools = True
    self._remaining = 0.0
    self._deadline = 0.0
    self._deadline_handle: asyncio.TimerHandle | None = None
    self._stderr = bytearray()
    self._tmpdir = ""
    self.dead_reason = ""

  # ---- life cycle ---------------------------------------------------------------------------

  @property
  def alive(self) -> bool:
    return not self.dead_reason and self.proc is not None and self.proc.returncode is None

  async def spawn(self) -> "ReplProcess":
    """Starts the process and waits for its ready message (cfg.spawn_timeout_s at most)."""
    cfg = self.cfg
    loop = asyncio.get_running_loop()
    host_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # The kernel then attaches the writer's pid and uid (in the host's namespaces) to what the
    # REPL writes: the ready message tells who runs the agents' code (see _handshake).
    host_sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    fd = child_sock.fileno()
    filter_fd = None
    user = None
    t0 = time.perf_counter()
    try:
      if cfg.isolation == "bwrap":
        jail.require_bwrap()
        filter_fd = jail.seccomp_pipe(cfg)
        user = jail.jail_user(cfg)
        argv = jail.bwrap_argv(cfg, fd, filter_fd, user)
        argv[0] = shutil.which("bwrap") or argv[0]
        # Not even bwrap itself gets the host's environment (it would be readable in the jail
        # through the reaper process otherwise), and the jail has its own cwd.
        env, cwd = {}, "/"
      else:
        _warn_process_mode()
        argv = jail.process_argv(cfg, fd)
        self._tmpdir = tempfile.mkdtemp(prefix="rao_sandbox_")
        env = {"HOME": self._tmpdir, "TMPDIR": self._tmpdir, "LANG": "C.UTF-8",
               "MALLOC_ARENA_MAX": "2"}
        cwd = self._tmpdir
      pass_fds = (fd,) + tuple(x for x in (filter_fd, user and user[0]) if x is not None)
      start = asyncio.ensure_future(asyncio.create_subprocess_exec(
          *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
          stderr=asyncio.subprocess.PIPE, pass_fds=pass_fds, env=env, cwd=cwd,
          start_new_session=True))
      try:
        self.proc = await asyncio.shield(start)
      except asyncio.CancelledError:
        # Python 3.11: a cancellation landing while asyncio connects the new process's pipes
        # leaves its transport waiting forever for a pipe that never connected (a pool
        # closing mid-spawn hung CI). Let the start finish, then kill what it started.
        try:
          self.proc = await start
        except Exception:  # pylint: disable=broad-except
          pass
        raise
    except BaseException:
      host_sock.close()
      child_sock.close()
      if self.proc is not None:
        self.pid = self.proc.pid
        await self.kill()
      self._remove_tmpdir()
      raise
    finally:
      if filter_fd is not None:
        os.close(filter_fd)
    child_sock.close()
    self.pid = self.proc.pid
    try:
      # Inside the try: a cancellation here (a pool closing mid-spawn) must kill the process
      # too, not leave it running with an unclosed transport.
      self._tasks = [asyncio.create_task(self._read_stderr())]
      self.info = await asyncio.wait_for(self._handshake(host_sock, user), cfg.spawn_timeout_s)
      host_sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 0)
      self._reader, self._writer = await asyncio.open_unix_connection(
          sock=host_sock, limit=1 << 20)
      self._tasks.append(asyncio.create_task(self._read_loop()))
    except (asyncio.TimeoutError, SandboxDied) as e:
      await self.kill()
      why = ("did not report ready within "
             f"{cfg.spawn_timeout_s} s" if isinstance(e, asyncio.TimeoutError) else str(e))
      err = self._stderr.decode("utf-8", "replace").strip()
      raise SandboxSpawnError(
          f"the sandbox ({cfg.isolation} mode) failed to start: {why}"
          + (f"; its stderr says: {err}" if err else "")) from None
    except BaseException:
      # Cancelled (a pool closing mid-spawn): never leave the process behind.
      if self._writer is None:
        host_sock.close()
      await asyncio.shield(self.kill())
      raise
    self.spawn_s = time.perf_counter() - t0
    return self

  async def _handshake(self, sock: socket.socket, user) -> dict:
    """Reads the ready message and the kernel's credentials of its writer.

    The pid in SCM_CREDENTIALS is translated by the kernel into this process's pid namespace,
    so it is the REPL's host pid whatever namespaces bwrap made; the REPL cannot lie about it.
    """
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    buf = bytearray()
    creds = None
    head = wire.HEADER_BYTES
    while True:
      try:
        data, anc, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(12))
      except BlockingIOError:
        await _readable(loop, sock.fileno())
        continue
      if not data:
        await self._reap_and_mark()
        raise SandboxDied(self.dead_reason)
      for level, kind, cdata in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and creds is None:
          creds = struct.unpack("3i", cdata[:12])
      buf += data
      if len(buf) >= head:
        size = wire.frame_size(buf[:head])
        if size > _SMALL_FRAME:
          self._violation(f"a first message of {size} bytes")
          raise SandboxDied(self.dead_reason)
        if len(buf) >= head + size:
          break
    try:
      msg = json.loads(bytes(buf[head:head + size]))
    except (ValueError, RecursionError):
      msg = None
    if not isinstance(msg, dict) or msg.get("op") not in ("ready", "fatal"):
      self._violation("a first message that is not ready")
      raise SandboxDied(self.dead_reason)
    if msg["op"] == "fatal":
      self._mark_dead(f"the REPL could not complete its jail: {str(msg.get('error'))[:2000]}")
      raise SandboxDied(self.dead_reason)
    if len(buf) > head + size:
      self._violation("bytes after its ready message")
      raise SandboxDied(self.dead_reason)
    if creds is None:
      self._violation("a ready message without credentials")
      raise SandboxDied(self.dead_reason)
    self.repl_pid, self.repl_uid = creds[0], creds[1]
    if user is not None and self.repl_uid != user[2]:
      self._mark_dead(f"the REPL runs as host uid {self.repl_uid}, not the jail's {user[2]}")
      raise SandboxDied(self.dead_reason)
    try:
      self._pidfd = os.pidfd_open(self.repl_pid)
    except OSError as e:
      # Linux < 5.3: no pidfd, so no stop between cells (a pid could be reused meanwhile).
      log.warning("pidfd_open(%d) failed (%r): the sandbox is not stopped between cells",
                  self.repl_pid, e)
    return msg

  async def kill(self) -> None:
    """Kills the whole sandbox (bwrap and, through it, the pid namespace) and waits for it."""
    self._mark_dead("killed by the host")
    proc = self.proc
    if proc is not None and proc.returncode is None:
      try:
        # The session (start_new_session) of the direct child: bwrap, or the REPL itself.
        # bwrap's --die-with-parent then takes down its pid-1 reaper, and with it the
        # whole pid namespace.
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    if proc is not None:
      await self._wait_exit(proc)
    if self._writer is not None:
      self._writer.close()
    for t in self._tool_tasks.values():
      t.cancel()
    self._tool_tasks.clear()
    if self._tasks:
      # The stderr reader ends by itself once the process is gone (EOF); waiting for it lets
      # asyncio close the pipe transport inside this loop.
      _, pending = await asyncio.wait(self._tasks, timeout=2.0)
      for t in pending:
        t.cancel()
      await asyncio.gather(*self._tasks, return_exceptions=True)
    self._tasks = []
    if self._pidfd is not None:
      os.close(self._pidfd)
      self._pidfd = None
    if proc is not None:
      # asyncio.subprocess.Process has no public close(); an unclosed transport would be
      # closed by the garbage collector, possibly after its event loop is gone.
      transport = getattr(proc, "_transport", None)
      if transport is not None:
        transport.close()
    self._remove_tmpdir()

  async def _wait_exit(self, proc: asyncio.subprocess.Process) -> None:
    """Waits (bounded) for the killed process, without trusting its stderr pipe to close.

    Python 3.11's Process.wait() returns only once the process has exited AND every pipe of it
    is closed. Any process left holding the stderr pipe's write end (a descendant that outlived
    bwrap) would make kill() wait forever, and with it the pool and the whole run (seen in CI).
    """
    waited = asyncio.ensure_future(proc.wait())
    done, _ = await asyncio.wait([waited], timeout=_EXIT_GRACE_S)
    if done:
      return
    # No holder at all is the common case here: the event loop was held up by other work and
    # has not yet read the pipe's end; closing our end below settles it without a word.
    holders = procfs.pipe_holders(_stderr_inode(proc)) if proc.returncode is not None else []
    if holders:
      # Only the sandbox's own descendants can hold that pipe: one that escaped the process
      # group and outlived the sandbox must not survive it.
      log.warning("sandbox %d exited (status %s) but its stderr pipe is still held open by "
                  "pid(s) %s; killing them and closing the host's end", self.pid,
                  proc.returncode, holders)
      for pid in holders:
        try:
          os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass
    # Closing the transport closes the host's pipe ends (the process's exit then completes
    # the wait) and sends SIGKILL once more if the process is still there.
    transport = getattr(proc, "_transport", None)
    if transport is not None:
      transport.close()
    done, _ = await asyncio.wait([waited], timeout=_EXIT_WAIT_S)
    if not done:
      waited.cancel()
      log.error("sandbox %d did not exit within %g s of SIGKILL (state %s); giving up on it",
                self.pid, _EXIT_GRACE_S + _EXIT_WAIT_S, procfs.state(self.pid))

  def _remove_tmpdir(self):
    if self._tmpdir:
      shutil.rmtree(self._tmpdir, ignore_errors=True)
      self._tmpdir = ""

  def _mark_dead(self, reason: str) -> None:
    if self.dead_reason:
      return
    self.dead_reason = reason
    for fut in (self._waiter,):
      if fut is not None and not fut.done():
        fut.set_exception(SandboxDied(reason))
        fut.exception()  # nobody may be waiting any more (a cancelled spawn): no log noise
    for t in self._tool_tasks.values():
      t.cancel()

  # ---- requests -----------------------------------------------------------------------------

  async def _send(self, msg: Mapping[str, Any]) -> None:
    if self._writer is None or self.dead_reason:
      raise SandboxDied(self.dead_reason or "not started")
    try:
      self._writer.write(wire.encode(msg))
      await self._writer.drain()
    except (ConnectionError, OSError) as e:
      self._mark_dead(f"the protocol channel broke: {e!r}")
      raise SandboxDied(self.dead_reason) from None

  async def _request(self, msg: dict, tools: Mapping[str, Callable] | None,
                     timeout: float) -> dict:
    if self._waiter is not None:
      raise RuntimeError("this sandbox is already running a cell; await it first")
    loop = asyncio.get_running_loop()
    nonce = secrets.token_hex(16)
    msg["id"] = nonce
    self._waiter_id = nonce
    self._waiter = loop.create_future()
    if tools is not None:
      self._cell_id = nonce
      self._tools = tools
    self._count_tools = tools is None or self.cfg.timeout_counts_tool_time
    self._remaining = timeout
    self._deadline_handle = None
    self._update_clock()
    try:
      if self._stopped:
        self._signal_repl(signal.SIGCONT)
        self._stopped = False
      await self._send(msg)
      reply = await self._waiter
    finally:
      if self.alive and self._pidfd is not None and self.stop_between_requests:
        # Nothing runs in the sandbox until the next request (see the module docstring).
        self._signal_repl(signal.SIGSTOP)
        self._stopped = True
      if self._deadline_handle is not None:
        self._deadline_handle.cancel()
        self._deadline_handle = None
      self._waiter = None
      self._waiter_id = ""
      self._cell_id = ""
      self._tools = {}
      # Host-side work of this cell ends with it: never-awaited or abandoned tool calls.
      for t in self._tool_tasks.values():
        t.cancel()
      self._tool_tasks.clear()
      self._tool_bytes.clear()
    if self._stopped:
      await self._until_stopped()
    return reply

  async def _until_stopped(self) -> None:
    """Returns once every thread of the REPL is stopped; a REPL that does not stop dies.

    SIGSTOP is only the start: the kernel wakes one thread, and that thread, once scheduled,
    stops the others. On a loaded machine that took tens of milliseconds, during which a
    thread the agent left behind still ran; so the cell's result is handed back only after
    the kernel reports every thread stopped.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _STOP_WAIT_S
    delay = 0.0002
    while not procfs.threads_stopped(self.repl_pid):
      if loop.time() > deadline:
        reason = (f"the REPL (pid {self.repl_pid}) was still running {_STOP_WAIT_S:g} s after "
                  f"the host stopped it between cells ({procfs.state(self.repl_pid)})")
        self._signal_repl(signal.SIGKILL)
        self._mark_dead(reason)
        raise SandboxDied(reason)
      await asyncio.sleep(delay)
      delay = min(2 * delay, 0.01)

  def _signal_repl(self, sig: int) -> None:
    if self._pidfd is None:
      return  # killed meanwhile (kill() closes the pidfd)
    try:
      signal.pidfd_send_signal(self._pidfd, sig)
    except ProcessLookupError:
      pass  # already gone: the read loop reports how

  def _update_clock(self) -> None:
    """(Re)starts or pauses the cell's deadline after the set of tool calls changed."""
    waiter = self._waiter
    if waiter is None or waiter.done():
      return
    loop = asyncio.get_running_loop()
    paused = bool(self._tool_tasks) and not self._count_tools
    if paused and self._deadline_handle is not None:
      self._remaining = max(0.0, self._deadline - loop.time())
      self._deadline_handle.cancel()
      self._deadline_handle = None
    elif not paused and self._deadline_handle is None:
      self._deadline = loop.time() + self._remaining
      self._deadline_handle = loop.call_later(self._remaining, self._on_deadline, waiter)

  @staticmethod
  def _on_deadline(waiter: asyncio.Future) -> None:
    if not waiter.done():
      waiter.set_exception(asyncio.TimeoutError())

  async def run(self, code: str, tools: Mapping[str, Callable], max_output: int,
                timeout: float) -> dict:
    """Runs one cell; returns the done message. Raises asyncio.TimeoutError or SandboxDied."""
    spec = [[name, is_async_callable(fn)] for name, fn in sorted(tools.items())]
    return await self._request(
        {"op": "run", "code": code, "tools": spec, "max_output": max_output}, tools, timeout)

  async def set_vars(self, variables: Mapping[str, Any], timeout: float) -> None:
    """Binds JSON values as REPL variables."""
    reply = await self._request({"op": "vars", "vars": dict(variables)}, None, timeout)
    if reply.get("error"):
      raise ValueError(f"the sandbox could not bind the variables: {reply['error']}")

  # ---- incoming -----------------------------------------------------------------------------

  def _frame_limits(self) -> dict:
    cfg = self.cfg
    done = cfg.max_output_chars * 6 + 3 * _SMALL_FRAME
    return {"ready": _SMALL_FRAME, "fatal": _SMALL_FRAME, "done": done,
            "vars_done": _SMALL_FRAME, "tool": cfg.tool_arg_max_bytes, "cancel": 1024}

  async def _read_loop(self) -> None:
    reader = self._reader
    limits = self._frame_limits()
    try:
      while True:
        size = wire.frame_size(await reader.readexactly(wire.HEADER_BYTES))
        # The op is read and checked before the rest: an unknown op or an oversized frame
        # ends the sandbox without the host reading, let alone parsing, its body.
        prefix = await reader.readexactly(min(size, wire.OP_PEEK_BYTES))
        op = wire.op_of(prefix)
        if op not in limits:
          self._violation("a message that does not start with a known op")
          return
        if size > limits[op]:
          self._violation(f"a {op!r} message of {size} bytes (limit {limits[op]})")
          return
        body = prefix + await reader.readexactly(size - len(prefix))
        try:
          msg = json.loads(body)
        except (ValueError, RecursionError):
          self._violation("a message that is not JSON (or is nested too deeply)")
          return
        if not isinstance(msg, dict) or msg.get("op") != op:
          self._violation("a message that is not a JSON object with its op first")
          return
        self._dispatch(msg, size)
        if self.dead_reason:
          return
        # One frame per turn of the loop: a sandbox that floods the channel shares the loop.
        await asyncio.sleep(0)
    except asyncio.IncompleteReadError:
      pass
    except (ConnectionError, OSError) as e:
      log.debug("sandbox %d channel error: %r", self.pid, e)
    except Exception as e:  # pylint: disable=broad-except
      # Whatever went wrong, a sandbox whose messages are no longer read must not stay alive.
      self._violation(f"a message the host could not handle ({type(e).__name__}: {e})")
      return
    await self._reap_and_mark()

  async def _reap_and_mark(self) -> None:
    """The channel closed: the process exited (or closed its end). Find out how."""
    proc = self.proc
    code = None
    if proc is not None:
      try:
        code = await asyncio.wait_for(proc.wait(), 2.0)
      except asyncio.TimeoutError:
        code = proc.returncode  # exited, but a leftover may hold the stderr pipe (wait())
    if code is None:
      reason = "the sandbox closed its protocol channel"
    elif code < 0 or (self.cfg.isolation == "bwrap" and 128 < code < 128 + 65):
      # bwrap reports its child's death by signal N as exit status 128 + N.
      num = -code if code < 0 else code - 128
      try:
        name = signal.Signals(num).name
      except ValueError:
        name = f"signal {num}"
      reason = f"the sandbox process was killed by {name}"
      if num == signal.SIGXCPU:
        reason += f" (it used up its CPU budget of {self.cfg.cpu_time_s} s)"
    else:
      reason = f"the sandbox process exited with status {code}"
    err = self._stderr.decode("utf-8", "replace").strip()
    if err and not self.info:
      reason += f" (stderr: {err[-2000:]})"
    self._mark_dead(reason)

  def _violation(self, what: str) -> None:
    log.warning("sandbox %d sent %s; it is replaced", self.pid, what)
    self._mark_dead(f"protocol violation: the sandbox sent {what}")
    if self.proc is not None and self.proc.returncode is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass

  async def _read_stderr(self) -> None:
    # Only bwrap and a failing interpreter start-up write here; keep the first few KiB.
    stream = self.proc.stderr
    while True:
      chunk = await stream.read(65536)
      if not chunk:
        return
      room = _STDERR_KEEP - len(self._stderr)
      if room > 0:
        self._stderr += chunk[:room]

  def _dispatch(self, msg: dict, size: int = 0) -> None:
    op = msg.get("op")
    if op in ("done", "vars_done"):
      # Only the reply to the request in flight counts: the nonce was never seen before. A
      # completion of anything else (a forged one, then the real one; a guessed nonce) is a
      # violation.
      if (self._waiter is not None and not self._waiter.done()
          and msg.get("id") == self._waiter_id and self._waiter_id):
        self._waiter.set_result(msg)
      else:
        self._violation(f"a {op!r} for no request in flight")
    elif op == "tool":
      self._start_tool(msg, size)
    elif op == "cancel":
      rid = str(msg.get("rid"))
      task = self._tool_tasks.pop(rid, None)
      self._tool_bytes.pop(rid, None)
      if task is not None:
        task.cancel()
        self._update_clock()
    else:
      # ready or fatal again: the REPL said these once, before any agent code ran.
      self._violation(f"a second {op!r} message")

  def _start_tool(self, msg: dict, size: int = 0) -> None:
    rid = msg.get("rid")
    if not isinstance(rid, str) or not rid or len(rid) > 64:
      return
    name = msg.get("name")
    args = msg.get("args", [])
    kwargs = msg.get("kwargs", {})
    error = None
    if not self._cell_id or msg.get("cell") != self._cell_id:
      error = "tools can only be called while a cell is running"
    elif rid in self._tool_tasks:
      error = "duplicate request id"
    elif not isinstance(name, str) or name not in self._tools:
      error = f"NameError: no tool named {name!r} is available in this cell"
    elif not isinstance(args, list) or not isinstance(kwargs, dict):
      error = "TypeError: malformed tool call"
    elif len(self._tool_tasks) >= self.cfg.max_pending_tool_calls:
      error = (f"too many tool calls in flight (the limit is "
               f"{self.cfg.max_pending_tool_calls}); await some before starting more")
    elif sum(self._tool_bytes.values()) + size > self.cfg.max_pending_tool_bytes:
      error = (f"too many bytes of tool arguments in flight (this call {size}, the limit "
               f"{self.cfg.max_pending_tool_bytes} for all calls together); await some "
               f"before starting more")
    if error is not None:
      asyncio.create_task(self._reply_safely({"op": "reply", "rid": rid, "ok": False,
                                              "error": error}))
      return
    task = asyncio.create_task(self._run_tool(rid, name, self._tools[name], args, kwargs))
    self._tool_tasks[rid] = task
    self._tool_bytes[rid] = size
    self._update_clock()

  async def _run_tool(self, rid: str, name: str, fn: Callable, args: list, kwargs: dict):
    try:
      result = fn(*args, **kwargs)
      if inspect.isawaitable(result):
        result = await result
      try:
        reply = wire.encode({"op": "reply", "rid": rid, "ok": True, "value": result})
      except (TypeError, ValueError) as e:
        reply = wire.encode({"op": "reply", "rid": rid, "ok": False,
                         "error": f"TypeError: tool {name} returned a value that is not "
                                  f"JSON-serialisable ({type(result).__name__}): {e}"})
    except asyncio.CancelledError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      # A tool's failure is an observation for the agent, not a host error.
      log.debug("tool %s raised %r", name, e)
      reply = wire.encode({"op": "reply", "rid": rid, "ok": False,
                       "error": f"{type(e).__name__}: {e}"})
    finally:
      if self._tool_tasks.get(rid) is asyncio.current_task():
        del self._tool_tasks[rid]
        self._tool_bytes.pop(rid, None)
        self._update_clock()
    if self._writer is not None and not self.dead_reason:
      try:
        self._writer.write(reply)
        await self._writer.drain()
      except (ConnectionError, OSError):
        pass

  async def _reply_safely(self, msg: dict) -> None:
    try:
      await self._send(msg)
    except SandboxDied:
      pass


async def _readable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
  fut = loop.create_future()
  loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
  try:
    await fut
  finally:
    loop.remove_reader(fd)


def _warn_process_mode() -> None:
  global _warned_process_mode
  if not _warned_process_mode:
    _warned_process_mode = True
    log.warning(
        "sandbox isolation='process' (asked for by the user): agents' code runs as a plain "
        "child process with rlimits and seccomp only, WITHOUT bubblewrap's filesystem, "
        "network and pid namespaces; use isolation='bwrap' wherever bubblewrap is installed")


def _stderr_inode(proc: asyncio.subprocess.Process) -> int | None:
  try:
    transport = proc._transport  # pylint: disable=protected-access
    pipe = transport.get_pipe_transport(2).get_extra_info("pipe")
    return os.fstat(pipe.fileno()).st_ino
  except (AttributeError, OSError, ValueError):
    return None
