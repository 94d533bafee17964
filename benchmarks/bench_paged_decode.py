"""The paged KV cache on one accelerator: its decode kernel against XLA's attention over the
gathered pages, and the rows of a 40K context the embedded engine holds, paged against a fixed
window.

    python benchmarks/bench_paged_decode.py --out DIR       # on a GPU or TPU (gpu_run.sh)
    python benchmarks/bench_paged_decode.py --smoke          # toy sizes on CPU: that it runs

1. ``paged_decode_kernel``: ``kernels.paged.paged_decode_attention`` (the platform's kernel:
   Pallas Triton on CUDA, Pallas TPU on TPU) against ``xla_paged_decode_attention`` (each row's
   pages gathered, XLA's masked attention over the table), one layer of Llama-3.2-1B's attention
   (32 heads, 8 KV heads, head dim 64), bfloat16, pages of 64 slots scattered over the pool,
   rows holding a quarter to all of their table; batch 64 x 4,096 slots and batch 8 x 40,960
   slots (40K); medians of repeats, sides alternating; the largest difference.
2. ``paged_rows_40k``: the embedded engine over a Llama-3.2-1B-shaped model (random bfloat16
   weights) with max_len 40,960, its pool given a share of the device's free memory; as many
   requests as that pool holds at TextCraft's measured mean context (bench_decode_floor: 703
   positions; here prompts of 640 tokens and 64 generated) run at once, greedy: the rows it held
   decoding together, its preemptions (0 expected), decode and prefill tokens/s, and the rows
   a fixed 40K window would hold in the same memory.

With ``--smoke`` both parts run at toy sizes on the CPU (the GPU kernel in interpret mode), so
the script is checked where no accelerator is; its figures mean nothing.

Progress on stderr; a JSON line per part (also written to DIR/<part>.json), the last one on
stdout the summary of both.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import time


def say(*a):
  print(*a, file=sys.stderr, flush=True)


def timed(fn, *args, repeats: int) -> float:
  """Median seconds of ``fn(*args)`` after a first (compiling) call."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def kernel_part(smoke: bool, repeats: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rao_jax.kernels import paged  # pylint: disable=g-import-not-at-top
  H, K, h, P = (32, 8, 64, 64) if not smoke else (4, 2, 16, 16)
  cases = ((64, 4096), (8, 40960)) if not smoke else ((4, 256), (2, 1024))
  kernel = (functools.partial(paged.gpu_paged_decode_attention, interpret=True) if smoke
            else paged.paged_decode_attention)
  rows = []
  for B, S in cases:
    W = S // P
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, 1, H, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B * W, K, h, P), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B * W, K, P, h), jnp.bfloat16)
    pages = jnp.asarray(rng.permutation(B * W).reshape(B, W), jnp.int32)
    start = jnp.asarray(rng.integers(S // 4, S, B), jnp.int32)
    fns = {"kernel": jax.jit(kernel), "xla": jax.jit(paged.xla_paged_decode_attention)}
    err = float(jnp.max(jnp.abs(fns["kernel"](q, k, v, pages, start).astype(jnp.float32)
                                - fns["xla"](q, k, v, pages, start).astype(jnp.float32))))
    times = {name: [] for name in fns}
    for r in range(3):
      for name in (("kernel", "xla") if r % 2 == 0 else ("xla", "kernel")):
        times[name].append(timed(fns[name], q, k, v, pages, start, repeats=repeats))
    t = {name: statistics.median(ts) for name, ts in times.items()}
    rows.append({"batch": B, "table_slots": S, "page_size": P,
                 "mean_held": float(jnp.mean(start + 1)), "kernel_s": t["kernel"],
                 "xla_s": t["xla"], "xla_over_kernel": t["xla"] / t["kernel"],
                 "max_abs_diff_bf16": err})
    say(f"paged decode B={B} S={S}: kernel {t['kernel'] * 1e3:.3f} ms, XLA {t['xla'] * 1e3:.3f} "
        f"ms, diff {err:.2e}")
  return {"heads": H, "kv_heads": K, "head_dim": h,
          "kernel": "rao_jax.kernels.paged.paged_decode_attention (the platform's kernel)"
                    + (" [smoke: the GPU kernel in interpret mode]" if smoke else ""),
          "peer": "XLA's masked attention over each row's gathered pages", "rows": rows}


def rows_part(smoke: bool) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from rao_jax.learner.testing import init_params  # pylint: disable=g-import-not-at-top
  from rao_jax.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from rao_jax.model.transformer import Transformer  # pylint: disable=g-import-not-at-top
  from rao_jax.rollout import GenerateRequest, SamplingParams  # pylint: disable=g-import-not-at-top
  from rao_jax.rollout.engine import EmbeddedEngine  # pylint: disable=g-import-not-at-top
  base = dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
              head_dim=64, mlp_dim=8192, rope_theta=500000.0, tie_embeddings=True,
              param_dtype="bfloat16", dtype="bfloat16")
  max_len, P, prompt_len, new, max_rows = 40960, 64, 640, 64, 512
  if smoke:
    base.update(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                mlp_dim=512)
    max_len, P, prompt_len, new, max_rows = 2048, 64, 40, 4, 4
  cfg = ModelConfig(**base)
  model = nnx.merge(nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))),
                              nnx.Param)[0], init_params(cfg, 0))
  kv_per_position = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * 2
  dev = jax.devices()[0]
  stats = dev.memory_stats() or {}
  if smoke or "bytes_limit" not in stats:
    free = 48 * P * kv_per_position        # a toy pool: 48 pages
  else:
    # A share of what the weights left: prefill's gathered views and XLA's temporaries need
    # the rest.
    free = 0.7 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  num_pages = max(int(free // (P * kv_per_position)), -(-max_len // P))
  per_request = -(-(prompt_len + new) // P)
  n_req = min(num_pages // per_request, max_rows)
  fixed_rows = num_pages * P // max_len
  say(f"pool: {num_pages} pages of {P} ({num_pages * P * kv_per_position / 1e9:.1f} GB): "
      f"{num_pages // per_request} requests of {prompt_len + new} positions, or {fixed_rows} "
      f"rows of a fixed {max_len} window; running {n_req}")
  engine = EmbeddedEngine(model, num_slots=n_req, max_len=max_len, page_size=P,
                          num_pages=num_pages, cache_lens=(1024, max_len), chunk_sizes=(256,),
                          prefill_rows=(min(4, n_req),), decode_rows=(n_req,),
                          share_prefix_min=0)
  say(f"warm-up: {engine.warmup(max_cache_len=1024):.0f} s")
  rng = np.random.default_rng(0)
  prompts = [list(map(int, rng.integers(3, cfg.vocab_size, prompt_len))) for _ in range(n_req)]

  async def run():
    params = SamplingParams(temperature=0.0, max_new_tokens=new)
    res = await asyncio.gather(*[engine.generate(GenerateRequest(p, params)) for p in prompts])
    await engine.close()
    return res
  t0 = time.perf_counter()
  results = asyncio.run(run())
  wall = time.perf_counter() - t0
  st = engine.stats
  held = max([int(k.rsplit("_", 1)[1]) for k in st if k.startswith("decode_calls_active_")]
             + [0])
  return {"model": "llama-3.2-1b shape, random bfloat16 weights" + (" [smoke: toy]" if smoke
                                                                      else ""),
          "max_len": max_len, "page_size": P, "pool_pages": num_pages,
          "pool_gb": num_pages * P * kv_per_position / 1e9, "request_positions": prompt_len + new,
          "requests": n_req, "rows_held_decoding_together": held,
          "paged_rows_the_pool_holds": num_pages // per_request, "fixed_window_rows": fixed_rows,
          "preemptions": int(st.get("preemptions", 0)),
          "finished": sum(r.finish_reason.value == "length" for r in results),
          "decode_tokens_per_s": st["decode_tokens"] / max(st["decode_s"], 1e-9),
          "prefill_tokens_per_s": st["prefill_tokens"] / max(st["prefill_s"], 1e-9),
          "wall_s": wall}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: that it runs")
  ap.add_argument("--out", default="", help="a folder for <part>.json (gpu_run.sh's $OUT)")
  ap.add_argument("--repeats", type=int, default=7)
  args = ap.parse_args()
  if args.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=g-import-not-at-top
  dev = jax.devices()[0]
  head = {"platform": dev.platform, "device": dev.device_kind, "smoke": args.smoke}
  summary = dict(head, bench="paged_decode")
  for name, part in (("paged_decode_kernel", lambda: kernel_part(args.smoke, args.repeats)),
                     ("paged_rows_40k", lambda: rows_part(args.smoke))):
    try:
      row = dict(head, bench=name, **part())
    except Exception as e:  # noqa: BLE001 - one part failing still reports the other
      row = dict(head, bench=name, error=f"{type(e).__name__}: {e}")
    line = json.dumps(row)
    say(line)
    if args.out:
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        f.write(line + "\n")
    summary[name] = row
  print(json.dumps(summary))
  if any("error" in summary[n] for n in ("paged_decode_kernel", "paged_rows_40k")):
    sys.exit(1)


if __name__ == "__main__":
  main()
