"""Learner throughput vs an equivalent PyTorch training step, and packing efficiency.

Default (CPU, float32): SmolLM2-135M, packed rows of 1024 tokens from realistic RAO trees, the
RAO loss (per-node token mean, w_d * A / |M_v|), AdamW + global-norm clipping. Ours: the
`Learner` step (jitted, micro-batch scan). Peer: transformers' LlamaForCausalLM with the SAME
weights, the SAME packed rows (block-diagonal causal 4-D mask, per-segment position ids), the
same loss and optimizer, rows accumulated one at a time exactly like our micro-batches. The
first step's losses of both are compared (they must agree: same weights, same tokens).

`--mfu` (GPU): model FLOPs utilisation of the learner step for a ~1B Llama configuration at
sequence 4096 in bfloat16 (float32 master weights). This session had no GPU, so that mode was
only exercised here with `--mfu --mfu_smoke` (a shrunken config on CPU) for correctness.

Prints progress to stderr and ONE final JSON line to stdout.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def packing_report(vocab: int, row_len: int, micro: int, seed: int = 0):
  """Packing efficiency on a batch of RAO-like trees (4 tasks x 8 trees, runtime-like lengths)."""
  from rao_jax.learner import compute_rewards_and_advantages, pack_trees
  from rao_jax.learner.testing import synthetic_trees
  trees = synthetic_trees(num_groups=4, group_size=8, vocab=vocab, seed=seed, max_len=row_len,
                          mean_len=300, max_children=3, max_depth=3)
  adv = compute_rewards_and_advantages(trees, lam=0.5)
  fine = tuple(range(micro, 513, micro))   # every multiple of the micro-batch (recommended)
  pow2 = tuple(micro * 2 ** i for i in range(10))
  b_fine = pack_trees(trees, adv, row_len, fine)
  b_pow2 = pack_trees(trees, adv, row_len, pow2)
  n_nodes = sum(len(t.nodes) for t in trees)
  log(f"packing: {len(trees)} trees, {n_nodes} nodes, {int(b_fine.stats['real_tokens'])} tokens "
      f"-> {b_fine.num_rows_used} rows used; efficiency {b_fine.packing_efficiency:.4f} "
      f"(buckets every {micro} rows), {b_pow2.packing_efficiency:.4f} (power-of-two buckets)")
  return {"packing_efficiency": b_fine.packing_efficiency,
          "packing_efficiency_pow2_buckets": b_pow2.packing_efficiency,
          "row_fill": b_fine.stats["row_fill"], "packing_trees": len(trees),
          "packing_nodes": n_nodes}, b_fine


def throughput_batch(packed, rows: int) -> dict:
  """The first `rows` (fullest) rows of a packed batch, as step arrays."""
  arrays = packed.arrays()
  return {k: (v[:rows].copy() if np.ndim(v) == 2 else v) for k, v in arrays.items()}


def make_learner(model, batch: dict, lr: float):
  from rao_jax.learner import Learner, LearnerConfig
  rows, T = batch["tokens_BxT"].shape
  cfg = LearnerConfig(row_len=T, micro_batch_rows=1, bucket_rows=(rows,), lr=lr, grad_clip=1.0,
                      b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0)
  return Learner(cfg, model.cfg, params=model)


def bench_ours(learner, batch: dict, repeats: int) -> tuple[float, float]:
  import jax
  t0 = time.perf_counter()
  first = learner.step(batch)
  log(f"ours: first step (compile + run) {time.perf_counter() - t0:.1f}s, loss {first['loss']:.6f}")
  times = []
  for i in range(repeats):
    t0 = time.perf_counter()
    m = learner.step(batch)   # returns host floats: the step has finished
    times.append(time.perf_counter() - t0)
    log(f"ours: step {i + 1}/{repeats} {times[-1]:.2f}s loss {m['loss']:.6f}")
  jax.clear_caches()
  return statistics.median(times), first["loss"]


def bench_torch(hf_dir: str, batch: dict, repeats: int, lr: float, threads: int
                ) -> tuple[float, float]:
  import torch
  from transformers import LlamaForCausalLM
  torch.set_num_threads(threads)
  model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                           attn_implementation="sdpa")
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                          weight_decay=0.0)
  tok = torch.from_numpy(batch["tokens_BxT"].astype(np.int64))
  tgt = torch.from_numpy(batch["targets_BxT"].astype(np.int64))
  pos = torch.from_numpy(batch["positions_BxT"].astype(np.int64))
  seg = torch.from_numpy(batch["segment_ids_BxT"].astype(np.int64))
  lmask = torch.from_numpy(batch["loss_mask_BxT"])
  coef = torch.from_numpy(batch["coef_BxT"])
  normalizer = float(batch["normalizer"])
  T = tok.shape[1]
  causal = torch.tril(torch.ones(T, T, dtype=torch.bool))

  def step():
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for r in range(tok.shape[0]):   # one row per micro-batch, as ours
      mask = ((seg[r, :, None] == seg[r, None, :]) & causal)[None, None]
      logits = model(tok[r:r + 1], attention_mask=mask, position_ids=pos[r:r + 1]).logits
      logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tgt[r:r + 1, :, None])[..., 0]
      loss = -(torch.where(lmask[r:r + 1], coef[r:r + 1] * logp, 0.0)).sum() / normalizer
      loss.backward()
      total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return total

  t0 = time.perf_counter()
  first = step()
  log(f"peer: first step {time.perf_counter() - t0:.1f}s, loss {first:.6f}")
  times = []
  for i in range(repeats):
    t0 = time.perf_counter()
    loss = step()
    times.append(time.perf_counter() - t0)
    log(f"peer: step {i + 1}/{repeats} {times[-1]:.2f}s loss {loss:.6f}")
  return statistics.median(times), first


def run_default(args) -> dict:
  import jax
  from rao_jax.model import load_pretrained
  from rao_jax.model.weights import export_hf
  T = 1024
  model, tokenizer = load_pretrained("smollm2-135m", dtype="float32")
  log(f"model: SmolLM2-135M float32, {jax.device_count()} device(s) {jax.devices()[0].platform}")
  pack, packed = packing_report(model.cfg.vocab_size, T, micro=4)
  batch = throughput_batch(packed, args.rows)
  tokens = args.rows * T
  real = int((batch["segment_ids_BxT"] > 0).sum())
  log(f"throughput batch: {args.rows} rows x {T} = {tokens} tokens ({real} real), "
      f"{int(batch['loss_mask_BxT'].sum())} loss tokens")
  with tempfile.TemporaryDirectory() as hf_dir:
    export_hf(model, model.cfg, None, hf_dir)
    learner = make_learner(model, batch, args.lr)
    del model   # the learner holds its own copy; keep the peak memory down
    gc.collect()
    ours_s, ours_loss = bench_ours(learner, batch, args.repeats)
    del learner
    gc.collect()
    peer_s, peer_loss = bench_torch(hf_dir, batch, args.repeats, args.lr,
                                    threads=os.cpu_count() or 1)
  ours_tps, peer_tps = tokens / ours_s, tokens / peer_s
  result = {
      "bench": "learner", "model": "smollm2-135m", "dtype": "float32",
      "platform": jax.devices()[0].platform, "rows": args.rows, "row_len": T,
      "loss": "rao", "repeats": args.repeats,
      "ours_step_s": ours_s, "peer_step_s": peer_s,
      "ours_tokens_per_s": ours_tps, "peer_tokens_per_s": peer_tps,
      "ratio": ours_tps / peer_tps,
      "first_loss_ours": ours_loss, "first_loss_peer": peer_loss,
      "first_loss_rel_diff": abs(ours_loss - peer_loss) / max(abs(peer_loss), 1e-12),
  }
  result.update(pack)
  result["goals_met"] = {"ratio>=1.0": result["ratio"] >= 1.0,
                         "packing_efficiency>=0.95": result["packing_efficiency"] >= 0.95}
  return result


def model_flops_per_token(cfg, seq: int) -> float:
  """Training FLOPs per token: 6 x (matmul parameters) + causal attention (PaLM, halved)."""
  D, F, L, H, K, h, V = (cfg.d_model, cfg.mlp_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                         cfg.head_dim, cfg.vocab_size)
  per_layer = D * H * h + 2 * D * K * h + H * h * D + 3 * D * F
  matmul_params = L * per_layer + V * D   # the LM head (tied or not) is one V x D matmul
  attention = 12 * L * H * h * seq / 2    # QK^T and AV, forward + backward, causal half
  return 6 * matmul_params + attention


def run_mfu(args) -> dict:
  import jax
  from rao_jax.learner import Learner, LearnerConfig
  from rao_jax.model.config import ModelConfig
  seq = args.seq
  base = dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
              head_dim=64, mlp_dim=8192, rope_theta=500000.0, tie_embeddings=True,
              param_dtype="float32", dtype="bfloat16", remat=args.remat, max_seq_len=seq)
  if args.mfu_smoke:   # a CPU-sized stand-in, only to exercise this code path
    base.update(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
                mlp_dim=1024)
  cfg = ModelConfig(**base)
  rows = args.rows
  lcfg = LearnerConfig(row_len=seq, micro_batch_rows=args.micro_rows, bucket_rows=(rows,),
                       lr=1e-5)
  log(f"mfu: {cfg.n_layers}L D={cfg.d_model} V={cfg.vocab_size}, seq {seq}, {rows} rows, "
      f"micro {args.micro_rows}, remat {args.remat}, {jax.devices()[0]}")
  from rao_jax.learner.testing import init_params
  learner = Learner(lcfg, cfg, params=init_params(cfg, 0))
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(learner.params))
  rng = np.random.default_rng(0)
  # One full-length trajectory per row (the standard MFU setting), the second half generated.
  tokens = rng.integers(1, cfg.vocab_size, size=(rows, seq)).astype(np.int32)
  positions = np.tile(np.arange(seq, dtype=np.int32), (rows, 1))
  segments = np.ones((rows, seq), np.int32)
  targets = np.roll(tokens, -1, axis=1)
  loss_mask = (positions >= seq // 2) & (positions < seq - 1)
  batch = {"tokens_BxT": tokens, "targets_BxT": targets, "positions_BxT": positions,
           "segment_ids_BxT": segments, "loss_mask_BxT": loss_mask,
           "coef_BxT": np.where(loss_mask, 1e-3, 0.0).astype(np.float32),
           "kl_weight_BxT": np.zeros((rows, seq), np.float32),
           "rollout_logp_BxT": np.zeros((rows, seq), np.float32),
           "normalizer": np.float32(rows)}
  t0 = time.perf_counter()
  learner.step(batch)
  log(f"mfu: first step (compile + run) {time.perf_counter() - t0:.1f}s")
  times = []
  for i in range(args.repeats):
    t0 = time.perf_counter()
    learner.step(batch)
    times.append(time.perf_counter() - t0)
    log(f"mfu: step {i + 1}/{args.repeats} {times[-1]:.3f}s")
  step_s = statistics.median(times)
  fpt = model_flops_per_token(cfg, seq)
  tps = rows * seq / step_s
  mfu = fpt * tps / (args.peak_tflops * 1e12)
  return {"bench": "learner_mfu", "platform": jax.devices()[0].platform,
          "device": str(jax.devices()[0].device_kind), "params": n_params, "seq": seq,
          "rows": rows, "dtype": "bfloat16 (float32 master weights)", "remat": args.remat,
          "step_s": step_s, "tokens_per_s": tps, "model_flops_per_token": fpt,
          "peak_tflops": args.peak_tflops, "mfu": mfu, "smoke": bool(args.mfu_smoke),
          "goals_met": {"mfu>=0.40": mfu >= 0.40}}


def main():
  from rao_jax import host_memory   # before JAX starts: freed step buffers are reused, not
  host_memory.keep_freed_memory()   # returned to the OS and page-faulted in again each step
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="1 row, 2 timed steps")
  p.add_argument("--rows", type=int, default=None,
                 help="rows per step (default 2 rows of 1024; --mfu: 8 rows of --seq)")
  p.add_argument("--repeats", type=int, default=3, help="timed steps (median reported)")
  p.add_argument("--lr", type=float, default=1e-5)
  p.add_argument("--mfu", action="store_true", help="MFU of a ~1B config (GPU)")
  p.add_argument("--mfu_smoke", action="store_true", help="with --mfu: tiny config, for CPU")
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--micro_rows", type=int, default=4, help="--mfu: rows per micro-batch")
  p.add_argument("--remat", default="full", choices=("none", "full", "dots"))
  p.add_argument("--peak_tflops", type=float, default=989.0,
                 help="dense bf16 peak of the device (H100/H200 SXM: 989)")
  args = p.parse_args()
  if args.rows is None:
    args.rows = 8 if args.mfu else 2
  if args.quick:
    args.rows, args.repeats = (args.micro_rows if args.mfu else 1), 2
  if args.mfu:
    result = run_mfu(args)
  else:
    result = run_default(args)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
