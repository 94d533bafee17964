"""Cross-slot prefix sharing in the embedded engine, on agent trees shaped like TextCraft's.

    python benchmarks/bench_prefix_share.py [--rounds 3]

Every node of an agent tree starts with the same system prompt (~430 tokens with the compact
TextCraft-Synth prompts, agent/prompts.py), then its own goal. The workload: 8 roots, each
writes a cell, launches 2 children concurrently and writes a second cell; every node runs 2
turns of 96 generated tokens and a 60-token observation, with sessions (as the agent runtime
does). SmolLM2-135M float32, greedy, the same engine shapes for both sides.

Peer: the same engine with sharing off (share_prefix_min=0), in alternating rounds (off, on,
off, on, ...); medians. Progress goes to stderr; the last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import numpy as np

HEAD, GOAL, NEW, OBS, TURNS, ROOTS, CHILDREN = 430, 40, 96, 60, 2, 8, 2


def say(*a):
  print(*a, file=sys.stderr, flush=True)


def make_run(engine, seed=0):
  from rao_jax.rollout import GenerateRequest, SamplingParams
  rng = np.random.default_rng(seed)
  head = list(map(int, rng.integers(3, 49000, HEAD)))
  params = SamplingParams(temperature=0.0, max_new_tokens=NEW)
  counter = iter(range(10 ** 6))

  async def node(depth):
    i = next(counter)
    r_obs = np.random.default_rng(1000 + i)
    history = head + list(map(int, r_obs.integers(3, 49000, GOAL)))
    for t in range(TURNS):
      r = await engine.generate(GenerateRequest(history, params, session_id=f"n{i}"))
      history = history + r.token_ids + list(map(int, r_obs.integers(3, 49000, OBS)))
      if depth == 0 and t == 0:
        await asyncio.gather(*[node(1) for _ in range(CHILDREN)])
    await engine.end_session(f"n{i}")

  async def run():
    nonlocal counter
    counter = iter(range(10 ** 6))
    before = dict(engine.stats)
    t0 = time.perf_counter()
    await asyncio.gather(*[node(0) for _ in range(ROOTS)])
    dt = time.perf_counter() - t0
    assert engine.flush_cache()     # every round starts cold
    return dt, {k: engine.stats[k] - before.get(k, 0)
                for k in ("prefill_tokens", "prefix_shared_tokens", "decode_tokens")}
  return run


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  from rao_jax import host_memory
  host_memory.keep_freed_memory()
  from rao_jax.kernels import mkl
  from rao_jax.model import load_pretrained
  from rao_jax.rollout.embedded import EmbeddedEngine

  say("loading SmolLM2-135M (float32)")
  model, _ = load_pretrained("smollm2-135m", dtype="float32")
  shape = dict(num_slots=32, max_len=1024, cache_lens=(512, 1024), chunk_sizes=(32, 256),
               prefill_rows=(1, 4))
  engines = {share: EmbeddedEngine(model, **shape, share_prefix_min=share) for share in (0, 32)}
  runs = {}
  for share, eng in engines.items():
    say(f"warm-up share_prefix_min={share}: {eng.warmup():.0f} s")
    runs[share] = make_run(eng)
    asyncio.run(runs[share]())     # warms what warmup() does not (host side, allocator)
  times, work = {0: [], 32: []}, {}
  for k in range(args.rounds):
    for share in (0, 32):
      dt, w = asyncio.run(runs[share]())
      times[share].append(dt)
      work[share] = w
      say(f"round {k} share_prefix_min={share}: {dt:.1f} s {w}")
  off, on = statistics.median(times[0]), statistics.median(times[32])
  nodes = ROOTS * (1 + CHILDREN)
  print(json.dumps({
      "bench": "prefix_share", "cpu": mkl.cpuinfo("model name"),
      "workload": f"{ROOTS} roots x {CHILDREN} children, {TURNS} turns, head {HEAD}, "
                  f"goal {GOAL}, {NEW} new + {OBS} obs per turn, greedy, sessions",
      "nodes": nodes, "rounds": args.rounds,
      "s_share_off": round(off, 2), "s_share_on": round(on, 2),
      "speedup": round(off / on, 3),
      "rounds_s_off": [round(t, 2) for t in times[0]],
      "rounds_s_on": [round(t, 2) for t in times[32]],
      "prefill_tokens_off": work[0]["prefill_tokens"],
      "prefill_tokens_on": work[32]["prefill_tokens"],
      "shared_tokens_on": work[32]["prefix_shared_tokens"]}))


if __name__ == "__main__":
  main()
