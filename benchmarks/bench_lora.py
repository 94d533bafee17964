"""LoRA against full fine-tuning on the same shapes: learner step time and memory, and the
engine's decode with the adapter merged into its weights against applied at every step.

    python benchmarks/bench_lora.py [--rank=8] [--rows=2] [--row_len=1024] [--rounds=3]

Learner: SmolLM2-135M (float32 on CPU), packed rows of RAO-like trees (bench_learner's batch),
the RAO loss, AdamW. Two learners from the same weights: full fine-tuning (the peer) and a LoRA
adapter of rank ``--rank`` on every projection. They alternate in rounds of ``--repeats`` steady
steps (first step of each compiled beforehand). Memory: XLA's memory analysis of each compiled
step (arguments + temporaries + outputs not aliased to donated arguments) and the memory plan's
estimate (rao_jax.learner.memory.estimate) for each.

Engine: one decode step (CachedForward, the engine's program) at batch 8 and 32 over a
1024-slot cache, with inference params where the adapter is merged (W + alpha / r A B, what the
embedded engine does on a sync) and where it is applied beside the weights at each step, in
alternating rounds.

Progress goes to stderr, ONE JSON line to stdout; --out writes it to a file too.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_learner  # noqa: E402
import bench_peak  # noqa: E402


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def _memory(learner, batch) -> dict:
  """XLA's memory analysis of the learner's compiled step, in bytes."""
  import jax
  arrays = {k: np.asarray(batch[k]) for k in learner._batch_shardings}   # noqa: SLF001
  arrays["normalizer"] = np.asarray(arrays["normalizer"], np.float32)
  dev = jax.device_put(arrays, learner._batch_shardings)   # noqa: SLF001
  compiled = learner._step_fn.lower(learner.state, dev).compile()   # noqa: SLF001
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
          - m.alias_size_in_bytes)
  return {"peak_bytes": int(peak), "argument_bytes": int(m.argument_size_in_bytes),
          "temp_bytes": int(m.temp_size_in_bytes)}


def learner_part(args) -> dict:
  import jax
  from rao_jax.learner import memory
  from rao_jax.model import load_pretrained
  from rao_jax.model import lora as lora_lib
  T = args.row_len
  model, _ = load_pretrained("smollm2-135m", dtype="float32")
  _, packed = bench_learner.packing_report(model.cfg.vocab_size, T, micro=1)
  batch = bench_learner.throughput_batch(packed, args.rows)
  real = int((batch["segment_ids_BxT"] > 0).sum())
  log(f"learner batch: {args.rows} rows x {T} tokens ({real} real)")
  full = bench_learner.make_learner(model, batch, lr=1e-5)
  lora_model = lora_lib.add_adapters(model, {"rank": args.rank, "alpha": 2.0 * args.rank})
  adapted = bench_learner.make_learner(lora_model, batch, lr=1e-4)
  n_adapter = sum(x.size for x in jax.tree.leaves(adapted.params))
  n_full = sum(x.size for x in jax.tree.leaves(full.params))
  del model, lora_model
  gc.collect()
  mem = {"full": _memory(full, batch), "lora": _memory(adapted, batch)}
  plan = {"full": memory.estimate(full.model_cfg, T, 1, "none")["total"],
          "lora": memory.estimate(adapted.model_cfg, T, 1, "none")["total"]}
  sides = {"full": bench_learner.ours_step(full, batch),
           "lora": bench_learner.ours_step(adapted, batch)}
  first = {}
  for name, fn in sides.items():
    t0 = time.perf_counter()
    first[name] = fn()
    log(f"{name}: first step {time.perf_counter() - t0:.1f}s loss {first[name]:.5f}")
  times = bench_learner.alternate(sides, args.repeats, args.rounds)
  med = {k: statistics.median(v["steady"]) for k, v in times.items()}
  del sides, full, adapted
  gc.collect()
  return {
      "rows": args.rows, "row_len": T, "real_tokens": real, "rank": args.rank,
      "adapter_params": int(n_adapter), "full_params": int(n_full),
      "full_step_s": med["full"], "lora_step_s": med["lora"],
      "lora_over_full_step": med["lora"] / med["full"],
      "full_steps_s": [round(x, 2) for x in times["full"]["steady"]],
      "lora_steps_s": [round(x, 2) for x in times["lora"]["steady"]],
      "first_loss_full": first["full"], "first_loss_lora": first["lora"],
      "xla_peak_bytes": {k: v["peak_bytes"] for k, v in mem.items()},
      "xla_memory": mem, "plan_bytes": plan,
      "lora_over_full_peak": mem["lora"]["peak_bytes"] / mem["full"]["peak_bytes"],
  }


def engine_part(args) -> dict:
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from rao_jax.model import load_pretrained
  from rao_jax.model import lora as lora_lib
  model, _ = load_pretrained("smollm2-135m", dtype="float32")
  lora_lib.add_adapters(model, {"rank": args.rank, "alpha": 2.0 * args.rank})
  rng = np.random.default_rng(0)
  for name, var in vars(model.lora).items():
    if name.endswith("_b"):
      var[...] = jnp.asarray(rng.normal(0, 0.01, var.shape), jnp.float32)
  merged = model.inference_params()
  # Applied: the base weights per layer, with the adapter's arrays beside them.
  base = nnx.merge(*nnx.split(model))
  del base.lora
  base.cfg = dataclasses.replace(model.cfg, lora=lora_lib.LoraConfig())
  applied = base.inference_params()
  adapter = model.lora.arrays()
  for i, layer in enumerate(applied["layers"]):
    layer.update({k: v[i] for k, v in adapter.items()})
  fwd = model.inference_fns()
  S = 1024

  @jax.jit
  def decode(params, tokens, cache, pos):
    h, cache = fwd(params, tokens, pos, cache, pos[:, 0])
    return fwd.logits(params, h), cache

  out = {}
  for B in (8, 32):
    cache = model.init_cache(B, S)
    tokens = jnp.ones((B, 1), jnp.int32)
    pos = jnp.full((B, 1), S // 2, jnp.int32)
    sides = {}
    for name, params in (("merged", merged), ("applied", applied)):
      def step(params=params):
        logits, _ = decode(params, tokens, cache, pos)
        jax.block_until_ready(logits)
      step()
      sides[name] = step
    # Agreement: both compute the same logits.
    lm = decode(merged, tokens, cache, pos)[0]
    la = decode(applied, tokens, cache, pos)[0]
    times = bench_learner.alternate(sides, args.decode_repeats, args.rounds)
    med = {k: statistics.median(v["steady"]) for k, v in times.items()}
    out[f"batch{B}"] = {"merged_s": med["merged"], "applied_s": med["applied"],
                        "applied_over_merged": med["applied"] / med["merged"],
                        "max_abs_logit_diff": float(jnp.abs(lm - la).max())}
    log(f"decode B={B}: merged {med['merged'] * 1e3:.1f} ms, applied "
        f"{med['applied'] * 1e3:.1f} ms")
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--rows", type=int, default=2)
  p.add_argument("--row_len", type=int, default=1024)
  p.add_argument("--repeats", type=int, default=2, help="steady learner steps per side a round")
  p.add_argument("--decode_repeats", type=int, default=10)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--skip_learner", action="store_true")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  import jax
  from rao_jax import host_memory
  host_memory.keep_freed_memory()
  t0 = time.perf_counter()
  result = {"bench": "lora", "model": "smollm2-135m", "dtype": "float32",
            "platform": jax.devices()[0].platform, "rank": args.rank,
            "targets": "q,k,v,o,gate,up,down"}
  result["engine_decode"] = engine_part(args)
  if not args.skip_learner:
    result["learner"] = learner_part(args)
  result.update(cpu=bench_peak.cpu_model(), load_avg_1m=round(os.getloadavg()[0], 2),
                minutes=round((time.perf_counter() - t0) / 60, 2))
  line = json.dumps(result)
  print(line)
  if args.out:
    with open(args.out, "w") as f:
      f.write(line + "\n")


if __name__ == "__main__":
  main()
