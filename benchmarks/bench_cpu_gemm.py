"""MKL sgemm through XLA FFI (rao_jax/model/matmul.py) against XLA:CPU's own dot, one process.

Two measurements, each alternating the two sides so that machine drift hits both:

  products  the SmolLM2 4 x 512 training step's product shapes alone (GF/s per side)
  step      the whole forward+backward step of bench_model.py, traced once with
            RAO_JAX_CPU_GEMM=xla and once with mkl (same weights, same batch, same process)

``step_speedup`` is XLA's median step time over MKL's (above 1: MKL faster). Progress goes to
stderr; the last stdout line is JSON.

    python benchmarks/bench_cpu_gemm.py [--batch 4] [--seq 512] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import log, make_ours, timed   # noqa: E402  (a sibling script)

# (M, K, N) of C[M, N] = A[M, K] B[K, N] in the 4 x 512 SmolLM2 step: MLP up/gate, MLP down,
# weight gradients, the output projection, and the LM head's input gradient.
SHAPES = [(2048, 576, 1536), (2048, 1536, 576), (1536, 2048, 576), (2048, 576, 576),
          (1024, 49152, 576)]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--reps", type=int, default=5, help="timed calls per product per round")
  args = parser.parse_args()
  from rao_jax.model import load_model, matmul
  result = {"benchmark": "cpu_gemm_mkl_vs_xla", "batch": args.batch, "seq": args.seq}
  rng = np.random.default_rng(0)
  for m, k, n in SHAPES:
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    fns = {}
    for side in ("xla", "mkl"):
      matmul.select(side)   # compiled now, so each side keeps its own choice
      lowered = jax.jit(lambda a, b: matmul.dense(a, b)).lower(a, b)
      assert ("rao_mkl_gemm" in lowered.as_text()) == (side == "mkl")
      fns[side] = lowered.compile()
    np.testing.assert_allclose(fns["mkl"](a, b), fns["xla"](a, b), rtol=1e-4, atol=1e-3)
    times = {"xla": [], "mkl": []}
    for _ in range(args.rounds):
      for side, fn in fns.items():
        fn(a, b).block_until_ready()
        times[side].extend(timed(lambda: fn(a, b).block_until_ready())[0]
                           for _ in range(args.reps))
    gf = {s: 2 * m * k * n / statistics.median(t) / 1e9 for s, t in times.items()}
    log(f"{m}x{k}x{n}: xla {gf['xla']:.0f} GF/s, mkl {gf['mkl']:.0f} GF/s")
    result[f"{m}x{k}x{n}_gflops"] = {s: round(v, 1) for s, v in gf.items()}
  model = load_model("smollm2-135m", dtype="float32")
  tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size,
                                             (args.batch, args.seq + 1))
  steps, losses = {}, {}
  for side in ("xla", "mkl"):
    matmul.select(side)
    steps[side] = make_ours(model, tokens)
    losses[side] = float(steps[side]()[0])   # compiles under this side's choice
  matmul.select("auto")
  if abs(losses["mkl"] - losses["xla"]) > 1e-4 * abs(losses["xla"]):
    raise SystemExit(f"losses differ: {losses}")
  times = {"xla": [], "mkl": []}
  for r in range(args.rounds):
    for side, step in steps.items():
      step()   # the first step after a switch is dropped (see bench_model.py)
      times[side].append(timed(step)[0])
      log(f"round {r} {side}: {times[side][-1]:.3f}s")
  med = {s: statistics.median(t) for s, t in times.items()}
  result.update(step_xla_s=round(med["xla"], 3), step_mkl_s=round(med["mkl"], 3),
                step_speedup=round(med["xla"] / med["mkl"], 3), loss_xla=losses["xla"],
                loss_mkl=losses["mkl"])
  print(json.dumps(result))


if __name__ == "__main__":
  main()
