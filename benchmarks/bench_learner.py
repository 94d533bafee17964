"""Learner throughput vs an equivalent PyTorch training step, and packing efficiency.

Default (CPU, float32): SmolLM2-135M, packed rows of 1024 tokens from realistic RAO trees, the
RAO loss (per-node token mean, w_d * A / |M_v|), AdamW + global-norm clipping. Ours: the
`Learner` step (jitted, micro-batch scan). Peer: transformers' LlamaForCausalLM with the SAME
weights, the SAME packed rows (block-diagonal causal 4-D mask, per-segment position ids), the
same loss and optimizer, rows accumulated one at a time exactly like our micro-batches (each
choice is written at `torch_step`), in a process of its own (`peer_process`). The first step's losses of both are compared (they must
agree: same weights, same tokens). The sides alternate in rounds (`--rounds` of `--repeats`
steady steps each; the first step after a switch is reported apart), so machine drift hits
both; `ours_spread` is the largest deviation of one of our steady steps from their median.
`model_gflops` / `share_of_peak_gemm`: model FLOPs of our step per second, 3 x (2 x P x N +
4 x L x H x h x pairs), P the product parameters (layers and LM head), N the real tokens, pairs
the (query, key) pairs inside each packed segment (bench_peak.model_flops), over the best float32
GEMM that benchmarks/bench_peak.py measured on this CPU.

`--lora=R`: our full fine-tuning step against a rank-R LoRA adapter on the same rows: step time
(alternating rounds) and peak memory (XLA's analysis of each compiled step, and the memory plan's
estimate); `benchmarks/bench_lora.py` runs it beside the engine's merged-vs-applied decode.

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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peak  # noqa: E402  (this folder's: the machine's measured peak)


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def packing_report(vocab: int, row_len: int, micro: int, seed: int = 0):
  """Packing efficiency on a batch of RAO-like trees (4 tasks x 8 trees, runtime-like lengths)."""
  from rao_jax.learner import compute_rewards_and_advantages, pack_trees
  from rao_jax.learner.testing import synthetic_trees
  trees = synthetic_trees(num_groups=4, group_size=8, vocab=vocab, seed=seed, max_len=row_len,
                          mean_len=300, max_children=3, max_depth=3)
  adv = compute_rewards_and_advantages(trees, lam=0.5, baseline="loo", drop_equal_groups=False)
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


def ours_step(learner, batch: dict):
  """Our learner's step as a callable (its first call compiles)."""
  def step():
    return learner.step(batch)["loss"]   # host floats: the step has finished
  return step


def torch_step(hf_dir: str, batch: dict, lr: float):
  """The same step in transformers + PyTorch, set up as a PyTorch user would.

  Configuration, each choice as its users make it: `from_pretrained` of the exported folder,
  float32, SDPA attention (transformers' default on CPU) with the 4-D block-diagonal causal mask
  that packed rows need (each row's own segments; the same mask ours applies), PyTorch's default
  thread count (one per core: `torch.get_num_threads()` is logged), `torch.optim.AdamW` with the
  same hyper-parameters and `clip_grad_norm_`, and rows accumulated one at a time (ours runs
  micro-batches of one row). The log-softmax runs on the float32 logits, as ours.
  """
  import torch
  from transformers import LlamaForCausalLM
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
  return step


def peer_process(hf_dir: str, batch: dict, lr: float, workdir: str):
  """`torch_step` in a process of its own (no JAX there), driven over a pipe.

  In one process with ours, the two frameworks' thread pools, allocators and caches met: our
  first step after a switch took 32 s against 18 s steady, and a steady one 29 s. Apart, each
  side's process waits idle on a read while the other runs. Returns (step, close, info): step()
  runs one step there and returns its loss; info says the peer's PyTorch version and threads.
  """
  import subprocess  # pylint: disable=import-outside-toplevel
  path = os.path.join(workdir, "batch.npz")
  np.savez(path, **batch)
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--peer_worker", hf_dir,
                           path, repr(lr)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)

  def reply():
    line = proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the peer process ended (exit status {proc.wait()}); see its stderr")
    return json.loads(line)

  def step():
    proc.stdin.write("step\n")
    proc.stdin.flush()
    return reply()["loss"]

  def close():
    proc.stdin.close()
    proc.wait(timeout=120)

  return step, close, reply()


def peer_worker(hf_dir: str, batch_path: str, lr: float) -> None:
  """The peer process: builds `torch_step`, says it is ready, runs a step per line read."""
  import torch  # pylint: disable=import-outside-toplevel
  with np.load(batch_path) as f:
    batch = {k: f[k] for k in f.files}
  step = torch_step(hf_dir, batch, lr)
  print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads()}), flush=True)
  for line in sys.stdin:
    if line.strip() == "step":
      print(json.dumps({"loss": step()}), flush=True)


def alternate(sides: dict, steps: int, rounds: int) -> dict:
  """Each side runs `steps` steps in a row, then the next side; `rounds` such rounds.

  The first step of a side after a switch is kept apart (`after_switch`): both frameworks share
  the cores and the memory, so it pays for the other's caches and freed memory. Returns, per
  side, {"steady": [s, ...], "after_switch": [s, ...]}.
  """
  times = {k: {"steady": [], "after_switch": []} for k in sides}
  for r in range(rounds):
    for name, fn in sides.items():
      t0 = time.perf_counter()
      fn()
      times[name]["after_switch"].append(time.perf_counter() - t0)
      for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times[name]["steady"].append(time.perf_counter() - t0)
      log(f"round {r} {name}: after switch {times[name]['after_switch'][-1]:.2f}s, then "
          + " ".join(f"{t:.2f}" for t in times[name]["steady"][-steps:]))
  return times


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
  seg = batch["segment_ids_BxT"]
  lengths = [int((row == sid).sum()) for row in seg for sid in np.unique(row) if sid > 0]
  flops = bench_peak.model_flops(model.cfg, real, bench_peak.causal_pairs(lengths), train=True)
  with tempfile.TemporaryDirectory() as hf_dir:
    export_hf(model, model.cfg, None, hf_dir)
    learner = make_learner(model, batch, args.lr)
    del model   # the learner holds its own copy; keep the peak memory down
    gc.collect()
    ours = ours_step(learner, batch)
    peer, close_peer, info = peer_process(hf_dir, batch, args.lr, hf_dir)
    log(f"peer: PyTorch {info['torch']}, {info['threads']} threads, in its own process")
    try:
      t0 = time.perf_counter()
      ours_loss = ours()
      log(f"ours: first step (compile + run) {time.perf_counter() - t0:.1f}s, "
          f"loss {ours_loss:.6f}")
      t0 = time.perf_counter()
      peer_loss = peer()
      log(f"peer: first step {time.perf_counter() - t0:.1f}s, loss {peer_loss:.6f}")
      times = alternate({"ours": ours, "peer": peer}, args.repeats, args.rounds)
    finally:
      close_peer()
  med = {k: statistics.median(v["steady"]) for k, v in times.items()}
  ours_tps, peer_tps = tokens / med["ours"], tokens / med["peer"]
  spread = lambda xs, m: max(abs(x / m - 1) for x in xs)  # noqa: E731
  result = {
      "bench": "learner", "model": "smollm2-135m", "dtype": "float32",
      "platform": jax.devices()[0].platform, "rows": args.rows, "row_len": T,
      "loss": "rao", "steps_per_round": args.repeats, "rounds": args.rounds,
      "ours_step_s": med["ours"], "peer_step_s": med["peer"],
      "ours_steps_s": [round(x, 2) for x in times["ours"]["steady"]],
      "peer_steps_s": [round(x, 2) for x in times["peer"]["steady"]],
      "ours_spread": round(spread(times["ours"]["steady"], med["ours"]), 3),
      "peer_spread": round(spread(times["peer"]["steady"], med["peer"]), 3),
      "ours_after_switch_s": statistics.median(times["ours"]["after_switch"]),
      "peer_after_switch_s": statistics.median(times["peer"]["after_switch"]),
      "ours_tokens_per_s": ours_tps, "peer_tokens_per_s": peer_tps,
      "ratio": ours_tps / peer_tps,
      "first_loss_ours": ours_loss, "first_loss_peer": peer_loss,
      "first_loss_rel_diff": abs(ours_loss - peer_loss) / max(abs(peer_loss), 1e-12),
      # Model FLOPs (bench_peak.model_flops: real tokens, attention within each packed segment)
      # per second of our step, as a share of this machine's best GEMM.
      **bench_peak.shares(flops_per_s=flops / med["ours"]),
      "cpu": bench_peak.cpu_model(), "load_avg_1m": round(os.getloadavg()[0], 2),
  }
  result.update(pack)
  result["goals_met"] = {"ratio>=1.0": result["ratio"] >= 1.0,
                         "ours_spread<=0.10": result["ours_spread"] <= 0.10,
                         "packing_efficiency>=0.95": result["packing_efficiency"] >= 0.95}
  return result


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
  fpt = bench_peak.model_flops(cfg, seq, bench_peak.causal_pairs([seq]), train=True) / seq
  tps = rows * seq / step_s
  mfu = fpt * tps / (args.peak_tflops * 1e12)
  return {"bench": "learner_mfu", "platform": jax.devices()[0].platform,
          "device": str(jax.devices()[0].device_kind), "params": n_params, "seq": seq,
          "rows": rows, "dtype": "bfloat16 (float32 master weights)", "remat": args.remat,
          "step_s": step_s, "tokens_per_s": tps, "model_flops_per_token": fpt,
          "peak_tflops": args.peak_tflops, "mfu": mfu, "smoke": bool(args.mfu_smoke),
          "goals_met": {"mfu>=0.40": mfu >= 0.40}}


def main():
  if len(sys.argv) == 5 and sys.argv[1] == "--peer_worker":
    peer_worker(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    return
  from rao_jax import host_memory   # before JAX starts: freed step buffers are reused, not
  host_memory.keep_freed_memory()   # returned to the OS and page-faulted in again each step
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="1 row, 2 timed steps")
  p.add_argument("--rows", type=int, default=None,
                 help="rows per step (default 2 rows of 1024; --mfu: 8 rows of --seq)")
  p.add_argument("--repeats", type=int, default=2,
                 help="timed steady steps per side per round (median over all reported)")
  p.add_argument("--rounds", type=int, default=2, help="alternating rounds (ours, then peer)")
  p.add_argument("--lr", type=float, default=1e-5)
  p.add_argument("--mfu", action="store_true", help="MFU of a ~1B config (GPU)")
  p.add_argument("--mfu_smoke", action="store_true", help="with --mfu: tiny config, for CPU")
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--micro_rows", type=int, default=4, help="--mfu: rows per micro-batch")
  p.add_argument("--remat", default="full", choices=("none", "full", "dots"))
  p.add_argument("--peak_tflops", type=float, default=989.0,
                 help="dense bf16 peak of the device (H100/H200 SXM: 989)")
  p.add_argument("--lora", type=int, default=0,
                 help="> 0: our full fine-tuning step against a LoRA adapter of this rank on "
                      "the same rows (time and peak memory; benchmarks/bench_lora.py)")
  args = p.parse_args()
  if args.rows is None:
    args.rows = 8 if args.mfu else 2
  if args.quick:
    args.rows, args.repeats, args.rounds = (args.micro_rows if args.mfu else 1), 2, 1
  if args.lora:
    import bench_lora   # noqa: E402  (this folder's)
    args.rank, args.row_len = args.lora, 1024
    result = {"bench": "learner_lora", **bench_lora.learner_part(args)}
  elif args.mfu:
    result = run_mfu(args)
  else:
    result = run_default(args)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
