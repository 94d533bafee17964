"""Adversarial suite: what a policy under RL might try from inside its REPL.

Every case checks four things: the attack is contained, the agent gets a clear observation,
the host and another agent's sandbox go on (a bystander keeps its state and the host event
loop keeps ticking), and nothing outside the sandbox changes.
"""
import asyncio
import hashlib
import json
import os
import sys
import time

import pytest

import rao_jax
from rao_jax.sandbox_host import (SandboxConfig, SandboxPool, bwrap_available,
                                  missing_bwrap_message)
from rao_jax.sandbox_host import jail

# A hang here (a host wait that never ends) must fail in minutes, not at the suite's 900 s.
pytestmark = [pytest.mark.skipif(not bwrap_available(), reason=missing_bwrap_message()),
              pytest.mark.timeout(180)]

CFG = SandboxConfig(isolation="bwrap", cell_timeout_s=10.0, max_output_chars=4000)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(rao_jax.__file__)))


def attack(code, *, cfg=CFG, tools=None, variables=None, follow_up="print('alive', 6 * 7)"):
  """Runs `code` in a victim sandbox next to a bystander; checks that both go on.

  Returns (result of the attack cell, result of the follow-up cell in the victim).
  """
  pids = []

  async def main():
    pool = SandboxPool(cfg, size=2)
    await pool.start()
    try:
      victim, bystander = await pool.acquire(), await pool.acquire()
      pids.extend([victim.pid, bystander.pid])
      if variables:
        await victim.set_variables(variables)
      await bystander.run_cell("state = 41")
      gaps = []

      async def heartbeat():
        last = time.perf_counter()
        while True:
          await asyncio.sleep(0.02)
          now = time.perf_counter()
          gaps.append(now - last)
          last = now

      beat = asyncio.create_task(heartbeat())
      res = await victim.run_cell(code, tools or {})
      beat.cancel()
      after = await victim.run_cell(follow_up, tools or {})
      pids.append(victim.pid)
      by = await bystander.run_cell("state += 1\nprint(state)")
      assert by.output == "42\n" and not by.sandbox_restarted, by
      # The host's event loop was never blocked by the attack.
      assert max(gaps, default=0) < 2.0, max(gaps)
      return res, after
    finally:
      await pool.close()

  res, after = asyncio.run(main())
  # No process of either sandbox outlives the pool.
  assert not [p for p in pids if os.path.exists(f"/proc/{p}")], pids
  if follow_up == "print('alive', 6 * 7)":
    assert after.output.endswith("alive 42\n"), after
  return res, after


# ---- network ------------------------------------------------------------------------------

def test_outbound_tcp_to_an_outside_address_fails():
  res, _ = attack(
      "import socket\ntry:\n  socket.create_connection(('1.1.1.1', 80), timeout=3)\n"
      "  print('CONNECTED')\nexcept OSError as e:\n  print('blocked', type(e).__name__)")
  assert res.output == "blocked PermissionError\n", res.observation


@pytest.mark.parametrize("seccomp", [True, False], ids=["seccomp", "netns-only"])
def test_tcp_to_a_server_on_the_hosts_loopback_fails(seccomp):
  """Both layers hold on their own: the seccomp socket rule and the empty network namespace."""
  accepted = []

  async def main():
    server = await asyncio.start_server(lambda r, w: accepted.append(1) or w.close(),
                                        "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = SandboxConfig(isolation="bwrap", cell_timeout_s=10.0, seccomp=seccomp)
    pool = SandboxPool(cfg, size=1)
    await pool.start()
    try:
      sb = await pool.acquire()
      return await sb.run_cell(
          "import socket\ntry:\n"
          f"  s = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
          "  print('CONNECTED')\nexcept OSError as e:\n  print('blocked', type(e).__name__)")
    finally:
      await pool.close()
      server.close()
      await server.wait_closed()

  res = asyncio.run(main())
  assert res.output.startswith("blocked "), res.observation
  assert ("PermissionError" in res.output) == seccomp
  assert accepted == []


# ---- reading secrets ------------------------------------------------------------------------

def test_host_files_home_project_and_environment_are_invisible(monkeypatch):
  secret = "rao-sandbox-test-secret-" + os.urandom(6).hex()
  monkeypatch.setenv("RAO_SANDBOX_TEST_SECRET", secret)
  paths = ["/etc/shadow", "/etc/passwd", os.path.join(REPO, "AGENTS.md"), REPO,
           os.path.expanduser("~"), os.path.join(os.path.expanduser("~"), ".bashrc"),
           os.path.realpath(sys.prefix), "/proc/1/environ", "/proc/self/environ"]
  code = (
      "import os\nseen = {}\n"
      f"for p in {paths!r}:\n"
      "  try:\n"
      "    seen[p] = sorted(os.listdir(p)) if os.path.isdir(p) else open(p).read()[:50]\n"
      "  except OSError as e:\n"
      "    seen[p] = type(e).__name__\n"
      "print(seen)\nprint(dict(os.environ))\nprint(sorted(os.listdir('/')))")
  res, _ = attack(code)
  assert secret not in res.output
  lines = res.output.splitlines()
  seen = eval(lines[0])  # pylint: disable=eval-used  (our own repr of a dict of strings)
  for p in paths:
    assert seen[p] in ("FileNotFoundError", "PermissionError"), (p, seen[p])
  env = eval(lines[1])  # pylint: disable=eval-used
  assert not any(k in os.environ and os.environ[k] == v and k not in ("LANG",)
                 for k, v in env.items() if k not in ("HOME", "TMPDIR", "PWD"))
  root = set(eval(lines[2]))  # pylint: disable=eval-used
  # Exactly the jail's own tree (lib/lib64 follow the host's layout): no home, work, proc.
  assert {"dev", "python", "sandbox", "tmp", "usr"} <= root
  assert root <= {"dev", "etc", "lib", "lib64", "python", "sandbox", "tmp", "usr"}, root


# ---- writing ------------------------------------------------------------------------------

def test_writes_outside_tmp_fail_and_change_nothing_outside(tmp_path):
  marker = "rao-escape-" + os.urandom(4).hex()
  targets = ["/" + marker, "/usr/lib/" + marker, "/python/bin/python3", "/sandbox/repl.py",
             "/etc/ld.so.cache", str(tmp_path / marker), os.path.join(REPO, marker)]
  repl_hash = hashlib.sha256(open(jail.REPL_PATH, "rb").read()).hexdigest()
  code = (
      "out = {}\n"
      f"for p in {targets!r}:\n"
      "  try:\n"
      "    with open(p, 'a') as f:\n"
      "      f.write('pwned')\n"
      "    out[p] = 'WROTE'\n"
      "  except OSError as e:\n"
      "    out[p] = type(e).__name__\n"
      f"open('/tmp/{marker}', 'w').write('private')\n"
      f"print(out)\nprint(open('/tmp/{marker}').read())")
  res, _ = attack(code)
  lines = res.output.splitlines()
  out = eval(lines[0])  # pylint: disable=eval-used
  assert all(v != "WROTE" for v in out.values()), out
  assert lines[1] == "private"  # /tmp works, and is private:
  assert not os.path.exists(f"/tmp/{marker}")
  assert not os.path.exists(tmp_path / marker) and not os.path.exists(os.path.join(REPO, marker))
  assert hashlib.sha256(open(jail.REPL_PATH, "rb").read()).hexdigest() == repl_hash


def test_file_size_limit_holds_in_tmp():
  cfg = SandboxConfig(isolation="bwrap", file_size_mb=1, cell_timeout_s=10.0)
  res, _ = attack("with open('/tmp/big', 'wb') as f:\n  f.write(b'0' * (4 << 20))", cfg=cfg)
  assert "File too large" in res.error or "OSError" in res.error, res.observation


# ---- processes, memory, time --------------------------------------------------------------

def test_fork_bomb_is_refused():
  res, _ = attack(
      "import os, subprocess\nerrors = set()\n"
      "for _ in range(1000):\n"
      "  try:\n    os.fork()\n  except OSError as e:\n    errors.add(type(e).__name__)\n"
      "try:\n  subprocess.run(['/python/bin/python3', '-c', 'pass'])\n"
      "except OSError as e:\n  errors.add('subprocess:' + type(e).__name__)\n"
      "try:\n  os.posix_spawn('/python/bin/python3', ['python3'], {})\n"
      "except OSError as e:\n  errors.add('spawn:' + type(e).__name__)\n"
      "print(sorted(errors))")
  assert res.output == ("['PermissionError', 'spawn:PermissionError', "
                        "'subprocess:PermissionError']\n"), res.observation


def test_memory_bomb_raises_memory_error_inside():
  cfg = SandboxConfig(isolation="bwrap", memory_mb=512, cell_timeout_s=20.0)
  res, _ = attack(
      "try:\n  big = bytearray(8 << 30)\nexcept MemoryError:\n  print('one shot: MemoryError')\n"
      "def grow():\n  hog = []\n  while True:\n    hog.append(bytearray(16 << 20))\n"
      "grow()", cfg=cfg)
  assert res.output == "one shot: MemoryError\n"
  assert res.error.rstrip().endswith("MemoryError"), res.observation


@pytest.mark.parametrize("code", ["while True: pass", "import time\ntime.sleep(10**6)"],
                         ids=["busy-loop", "sleep"])
def test_endless_cell_is_killed_and_replaced(code):
  cfg = SandboxConfig(isolation="bwrap", cell_timeout_s=1.0)
  old_pids = []

  async def main():
    pool = SandboxPool(cfg, size=1)
    await pool.start()
    try:
      sb = await pool.acquire()
      await sb.set_variables({"context": "the task text"})
      await sb.run_cell("mine = 1")
      old_pids.append(sb.pid)
      t0 = time.perf_counter()
      res = await sb.run_cell(code)
      took = time.perf_counter() - t0
      after = await sb.run_cell("print(context)\nprint('mine' in dir())")
      return res, took, after, sb.pid
    finally:
      await pool.close()

  res, took, after, new_pid = asyncio.run(main())
  assert res.timed_out and res.sandbox_restarted and not res.crashed
  assert "did not finish within 1 s" in res.output and "variables" in res.output
  assert res.error == "CellTimeout: the cell ran longer than 1 s"
  assert 1.0 <= took < 8.0
  assert new_pid != old_pids[0]
  # The killed sandbox is gone entirely (bwrap, its reaper and the REPL).
  assert not os.path.exists(f"/proc/{old_pids[0]}")
  # Provided variables are bound again; the agent's own are gone.
  assert after.output == "the task text\nFalse\n"


def test_one_hundred_megabytes_of_output_is_truncated():
  cfg = SandboxConfig(isolation="bwrap", max_output_chars=1000, cell_timeout_s=30.0)
  res, _ = attack(
      "import os, sys\nprint('x' * 50_000_000)\nsys.stdout.write('s' * 10_000_000)\n"
      "os.write(1, b'y' * 40_000_000)\nos.write(2, b'z' * 1_000_000)\nprint('the end')", cfg=cfg)
  assert res.error is None
  assert res.output.startswith("x" * 1000 + "\n[output truncated: ")
  assert len(res.output) < 1300
  dropped = int(res.output.split("[output truncated: ")[1].split()[0])
  total = 50_000_001 + 10_000_000 + 40_000_000 + 1_000_000 + len('the end\n')
  assert dropped == total - 1000


# ---- the protocol -------------------------------------------------------------------------

def test_forged_replies_on_stdout_and_fd1_are_just_output():
  calls = []
  forged_done = json.dumps({"op": "done", "id": "0" * 32, "output": "FORGED", "error": None})
  forged_reply = json.dumps({"op": "reply", "rid": "x", "ok": True, "value": "FORGED"})
  code = (
      "import os, sys\n"
      f"print({forged_done!r})\nprint({forged_reply!r})\n"
      f"frame = {forged_done!r}.encode()\n"
      "os.write(1, len(frame).to_bytes(4, 'big') + frame)\n"
      "sys.__stdout__.write('via __stdout__\\n')\n"
      "print('tool says', craft('real'))")
  res, _ = attack(code, tools={"craft": lambda x: calls.append(x) or x.upper()})
  assert res.error is None
  # Buffered sys.__stdout__ text reaches fd 1 when the REPL flushes it at the end of the cell.
  assert "tool says REAL\n" in res.output and "via __stdout__\n" in res.output, res.observation
  assert "FORGED" in res.output  # shown as the text it is, never taken as a message
  assert calls == ["real"]


FIND_PROTOCOL_FD = (
    "import os, stat\n"
    "def is_sock(f):\n"
    "  try:\n    return stat.S_ISSOCK(os.fstat(f).st_mode)\n  except OSError:\n"
    "    return False\n"
    # The protocol socket is one of these (the others belong to the REPL's event loop and
    # ignore what they are sent), so the agent writes to all of them.
    "fds = [f for f in range(3, 4096) if is_sock(f)]\n")


@pytest.mark.parametrize("forged", ["tool-for-another-cell", "done-with-a-guessed-nonce",
                                    "unknown-op"])
def test_forged_messages_on_the_protocol_fd_are_rejected(forged):
  calls = []
  # The agent finds the protocol socket and writes well-formed frames to it. A tool call for
  # a cell that is not running is refused (a late call of a finished cell looks the same);
  # a completion of no request in flight, or an unknown op, ends the sandbox.
  message = {
      "tool-for-another-cell": {"op": "tool", "cell": "f" * 32, "rid": "r1", "name": "craft",
                                "args": ["forged"], "kwargs": {}},
      "done-with-a-guessed-nonce": {"op": "done", "id": "0" * 32, "output": "FORGED",
                                    "error": None},
      "unknown-op": {"op": "hello"}}[forged]
  code = FIND_PROTOCOL_FD + (
      "import json\n"
      "def frame(m):\n  b = json.dumps(m).encode()\n  return len(b).to_bytes(4, 'big') + b\n"
      f"for fd in fds:\n  os.write(fd, frame({message!r}))\n"
      "import time\ntime.sleep(0.5)\nprint('real end')")
  res, _ = attack(code, tools={"craft": lambda x: calls.append(x) or x})
  if forged == "tool-for-another-cell":
    assert res.output == "real end\n" and not res.crashed, res.observation
  else:
    assert res.crashed and "protocol violation" in res.output, res.observation
    assert "FORGED" not in res.output
  assert calls == []


def test_garbage_on_the_protocol_fd_replaces_the_sandbox():
  code = FIND_PROTOCOL_FD + (
      "for fd in fds:\n"
      "  os.write(fd, (2**31).to_bytes(4, 'big') + b'x' * 100)\n"
      "import time\ntime.sleep(5)")
  res, _ = attack(code)
  assert res.crashed and res.sandbox_restarted
  assert "protocol violation" in res.output


# ---- processes that end ------------------------------------------------------------------

def test_killing_the_parent_is_contained():
  # The parent in the pid namespace is bwrap's reaper (pid 1), which ignores signals from
  # inside (and, on a root host, belongs to another uid than the agent's code); the host's
  # processes are not visible at all.
  res, _ = attack(
      "import os, signal\nprint('ppid', os.getppid())\n"
      "for pid, sig in [(os.getppid(), signal.SIGKILL), (1, signal.SIGTERM)]:\n"
      "  try:\n    os.kill(pid, sig)\n  except PermissionError:\n    pass\n"
      "try:\n  os.kill(-1, signal.SIGKILL)\n"
      "except ProcessLookupError:\n  print('nobody else to kill')\n"
      "print('parent is out of reach')")
  assert res.output == "ppid 1\nnobody else to kill\nparent is out of reach\n", res.observation


def test_killing_itself_is_a_crash_and_a_restart():
  res, _ = attack("import os, signal\nos.killpg(0, signal.SIGKILL)")
  assert res.crashed and res.sandbox_restarted and not res.timed_out
  assert "killed by SIGKILL" in res.output and "fresh sandbox" in res.output


def test_sys_exit_is_refused_and_os_exit_restarts():
  async def main():
    pool = SandboxPool(CFG, size=1)
    await pool.start()
    try:
      sb = await pool.acquire()
      r1 = await sb.run_cell("kept = 1\nimport sys\nsys.exit(0)")
      r2 = await sb.run_cell("raise SystemExit('bye')")
      r3 = await sb.run_cell("print(kept)")
      r4 = await sb.run_cell("import os\nos._exit(3)")
      r5 = await sb.run_cell("import os\nos.abort()")
      r6 = await sb.run_cell("print('fresh', 'kept' in dir())")
      return r1, r2, r3, r4, r5, r6
    finally:
      await pool.close()

  r1, r2, r3, r4, r5, r6 = asyncio.run(main())
  assert r1.error.startswith("SystemExit(0): exiting is not allowed") and not r1.crashed
  assert r2.error.startswith("SystemExit('bye')")
  assert r3.output == "1\n"
  assert r4.crashed and r4.sandbox_restarted and "exited with status 3" in r4.output
  assert r4.error == "SandboxCrashed: the sandbox process exited with status 3"
  assert r5.crashed and "SIGABRT" in r5.output
  assert r6.output == "fresh False\n"


def test_deleting_builtins_and_tool_proxies_does_not_stick():
  tools = {"craft": lambda x: f"made {x}"}
  res, after = attack(
      "import builtins\nfor name in ('print', 'len', 'isinstance', 'str', '__import__'):\n"
      "  delattr(builtins, name)\n"
      "del craft\n__builtins__ = None\n",
      tools=tools, follow_up="print(len('abc'), craft('torch'))")
  assert res.error is None, res.observation
  assert after.output == "3 made torch\n", after.observation


# ---- limits that live on the host ----------------------------------------------------------

MAX_DEPTH = 2


def test_depth_limit_lives_on_the_host_and_cannot_be_raised():
  """Real recursion: launch_subagent runs the goal (code, standing in for the policy) in a new
  sandbox one level deeper; the code tries every way to raise the limit from inside."""
  depths_reached = []
  cheat = (
      "import os, sys\nos.environ['RAO_MAX_DEPTH'] = '99'\nos.environ['MAX_DEPTH'] = '99'\n"
      "sys.setrecursionlimit(100000)\n"
      "try:\n  await launch_subagent('x', max_depth=99)\nexcept Exception as e:\n"
      "  print('kwarg refused:', type(e).__name__)\n"
      "try:\n  print('child said:', await launch_subagent(GOAL))\n"
      "except Exception as e:\n  print('launch refused:', e)\n")

  async def main():
    pool = SandboxPool(CFG, size=2)
    await pool.start()

    def make_launcher(depth):
      async def launch_subagent(goal):
        if depth + 1 > MAX_DEPTH:
          raise RuntimeError(f"depth limit {MAX_DEPTH} reached; solve this yourself")
        depths_reached.append(depth + 1)
        child = await pool.acquire()
        try:
          await child.set_variables({"GOAL": goal})
          res = await child.run_cell(goal, {"launch_subagent": make_launcher(depth + 1)})
          return res.observation.strip().replace("\n", " / ")
        finally:
          await pool.release(child)
      return launch_subagent

    try:
      root = await pool.acquire()
      await root.set_variables({"GOAL": cheat})
      return await root.run_cell(cheat, {"launch_subagent": make_launcher(0)})
    finally:
      await pool.close()

  res = asyncio.run(main())
  assert depths_reached == [1, 2]
  # Root (depth 0) -> child (1) -> grandchild (2), whose own launch is refused by the host.
  assert res.output.count("launch refused: RuntimeError: depth limit 2 reached") == 1, \
      res.observation
  assert res.output.count("kwarg refused: ToolError") == 3
  assert os.environ.get("RAO_MAX_DEPTH") is None and os.environ.get("MAX_DEPTH") is None


def test_a_tool_that_raises_is_an_observation_and_the_cell_goes_on():
  def craft(item):
    raise KeyError(item)

  res, _ = attack(
      "try:\n  craft('netherite')\nexcept Exception as e:\n  print('failed:', e)\n"
      "print('continuing')", tools={"craft": craft})
  assert res.output == "failed: KeyError: 'netherite'\ncontinuing\n"


def test_coroutines_never_awaited_are_contained():
  events = []

  async def launch_subagent(goal):
    events.append("started")
    try:
      await asyncio.sleep(3)
      events.append("ran to the end")
    except asyncio.CancelledError:
      events.append("cancelled")
      raise

  res, _ = attack(
      "import asyncio\nasync def helper():\n  return 1\nhelper()\n"
      "await asyncio.sleep(0)\nlaunch_subagent('forgotten')\nprint('cell over')",
      tools={"launch_subagent": launch_subagent})
  assert "cell over\n" in res.output
  assert "was never awaited" in res.output  # Python's own warning, shown to the agent
  assert "still pending when the cell ended and were cancelled" in res.output
  # Cancelled on the host too: either before it started or while it ran.
  assert events in ([], ["started", "cancelled"])


# ---- limits that hold as root, against threads, shared memory and the host loop --

@pytest.mark.slow
def test_live_agent_limit_holds_when_launches_are_gathered():
  """Class 6: launches gathered in one loop iteration all passed the live-agent check before
  any child counted itself (29 live with a limit of 4). Peak overlap of the nodes' lifetimes,
  from their own records, must stay within max_live_agents."""
  from rao_jax.agent import chat, local_exec, runner as rn
  from rao_jax.envs import base
  from rao_jax.envs import textcraft_synth as ts
  from rao_jax.rollout import base as rollout

  tok = chat.ByteChatTokenizer()
  env = ts.TextCraftSynthEnv(ts.SynthConfig(tasks_per_difficulty=2, items_per_tier=20))
  t = env.tasks("test/easy")[0]
  task = base.Task(task_id=t.task_id, env=t.env, goal=t.goal, fields=t.fields,
                   difficulty=t.difficulty, max_steps=200)
  target = next(iter(task.fields["target_items"]))

  class Engine(rollout.Engine):
    weight_version = 0

    async def generate(self, request):
      text = tok.decode(request.prompt_ids)
      turn = text.count("[turns left: ")
      if "you are at depth 0" in text and turn == 0:
        code = ("import asyncio\nres = await asyncio.gather(*[launch_subagent("
                f"{{{target!r}: 1}}, 3) for _ in range(12)])\nprint(res)")
      elif "you are at depth 0" in text:
        code = "finish('done')"
      else:
        code = "import asyncio\nawait asyncio.sleep(0.2)\nfinish('child done')"
      ids = tok.encode(f"```python\n{code}\n```") + [tok.stop_token_ids[0]]
      return rollout.GenerateResult(ids, [-0.5] * len(ids), rollout.FinishReason.STOP, 0)

  r = rn.TreeRunner(env, Engine(), tok, local_exec.LocalReplPool(),
                    rn.RunnerConfig(max_live_agents=4, max_depth=1))
  (tree,) = asyncio.run(r.run_tasks([task]))
  events = sorted([(n.timings["start"], 1) for n in tree.nodes]
                  + [(n.timings["end"], -1) for n in tree.nodes])
  live = peak = 0
  for _, d in events:
    live += d
    peak = max(peak, live)
  assert peak <= 4, peak
  # The limit refused launches with a clear message instead of starting them.
  obs = tree.root.extras["turns"][0]["observation"]
  assert "4 agents are already running in this tree" in obs, obs
  assert 1 <= len(tree.nodes) - 1 <= 3


def _shmem_kib():
  with open("/proc/meminfo", encoding="utf-8") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


def test_shared_memory_outside_the_limits_is_bounded():
  """Class 1: /dev/shm, /dev, the tmpfs masks over site-packages, memfd and SysV shared memory
  are all memory the host pays for outside RLIMIT_AS. Each is filled (up to 96 MiB) while the
  host measures its shared memory: the growth must stay within tmp_size_mb (+ slack)."""
  cfg = SandboxConfig(isolation="bwrap", memory_mb=256, tmp_size_mb=32, cell_timeout_s=60.0)
  base = []

  def shmem_growth_mib():
    return (_shmem_kib() - base[0]) / 1024

  code = (
      "import ctypes, os, sys\n"
      "chunk = b'x' * (4 << 20)\nheld, report = [], {}\n"
      "def fill(name, write, limit=96 << 20):\n"
      "  done = 0\n"
      "  try:\n"
      "    while done < limit:\n"
      "      write()\n"
      "      done += len(chunk)\n"
      "    report[name] = f'{done >> 20} MiB'\n"
      "  except OSError as e:\n"
      "    report[name] = f'{done >> 20} MiB then {type(e).__name__}'\n"
      "def file_writer(path):\n"
      "  f = open(path, 'wb', buffering=0)\n  held.append(f)\n"
      "  return lambda: f.write(chunk)\n"
      "site = os.path.join(os.path.dirname(os.__file__), 'site-packages')\n"
      "for name, path in [('dev_shm', '/dev/shm/x'), ('dev', '/dev/x'),\n"
      "                   ('site_packages', site + '/x'), ('tmp', '/tmp/x')]:\n"
      "  try:\n    fill(name, file_writer(path))\n"
      "  except OSError as e:\n    report[name] = type(e).__name__\n"
      "for k in range(3):\n"
      "  try:\n"
      "    fd = os.memfd_create(f'm{k}')\n    held.append(fd)\n"
      "    fill(f'memfd{k}', lambda: os.write(fd, chunk), 32 << 20)\n"
      "  except OSError as e:\n    report[f'memfd{k}'] = type(e).__name__\n"
      "libc = ctypes.CDLL(None, use_errno=True)\n"
      "libc.shmat.restype = ctypes.c_void_p\n"
      "for k in range(3):\n"
      "  sid = libc.shmget(0, 32 << 20, 0o1600)\n"
      "  if sid < 0:\n    report[f'sysv{k}'] = os.strerror(ctypes.get_errno())\n    continue\n"
      "  addr = libc.shmat(sid, None, 0)\n"
      "  if addr in (None, ctypes.c_void_p(-1).value):\n"
      "    report[f'sysv{k}'] = 'shmat: ' + os.strerror(ctypes.get_errno())\n    continue\n"
      "  ctypes.memset(addr, 1, 32 << 20)\n  libc.shmdt(ctypes.c_void_p(addr))\n"
      "  report[f'sysv{k}'] = '32 MiB'\n"
      "import fcntl\nr, w = os.pipe()\n"
      "try:\n  fcntl.fcntl(w, 1031, 1 << 20)\n  report['pipe_1mib'] = 'grown'\n"
      "except OSError as e:\n  report['pipe_1mib'] = type(e).__name__\n"
      "try:\n  os.openpty()\n  report['pty'] = 'opened'\n"
      "except OSError as e:\n  report['pty'] = type(e).__name__\n"
      "print(report)\nprint('growth', round(measure()))\n")

  async def main():
    pool = SandboxPool(cfg, size=1)
    await pool.start()
    try:
      sb = await pool.acquire()
      base.append(_shmem_kib())
      return await sb.run_cell(code, {"measure": shmem_growth_mib})
    finally:
      await pool.close()

  res = asyncio.run(main())
  assert res.error is None, res.observation
  report = eval(res.output.splitlines()[0])  # pylint: disable=eval-used
  growth = int(res.output.splitlines()[1].split()[1])
  print(f"shared memory growth {growth} MiB; {report}")
  # /tmp is the one writable tmpfs and fills up to its size; every other way is refused.
  assert report["tmp"].startswith("32 MiB then OSError") or report["tmp"].startswith(
      "28 MiB then OSError"), report
  assert growth <= cfg.tmp_size_mb + 16, (growth, report)
  for name in ("dev_shm", "dev", "site_packages", "memfd0", "sysv0"):
    assert not report[name].startswith("32 MiB") and not report[name].startswith("96 MiB"), \
        (name, report)
  # Kernel buffers outside RLIMIT_AS: pipes keep their default size, and there are no ptys.
  assert report["pipe_1mib"] == "PermissionError" and report["pty"] != "opened", report


def test_thread_limit_holds_as_root():
  """Class 2: RLIMIT_NPROC is not applied to uid 0; the jail runs agents' code under an
  unprivileged uid so that `processes` bounds its threads whoever runs the host."""
  cfg = SandboxConfig(isolation="bwrap", processes=64, cell_timeout_s=60.0)
  res, _ = attack(
      "import os, threading\nthreading.stack_size(65536)\nstop = threading.Event()\n"
      "n, err = 0, None\n"
      "try:\n"
      "  while n < 2000:\n"
      "    threading.Thread(target=stop.wait, daemon=True).start()\n    n += 1\n"
      "except RuntimeError as e:\n  err = str(e)\n"
      "stop.set()\n"
      "try:\n  os.setuid(0)\n  regained = True\nexcept PermissionError:\n  regained = False\n"
      "print(n, err, os.getuid() != 0, regained)", cfg=cfg)
  n, rest = res.output.split(" ", 1)
  print(f"threads started before the limit: {n}")
  assert int(n) < 64, res.observation
  assert rest == "can't start new thread True False\n", res.observation


def test_code_does_not_run_between_cells():
  """Class 3: a background thread started by a cell kept running (and burning CPU) after the
  cell returned. Between cells nothing of the sandbox may run."""
  timing = {}

  async def main():
    pool = SandboxPool(CFG, size=1)
    await pool.start()
    try:
      sb = await pool.acquire()
      await sb.run_cell(
          "import threading, time\nticks = []\n"
          "def spin():\n  while True:\n    ticks.append(time.time())\n    time.sleep(0.01)\n"
          "threading.Thread(target=spin, daemon=True).start()\ntime.sleep(0.1)")
      timing["done"] = time.time()
      await asyncio.sleep(1.0)
      timing["next"] = time.time()
      return await sb.run_cell(
          f"print(sum({timing['done'] + 0.05} < t < {timing['next'] - 0.05} for t in ticks))")
    finally:
      await pool.close()

  res = asyncio.run(main())
  assert res.output == "0\n", res.observation


def _thread_states(pid):
  states = []
  for tid in os.listdir(f"/proc/{pid}/task"):
    with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
      stat = f.read()
    states.append(stat[stat.rfind(b")") + 2:][:1].decode())
  return states


def test_every_thread_is_stopped_when_a_cell_returns():
  """SIGSTOP stops a process's threads one after another (the thread the kernel wakes must be
  scheduled to stop the rest): under load a spinning thread ran on for tens of milliseconds
  after the cell had returned. The host hands a result back only once all are stopped."""
  async def main():
    pool = SandboxPool(CFG, size=1)
    await pool.start()
    try:
      sb = await pool.acquire()
      await sb.run_cell("import threading\ndef spin():\n  while True:\n    sum(range(1000))\n"
                        "for _ in range(4):\n  threading.Thread(target=spin, daemon=True).start()")
      seen = []
      for i in range(40):
        await sb.run_cell(f"x = {i}")
        seen.append(_thread_states(sb._proc.repl_pid))  # pylint: disable=protected-access
      return seen
    finally:
      await pool.close()

  seen = asyncio.run(main())
  assert all(len(states) >= 5 for states in seen), seen
  running = [states for states in seen if set(states) - {"T", "t"}]
  assert not running, f"{len(running)} of 40 cells returned with threads still runnable: {running}"


def test_cpu_budget_is_a_limit_the_agent_cannot_raise():
  """Class 3: RLIMIT_CPU bounds the CPU of a sandbox's whole life (tool waits included)."""
  cfg = SandboxConfig(isolation="bwrap", cpu_time_s=300)
  res, _ = attack(
      "import resource\nsoft, hard = resource.getrlimit(resource.RLIMIT_CPU)\nprint(soft, hard)\n"
      "try:\n  resource.setrlimit(resource.RLIMIT_CPU, (hard + 100, hard + 100))\n"
      "except ValueError:\n  print('cannot raise')", cfg=cfg)
  assert res.output == "300 301\ncannot raise\n", res.observation


def _loop_cpu_probe(gaps):
  async def beat():
    last = time.thread_time()
    while True:
      await asyncio.sleep(0.01)
      now = time.thread_time()
      gaps.append(now - last)
      last = now
  return beat


FRAME_WRITER = FIND_PROTOCOL_FD + (
    "def frame(b):\n  return len(b).to_bytes(4, 'big') + b\n")


def test_host_event_loop_does_not_pay_for_big_frames():
  """Class 4: a 32 MiB frame of cheap JSON with an unknown op cost the host loop ~2 s of parsing
  (every other agent stalled). Unknown ops end the sandbox before the frame is parsed."""
  gaps = []
  code = FRAME_WRITER + (
      "body = b'{\"op\": \"junk\", \"a\": [' + b'0,' * (16 << 20) + b'0]}'\n"
      "for fd in fds:\n  os.write(fd, frame(body))\n"
      "import time\ntime.sleep(5)")

  async def main():
    cfg = SandboxConfig(isolation="bwrap", cell_timeout_s=30.0, memory_mb=512)
    pool = SandboxPool(cfg, size=1)
    await pool.start()
    try:
      sb = await pool.acquire()
      beat = asyncio.create_task(_loop_cpu_probe(gaps)())
      res = await sb.run_cell(code)
      beat.cancel()
      return res
    finally:
      await pool.close()

  res = asyncio.run(main())
  print(f"most loop-thread CPU between two heartbeats: {max(gaps):.3f} s")
  assert res.crashed and "protocol violation" in res.output, res.observation
  assert max(gaps) < 0.3, max(gaps)


def test_deeply_nested_frame_ends_the_sandbox():
  """Class 4: a deeply nested frame killed the host's reader task with a RecursionError while
  the sandbox still counted as alive (its cell then hung until the timeout)."""
  code = FRAME_WRITER + (
      "body = b'{\"op\": \"tool\", \"a\": ' + b'[' * 200000 + b']' * 200000 + b'}'\n"
      "for fd in fds:\n  os.write(fd, frame(body))\n"
      "import time\ntime.sleep(5)")
  res, _ = attack(code)
  assert res.crashed and not res.timed_out and "protocol violation" in res.output, \
      res.observation


@pytest.mark.slow
def test_pending_tool_calls_cannot_hold_unbounded_host_memory():
  """Class 5: 24 pending calls of 30 MB held 686 MiB in the host for one sandbox. Pending
  calls are bounded in count and in bytes; too big an argument is refused inside."""
  cfg = SandboxConfig(isolation="bwrap", memory_mb=512, cell_timeout_s=60.0)
  held = []

  def rss_mib():
    with open("/proc/self/statm", encoding="utf-8") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

  async def hold(data):
    held.append(len(data))
    await asyncio.Event().wait()

  base = []

  def report():
    return [len(held), sum(held), rss_mib() - base[0]]

  code = (
      "import asyncio\n"
      "async def wave(size, n=24):\n"
      "  futs, refused, late = [], 0, 0\n"
      "  for _ in range(n):\n"
      "    try:\n      futs.append(asyncio.ensure_future(hold('x' * size)))\n"
      "    except Exception:\n      refused += 1\n"
      "  for _ in range(400):\n"
      "    await asyncio.sleep(0.05)\n"
      "    late = sum(f.done() and f.exception() is not None for f in futs)\n"
      "    if refused + late + report()[0] - started >= n:\n"
      "      break\n"
      "  return refused + late\n"
      "started = 0\n"
      "r1 = await wave(30_000_000, 4)\nstarted = report()[0]\n"
      "r2 = await wave(3_900_000)\n"
      "n, total, growth = report()\n"
      "print(r1, r2, n, total, round(growth))")

  async def main():
    pool = SandboxPool(cfg, size=1)
    await pool.start()
    try:
      sb = await pool.acquire()
      base.append(rss_mib())
      return await sb.run_cell(code, {"hold": hold, "report": report})
    finally:
      await pool.close()

  res = asyncio.run(main())
  assert res.error is None, res.observation
  r1, r2, n, total, growth = map(int, res.output.splitlines()[0].split())
  print(f"pending calls held: {n} ({total / 2**20:.1f} MiB), refused {r1} + {r2}, "
        f"host RSS growth {growth} MiB")
  assert r1 == 4, res.observation  # every 30 MB argument is refused inside the sandbox
  assert total <= cfg.max_pending_tool_bytes, res.observation
  assert n + r2 == 24 and r2 > 0, res.observation
  assert growth < 2 * cfg.max_pending_tool_bytes / 2**20 + 64, res.observation


def test_forged_cell_completion_does_not_let_code_run_on():
  """Class 7: agent code found the cell's nonce in the REPL's memory and sent `done` while it
  kept running. Once the host takes a cell as done nothing of the sandbox runs, and the real
  completion that follows a forged one ends the sandbox."""
  code = FRAME_WRITER + (
      "import gc, json, time\n"
      "repl = next(o for o in gc.get_objects() if type(o).__name__ == '_Repl')\n"
      "forged = json.dumps({'op': 'done', 'id': repl.cell_id, 'output': 'FORGED', "
      "'error': None}).encode()\n"
      "os.write(repl.fd, frame(forged))\n"
      "ticks = []\nend = time.time() + 1.5\n"
      "while time.time() < end:\n  ticks.append(time.time())\n  time.sleep(0.01)\n")
  timing = {}

  async def main():
    pool = SandboxPool(CFG, size=1)
    await pool.start()
    try:
      sb = await pool.acquire()
      first = await sb.run_cell(code)
      timing["done"] = time.time()
      def state():
        with open(f"/proc/{sb.repl_pid}/stat", encoding="utf-8") as f:
          return f.read().rsplit(")", 1)[1].split()[0]
      # A stop takes effect when the process next runs (it runs no code of its own before),
      # which on a loaded machine may take a moment; from then on it stays stopped.
      for _ in range(100):
        if state() == "T":
          break
        await asyncio.sleep(0.02)
      states = []
      for _ in range(5):
        await asyncio.sleep(0.1)
        states.append(state())
      second = await sb.run_cell("print(len(ticks))")
      return first, states, second
    finally:
      await pool.close()

  first, states, second = asyncio.run(main())
  assert first.output == "FORGED"  # what the agent prints is its own business...
  assert set(states) == {"T"}, states  # ...but nothing runs once the host took the cell as done
  assert second.crashed and "protocol violation" in second.output, second.observation


def test_agents_cannot_signal_each_other_through_shared_files():
  """Class 8 (decided: closed where cheap): flock, POSIX/OFD locks and inotify on the
  read-only files every jail shares were a channel between two live agents."""
  res, _ = attack(
      "import ctypes, fcntl, os\nout = []\nf = open('/sandbox/repl.py', 'rb')\n"
      "for name, fn in [('flock', lambda: fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)),\n"
      "                 ('lockf', lambda: fcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB))]:\n"
      "  try:\n    fn()\n    out.append(name + ' ok')\n"
      "  except OSError as e:\n    out.append(name + ' ' + type(e).__name__)\n"
      "libc = ctypes.CDLL(None, use_errno=True)\n"
      "ino = libc.inotify_init1(0)\n"
      "out.append('inotify ' + ('ok' if ino >= 0 else os.strerror(ctypes.get_errno())))\n"
      "print(out)")
  assert res.output == ("['flock PermissionError', 'lockf PermissionError', "
                        "'inotify Operation not permitted']\n"), res.observation


def test_a_huge_error_message_is_shortened_not_a_protocol_violation():
  """Completions have a size limit now (class 4): the REPL must keep its own within it."""
  res, _ = attack("raise SystemExit('x' * 1_000_000)")
  assert not res.crashed and res.error.startswith("SystemExit('xxx"), res.observation
  assert "[... shortened ...]" in res.error and len(res.error) < 8200


@pytest.mark.slow
def test_cpu_burnt_while_a_cell_waits_for_a_tool_ends_the_sandbox():
  """Class 3: the cell clock pauses while a host tool runs (a subagent may take minutes); a
  thread burning CPU meanwhile is stopped by the sandbox's CPU budget, with a clear note.
  (19 s of wall time on the loaded 2-core VM for 1 s of CPU at nice 19.)"""
  cfg = SandboxConfig(isolation="bwrap", cpu_time_s=1, cell_timeout_s=150.0)

  async def wait_long():
    await asyncio.sleep(120)

  res, _ = attack(
      "import threading\ndef spin():\n  while True:\n    pass\n"
      "threading.Thread(target=spin, daemon=True).start()\nawait wait_long()",
      cfg=cfg, tools={"wait_long": wait_long})
  assert res.crashed and res.sandbox_restarted, res.observation
  assert "SIGXCPU (it used up its CPU budget of 1 s)" in res.error, res.observation


def test_a_tool_frame_costs_the_host_loop_one_bounded_parse():
  """Class 4: a known op is parsed, within its size limit: a maximal tool frame of the
  costliest JSON per byte (4 MiB of `0,` items) costs the loop one short parse; one byte over
  the limit ends the sandbox unread."""
  gaps = []
  limit = CFG.tool_arg_max_bytes
  code = FRAME_WRITER + (
      "import gc\n"
      "repl = next(o for o in gc.get_objects() if type(o).__name__ == '_Repl')\n"
      "def tool_frame(size):\n"
      "  head = b'{\"op\": \"tool\", \"cell\": \"' + b'f' * 32 + b'\", \"rid\": \"r1\", '\n"
      "  head += b'\"name\": \"x\", \"args\": ['\n"
      "  n = (size - len(head) - 18) // 2\n"
      "  body = head + b'0,' * n + b'0], \"kwargs\": {}}'\n"
      "  return body + b' ' * (size - len(body))\n"
      f"os.write(repl.fd, frame(tool_frame({limit})))\n"
      "import time\ntime.sleep(1)\nprint('first frame refused, sandbox alive')\n"
      f"os.write(repl.fd, frame(tool_frame({limit + 1})))\ntime.sleep(5)")

  async def main():
    pool = SandboxPool(CFG, size=1)
    await pool.start()
    try:
      sb = await pool.acquire()
      await sb.run_cell("pass")
      beat = asyncio.create_task(_loop_cpu_probe(gaps)())
      res = await sb.run_cell(code)
      beat.cancel()
      return res
    finally:
      await pool.close()

  res = asyncio.run(main())
  print(f"most loop-thread CPU between two heartbeats: {max(gaps):.3f} s")
  assert res.crashed and f"a 'tool' message of {limit + 1} bytes" in res.output, \
      res.observation
  assert max(gaps) < 0.5, max(gaps)
