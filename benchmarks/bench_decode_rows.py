"""The embedded engine's decode call at each row bucket of a 32-slot cache: attention reading its
rows in place against copying them out first.

    python benchmarks/bench_decode_rows.py [--rounds 3] [--cache_lens 1024,2048]

The engine decodes its first R slots (R = the decode bucket of the active requests). Before,
each layer's attention took the cache rows [0:R] as a slice, and XLA:CPU copied that slice out
of the cache before its products (R x 3 MB a layer at length 2,048 for SmolLM2-135M), so a call
at 16 of 32 rows cost about what 32 rows cost. Now ``attention.cache_rows_attention`` reads
each row in place on CPU. Both programs are compiled side by side in this process (the
"sliced" one traces the former attention, defined here) and timed in alternating rounds, on
SmolLM2-135M float32, row lengths spread over [S/4, S), one decode step a call, the engine's
own ``programs.decode``. Progress goes to stderr; the last stdout line is one JSON object with
the medians over rounds (ms a call), sliced / in_place per (cache length, rows), and each
program's temporary buffers (XLA's memory analysis: the copied rows live there).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peak  # noqa: E402  (this folder's: names the CPU)

SLOTS = 32
ROWS = (1, 2, 4, 8, 16, 32)


def say(*a):
  print(*a, file=sys.stderr, flush=True)


@contextlib.contextmanager
def sliced_attention():
  """While tracing: the former decode attention, which sliced (or gathered) the cache rows."""
  import jax.numpy as jnp
  from rao_jax.kernels import attention
  kept = attention.cache_rows_attention

  def former(q, k, v, visible, dtype, rows_B=None):
    B = q.shape[0]
    if rows_B is None and B == k.shape[0]:
      kc, vc = k, v
    elif rows_B is None:
      kc, vc = k[:B], v[:B]
    else:
      kc, vc = jnp.take(k, rows_B, axis=0), jnp.take(v, rows_B, axis=0)
    return attention.cached_attention(q, kc, vc, visible, dtype)
  attention.cache_rows_attention = former
  try:
    yield
  finally:
    attention.cache_rows_attention = kept


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--calls", type=int, default=5, help="timed calls per round (median)")
  ap.add_argument("--cache_lens", default="1024,2048")
  args = ap.parse_args()
  from rao_jax import host_memory
  host_memory.keep_freed_memory()
  import jax
  from rao_jax.model import load_model
  from rao_jax.rollout.engine import programs as P

  model = load_model("smollm2-135m", dtype="float32")
  params, fns = model.inference_params(), model.inference_fns()
  variants = ("in_place", "sliced")
  times, temp_mb = {}, {}
  for S in (int(s) for s in args.cache_lens.split(",")):
    state = {"cache": model.init_cache(batch_size=SLOTS, max_len=S)}
    progs = {}
    for name in variants:
      # A function of its own for each variant: jit's trace cache is keyed by the function,
      # so two jit objects over the same one would share the first variant's program.
      def decode(*a):
        return P.decode.__wrapped__(*a)
      fn = jax.jit(decode, static_argnums=(0, 1), donate_argnums=(3,))
      with (sliced_attention() if name == "sliced" else contextlib.nullcontext()):
        for R in ROWS:
          # Row r is page r of the cache (a pool of SLOTS pages of S slots): the engine's
          # decode program reading the first R rows, as before its cache was paged.
          batch = P.DecodeBatch.zeros(R, 1)
          batch.pages_RxW[:, 0] = np.arange(R)
          batch.lengths_R[:] = np.linspace(S // 4, S - 2, R).astype(np.int32)
          batch.active_R[:] = True
          arrays = P.sampling_arrays(R)
          t0 = time.perf_counter()
          state["cache"], toks, _ = fn(fns, 1, params, state["cache"], batch, arrays)
          jax.block_until_ready(toks)
          say(f"compiled {name} rows {R} cache {S}: {time.perf_counter() - t0:.1f} s")
          progs[name, R] = (fn, batch, arrays)
          # XLA's temporary buffers for the call: the copied rows live here.
          mem = fn.lower(fns, 1, params, state["cache"], batch, arrays).compile(
              ).memory_analysis()
          temp_mb.setdefault(f"cache{S}", {}).setdefault(name, {})[R] = round(
              mem.temp_size_in_bytes / 1e6, 1)
    for rnd in range(args.rounds):
      for R in ROWS:
        for name in (variants if rnd % 2 == 0 else variants[::-1]):
          fn, batch, arrays = progs[name, R]
          ts = []
          for _ in range(args.calls + 1):
            t0 = time.perf_counter()
            state["cache"], toks, _ = fn(fns, 1, params, state["cache"], batch, arrays)
            jax.block_until_ready(toks)
            ts.append(time.perf_counter() - t0)
          ms = 1000 * statistics.median(ts[1:])
          times.setdefault((S, R, name), []).append(ms)
          say(f"round {rnd} cache {S} rows {R} {name}: {ms:.1f} ms")
    del state
  result = {"benchmark": "decode_rows_smollm2_135m_f32", "cpu": bench_peak.cpu_model(),
            "cores": os.cpu_count(), "slots": SLOTS, "rounds": args.rounds,
            "row_lengths": "spread evenly over [S/4, S)", "ms": {}, "sliced_over_in_place": {},
            "temp_mb": temp_mb}
  for (S, R, name), v in sorted(times.items()):
    result["ms"].setdefault(f"cache{S}", {}).setdefault(name, {})[R] = round(
        statistics.median(v), 1)
  for key, by in result["ms"].items():
    result["sliced_over_in_place"][key] = {
        R: round(by["sliced"][R] / by["in_place"][R], 2) for R in ROWS}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
