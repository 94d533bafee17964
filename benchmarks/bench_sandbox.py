"""Benchmark of the agents' REPL sandbox (bubblewrap + rlimits + seccomp).

Measures, medians and 99th percentiles over repeats:
  spawn_ms          cold start of one sandbox until its first reply (the ready message)
  first_cell_ms     cold start plus the first cell (the REPL imports its cell machinery
                    and asyncio right after reporting ready, so this includes them)
  pool_acquire_ms   taking a started sandbox from a SandboxPool
  pool_first_cell_ms  acquire + first cell `x = 1 + 1` from a warm pool (what an agent sees)
  exec_ms           round trip of the cell `x = 1 + 1` in a warm REPL
  tool_cell_ms      round trip of a cell that calls one host tool (`craft(1)`)
Peers in the same run: the weaker isolation="process" mode (same REPL, no bwrap) and a bare
`python -I -S -c pass` start, to show what the jail itself costs.

Goals (issue 4): pool acquire <= 5 ms and exec <= 1 ms at the median, cold spawn <= 100 ms.

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


async def main(quick):
  n_spawn = 10 if quick else 40
  n_exec = 300 if quick else 2000
  bwrap = SandboxConfig(isolation="bwrap")
  proc_cfg = SandboxConfig(isolation="process")
  result = {"quick": quick}

  log(f"cold spawns (bwrap) x{n_spawn}")
  spawn, first = await cold_spawns(bwrap, n_spawn)
  result["spawn_ms_p50"], result["spawn_ms_p99"] = _ms(spawn)
  result["first_cell_ms_p50"], result["first_cell_ms_p99"] = _ms(first)

  log(f"pool acquires x{n_spawn}")
  acquire, pooled_first = await pool_acquires(bwrap, n_spawn)
  result["pool_acquire_ms_p50"], result["pool_acquire_ms_p99"] = _ms(acquire)
  result["pool_first_cell_ms_p50"], result["pool_first_cell_ms_p99"] = _ms(pooled_first)

  log(f"exec round trips x{n_exec}")
  execs, tool_cells = await exec_round_trips(bwrap, n_exec)
  result["exec_ms_p50"], result["exec_ms_p99"] = _ms(execs)
  result["tool_cell_ms_p50"], result["tool_cell_ms_p99"] = _ms(tool_cells)

  log("peers: process mode and bare python")
  p_spawn, _ = await cold_spawns(proc_cfg, n_spawn)
  result["peer_process_spawn_ms_p50"] = _ms(p_spawn)[0]
  p_exec, _ = await exec_round_trips(proc_cfg, n_exec)
  result["peer_process_exec_ms_p50"] = _ms(p_exec)[0]
  result["peer_bare_python_ms_p50"] = _ms(await bare_python(n_spawn))[0]
  result["spawn_vs_process_mode"] = round(
      result["spawn_ms_p50"] / result["peer_process_spawn_ms_p50"], 3)
  result["spawn_vs_bare_python"] = round(
      result["spawn_ms_p50"] / result["peer_bare_python_ms_p50"], 3)
  result["exec_vs_process_mode"] = round(
      result["exec_ms_p50"] / result["peer_process_exec_ms_p50"], 3)
  result["goals_met"] = {
      "pool_acquire_ms_p50<=5": result["pool_acquire_ms_p50"] <= 5,
      "exec_ms_p50<=1": result["exec_ms_p50"] <= 1,
      "spawn_ms_p50<=100": result["spawn_ms_p50"] <= 100,
  }
  result["load_avg_1m"] = round(os.getloadavg()[0], 2)
  return result


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer repeats (about 15 s)")
  args = parser.parse_args()
  print(json.dumps(asyncio.run(main(args.quick))))
