"""This machine's measured peak: the best float32 GEMM and the memory bandwidth, on all cores.

    python benchmarks/bench_peak.py [--quick]

Every other CPU benchmark states its model FLOP/s (or, for decode, its bytes/s) as a share of
these two figures, read back from the newest line of `benchmarks/results/bench_peak.json` for the
same CPU model (`load_peak`). A vendor's datasheet peak (cores x clock x FMA width) says little
on a shared cloud VM whose clock, SMT siblings and memory channels are not ours to know; what
the best library reaches here is the ceiling that matters to a user of this machine.

1. GEMM, float32, C = A @ B with square n x n operands (2 n^3 FLOPs), n in 1024, 2048, 4096:
   numpy's BLAS (OpenBLAS in the PyPI wheel), PyTorch (MKL / oneDNN), and XLA (jnp.dot, jitted),
   each on all cores with its default threads, alternating in rounds. `peak_gflops` is the best
   median over libraries and sizes.
2. Memory bandwidth, STREAM convention (bytes read + bytes written, no write-allocate):
   copy b = a (8 bytes per element) and triad a = b + s * c (12 bytes per element) over 64M-element
   float32 arrays (256 MB each, far past any cache): numpy (one thread), PyTorch (all threads),
   XLA (jitted). `peak_gbps` is the best median.

Progress goes to stderr; the last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_peak.json")


def say(*a):
  print(*a, file=sys.stderr, flush=True)


def cpu_model() -> str:
  """The CPU's model with its vector instruction sets: peaks are looked up by it, and two EPYC
  generations that a VM names alike differ by 2x here."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from rao_jax.kernels import mkl  # pylint: disable=g-import-not-at-top
  return mkl.cpu_name()


# -- what the other benchmarks import ------------------------------------------------------------


def load_peak(path: str = RESULTS, cpu: str | None = None) -> dict | None:
  """The newest bench_peak line measured on this CPU model (None: run bench_peak.py first)."""
  cpu = cpu_model() if cpu is None else cpu
  try:
    with open(path) as f:
      lines = [json.loads(l) for l in f if l.strip()]
  except OSError:
    return None
  same = [l for l in lines if l.get("cpu") == cpu and l.get("cores") == os.cpu_count()]
  return same[-1] if same else None


def shares(flops_per_s: float | None = None, bytes_per_s: float | None = None,
           peak: dict | None = None) -> dict:
  """`{gflops, share_of_peak_gemm, gbps, share_of_peak_bandwidth}` for a benchmark's JSON line."""
  peak = load_peak() if peak is None else peak
  out = {}
  if flops_per_s is not None:
    out["model_gflops"] = round(flops_per_s / 1e9, 2)
  if bytes_per_s is not None:
    out["model_gbps"] = round(bytes_per_s / 1e9, 2)
  if peak is None:
    out["peak"] = "not measured on this CPU: run benchmarks/bench_peak.py"
    return out
  if flops_per_s is not None:
    out["share_of_peak_gemm"] = round(flops_per_s / 1e9 / peak["peak_gflops"], 3)
  if bytes_per_s is not None:
    out["share_of_peak_bandwidth"] = round(bytes_per_s / 1e9 / peak["peak_gbps"], 3)
  out["peak"] = {"gflops": peak["peak_gflops"], "gbps": peak["peak_gbps"]}
  return out


def matmul_params(cfg) -> int:
  """Parameters that take part in a product per token: every layer's weights and the LM head."""
  D, F, L, H, K, h, V = (cfg.d_model, cfg.mlp_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                         cfg.head_dim, cfg.vocab_size)
  per_layer = D * H * h + 2 * D * K * h + H * h * D + 3 * D * F   # q, k, v, o, gate, up, down
  return L * per_layer + V * D   # the LM head (tied or not) is one V x D product


def model_flops(cfg, tokens: int, attended_pairs: int, train: bool) -> float:
  """Model FLOPs of a forward (train=False) or forward + backward (train=True) pass.

  2 FLOPs per multiply-add: forward = 2 x matmul_params x tokens + 4 x L x H x h x pairs (QK^T
  and AV, each 2 x h per head per (query, key) pair; `attended_pairs` counts the pairs the causal
  mask keeps, sum over sequences of n (n + 1) / 2). Backward is twice the forward (PaLM's
  6N + 12 L H h T/2 per token). Norms, RoPE, softmax and the optimizer are not counted.
  """
  fwd = 2 * matmul_params(cfg) * tokens + 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * (
      attended_pairs)
  return 3 * fwd if train else fwd


def causal_pairs(lengths) -> int:
  """(query, key) pairs a causal mask keeps over sequences (or packed segments) of `lengths`."""
  return int(sum(n * (n + 1) // 2 for n in lengths))


def decode_step_bytes(cfg, context_lens, bytes_per_value: int = 4) -> int:
  """Bytes a decode step must read at least: every product weight once, plus each row's K and V
  cache over its context (2 x L x K x h values per position)."""
  kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
  return bytes_per_value * (matmul_params(cfg) + kv * int(sum(context_lens)))


# -- the measurements -----------------------------------------------------------------------------


def gemm_sides(n: int):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
  ta, tb = torch.from_numpy(a), torch.from_numpy(b)
  ja, jb = jnp.asarray(a), jnp.asarray(b)
  dot = jax.jit(jnp.dot)
  return {"numpy": lambda: a @ b, "torch": lambda: torch.mm(ta, tb),
          "xla": lambda: dot(ja, jb).block_until_ready()}


def bandwidth_sides(n: int):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  a = np.ones(n, np.float32)
  b, c = a * 2, a * 3
  ta, tb, tc = torch.from_numpy(a.copy()), torch.from_numpy(b), torch.from_numpy(c)
  ja, jb, jc = jnp.asarray(a), jnp.asarray(b), jnp.asarray(c)
  copy = jax.jit(lambda x: x + 0.0)   # a jitted identity is elided; +0.0 reads and writes
  triad = jax.jit(lambda x, y: x + 3.0 * y)
  return {
      "numpy_copy": (8, lambda: np.copyto(a, b)),
      "numpy_triad": (12, lambda: np.add(b, np.multiply(c, 3.0, out=a), out=a)),
      "torch_copy": (8, lambda: ta.copy_(tb)),
      "torch_triad": (12, lambda: torch.add(tb, tc, alpha=3.0, out=ta)),
      "xla_copy": (8, lambda: copy(jb).block_until_ready()),
      "xla_triad": (12, lambda: triad(jb, jc).block_until_ready()),
  }


def rounds(sides: dict, repeats: int, rounds_: int) -> dict:
  """Median seconds of each side; sides alternate within each round (drift hits all alike)."""
  for fn in sides.values():   # compile / first touch
    fn()
  times = {k: [] for k in sides}
  for _ in range(rounds_):
    for k, fn in sides.items():
      for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="n 2048 only, fewer rounds, 64 MB arrays")
  ap.add_argument("--save", action="store_true", help=f"append the line to {RESULTS}")
  args = ap.parse_args()
  import numpy as np
  import torch
  sizes = (2048,) if args.quick else (1024, 2048, 4096)
  n_rounds = 2 if args.quick else 3
  say(f"cpu {cpu_model()!r}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
  gemm = {}
  for n in sizes:
    med = rounds(gemm_sides(n), repeats=2 if n >= 4096 else 4, rounds_=n_rounds)
    gemm[n] = {k: round(2 * n ** 3 / s / 1e9, 1) for k, s in med.items()}
    say(f"GEMM n={n}: " + ", ".join(f"{k} {v} GFLOP/s" for k, v in gemm[n].items()))
  elems = (16 if args.quick else 64) * 2 ** 20
  sides = bandwidth_sides(elems)
  med = rounds({k: fn for k, (_, fn) in sides.items()}, repeats=3, rounds_=n_rounds)
  bw = {k: round(sides[k][0] * elems / med[k] / 1e9, 2) for k in sides}
  say("bandwidth: " + ", ".join(f"{k} {v} GB/s" for k, v in bw.items()))
  best_gemm = max((v, f"{k} n={n}") for n, d in gemm.items() for k, v in d.items())
  best_bw = max((v, k) for k, v in bw.items())
  np_blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
  out = {"benchmark": "peak", "cpu": cpu_model(), "cores": os.cpu_count(),
         "load_avg_1m": round(os.getloadavg()[0], 2),
         "gemm_gflops": {str(n): d for n, d in gemm.items()},
         "bandwidth_gbps": bw,
         "peak_gflops": best_gemm[0], "peak_gemm_by": best_gemm[1],
         "peak_gbps": best_bw[0], "peak_bandwidth_by": best_bw[1],
         "libraries": {"numpy_blas": f"{np_blas.get('name')} {np_blas.get('version')}",
                       "torch": torch.__version__,
                       "torch_blas": "mkl" if torch.backends.mkl.is_available() else "other"},
         "quick": args.quick}
  if args.save:
    with open(RESULTS, "a") as f:
      f.write(json.dumps(out) + "\n")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
