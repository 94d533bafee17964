"""The REPL that runs agents' code inside the jail.

This program is untrusted territory: it runs the policy's Python and therefore never imports
rao_jax, only the standard library and `wire.py`, which lies beside it in the package and in
the jail (/sandbox). The host (``rao_jax.sandbox_host``) starts it, usually
under bubblewrap, as

    python -I -S -B repl.py fd=N memory_mb=.. file_size_mb=.. open_files=.. processes=..
                            cpu_s=.. max_tool_bytes=.. [uid=..]
                            seccomp=<hex BPF program compiled by the host with pyseccomp>
                            seccomp_after_ready=<hex BPF program>

and speaks to it over ONE dedicated file descriptor (a UNIX socketpair end, number N), never
over stdout, in the frames that `wire.py` (beside this file) defines for both sides.

Start-up order matters: limits and the seccomp filter(s) are installed before any thread
exists, because a seccomp filter only applies to the thread that loads it and to threads
created later. Under bwrap, bwrap installs the main filter before this program starts and
this program adds the exec rules right after ready (see rao_jax/sandbox_host/seccomp.py).
"""
import builtins as _builtins_module
import os
import sys

# -I leaves this file's folder off sys.path; the protocol module lies beside it.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wire  # pylint: disable=wrong-import-position
del sys.path[0]  # the agent's imports never look into the REPL's folder

# The REPL's own functions look builtins up in this private copy (a function captures its
# module's __builtins__ when it is created), so agent code that deletes or replaces builtins
# (`del builtins.len`) cannot break the protocol, even in the threads that run during a cell.
__builtins__ = dict(_builtins_module.__dict__)

# Bound once, so agent code that deletes or replaces module attributes cannot break the
# protocol in the middle of a cell.
_write = os.write
_read = os.read
_frame = wire.frame
_frame_size = wire.frame_size
_HEADER = wire.HEADER_BYTES

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


def _parse_args(argv):
  """key=value arguments (no json yet: its import costs start-up time)."""
  cfg = {}
  for item in argv:
    key, _, value = item.partition("=")
    cfg[key] = int(value) if value.lstrip("-").isdigit() else value
  return cfg


def _set_limits(cfg):
  """Lowers soft AND hard resource limits, so the agent's code cannot raise them again."""
  import resource
  mb = 1024 * 1024
  wanted = {
      "RLIMIT_AS": cfg["memory_mb"] * mb,
      "RLIMIT_FSIZE": cfg["file_size_mb"] * mb,
      "RLIMIT_NOFILE": cfg["open_files"],
      "RLIMIT_CORE": 0,
      "RLIMIT_MSGQUEUE": 0,
  }
  # RLIMIT_NPROC is counted per uid (per user namespace) and the kernel does not apply it to
  # root at all: the host gives the jail a uid of its own (see main); the seccomp filter (no
  # fork, no non-thread clone) is what stops a fork bomb.
  if os.getuid() != 0 and cfg.get("processes", 0) > 0:
    wanted["RLIMIT_NPROC"] = cfg["processes"]
  applied = {}
  for name, value in wanted.items():
    res = getattr(resource, name)
    _, hard = resource.getrlimit(res)
    if hard != resource.RLIM_INFINITY and hard < value:
      value = hard
    resource.setrlimit(res, (value, value))
    applied[name] = value
  if cfg.get("cpu_s", 0) > 0:
    # CPU of the whole life: SIGXCPU at the soft limit (the host names it), SIGKILL a second
    # later should the agent's code catch that.
    cpu = cfg["cpu_s"]
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY and hard < cpu + 1:
      cpu = hard - 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    applied["RLIMIT_CPU"] = cpu
  return applied


def _switch_uid(uid):
  """Becomes `uid` (and gid) for good; on a root host this is what makes RLIMIT_NPROC apply.

  bwrap left this process CAP_SETUID and CAP_SETGID only; changing every uid away from 0
  clears all capabilities, so nothing can switch back (checked below).
  """
  os.setgroups([])
  os.setresgid(uid, uid, uid)
  os.setresuid(uid, uid, uid)
  try:
    os.setresuid(0, 0, 0)
  except PermissionError:
    return
  raise RuntimeError("the REPL could switch back to uid 0 after dropping it")


def _load_seccomp(bpf_hex):
  """Installs the host's seccomp filter (a BPF program compiled with pyseccomp/libseccomp).

  The host compiles it once (rao_jax/sandbox_host/seccomp.py); loading it here takes one
  prctl, instead of importing pyseccomp, typing and ctypes.util in every sandbox.
  """
  import ctypes
  prog_bytes = bytes.fromhex(bpf_hex)
  if not prog_bytes or len(prog_bytes) % 8:
    raise RuntimeError("the seccomp program from the host is malformed")

  class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

  buf = ctypes.create_string_buffer(prog_bytes, len(prog_bytes))
  prog = SockFprog(len(prog_bytes) // 8, ctypes.addressof(buf))
  libc = ctypes.CDLL(None, use_errno=True)
  libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                         ctypes.c_ulong]
  # No new privileges: required for an unprivileged filter, and no setuid binary could
  # regain anything anyway.
  if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
  if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


def main():
  cfg = _parse_args(sys.argv[1:])
  sys.argv = ["repl"]  # the agent's code has no use for the fd number or the filter
  fd = cfg["fd"]
  # fds 1 and 2 become the write end of a pipe that this process drains into the current
  # cell's output; the original fds (towards the host) are gone, so the agent's code has no
  # way to write anything the host would read except through the protocol fd.
  out_r, out_w = os.pipe()
  os.dup2(out_w, 1)
  os.dup2(out_w, 2)
  os.close(out_w)
  null = os.open("/dev/null", os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  bpf = cfg.get("seccomp", "")
  try:
    if cfg.get("uid"):
      _switch_uid(cfg["uid"])
    limits = _set_limits(cfg)
    if bpf:
      _load_seccomp(bpf)
  except BaseException as e:  # pylint: disable=broad-except
    # Never run agent code in a half-built jail; tell the host why (stderr is gone already).
    text = repr(f"{type(e).__name__}: {e}")[1:-1].replace('"', "'")
    data = ('{"op": "fatal", "error": "%s"}' % text).encode()
    _write(fd, _frame(data))
    os._exit(1)
  after_ready = cfg.get("seccomp_after_ready", "")
  # The ready message is written by hand: json and the cell machinery are imported after it,
  # while the host already counts this sandbox as started (a first cell simply queues).
  ready = ('{"op": "ready", "pid": %d, "seccomp": %s, "limits": {%s}}' % (
      os.getpid(), "true" if (bpf or after_ready) else "false",
      ", ".join('"%s": %d' % kv for kv in sorted(limits.items()))))
  _write(fd, _frame(ready.encode()))
  if after_ready:
    # Under bwrap, bwrap installed the main filter before starting this interpreter (it
    # still had to exec it); the exec rules come now, on the only thread, before anything
    # from the host is read.
    try:
      _load_seccomp(after_ready)
    except BaseException:  # pylint: disable=broad-except
      os._exit(1)  # the host sees the channel close and reports a crash
  _late_imports()
  repl = _Repl(fd, out_r, cfg.get("max_tool_bytes", 1 << 62))
  repl.ensure_loop()
  repl.serve()


# --------------------------------------------------------------------------------------------
# Everything below runs after the jail is complete.

ast = bisect = dis = json = linecache = threading = traceback = None
_dumps = _loads = _Lock = _Thread = _Event = None


def _late_imports():
  global ast, bisect, dis, json, linecache, threading, traceback
  global _dumps, _loads, _Lock, _Thread, _Event
  import bisect  # pylint: disable=redefined-outer-name,import-outside-toplevel
  import dis  # pylint: disable=redefined-outer-name,import-outside-toplevel
  import ast  # pylint: disable=redefined-outer-name,import-outside-toplevel
  import json  # pylint: disable=redefined-outer-name,import-outside-toplevel
  import linecache  # pylint: disable=redefined-outer-name,import-outside-toplevel
  import threading  # pylint: disable=redefined-outer-name,import-outside-toplevel
  import traceback  # pylint: disable=redefined-outer-name,import-outside-toplevel
  _dumps = json.dumps
  _loads = json.loads
  _Lock = threading.Lock
  _Thread = threading.Thread
  _Event = threading.Event


_LAST = "_repl_last_value_"
_new_nonce = lambda: os.urandom(8).hex()  # noqa: E731


class ToolError(Exception):
  """A tool call failed on the host; the message is the host's error text."""


class _Capture:
  """Cell output: keeps the first `limit` characters and counts the rest."""

  def __init__(self):
    self.lock = _Lock()
    self.reset(0)

  def reset(self, limit):
    self.parts = []
    self.kept = 0
    self.dropped = 0
    self.limit = limit

  def add(self, text):
    if not text:
      return
    with self.lock:
      room = self.limit - self.kept
      if room <= 0:
        self.dropped += len(text)
        return
      if len(text) > room:
        self.dropped += len(text) - room
        text = text[:room]
      self.parts.append(text)
      self.kept += len(text)

  def take(self):
    with self.lock:
      text = "".join(self.parts)
      if self.dropped:
        text += (f"\n[output truncated: {self.dropped} more characters were not shown; "
                 f"the limit is {self.limit} characters per cell]")
      self.parts = []
      return text


class _Bytes:
  """sys.stdout.buffer: bytes are decoded (UTF-8, invalid bytes replaced) into the output."""

  def __init__(self, capture):
    self._capture = capture

  def write(self, b):
    self._capture.add(bytes(b).decode("utf-8", "replace"))
    return len(b)

  def flush(self):
    pass


class _Stream:
  """sys.stdout / sys.stderr during a cell."""

  encoding = "utf-8"
  errors = "replace"

  def __init__(self, capture, fileno):
    self._capture = capture
    self._fileno = fileno
    self.buffer = _Bytes(capture)

  def write(self, s):
    if not isinstance(s, str):
      raise TypeError(f"write() argument must be str, not {type(s).__name__}")
    self._capture.add(s)
    return len(s)

  def writelines(self, lines):
    for line in lines:
      self.write(line)

  def flush(self):
    pass

  def isatty(self):
    return False

  def writable(self):
    return True

  def readable(self):
    return False

  def fileno(self):
    return self._fileno


class _ToolCall:
  """Bookkeeping for one request to the host."""

  __slots__ = ("name", "rid", "event", "ok", "value", "loop", "future", "on_done")

  def __init__(self, name, rid):
    self.name = name
    self.rid = rid
    self.event = None
    self.ok = None
    self.value = None
    self.loop = None
    self.future = None
    self.on_done = None


_AWAIT_CACHE = {}


def _directly_awaited(frame):
  """True when the call at `frame`'s current instruction is the operand of `await`.

  f_lasti points at the CALL or at one of its inline cache entries, so the question is
  whether the first real instruction after it is GET_AWAITABLE.
  """
  code = frame.f_code
  entry = _AWAIT_CACHE.get(code)
  if entry is None:
    instrs = list(dis.get_instructions(code))
    entry = ([i.offset for i in instrs], [i.opname == "GET_AWAITABLE" for i in instrs])
    _AWAIT_CACHE[code] = entry
  offsets, awaits = entry
  k = bisect.bisect_right(offsets, frame.f_lasti)
  return k < len(offsets) and awaits[k]


class _Repl:
  """Protocol loop, cell execution and tool forwarding."""

  def __init__(self, fd, out_r, max_tool_bytes):
    self.fd = fd
    self.max_tool_bytes = max_tool_bytes
    self.out_r = out_r
    self.send_lock = _Lock()
    self.out_lock = _Lock()
    self.capture = _Capture()
    self.stdout = _Stream(self.capture, 1)
    self.stderr = _Stream(self.capture, 2)
    self.calls = {}  # rid -> _ToolCall, requests in flight
    self.calls_lock = _Lock()
    self.cell_id = None
    self.cell_no = 0
    self.commands = []  # run / vars requests, handed from the reader thread to the main thread
    self.commands_cv = threading.Condition(_Lock())
    self.loop = None
    import builtins
    self.builtins_mod = builtins
    self.builtins_dict = builtins.__dict__
    self.builtins_items = tuple(builtins.__dict__.items())
    self.ns = {"__name__": "__main__", "__builtins__": builtins}
    self.decoder = __import__("codecs").getincrementaldecoder("utf-8")("replace")
    # Non-blocking before any reader exists: _drain_now must never wait on an empty pipe.
    os.set_blocking(out_r, False)
    _Thread(target=self._drain_fd_output, name="repl-output", daemon=True).start()
    _Thread(target=self._read_host, name="repl-reader", daemon=True).start()

  # ---- wire -------------------------------------------------------------------------------

  def send(self, obj):
    self._restore_builtins()
    frame = _frame(_dumps(obj).encode("utf-8"))
    with self.send_lock:
      view = memoryview(frame)
      while view:
        n = _write(self.fd, view)
        view = view[n:]

  def _read_exact(self, n):
    chunks = []
    while n:
      b = _read(self.fd, min(n, 1 << 20))
      if not b:
        return None
      chunks.append(b)
      n -= len(b)
    return b"".join(chunks)

  def _read_host(self):
    """Reader thread: tool replies go straight to their waiter, commands to the main thread."""
    try:
      while True:
        head = self._read_exact(_HEADER)
        if head is None:
          break
        body = self._read_exact(_frame_size(head))
        if body is None:
          break
        try:
          self._restore_builtins()
          msg = _loads(body)
          if msg.get("op") == "reply":
            self._resolve(msg)
            continue
        except Exception:  # pylint: disable=broad-except
          continue  # one bad message (or a loop the agent closed) must not end the REPL
        with self.commands_cv:
          self.commands.append(msg)
          self.commands_cv.notify()
    except BaseException:  # pylint: disable=broad-except
      pass
    # The host is gone or closed the channel: nothing left to serve.
    os._exit(0)

  def _resolve(self, msg):
    with self.calls_lock:
      call = self.calls.pop(msg.get("rid"), None)
    if call is None:
      return  # not ours (never issued, already answered or cancelled)
    call.ok = bool(msg.get("ok"))
    call.value = msg.get("value") if call.ok else str(msg.get("error"))
    if call.future is not None:
      call.loop.call_soon_threadsafe(self._settle_future, call)
    else:
      call.event.set()

  @staticmethod
  def _settle_future(call):
    fut = call.future
    if fut.done():
      return
    if call.ok:
      fut.set_result(call.value)
    else:
      fut.set_exception(ToolError(call.value))

  def _drain_fd_output(self):
    """Output thread: whatever reaches fd 1 or 2 (os.write, C code) joins the cell output.

    It keeps reading while a cell writes, so 100 MB written to fd 1 cost time, not a hang.
    """
    import select
    poller = select.poll()
    poller.register(self.out_r, select.POLLIN)
    while True:
      poller.poll()
      if not self._drain_now():
        return  # every write end is closed (the agent closed fds 1 and 2): nothing to read

  def _drain_now(self):
    """Moves what is in the output pipe into the capture; False once the pipe is closed.

    Reading under `out_lock` means that at the end of a cell, after one more call, every
    byte written before that point is in the output.
    """
    with self.out_lock:
      while True:
        try:
          b = _read(self.out_r, 1 << 16)
        except BlockingIOError:
          return True
        except OSError:
          return False
        if not b:
          return False
        self.capture.add(self.decoder.decode(b))

  # ---- tools ------------------------------------------------------------------------------

  def _make_proxy(self, name, is_async):
    repl = self

    def proxy(*args, **kwargs):
      return repl.call_tool(name, is_async, sys._getframe(1), args, kwargs)

    proxy.__name__ = proxy.__qualname__ = name
    proxy.__doc__ = (f"Calls the host tool {name!r}. `{name}(...)` returns its result; "
                     f"`await {name}(...)` and asyncio.gather(...) run calls concurrently.")
    return proxy

  def call_tool(self, name, is_async, frame, args, kwargs):
    self._restore_builtins()
    cell = self.cell_id
    if cell is None:
      raise ToolError(f"{name}: tools can only be called while a cell is running")
    try:
      payload = {"op": "tool", "cell": cell, "rid": "", "name": name, "args": list(args),
                 "kwargs": kwargs}
      size = len(_dumps(payload).encode("utf-8"))
    except (TypeError, ValueError) as e:
      raise TypeError(f"{name}(...): arguments must be JSON values (str, int, float, bool, "
                      f"None, list, dict with str keys): {e}") from None
    if size + 64 > self.max_tool_bytes:
      raise ToolError(f"{name}(...): the arguments are {size} bytes of JSON; a tool call may "
                      f"carry at most {self.max_tool_bytes - 64} bytes. Pass less (e.g. a "
                      f"slice, or a name the tool can look up)")
    loop = None
    aio = sys.modules.get("asyncio")
    if aio is not None:
      loop = aio._get_running_loop()  # pylint: disable=protected-access
    rid = _new_nonce()
    payload["rid"] = rid
    call = _ToolCall(name, rid)
    # Inside a running event loop an awaitable is returned when the caller awaits this very
    # call, or when the host tool is asynchronous (so it can go to asyncio.gather); in every
    # other case the call blocks and returns the result, so `x = craft(...)` just works.
    if loop is not None and (is_async or _directly_awaited(frame)):
      call.loop = loop
      call.future = loop.create_future()
      call.on_done = lambda fut: self._on_future_done(fut, rid)
      call.future.add_done_callback(call.on_done)
    else:
      call.event = _Event()
    with self.calls_lock:
      self.calls[rid] = call
    self.send(payload)
    if call.future is not None:
      return call.future
    call.event.wait()
    if call.ok:
      return call.value
    raise ToolError(call.value)

  def _on_future_done(self, fut, rid):
    # The agent cancelled the awaitable (asyncio.wait_for, task.cancel): stop the host side.
    if fut.cancelled():
      with self.calls_lock:
        pending = self.calls.pop(rid, None)
      if pending is not None:
        self.send({"op": "cancel", "rid": rid})

  def _cancel_pending(self):
    """Ends the requests a finished cell left behind (e.g. a tool call never awaited)."""
    with self.calls_lock:
      pending = list(self.calls.items())
      self.calls.clear()
    names = []
    for rid, call in pending:
      names.append(call.name)
      self.send({"op": "cancel", "rid": rid})
      if call.future is not None and not call.future.done():
        call.future.remove_done_callback(call.on_done)
        call.future.cancel()
    return names

  # ---- cells ------------------------------------------------------------------------------

  def serve(self):
    while True:
      with self.commands_cv:
        while not self.commands:
          self.commands_cv.wait()
        msg = self.commands.pop(0)
      op = msg.get("op")
      if op == "run":
        self.send(self.run_cell(msg))
      elif op == "vars":
        err = None
        try:
          self.ns.update(msg["vars"])
        except Exception as e:  # pylint: disable=broad-except
          err = repr(e)
        self.send({"op": "vars_done", "id": msg.get("id"), "error": err})

  def _restore_builtins(self):
    """Puts back builtins the agent deleted or replaced.

    Called before each cell and before the REPL itself uses the standard library (json in
    send / receive), whose functions look builtins up in the shared, agent-writable dict.
    """
    bdict = self.builtins_dict
    for k, v in self.builtins_items:
      if bdict.get(k, bdict) is not v:
        bdict[k] = v

  def _restore_runtime(self):
    # The agent may have deleted or replaced builtins, sys.stdout, or the proxies last cell.
    self._restore_builtins()
    self.ns["__builtins__"] = self.builtins_mod
    sys.stdout = self.stdout
    sys.stderr = self.stderr

  def run_cell(self, msg):
    self.cell_no += 1
    self.capture.reset(int(msg.get("max_output", 20000)))
    self._restore_runtime()
    for name, is_async in msg.get("tools", ()):
      self.ns[name] = self._make_proxy(name, bool(is_async))
    error = None
    self.cell_id = msg["id"]
    try:
      error = self._execute(msg["code"])
    except BaseException as e:  # pylint: disable=broad-except
      error = f"{type(e).__name__}: {e} (raised by the REPL itself)"
    self.cell_id = None
    try:
      sys.stdout = self.stdout
      sys.stderr = self.stderr
      # Text written through the original buffered streams reaches fd 1/2 only on flush.
      for stream in (sys.__stdout__, sys.__stderr__):
        try:
          stream.flush()
        except Exception:  # pylint: disable=broad-except
          pass
      self._drain_now()
      leftover = self._cancel_pending()
      if leftover:
        self.capture.add(
            f"\n[note: {len(leftover)} tool call(s) ({', '.join(sorted(set(leftover)))}) were "
            f"still pending when the cell ended and were cancelled; await them in the cell "
            f"that makes them]")
      output = self.capture.take()
    except BaseException as e:  # pylint: disable=broad-except
      output = f"[the REPL could not collect the output: {e!r}]"[:2000]
    if error is not None and len(error) > 8000:
      # The host keeps 8000 characters, and an oversized completion would be a protocol
      # violation (e.g. SystemExit('x' * 10**7) shows its whole argument).
      error = error[:4000] + "\n[... shortened ...]\n" + error[-3000:]
    return {"op": "done", "id": msg["id"], "output": output, "error": error}

  def _execute(self, src):
    filename = f"<cell {self.cell_no}>"
    try:
      tree = ast.parse(src, filename=filename, mode="exec")
    except SyntaxError as e:
      return "".join(traceback.format_exception_only(SyntaxError, e)).rstrip()
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    # The value of a final bare expression is shown, as in an interactive session. It is
    # captured by an assignment inside the same code object, so that an `await` anywhere in
    # the cell makes the WHOLE cell run in the event loop.
    show = bool(tree.body) and isinstance(tree.body[-1], ast.Expr)
    if show:
      last = tree.body[-1]
      tree.body[-1] = ast.copy_location(
          ast.Assign(targets=[ast.Name(_LAST, ast.Store())], value=last.value), last)
      ast.fix_missing_locations(tree)
    try:
      code = compile(tree, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                     dont_inherit=True)
      self._run_code(code)
      if show:
        value = self.ns.pop(_LAST, None)
        if value is not None:
          self.capture.add(repr(value) + "\n")
    except BaseException as e:  # pylint: disable=broad-except
      self.ns.pop(_LAST, None)
      self._restore_runtime()  # formatting needs the builtins the cell may have deleted
      return self._format_error(e)
    return None

  def ensure_loop(self):
    """The event loop for top-level await, and `asyncio` in the agent's namespace.

    The agents' prompts promise `asyncio` (for asyncio.gather). main() calls this right after
    the ready message, while the sandbox idles in the pool, so neither the cold start nor
    the first cell pays for the import.
    """
    if self.loop is None:
      import asyncio
      self.loop = asyncio.new_event_loop()
      asyncio.set_event_loop(self.loop)
      self.ns.setdefault("asyncio", asyncio)

  def _run_code(self, code):
    self.ensure_loop()
    if code.co_flags & 0x80:  # CO_COROUTINE: the cell uses top-level await
      return self.loop.run_until_complete(eval(code, self.ns))  # pylint: disable=eval-used
    return eval(code, self.ns)  # pylint: disable=eval-used

  def _format_error(self, exc):
    if isinstance(exc, SystemExit):
      return (f"SystemExit({exc.code!r}): exiting is not allowed here; the REPL keeps running "
              f"and your variables are kept")
    # Only the agent's own frames: the REPL's and asyncio's internals are noise to the agent.
    tb = exc.__traceback__
    frames = [f for f in traceback.extract_tb(tb) if f.filename.startswith("<cell ")]
    lines = traceback.format_list(frames[-8:]) if frames else []
    head = "Traceback (most recent call last):\n" if lines else ""
    msg = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
    text = head + "".join(lines) + msg
    if len(text) > 4000:
      text = text[:1500] + "\n[... traceback shortened ...]\n" + text[-2000:]
    return text


if __name__ == "__main__":
  main()
