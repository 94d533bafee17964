"""The REPL as an agent uses it: namespace, top-level await, tools, output, tracebacks."""
import asyncio
import time

import pytest

from rao_jax.sandbox_host import (SandboxConfig, Sandbox, bwrap_available,
                                  missing_bwrap_message)

# A hang here (a host wait that never ends) must fail in minutes, not at the suite's 900 s.
pytestmark = [pytest.mark.skipif(not bwrap_available(), reason=missing_bwrap_message()),
              pytest.mark.timeout(180)]

CFG = SandboxConfig(isolation="bwrap", cell_timeout_s=20.0, max_output_chars=2000)


def run_in_sandbox(body, cfg=CFG):
  """Runs `await body(sandbox)` on a fresh sandbox and closes it."""
  async def main():
    sb = await Sandbox.start(cfg)
    try:
      return await body(sb)
    finally:
      await sb.close()
  return asyncio.run(main())


def test_namespace_persists_and_final_expression_is_shown():
  async def body(sb):
    r1 = await sb.run_cell("x = 20\ndef f(y):\n  return x + y")
    r2 = await sb.run_cell("f(22)")
    r3 = await sb.run_cell("import math\nz = math.sqrt(16)\nprint('z', z)\nNone")
    return r1, r2, r3
  r1, r2, r3 = run_in_sandbox(body)
  assert (r1.output, r1.error) == ("", None)
  assert r2.output == "42\n" and r2.error is None
  assert r3.output == "z 4.0\n"
  assert not any(r.timed_out or r.crashed or r.sandbox_restarted for r in (r1, r2, r3))


def test_concurrent_tool_calls_from_one_cell():
  state = {"now": 0, "max": 0}

  async def launch_subagent(goal, delay=0.8):
    state["now"] += 1
    state["max"] = max(state["max"], state["now"])
    try:
      await asyncio.sleep(delay)
      return f"answer to {goal}"
    finally:
      state["now"] -= 1

  tools = {"launch_subagent": launch_subagent}

  async def body(sb):
    gathered = await sb.run_cell(
        "import asyncio\n"
        "rs = await asyncio.gather(launch_subagent('a'), launch_subagent('b'),\n"
        "                          launch_subagent('c'))\n"
        "print(rs)", tools)
    peak_gather = state["max"]
    state["max"] = 0
    # Started without await, awaited later in the same cell: still concurrent.
    staggered = await sb.run_cell(
        "t1 = launch_subagent('d')\nt2 = launch_subagent('e')\n"
        "print(await t1, '|', await t2)", tools)
    return gathered, peak_gather, staggered, state["max"]

  gathered, peak_gather, staggered, peak_staggered = run_in_sandbox(body)
  assert gathered.error is None, gathered.error
  assert gathered.output == "['answer to a', 'answer to b', 'answer to c']\n"
  assert peak_gather == 3
  assert staggered.output == "answer to d | answer to e\n"
  assert peak_staggered == 2


def test_sync_and_async_tools_usable_plainly_and_awaited():
  calls = []

  def craft(item, n=1):
    calls.append((item, n))
    return {"item": item, "count": n}

  async def launch_subagent(goal):
    await asyncio.sleep(0.01)
    return goal.upper()

  tools = {"craft": craft, "launch_subagent": launch_subagent}

  async def body(sb):
    plain = await sb.run_cell("r = craft('stick', n=4)\nprint(r['count'], type(r).__name__)",
                              tools)
    # In a cell that uses await, a plain call of a sync tool still returns its value.
    mixed = await sb.run_cell(
        "import asyncio\nawait asyncio.sleep(0)\nv = craft('plank')\n"
        "w = await craft('torch')\nprint(v['item'], w['item'])", tools)
    # An async host tool called without await outside async code just returns its result.
    plain_async = await sb.run_cell("print(launch_subagent('hi'))", tools)
    return plain, mixed, plain_async

  plain, mixed, plain_async = run_in_sandbox(body)
  assert plain.output == "4 dict\n", plain.observation
  assert mixed.output == "plank torch\n", mixed.observation
  assert plain_async.output == "HI\n", plain_async.observation
  assert calls == [("stick", 4), ("plank", 1), ("torch", 1)]


def test_tool_exception_becomes_an_exception_with_its_message_inside():
  def craft(item):
    raise ValueError(f"no recipe for {item}")

  async def body(sb):
    uncaught = await sb.run_cell("craft('diamond_sword')", {"craft": craft})
    caught = await sb.run_cell(
        "try:\n  craft('x')\nexcept Exception as e:\n  print(type(e).__name__, '-', e)",
        {"craft": craft})
    return uncaught, caught

  uncaught, caught = run_in_sandbox(body)
  assert "ValueError: no recipe for diamond_sword" in uncaught.error
  assert caught.output == "ToolError - ValueError: no recipe for x\n"


def test_tool_values_must_be_json():
  def bad_result():
    return {1, 2}

  async def body(sb):
    bad_arg = await sb.run_cell("craft(object())", {"craft": lambda x: x})
    bad_ret = await sb.run_cell("bad_result()", {"bad_result": bad_result})
    return bad_arg, bad_ret

  bad_arg, bad_ret = run_in_sandbox(body)
  assert "TypeError" in bad_arg.error and "JSON" in bad_arg.error
  assert "not JSON-serialisable" in bad_ret.error


def test_tools_are_bound_per_cell():
  async def body(sb):
    with_tool = await sb.run_cell("print(craft('a'))", {"craft": lambda x: x + "!"})
    without = await sb.run_cell("craft('b')", {})
    return with_tool, without

  with_tool, without = run_in_sandbox(body)
  assert with_tool.output == "a!\n"
  assert "no tool named 'craft' is available in this cell" in without.error


def test_output_is_captured_at_fd_level_and_truncated_with_a_note():
  cfg = SandboxConfig(isolation="bwrap", max_output_chars=100)

  async def body(sb):
    mixed = await sb.run_cell(
        "import os, sys\nprint('out')\nsys.stderr.write('err\\n')\n"
        "sys.stdout.buffer.write(b'bin\\n')\n"
        "os.write(1, b'fd1\\n')\nos.write(2, b'fd2\\n')")
    long = await sb.run_cell("print('y' * 1000)")
    return mixed, long

  mixed, long = run_in_sandbox(body, cfg)
  for piece in ("out\n", "err\n", "bin\n", "fd1\n", "fd2\n"):
    assert piece in mixed.output
  assert long.output.startswith("y" * 100 + "\n[output truncated: 901 more characters")
  assert len(long.output) < 300


def test_short_traceback_shows_only_the_agents_frames():
  async def body(sb):
    return await sb.run_cell(
        "import asyncio\ndef inner(d):\n  return d['missing']\n"
        "async def outer():\n  return inner({})\nawait outer()")

  res = run_in_sandbox(body)
  assert res.output == ""
  assert res.error.startswith("Traceback (most recent call last):")
  assert res.error.rstrip().endswith("KeyError: 'missing'")
  assert "repl.py" not in res.error and "asyncio" not in res.error.split("\n", 2)[1]
  assert res.error.count('File "<cell') == 3


def test_syntax_error_is_reported():
  res = run_in_sandbox(lambda sb: sb.run_cell("def f(:\n  pass"))
  assert "SyntaxError" in res.error and not res.crashed


def test_set_variables_binds_json_values():
  context = "lorem ipsum " * 100_000  # 1.2 MB, like a long-context task

  async def body(sb):
    await sb.set_variables({"context": context, "meta": {"n": 3, "tags": ["a", "b"]}})
    res = await sb.run_cell("print(len(context), meta['n'], meta['tags'][1])")
    with pytest.raises(ValueError, match="JSON"):
      await sb.set_variables({"x": object()})
    with pytest.raises(ValueError, match="identifiers"):
      await sb.set_variables({"not a name": 1})
    return res

  res = run_in_sandbox(body)
  assert res.output == f"{len(context)} 3 b\n"


def test_awaiting_with_a_timeout_cancels_the_host_call():
  events = []

  async def launch_subagent(goal):
    try:
      await asyncio.sleep(5)
      events.append("finished")
    except asyncio.CancelledError:
      events.append("cancelled")
      raise

  async def body(sb):
    t0 = time.perf_counter()
    res = await sb.run_cell(
        "import asyncio\ntry:\n  await asyncio.wait_for(launch_subagent('slow'), 0.2)\n"
        "except asyncio.TimeoutError:\n  print('gave up')",
        {"launch_subagent": launch_subagent})
    await asyncio.sleep(0.1)
    return res, time.perf_counter() - t0

  res, elapsed = run_in_sandbox(body)
  assert res.output == "gave up\n"
  assert events == ["cancelled"] and elapsed < 4


def test_rlimits_are_set_by_the_repl_on_itself():
  cfg = SandboxConfig(isolation="bwrap", memory_mb=512, file_size_mb=8, open_files=64)
  res = run_in_sandbox(lambda sb: sb.run_cell(
      "import resource as r\n"
      "print([r.getrlimit(getattr(r, n)) for n in "
      "('RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE', 'RLIMIT_CORE')])"), cfg)
  mb = 2 ** 20
  assert res.output == str([(512 * mb, 512 * mb), (8 * mb, 8 * mb), (64, 64), (0, 0)]) + "\n"


def test_cells_run_in_under_a_few_milliseconds_when_warm():
  async def body(sb):
    times = []
    for _ in range(30):
      t0 = time.perf_counter()
      await sb.run_cell("x = 1 + 1")
      times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]

  median = run_in_sandbox(body)
  # The goal is <= 1 ms; CI shares 2 cores with other tests, so only a loose bound here
  # (benchmarks/bench_sandbox.py measures it properly).
  assert median < 0.05


def test_seccomp_filter_is_active_in_the_jail():
  """Probes whose result differs with and without the filter, even inside the namespaces."""
  async def body(sb):
    return sb._proc.info, await sb.run_cell(  # pylint: disable=protected-access
        "import ctypes, errno, socket, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "rc = libc.syscall(425, 1, 0)\n"  # io_uring_setup: EFAULT if it were allowed
        "print('io_uring', errno.errorcode[ctypes.get_errno()])\n"
        "rc = libc.syscall(435, 0, 0)\n"  # clone3: ENOSYS so that glibc uses clone
        "print('clone3', errno.errorcode[ctypes.get_errno()])\n"
        "try:\n  socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
        "except OSError as e:\n  print('inet', errno.errorcode[e.errno])\n"
        "import os\ntry:\n  os.execv('/python/bin/python3', ['python3', '-c', 'pass'])\n"
        "except OSError as e:\n  print('exec', errno.errorcode[e.errno])\n"
        "t = threading.Thread(target=print, args=('threads still work',))\n"
        "t.start()\nt.join()")

  info, res = run_in_sandbox(body)
  assert info["seccomp"] is True
  assert res.output == ("io_uring EPERM\nclone3 ENOSYS\ninet EACCES\nexec EPERM\n"
                        "threads still work\n"), res.observation


@pytest.mark.parametrize("counts", [False, True], ids=["tool-time-excluded", "tool-time-counted"])
def test_time_spent_in_host_tools_is_not_charged_to_the_cell(counts):
  """A parent awaiting a long subagent is not killed for the host's time (by default)."""
  cfg = SandboxConfig(isolation="bwrap", cell_timeout_s=1.5, timeout_counts_tool_time=counts)

  async def launch_subagent(goal):
    await asyncio.sleep(0.8)
    return goal

  async def body(sb):
    await sb.run_cell("import asyncio")  # the first cell's one-off imports are not the point
    return await sb.run_cell(
        "import asyncio\nr = [await launch_subagent(str(i)) for i in range(3)]\nprint(r)",
        {"launch_subagent": launch_subagent})

  res = run_in_sandbox(body, cfg)
  if counts:
    assert res.timed_out and res.sandbox_restarted
  else:
    assert res.output == "['0', '1', '2']\n" and not res.timed_out, res.observation
    assert res.duration_s > 2.4


def test_tool_calls_in_flight_are_capped():
  cfg = SandboxConfig(isolation="bwrap", max_pending_tool_calls=4)

  async def launch_subagent(goal):
    await asyncio.sleep(0.3)
    return goal

  async def body(sb):
    return await sb.run_cell(
        "import asyncio\n"
        "rs = await asyncio.gather(*[launch_subagent(i) for i in range(6)], "
        "return_exceptions=True)\n"
        "print(sum(isinstance(r, int) for r in rs), sorted({str(r)[:40] for r in rs "
        "if isinstance(r, Exception)}))", {"launch_subagent": launch_subagent})

  res = run_in_sandbox(body, cfg)
  assert res.output == "4 ['too many tool calls in flight (the limit']\n", res.observation


def test_cancelling_a_cell_discards_the_process():
  async def body(sb):
    first_pid = sb.pid
    task = asyncio.create_task(sb.run_cell("import time\ntime.sleep(60)"))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
      await task
    res = await sb.run_cell("print('next')")
    return first_pid, res, sb.pid

  first_pid, res, pid = run_in_sandbox(body)
  assert res.sandbox_restarted and res.output.endswith("next\n") and pid != first_pid
