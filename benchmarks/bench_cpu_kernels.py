"""The MKL kernels through XLA FFI (rao_jax/kernels/mkl.py) against XLA:CPU's own ops.

Three measurements in one process, each alternating the two sides so that machine drift hits
both:

  products   the SmolLM2 4 x 512 training step's product shapes alone, with the transposes the
             step uses (GF/s per side; ``matmul.dense``)
  attention  one layer's causal attention forward+backward at the step's shape
             (``mkl_attention.causal_attention`` against the model's XLA version)
  step       the whole forward+backward step of bench_model.py, for a model with
             ModelConfig.kernels="xla" and one with "mkl" (same weights, same batch)

``*_speedup`` is XLA's median time over MKL's (above 1: MKL faster). Progress goes to stderr; the
last stdout line is JSON.

    python benchmarks/bench_cpu_kernels.py [--batch 4] [--seq 512] [--rounds 3]
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

# (M, K, N, trans_a, trans_b) of C[M, N] = op(A)[M, K] op(B)[K, N] in the 4 x 512 SmolLM2
# step: MLP up/gate, MLP down, its input gradient, the MLP's weight gradients (reductions over
# the 2048 tokens), the output projection, the LM head's logits and input gradient.
SHAPES = [(2048, 576, 1536, False, False), (2048, 1536, 576, False, False),
          (2048, 1536, 576, False, True), (576, 2048, 1536, True, False),
          (1536, 2048, 576, True, False), (2048, 576, 576, False, False),
          (1024, 576, 49152, False, True), (1024, 49152, 576, False, False)]


def _alternate(fns, args, rounds, reps):
  """Median seconds per call of each side, alternating sides by round."""
  times = {side: [] for side in fns}
  for _ in range(rounds):
    for side, fn in fns.items():
      jax.block_until_ready(fn(*args))
      times[side].extend(timed(lambda: jax.block_until_ready(fn(*args)), 0)[0]
                         for _ in range(reps))
  return {side: statistics.median(t) for side, t in times.items()}


def _attention(args, result):
  from rao_jax.kernels import mkl
  from rao_jax.model import transformer
  B, T, H, K, h = args.batch, args.seq, 9, 3, 64   # SmolLM2-135M's heads
  rng = np.random.default_rng(0)
  q, k, v, w = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                for s in ((B, T, H, h), (B, T, K, h), (B, T, K, h), (B, T, H, h)))
  seg = jnp.ones((B, T), jnp.int32)
  fns = {}
  for side in ("xla", "mkl"):
    cfg = transformer.ModelConfig(vocab_size=8, d_model=H * h, n_layers=1, n_heads=H,
                                  n_kv_heads=K, head_dim=h, mlp_dim=8, dtype="float32",
                                  kernels=side)
    attend = transformer._self_attention(cfg, seg, False)   # what the model's block calls
    loss = lambda q, k, v, attend=attend: jnp.sum(attend(q, k, v) * w)   # noqa: E731
    lowered = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(q, k, v)
    assert (mkl.ATTENTION_FWD in lowered.as_text()) == (side == "mkl")
    fns[side] = lowered.compile()
  got, want = fns["mkl"](q, k, v), fns["xla"](q, k, v)
  for g_, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g_, w_, rtol=1e-3, atol=1e-3 * float(jnp.abs(w_).max()))
  med = _alternate(fns, (q, k, v), args.rounds, args.reps)
  log(f"attention fwd+bwd: xla {med['xla'] * 1e3:.1f} ms, mkl {med['mkl'] * 1e3:.1f} ms")
  result["attention_ms"] = {side: round(t * 1e3, 2) for side, t in med.items()}
  result["attention_speedup"] = round(med["xla"] / med["mkl"], 3)


def main():
  from rao_jax import host_memory   # before JAX starts: freed step buffers are reused, not
  host_memory.keep_freed_memory()   # returned to the OS and page-faulted in again each step
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--reps", type=int, default=5, help="timed calls per product per round")
  args = parser.parse_args()
  from rao_jax.kernels import matmul, mkl
  from rao_jax.model import load_model
  result = {"benchmark": "cpu_kernels_mkl_vs_xla", "batch": args.batch, "seq": args.seq,
            "cpu": mkl.cpuinfo("model name")}
  rng = np.random.default_rng(0)
  for m, k, n, ta, tb in SHAPES:
    a = jnp.asarray(rng.standard_normal((k, m) if ta else (m, k)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, k) if tb else (k, n)), jnp.float32)
    fns = {}
    for side in ("xla", "mkl"):
      lowered = jax.jit(lambda a, b, ta=ta, tb=tb, side=side: matmul.dense(
          a, b, ta, tb, kernels=side)).lower(a, b)
      assert (mkl.GEMM in lowered.as_text()) == (side == "mkl")
      fns[side] = lowered.compile()
    np.testing.assert_allclose(fns["mkl"](a, b), fns["xla"](a, b), rtol=1e-4, atol=1e-3)
    med = _alternate(fns, (a, b), args.rounds, args.reps)
    gf = {s: 2 * m * k * n / t / 1e9 for s, t in med.items()}
    name = f"{m}x{k}x{n}" + ("_ta" if ta else "") + ("_tb" if tb else "")
    log(f"{name}: xla {gf['xla']:.0f} GF/s, mkl {gf['mkl']:.0f} GF/s")
    result[f"{name}_gflops"] = {s: round(v, 1) for s, v in gf.items()}
  _attention(args, result)
  steps, losses = {}, {}
  for side in ("xla", "mkl"):
    model = load_model("smollm2-135m", dtype="float32", kernels=side)
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size,
                                               (args.batch, args.seq + 1))
    steps[side] = make_ours(model, tokens)
    losses[side] = float(steps[side]()[0])
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
