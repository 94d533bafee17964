"""Benchmark of the agents' REPL sandbox (bubblewrap + rlimits + seccomp).

Measures, medians and 99th percentiles over repeats:
  spawn_ms          cold start of one sandbox until its first reply (the ready message)
  first_cell_ms     cold start plus the first cell (the REPL imports its cell machinery
                    and asyncio right after reporting ready, so this includes them)
  pool_acquire_ms   taking a started sandbox from a SandboxPool
  pool_first_cell_ms  acquire + first cell `x = 1 + 1` from a warm pool (what an agent sees)
  exec_ms           round trip of the cell `x = 1 + 1` in a warm REPL
  tool_cell_ms      round trip of a cell that calls one host tool (`craft(1)`)
Peers in the same run: the weaker isolation="process" mode (same REPL, no bwrap; spawns and
round trips alternate with the jail's in rounds) and a bare `python -I -S -c pass` start, to
show what the jail itself costs.

Hardening:
  stop_cont_exec_ratio  exec with the REPL stopped between cells (SIGSTOP/SIGCONT) over exec
                        without, in alternating rounds of 50 in one process (its cost per cell)
  load_*                64 concurrent sandboxes x 20 cells, 8 of them misbehaving (one per class
                        of attack): the well-behaved agents' acquire and cell round trip
                        (`x = 1 + 1`) under that load, their failures, the attacks contained,
                        the host's RSS growth
Goals: pool acquire <= 5 ms and exec <= 1 ms at the median, cold spawn <= 100 ms
(measured on a quiet pool; the load figures say what 64 busy sandboxes on this machine cost).

  python benchmarks/bench_sandbox.py [--quick]

Progress goes to stderr; the last stdout line is one JSON object.
"""
import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rao_jax.sandbox_host import SandboxConfig, SandboxPool, Sandbox  # noqa: E402
from rao_jax.sandbox_host.process import ReplProcess  # noqa: E402


def _ms(xs):
  xs = sorted(xs)
  p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
  return round(statistics.median(xs) * 1e3, 3), round(p99 * 1e3, 3)


def log(msg):
  print(msg, file=sys.stderr, flush=True)


async def cold_spawns(cfg, n):
  spawn, first = [], []
  for _ in range(n):
    t0 = time.perf_counter()
    proc = await ReplProcess(cfg).spawn()
    spawn.append(time.perf_counter() - t0)
    sb = Sandbox(cfg, proc)
    await sb.run_cell("pass")
    first.append(time.perf_counter() - t0)
    await sb.close()
  return spawn, first


async def bare_python(n):
  out = []
  for _ in range(n):
    t0 = time.perf_counter()
    p = await asyncio.create_subprocess_exec(os.path.realpath(sys.executable), "-I", "-S",
                                             "-c", "pass")
    await p.wait()
    out.append(time.perf_counter() - t0)
  return out


async def pool_acquires(cfg, n):
  """Acquire latency, and acquire + first cell as an agent sees it from a warm pool."""
  pool = SandboxPool(cfg, size=4)
  await pool.start()
  acquire, first_cell = [], []
  try:
    for _ in range(n):
      await pool.wait_full()
      await asyncio.sleep(0.2)  # pooled sandboxes finish their post-ready imports while idle
      t0 = time.perf_counter()
      sb = await pool.acquire()
      acquire.append(time.perf_counter() - t0)
      await sb.run_cell("x = 1 + 1")
      first_cell.append(time.perf_counter() - t0)
      await pool.release(sb)
  finally:
    await pool.close()
  return acquire, first_cell


async def exec_round_trips(cfg, n):
  sb = await Sandbox.start(cfg)
  tools = {"craft": lambda x: x + 1}
  try:
    for _ in range(20):  # warm-up: late imports, caches
      await sb.run_cell("x = 1 + 1")
      await sb.run_cell("y = craft(1)", tools)
    execs, tool_cells = [], []
    for _ in range(n):
      t0 = time.perf_counter()
      await sb.run_cell("x = 1 + 1")
      execs.append(time.perf_counter() - t0)
    for _ in range(max(50, n // 5)):
      t0 = time.perf_counter()
      await sb.run_cell("y = craft(1)", tools)
      tool_cells.append(time.perf_counter() - t0)
    return execs, tool_cells
  finally:
    await sb.close()


async def stop_cont_ratio(cfg, rounds):
  """exec with and without the stop between cells, alternating blocks of 50, one sandbox."""
  sb = await Sandbox.start(cfg)
  with_stop, without = [], []
  try:
    for _ in range(20):
      await sb.run_cell("x = 1 + 1")
    for r in range(2 * rounds):
      stop = r % 2 == 0
      ReplProcess.stop_between_requests = stop
      for _ in range(50):
        t0 = time.perf_counter()
        await sb.run_cell("x = 1 + 1")
        (with_stop if stop else without).append(time.perf_counter() - t0)
  finally:
    ReplProcess.stop_between_requests = True
    await sb.close()
  return with_stop, without


FIND_FD = (
    "import os, stat\n"
    "def is_sock(f):\n"
    "  try:\n    return stat.S_ISSOCK(os.fstat(f).st_mode)\n  except OSError:\n"
    "    return False\n"
    "fds = [f for f in range(3, 4096) if is_sock(f)]\n"
    "def frame(b):\n  return len(b).to_bytes(4, 'big') + b\n")
# One attack per class the sandbox contains (class 6 is the runtime's; a nested frame stands in) and
# how to tell it was contained (tests/test_sandbox_pool.py has the same set with more checks).
ATTACKS = {
    "shared-memory": ("import os\nout = []\nfor p in ('/dev/shm/x', '/dev/x'):\n  try:\n"
                      "    open(p, 'wb').write(b'x' * (8 << 20))\n    out.append('WROTE')\n"
                      "  except OSError as e:\n    out.append('refused')\nprint(out)",
                      lambda r: "WROTE" not in r.output),
    "threads": ("import threading\nthreading.stack_size(65536)\nev = threading.Event()\nn = 0\n"
                "try:\n  while n < 5000:\n"
                "    threading.Thread(target=ev.wait, daemon=True).start()\n    n += 1\n"
                "except RuntimeError:\n  pass\nev.set()\nprint(n)",
                lambda r: r.error is None and int(r.output) < 256),
    "cpu-spinner": ("import threading\ndef spin():\n  while True:\n    sum(range(10000))\n"
                    "threading.Thread(target=spin, daemon=True).start()",
                    lambda r: r.error is None),
    "big-frame": (FIND_FD + "body = b'{\"op\": \"junk\", \"a\": [' + b'0,' * (16 << 20) + "
                  "b'0]}'\nfor fd in fds:\n  os.write(fd, frame(body))\n"
                  "import time\ntime.sleep(5)",
                  lambda r: r.crashed),
    "pending-tool-bytes": ("import asyncio\n"
                           "fs = [asyncio.ensure_future(hold('x' * 3_900_000)) for _ in range(24)]\n"
                           "for _ in range(600):\n  await asyncio.sleep(0.05)\n"
                           "  if sum(f.done() for f in fs) >= 16:\n    break\n"
                           "print(sum(f.done() for f in fs))",
                           lambda r: r.output.startswith("16")),
    "nested-frame": (FIND_FD + "body = b'{\"op\": \"tool\", \"a\": ' + b'[' * 200000 + "
                     "b']' * 200000 + b'}'\nfor fd in fds:\n  os.write(fd, frame(body))\n"
                     "import time\ntime.sleep(5)",
                     lambda r: r.crashed),
    "forged-done": (FIND_FD + "import gc, json, time\n"
                    "repl = next(o for o in gc.get_objects() if type(o).__name__ == '_Repl')\n"
                    "os.write(repl.fd, frame(json.dumps({'op': 'done', 'id': repl.cell_id, "
                    "'output': 'FORGED', 'error': None}).encode()))\ntime.sleep(1)",
                    lambda r: True),  # found out at the next cell (checked below)
    "shared-file-locks": ("import fcntl\nf = open('/sandbox/repl.py', 'rb')\n"
                          "try:\n  fcntl.flock(f, fcntl.LOCK_SH)\n  print('locked')\n"
                          "except OSError:\n  print('refused')",
                          lambda r: r.output == "refused\n"),
}


def _rss_mib():
  with open("/proc/self/statm", encoding="utf-8") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def under_attack(cfg, n_agents=64, n_cells=20, attack_at=3):
  """The load test as a benchmark: latencies the well-behaved agents see next to 8 attacks."""
  async def hold(data):
    await asyncio.Event().wait()

  tools = {"hold": hold}
  acquire, execs, failures, contained = [], [], 0, 0
  names = list(ATTACKS)

  async def agent(pool, k):
    nonlocal failures, contained
    t0 = time.perf_counter()
    sb = await pool.acquire()
    bad = names[k - (n_agents - len(names))] if k >= n_agents - len(names) else None
    if bad is None:
      acquire.append(time.perf_counter() - t0)
    try:
      for i in range(n_cells):
        if bad is not None and i == attack_at:
          res = await sb.run_cell(ATTACKS[bad][0], tools)
          contained += bool(ATTACKS[bad][1](res))
          continue
        t1 = time.perf_counter()
        res = await sb.run_cell("x = 1 + 1", tools)
        if bad is None:
          execs.append(time.perf_counter() - t1)
          failures += bool(res.error or res.crashed or res.timed_out or res.sandbox_restarted)
        elif bad == "forged-done" and i == attack_at + 1 and not res.crashed:
          contained -= 1  # the forged completion must be found out here
    finally:
      await pool.release(sb)

  peak = {"rss": 0.0}

  async def watch():
    while True:
      peak["rss"] = max(peak["rss"], _rss_mib())
      await asyncio.sleep(0.05)

  pool = SandboxPool(cfg, size=n_agents)
  await pool.start()
  base = _rss_mib()
  watcher = asyncio.create_task(watch())
  t0 = time.perf_counter()
  try:
    await asyncio.gather(*(agent(pool, k) for k in range(n_agents)))
  finally:
    watcher.cancel()
    wall = time.perf_counter() - t0
    await pool.close()
  return {"load_acquire_ms_p50": _ms(acquire)[0], "load_exec_ms_p50": _ms(execs)[0],
          "load_exec_ms_p99": _ms(execs)[1], "load_good_failures": failures,
          "load_attacks_contained": f"{contained}/{len(names)}",
          "load_rss_growth_mib": round(peak["rss"] - base, 1), "load_wall_s": round(wall, 2)}


async def main(quick):
  n_spawn = 10 if quick else 40
  n_exec = 300 if quick else 2000
  bwrap = SandboxConfig(isolation="bwrap")
  proc_cfg = SandboxConfig(isolation="process")
  result = {"quick": quick}

  # The bwrap jail and its peer, the same REPL in isolation="process" (what a user who trusts
  # the code, or has no bubblewrap, configures: SandboxConfig's other defaults unchanged), run
  # in alternating rounds so machine drift hits both.
  rounds = 2 if quick else 4
  log(f"cold spawns (bwrap and process mode, alternating) x{n_spawn}")
  spawn, first, p_spawn = [], [], []
  for _ in range(rounds):
    s_, f_ = await cold_spawns(bwrap, n_spawn // rounds)
    spawn += s_
    first += f_
    p_spawn += (await cold_spawns(proc_cfg, n_spawn // rounds))[0]
  result["spawn_ms_p50"], result["spawn_ms_p99"] = _ms(spawn)
  result["first_cell_ms_p50"], result["first_cell_ms_p99"] = _ms(first)

  log(f"pool acquires x{n_spawn}")
  acquire, pooled_first = await pool_acquires(bwrap, n_spawn)
  result["pool_acquire_ms_p50"], result["pool_acquire_ms_p99"] = _ms(acquire)
  result["pool_first_cell_ms_p50"], result["pool_first_cell_ms_p99"] = _ms(pooled_first)

  log(f"exec round trips (bwrap and process mode, alternating) x{n_exec}")
  execs, tool_cells, p_exec = [], [], []
  for _ in range(rounds):
    e_, t_ = await exec_round_trips(bwrap, n_exec // rounds)
    execs += e_
    tool_cells += t_
    p_exec += (await exec_round_trips(proc_cfg, n_exec // rounds))[0]
  result["exec_ms_p50"], result["exec_ms_p99"] = _ms(execs)
  result["tool_cell_ms_p50"], result["tool_cell_ms_p99"] = _ms(tool_cells)

  log("stop/continue between cells: alternating rounds")
  with_stop, without = await stop_cont_ratio(bwrap, 4 if quick else 20)
  result["exec_ms_p50_no_stop"] = _ms(without)[0]
  result["stop_cont_exec_ratio"] = round(_ms(with_stop)[0] / _ms(without)[0], 3)

  log("peer: bare python")
  result["peer_process_spawn_ms_p50"] = _ms(p_spawn)[0]
  result["peer_process_exec_ms_p50"] = _ms(p_exec)[0]
  result["peer_bare_python_ms_p50"] = _ms(await bare_python(n_spawn))[0]
  result["spawn_vs_process_mode"] = round(
      result["spawn_ms_p50"] / result["peer_process_spawn_ms_p50"], 3)
  result["spawn_vs_bare_python"] = round(
      result["spawn_ms_p50"] / result["peer_bare_python_ms_p50"], 3)
  result["exec_vs_process_mode"] = round(
      result["exec_ms_p50"] / result["peer_process_exec_ms_p50"], 3)
  log("load: 64 sandboxes x 20 cells, 8 misbehaving")
  result.update(await under_attack(bwrap))
  result["goals_met"] = {
      "pool_acquire_ms_p50<=5": result["pool_acquire_ms_p50"] <= 5,
      "exec_ms_p50<=1": result["exec_ms_p50"] <= 1,
      "spawn_ms_p50<=100": result["spawn_ms_p50"] <= 100,
  }
  result["goals_met"]["load_good_failures==0"] = result["load_good_failures"] == 0
  result["load_avg_1m"] = round(os.getloadavg()[0], 2)
  result["uid"] = os.geteuid()
  return result


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer repeats (about 15 s)")
  args = parser.parse_args()
  print(json.dumps(asyncio.run(main(args.quick))))
