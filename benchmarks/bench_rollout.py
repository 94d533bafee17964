"""Rollout benchmark: the embedded JAX engine vs transformers generate() on PyTorch CPU.

    python benchmarks/bench_rollout.py [--quick]

1. Decode throughput of SmolLM2-135M at batch 1, 8 and 32: 64 new tokens (greedy) after a
   256-token prompt, against ``transformers`` ``generate()`` (PyTorch CPU, same weights exported
   to an HF folder) in the same run. Each side is timed generating 1 token (prefill) and 64
   tokens; decode tokens/s = B * 63 / (t64 - t1) -> ratio_b1, ratio_b8, ratio_b32. The
   end-to-end figures (prefill included, B * 64 / t64) are reported too: e2e_ratio_b*. At
   batch 32 the 8K-token prefill is most of the end-to-end time on both sides. The sides
   alternate in rounds; the peer is set up as its users do (`torch_round`) and runs in a
   process of its own (`peer_process`): in ours, PyTorch's and XLA's thread pools met, and one
   side's decode fell to about half its speed whenever the other's had just run (batch 32,
   three rounds: ours 89/97/183 tok/s while the peer's ran 157/157/111).
   `share_of_peak_bandwidth_b*`: the bytes a decode step must read (every product weight once,
   float32, plus each row's K and V over its mean context: bench_peak.decode_step_bytes) times
   steps/s, over the best memory bandwidth bench_peak.py measured on this CPU;
   `share_of_peak_gemm_b*`: forward model FLOPs (bench_peak.model_flops) per second over its
   best GEMM. Decode is bandwidth-bound at small batches, compute-bound as the batch grows.
2. Multi-turn agents: 8 agents x 6 turns, 64 generated + 64-token observation per turn, with
   sessions (KV kept between turns) vs without (every turn re-prefills the history) ->
   session_speedup.

Progress goes to stderr; the last stdout line is one JSON object. Medians over repeats.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peak  # noqa: E402  (this folder's: the machine's measured peak)

PROMPT, NEW = 256, 64


def say(*a):
  print(*a, file=sys.stderr, flush=True)


def _rates(B, t1, t64):
  """(decode tokens/s, end-to-end tokens/s) from median times for 1 and NEW new tokens.

  Decode is None where the 64-token run was not slower than the 1-token one (a timing that
  cannot be split into prefill and decode; never divided by a near-zero difference)."""
  t1, t64 = statistics.median(t1), statistics.median(t64)
  return (B * (NEW - 1) / (t64 - t1) if t64 > t1 else None), B * NEW / t64


def engine_round(engine, prompts):
  """One timing round of the engine: (seconds for 1 new token, seconds for NEW), greedy."""
  from rao_jax.rollout import GenerateRequest, SamplingParams

  async def once(n):
    params = SamplingParams(temperature=0.0, max_new_tokens=n)
    t0 = time.perf_counter()
    res = await asyncio.gather(*[engine.generate(GenerateRequest(p, params)) for p in prompts])
    dt = time.perf_counter() - t0
    assert all(len(r.token_ids) == n for r in res), [r.finish_reason for r in res]
    return dt

  def one_round():
    # Every timed call prefills its whole prompt, as generate() does: the prefixes that the
    # previous call left in the engine are dropped first.
    engine.flush_cache()
    t1 = asyncio.run(once(1))
    engine.flush_cache()
    return t1, asyncio.run(once(NEW))
  one_round()               # compiles this batch's shapes (prefill, decode, a 1-token request)
  return one_round


def torch_round(hf_model, prompts):
  """One timing round of the peer, set up as a transformers user would: `generate()` on the
  `from_pretrained` model in eval mode under `torch.inference_mode()`, greedy, the prompts as
  one unpadded batch, the default (dynamic) KV cache and PyTorch's default threads."""
  import torch
  x = torch.tensor(prompts, dtype=torch.long)
  mask = torch.ones_like(x)

  def gen(n):
    t0 = time.perf_counter()
    with torch.inference_mode():
      out = hf_model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
    assert out.shape[1] == PROMPT + n
    return time.perf_counter() - t0

  def one_round():
    return gen(1), gen(NEW)
  gen(2)                    # first-call set-up, untimed
  return one_round


def peer_process(hf_dir: str):
  """`torch_round` in a process of its own (no JAX there), driven over a pipe.

  Returns (setup, close, info): setup(prompts) builds that batch's round there (its untimed
  first call included) and returns a function that runs one round and returns (t1, t64);
  info names the peer's PyTorch version and threads.
  """
  import subprocess  # pylint: disable=import-outside-toplevel
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--peer_worker", hf_dir],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

  def ask(msg):
    proc.stdin.write(json.dumps(msg) + "\n")
    proc.stdin.flush()
    return reply()

  def reply():
    line = proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the peer process ended (exit status {proc.wait()}); see its stderr")
    return json.loads(line)

  def setup(prompts):
    ask({"prompts": prompts})
    return lambda: tuple(ask({"round": True})["times"])

  def close():
    proc.stdin.close()
    proc.wait(timeout=120)

  return setup, close, reply()


def peer_worker(hf_dir: str) -> None:
  """The peer process: loads the HF folder, says it is ready, then per line either sets up a
  batch (`{"prompts": ...}`) or times one round of it (`{"round": true}`)."""
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import AutoModelForCausalLM  # pylint: disable=import-outside-toplevel
  hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads()}), flush=True)
  one_round = None
  for line in sys.stdin:
    msg = json.loads(line)
    if "prompts" in msg:
      one_round = torch_round(hf, msg["prompts"])
      print(json.dumps({"ready": True}), flush=True)
    else:
      print(json.dumps({"times": one_round()}), flush=True)


def multi_turn(model, sessions: bool, agents=8, turns=6, first_prompt=128, obs=64, seed=0):
  from rao_jax.rollout import GenerateRequest, SamplingParams
  from rao_jax.rollout.embedded import EmbeddedEngine
  rng = np.random.default_rng(seed)
  firsts = [list(map(int, rng.integers(3, 49000, first_prompt))) for _ in range(agents)]
  observations = [[list(map(int, rng.integers(3, 49000, obs))) for _ in range(turns)]
                  for _ in range(agents)]
  engine = EmbeddedEngine(model, num_slots=agents, max_len=1024, cache_lens=(256, 512, 1024),
                          chunk_sizes=(16, 64, 256), prefill_rows=(1, 8), decode_steps=1)
  # Every shape up front: which (rows, chunk, cache length) combinations a run meets depends on
  # thread timing, so a compile pass alone can leave one to compile inside a timed run.
  engine.warmup()
  params = SamplingParams(temperature=0.0, max_new_tokens=NEW)

  async def agent(i):
    history = list(firsts[i])
    for t in range(turns):
      r = await engine.generate(GenerateRequest(history, params,
                                                session_id=f"a{i}" if sessions else None))
      history = history + r.token_ids + observations[i][t]
    return len(history)

  async def run():
    t0 = time.perf_counter()
    await asyncio.gather(*[agent(i) for i in range(agents)])
    dt = time.perf_counter() - t0
    assert engine.flush_cache()     # the next repeat starts cold, like the first
    return dt
  return run, engine


def main():
  if len(sys.argv) == 3 and sys.argv[1] == "--peer_worker":
    peer_worker(sys.argv[2])
    return
  from rao_jax import host_memory   # before JAX starts: freed step buffers are reused, not
  host_memory.keep_freed_memory()   # returned to the OS and page-faulted in again each step
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="one repeat each")
  ap.add_argument("--batches", default="1,8,32", help="batch sizes of the throughput part")
  ap.add_argument("--no-sessions", action="store_true", help="skip the multi-turn part")
  args = ap.parse_args()
  repeats = 1 if args.quick else 3
  from rao_jax.model import load_pretrained
  from rao_jax.model.weights import export_hf
  from rao_jax.rollout.embedded import EmbeddedEngine

  say("loading SmolLM2-135M (float32)")
  model, tok = load_pretrained("smollm2-135m", dtype="float32")
  tmp = tempfile.mkdtemp(prefix="bench_rollout_")
  export_hf(model, None, tok, tmp)
  peer_setup, peer_close, info = peer_process(tmp)
  say(f"peer: PyTorch {info['torch']}, {info['threads']} threads (its default), own process")
  rng = np.random.default_rng(0)
  out = {}
  # One engine for all batch sizes: decode runs over the first 1 / 8 / 32 slots only.
  engine = EmbeddedEngine(model, num_slots=32, max_len=384, cache_lens=(256, 384),
                          chunk_sizes=(64, 256), prefill_rows=(1, 8), decode_rows=(1, 8, 32))
  for b in [int(x) for x in args.batches.split(",") if x]:
    prompts = [list(map(int, rng.integers(3, 49000, PROMPT))) for _ in range(b)]
    t0 = time.perf_counter()
    reps = repeats if b < 32 else max(1, repeats - 1)
    sides = {"embedded": engine_round(engine, prompts), "torch": peer_setup(prompts)}
    say(f"b={b}: both sides warm ({time.perf_counter() - t0:.0f} s incl. compile)")
    times = {k: ([], []) for k in sides}
    for _ in range(reps):    # alternating rounds: machine drift hits both sides alike
      for k, fn in sides.items():
        t1, t64 = fn()
        times[k][0].append(t1)
        times[k][1].append(t64)
    jx, jx_e2e = _rates(b, *times["embedded"])
    pt, pt_e2e = _rates(b, *times["torch"])
    say(f"b={b}: embedded decode {jx} tok/s, end-to-end {jx_e2e:.1f} tok/s")
    say(f"b={b}: torch generate decode {pt} tok/s, end-to-end {pt_e2e:.1f} tok/s")
    out[f"embedded_tok_s_b{b}"] = jx and round(jx, 2)
    out[f"torch_tok_s_b{b}"] = pt and round(pt, 2)
    out[f"ratio_b{b}"] = round(jx / pt, 3) if jx and pt else None
    out[f"e2e_ratio_b{b}"] = round(jx_e2e / pt_e2e, 3)
    if jx:
      # A decode step reads every product weight once and each row's K/V over its context
      # (256-319 tokens, mean PROMPT + NEW / 2): bench_peak.decode_step_bytes, float32.
      step_bytes = bench_peak.decode_step_bytes(model.cfg, [PROMPT + NEW // 2] * b)
      sh = bench_peak.shares(flops_per_s=bench_peak.model_flops(
          model.cfg, b, b * (PROMPT + NEW // 2), train=False) * jx / b,
          bytes_per_s=step_bytes * jx / b)
      out[f"share_of_peak_bandwidth_b{b}"] = sh.get("share_of_peak_bandwidth")
      out[f"share_of_peak_gemm_b{b}"] = sh.get("share_of_peak_gemm")
  del engine
  peer_close()

  times = {}
  for sessions in (() if args.no_sessions else (False, True)):
    run, eng = multi_turn(model, sessions)
    asyncio.run(run())       # warm-up pass: the shapes are compiled, this warms the rest
    ts = [asyncio.run(run()) for _ in range(max(1, repeats - 1))]
    times[sessions] = statistics.median(ts)
    say(f"multi-turn sessions={sessions}: {times[sessions]:.1f} s "
        f"(prefilled {eng.stats['prefill_tokens']} tokens, cached {eng.stats['cached_tokens']})")
  if times:
    out["multi_turn_s_no_sessions"] = round(times[False], 2)
    out["multi_turn_s_sessions"] = round(times[True], 2)
    out["session_speedup"] = round(times[False] / times[True], 3)
  peak = bench_peak.load_peak()
  out.update(peer={"torch": info["torch"], "threads": info["threads"], "process": "own"},
             cpu=bench_peak.cpu_model(), load_avg_1m=round(os.getloadavg()[0], 2),
             peak=peak and {"gflops": peak["peak_gflops"], "gbps": peak["peak_gbps"]})
  print(json.dumps(out))


if __name__ == "__main__":
  main()
