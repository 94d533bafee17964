"""SandboxPool: pre-started sandboxes, one per agent, never reused; many at once."""
import asyncio
import os
import statistics
import time

import pytest

from rao_jax.sandbox_host import (SandboxConfig, SandboxPool, bwrap_available,
                                  missing_bwrap_message)

needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason=missing_bwrap_message())

CFG = SandboxConfig(isolation="bwrap", cell_timeout_s=60.0)
# A hang here (a host wait that never ends) must fail in minutes, not at the suite's 900 s.
pytestmark = pytest.mark.timeout(300)


@needs_bwrap
def test_acquire_is_fast_and_release_discards_the_sandbox():
  async def main():
    pool = SandboxPool(CFG, size=3)
    await pool.start()
    try:
      acquire_s = []
      pids = []
      for i in range(6):
        await pool.wait_full()
        t0 = time.perf_counter()
        sb = await pool.acquire()
        acquire_s.append(time.perf_counter() - t0)
        pids.append(sb.pid)
        # Whatever one agent leaves behind is never seen by the next.
        seen = await sb.run_cell("print('left_behind' in dir())\nleft_behind = 'secret'")
        assert seen.output == "False\n", seen
        await pool.release(sb)
        assert sb.closed
        with pytest.raises(RuntimeError, match="closed"):
          await sb.run_cell("1")
      await pool.wait_full()
      return acquire_s, pids, pool.ready_count, pool.cold_acquires
    finally:
      await pool.close()

  acquire_s, pids, ready, cold = asyncio.run(main())
  assert len(set(pids)) == len(pids)  # a fresh process every time
  assert ready == 3 and cold == 0
  for pid in pids:
    assert not os.path.exists(f"/proc/{pid}")
  # Goal: <= 5 ms; a loose bound because CI shares its 2 cores.
  assert statistics.median(acquire_s) < 0.05, acquire_s


@needs_bwrap
def test_acquire_past_the_ready_set_spawns_directly():
  async def main():
    pool = SandboxPool(CFG, size=1)
    await pool.start()
    try:
      a, b = await pool.acquire(), await pool.acquire()
      ra, rb = await a.run_cell("print('a')"), await b.run_cell("print('b')")
      return ra.output + rb.output, pool.cold_acquires
    finally:
      await pool.close()

  out, cold = asyncio.run(main())
  assert out == "a\nb\n" and cold >= 1


@needs_bwrap
def test_pool_close_kills_handed_out_sandboxes():
  async def main():
    pool = SandboxPool(CFG, size=2)
    await pool.start()
    sb = await pool.acquire()
    pid = sb.pid
    await pool.close()
    with pytest.raises(RuntimeError):
      await pool.acquire()
    return pid

  pid = asyncio.run(main())
  assert not os.path.exists(f"/proc/{pid}")


def test_pool_rejects_bad_arguments():
  with pytest.raises(ValueError, match="size"):
    SandboxPool(CFG, size=-1)
  with pytest.raises(TypeError, match="SandboxConfig"):
    SandboxPool({"isolation": "bwrap"}, size=1)

  async def main():
    with pytest.raises(RuntimeError, match="start"):
      await SandboxPool(CFG, size=1).acquire()
  asyncio.run(main())


def test_process_mode_still_has_rlimits_and_seccomp():
  """The weaker mode keeps the REPL's own layers; /proc is visible there, so the kernel can
  confirm that the filter is on. Each probe fails with EPERM only because of seccomp (this
  runs as the host's uid, outside any namespace)."""
  cfg = SandboxConfig(isolation="process", memory_mb=512, cell_timeout_s=30.0)
  code = (
      "import ctypes, errno, os, resource, socket, threading\n"
      "libc = ctypes.CDLL(None, use_errno=True)\n"
      "def err(rc):\n  return errno.errorcode.get(ctypes.get_errno(), rc) if rc == -1 else rc\n"
      "status = open('/proc/self/status').read()\n"
      "print('seccomp', [l.split()[1] for l in status.splitlines() if l.startswith('Seccomp:')])\n"
      "print('as', resource.getrlimit(resource.RLIMIT_AS)[0] >> 20)\n"
      "print('unshare', err(libc.unshare(0x04000000)))\n"  # CLONE_NEWUTS
      "print('bpf', err(libc.syscall(321, 0, 0, 0)))\n"
      "print('setns', err(libc.setns(-1, 0)))\n"
      "print('io_uring', err(libc.syscall(425, 1, 0)))\n"
      "print('mount', err(libc.mount(b'none', b'/nonexistent-rao', b'tmpfs', 0, None)))\n"
      # PTRACE_PEEKUSER on a process we never attached to: ESRCH without the filter.
      "print('ptrace', err(libc.ptrace(3, os.getppid(), 0, 0)))\n"
      "for fam in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK):\n"
      "  try:\n    socket.socket(fam, socket.SOCK_DGRAM)\n    print('socket ok', fam)\n"
      "  except OSError as e:\n    print('socket', errno.errorcode[e.errno])\n"
      "a, b = socket.socketpair()\nprint('unix ok')\n"
      "try:\n  os.fork()\nexcept OSError as e:\n  print('fork', errno.errorcode[e.errno])\n"
      "t = threading.Thread(target=print, args=('thread ok',))\nt.start()\nt.join()\n")

  async def main():
    pool = SandboxPool(cfg, size=1)
    await pool.start()
    try:
      sb = await pool.acquire()
      return await sb.run_cell(code)
    finally:
      await pool.close()

  res = asyncio.run(main())
  assert res.error is None, res.observation
  assert res.output.splitlines() == [
      "seccomp ['2']", "as 512", "unshare EPERM", "bpf EPERM", "setns EPERM",
      "io_uring EPERM", "mount EPERM", "ptrace EPERM", "socket EACCES", "socket EACCES", "socket EACCES",
      "unix ok", "fork EPERM", "thread ok"]


# The misbehaving agents of the load test, one per class of attack the pool contains (class 6, the live-agent
# limit, is the runtime's: its test is in test_sandbox_adversarial.py; a deeply nested frame,
# the other half of class 4, takes its place). Each is (attack cell, check of its result).
_FIND_FD = (
    "import os, stat\n"
    "def is_sock(f):\n"
    "  try:\n    return stat.S_ISSOCK(os.fstat(f).st_mode)\n  except OSError:\n"
    "    return False\n"
    "fds = [f for f in range(3, 4096) if is_sock(f)]\n"
    "def frame(b):\n  return len(b).to_bytes(4, 'big') + b\n")
BAD_AGENTS = {
    "shared-memory": (
        "import os\nout = []\n"
        "for p in ('/dev/shm/x', '/dev/x'):\n"
        "  try:\n    open(p, 'wb').write(b'x' * (8 << 20))\n    out.append('WROTE')\n"
        "  except OSError as e:\n    out.append(e.strerror)\n"
        "try:\n  os.memfd_create('m')\nexcept OSError as e:\n  out.append(e.strerror)\n"
        "print(out)",
        lambda r: r.output == "['Read-only file system', 'Read-only file system', "
                              "'Operation not permitted']\n"),
    "threads": (
        "import threading\nthreading.stack_size(65536)\nstop = threading.Event()\nn = 0\n"
        "try:\n  while n < 5000:\n"
        "    threading.Thread(target=stop.wait, daemon=True).start()\n    n += 1\n"
        "except RuntimeError:\n  pass\nstop.set()\nprint(n)",
        lambda r: r.error is None and 200 < int(r.output) < 256),
    "cpu-between-cells": None,  # see the agent below: it needs the host's clock
    "big-frame": (
        _FIND_FD + "body = b'{\"op\": \"junk\", \"a\": [' + b'0,' * (16 << 20) + b'0]}'\n"
        "for fd in fds:\n  os.write(fd, frame(body))\nimport time\ntime.sleep(5)",
        lambda r: r.crashed and "protocol violation" in r.output),
    "pending-tool-bytes": (
        "import asyncio\nfuts = [asyncio.ensure_future(hold('x' * 3_900_000)) for _ in range(24)]\n"
        "for _ in range(600):\n  await asyncio.sleep(0.05)\n"
        "  if sum(f.done() for f in futs) >= 16:\n    break\n"
        "print(sum(f.done() and f.exception() is not None for f in futs))",
        lambda r: r.error is None and int(r.output.split()[0]) == 16),
    "nested-frame": (
        _FIND_FD + "body = b'{\"op\": \"tool\", \"a\": ' + b'[' * 200000 + b']' * 200000 + b'}'\n"
        "for fd in fds:\n  os.write(fd, frame(body))\nimport time\ntime.sleep(5)",
        lambda r: r.crashed and not r.timed_out and "protocol violation" in r.output),
    "forged-done": (
        _FIND_FD + "import gc, json, time\n"
        "repl = next(o for o in gc.get_objects() if type(o).__name__ == '_Repl')\n"
        "os.write(repl.fd, frame(json.dumps({'op': 'done', 'id': repl.cell_id, "
        "'output': 'FORGED', 'error': None}).encode()))\ntime.sleep(1)",
        lambda r: r.output == "FORGED"),
    "shared-file-locks": (
        "import fcntl\nf = open('/sandbox/repl.py', 'rb')\n"
        "try:\n  fcntl.flock(f, fcntl.LOCK_SH)\n  print('locked')\n"
        "except OSError as e:\n  print(e.strerror)",
        lambda r: r.output == "Operation not permitted\n"),
}


def _rss_mib():
  with open("/proc/self/statm", encoding="utf-8") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@needs_bwrap
@pytest.mark.slow
def test_sixty_four_concurrent_sandboxes_run_twenty_cells_each():
  """56 well-behaved agents and 8 misbehaving ones (one per class of attack) at once: no
  failure among the well-behaved, every attack contained, host memory bounded."""
  n_agents, n_cells, attack_at = 64, 20, 3
  bad = list(BAD_AGENTS)
  n_good = n_agents - len(bad)
  tool_calls = {"n": 0}

  def craft(agent, i):
    tool_calls["n"] += 1
    return agent * 1000 + i

  async def launch_subagent(agent, i):
    await asyncio.sleep(0.001)
    return -(agent * 1000 + i)

  async def hold(data):
    await asyncio.Event().wait()

  tools = {"craft": craft, "launch_subagent": launch_subagent, "hold": hold}

  async def good_agent(pool, k):
    sb = await pool.acquire()
    try:
      await sb.set_variables({"me": k})
      results = []
      for i in range(n_cells):
        if i == 0:
          code = "total = 0"
        elif i % 5 == 0:
          code = (f"import asyncio\nxs = await asyncio.gather(launch_subagent(me, {i}), "
                  f"launch_subagent(me, {i}))\ntotal += sum(xs)\nprint(total)")
        else:
          code = f"total += craft(me, {i})\nprint(total)"
        results.append(await sb.run_cell(code, tools))
      return results
    finally:
      await pool.release(sb)

  async def bad_agent(pool, name):
    """Plain cells, the attack at cell `attack_at`; returns (attack result, other results)."""
    sb = await pool.acquire()
    windows, attack, others = [], None, []
    try:
      for i in range(n_cells):
        if i == attack_at and name == "cpu-between-cells":
          code = ("import threading, time\nticks = []\n"
                  "def spin():\n  while True:\n    ticks.append(time.time())\n"
                  "    sum(range(20000))\n"
                  "threading.Thread(target=spin, daemon=True).start()")
        elif i == n_cells - 1 and name == "cpu-between-cells":
          # Ticks while the host ran no cell here (it idles 0.2 s after each cell).
          code = f"print(sum(any(a < t < b for a, b in {windows!r}) for t in ticks))"
        elif i == attack_at:
          code = BAD_AGENTS[name][0]
        else:
          code = f"print(craft({1000 + bad.index(name)}, {i}))"
        res = await sb.run_cell(code, tools)
        if i == attack_at:
          attack = res
        else:
          others.append(res)
        if name == "cpu-between-cells" and i >= attack_at:
          t_done = time.time()
          await asyncio.sleep(0.2)
          windows.append((t_done + 0.02, time.time() - 0.02))
      return attack, others
    finally:
      await pool.release(sb)

  rss = {"peak": 0.0}

  async def watch_rss():
    while True:
      rss["peak"] = max(rss["peak"], _rss_mib())
      await asyncio.sleep(0.05)

  async def main():
    pool = SandboxPool(CFG, size=n_agents)
    await pool.start()
    rss["base"] = _rss_mib()
    watcher = asyncio.create_task(watch_rss())
    try:
      return await asyncio.gather(*(good_agent(pool, k) for k in range(n_good)),
                                  *(bad_agent(pool, name) for name in bad))
    finally:
      watcher.cancel()
      await pool.close()

  t0 = time.perf_counter()
  all_results = asyncio.run(main())
  elapsed = time.perf_counter() - t0
  for k, results in enumerate(all_results[:n_good]):
    total = 0
    for i, res in enumerate(results):
      assert res.error is None and not res.timed_out and not res.crashed, (k, i, res)
      assert not res.sandbox_restarted
      if i == 0:
        continue
      total += -2 * (k * 1000 + i) if i % 5 == 0 else k * 1000 + i
      assert res.output == f"{total}\n", (k, i, res.output)
  for name, (attack, others) in zip(bad, all_results[n_good:]):
    if name == "cpu-between-cells":
      assert attack.error is None and others[-1].output == "0\n", (name, others[-1])
    else:
      assert BAD_AGENTS[name][1](attack), (name, attack)
    # The bad agent itself goes on: its other cells run (in a fresh sandbox after a kill; a
    # forged completion is found out, and the sandbox replaced, at the cell after it).
    after = others[attack_at + (name == "forged-done"):]
    if name == "forged-done":
      assert others[attack_at].crashed and "protocol violation" in others[attack_at].output
    assert all(r.error is None and not r.crashed for r in after), (name, after)
  assert tool_calls["n"] >= n_good * (n_cells - 1 - 3)
  # What the host holds for all 64 is bounded (the pending-bytes agent alone may hold 32 MiB).
  assert rss["peak"] - rss["base"] < 256, rss
  assert elapsed < 150


def test_kill_returns_when_a_leftover_process_holds_the_stderr_pipe(caplog):
  # Python 3.11's Process.wait() also waits for every pipe to close; a descendant that
  # outlives the sandbox's own process and keeps its stderr once hung kill(), and with it the
  # pool and the run (CI). The direct child here leaves such a descendant behind in its own
  # session, out of reach of the kill.
  from rao_jax.sandbox_host.process import ReplProcess

  async def main():
    rp = ReplProcess(SandboxConfig(isolation="process"))
    rp.proc = await asyncio.create_subprocess_exec(
        # The descendant reports its pid only once it is in its own session.
        "sh", "-c", "setsid sh -c 'echo $$ >&2; exec sleep 60' & exec sleep 60",
        stderr=asyncio.subprocess.PIPE, start_new_session=True)
    rp.pid = rp.proc.pid
    leftover = int(await asyncio.wait_for(rp.proc.stderr.readline(), 10))
    rp._tasks = [asyncio.create_task(rp._read_stderr())]
    t0 = time.perf_counter()
    try:
      await asyncio.wait_for(rp.kill(), 30)
      await asyncio.sleep(0.2)
      # Killed by the host (a zombie until init reaps it, or gone).
      with open(f"/proc/{leftover}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
      return time.perf_counter() - t0, rp.proc.returncode, leftover, state
    except FileNotFoundError:
      return time.perf_counter() - t0, rp.proc.returncode, leftover, "gone"
    finally:
      try:
        os.kill(leftover, 9)
      except ProcessLookupError:
        pass

  with caplog.at_level("WARNING", logger="rao_jax.sandbox_host.process"):
    took, code, leftover, state = asyncio.run(main())
  assert took < 8.0, took
  assert code == -9
  assert f"still held open by pid(s) [{leftover}]; killing them" in caplog.text, caplog.text
  assert state in ("Z", "gone"), state


@needs_bwrap
def test_a_spawn_cancelled_at_any_point_leaves_no_process_behind():
  # Pools cancel their background spawns on close(); a cancellation landing between the
  # process start and its ready message once left the process running (and its transport to
  # the garbage collector). Sweep the cancellation over the whole spawn.
  from rao_jax.sandbox_host.process import ReplProcess

  async def main():
    procs = []
    # Fine steps over the process start (where Python 3.11's own cancellation path hangs),
    # coarser ones over the wait for the ready message; twice, as the timing is not exact.
    sweep = [i * 0.0003 for i in range(30)] + [i * 0.002 for i in range(30)]
    for delay_s in sweep * 2:
      rp = ReplProcess(CFG)
      task = asyncio.create_task(rp.spawn())
      await asyncio.sleep(delay_s)
      task.cancel()
      try:
        await task
      except asyncio.CancelledError:
        pass
      procs.append(rp)
      if rp.info:      # spawn finished before the cancel: the caller owns it, so kill it
        await rp.kill()
    return procs

  procs = asyncio.run(main())
  started = [rp for rp in procs if rp.proc is not None]
  assert len(started) >= 40, len(started)    # the sweep did reach past the process start
  assert all(rp.proc.returncode is not None for rp in started)
  assert not [rp.pid for rp in started if os.path.exists(f"/proc/{rp.pid}")]
