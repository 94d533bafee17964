"""Forward+backward of the mean token cross-entropy on SmolLM2-135M: rao_jax vs transformers.

Both run float32 on CPU over the same weights and the same batch (default 4 x 512 tokens):
ours is one jitted ``value_and_grad`` step over ``token_logprob_sum`` (what the learner runs
for the NLL and the RAO loss); the peer is what a transformers user writes:
``LlamaForCausalLM.from_pretrained`` of the same weights (float32, default SDPA attention,
PyTorch's default threads) and ``model(input_ids, labels=input_ids).loss.backward()``. Both run
in this one process, so both get the malloc configuration that ``host_memory.keep_freed_memory``
applies (it speeds the peer up as well). The two run
in alternating rounds (so machine drift hits both); each round runs one side ``--steps`` times
in a row, then the other. The first step of a side
after a switch is reported apart (``*_after_switch_s``): measured here, our step right after a
PyTorch step is 20-25% slower than after one of ours (both frameworks share the two cores and
the memory), so mixing them would measure the switch, not either side. ``ratio`` compares the
steady steps; ``ratio_after_switch`` the first ones. Medians after warm-up. ``cpu_kernels``
says which kernels ran our float32 products and attention (``mkl`` or ``xla``:
rao_jax/kernels/mkl.py; ``--kernels=xla`` times XLA's own), ``cpu`` the
CPU model they were chosen for. ``*_faults_max``: the most page faults one steady step took;
a step that maps its memory afresh pays 0.2-0.6M of them and seconds (see
rao_jax/host_memory.py), so a high count explains an outlier. ``model_gflops`` and
``share_of_peak_gemm``: model FLOPs of our step per second, 3 x (2 x P x B x T + 4 x L x H x h x
B x T (T + 1) / 2) with P the product parameters (layers and LM head; bench_peak.model_flops),
over the best float32 GEMM that bench_peak.py measured on this CPU. Progress goes to stderr; the last
stdout line is JSON.

    python benchmarks/bench_model.py [--quick] [--batch 4] [--seq 512] [--steps 5]
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peak  # noqa: E402  (this folder's: the machine's measured peak)


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def make_ours(model, tokens_BxT, forward_only=False):
  from rao_jax.model import token_logprob_sum
  graphdef, state = nnx.split(model)
  B, T = tokens_BxT.shape
  positions = jnp.broadcast_to(jnp.arange(T - 1), (B, T - 1))
  segments = jnp.ones((B, T - 1), jnp.int32)
  coef = jnp.full((B, T - 1), -1.0 / (B * (T - 1)), jnp.float32)   # the mean NLL

  def loss_fn(state, tokens):
    # What the learner runs for the NLL and the RAO loss (linear in the log-probs).
    m = nnx.merge(graphdef, state)
    hidden = m(tokens[:, :-1], positions, segments)
    return token_logprob_sum(m, hidden, tokens[:, 1:], coef)[0]

  fn = jax.jit(loss_fn if forward_only else jax.value_and_grad(loss_fn))
  tokens = jnp.asarray(tokens_BxT)

  def step():
    return jax.block_until_ready(fn(state, tokens))
  return step


def build_peer(model, hf_dir: str):
  """The peer as a PyTorch user sets it up: `from_pretrained` of our weights exported as an HF
  folder, float32, transformers' default attention on CPU (SDPA), train mode, PyTorch's default
  threads (one per core; logged)."""
  import torch
  from transformers import LlamaForCausalLM
  from rao_jax.model.weights import export_hf
  export_hf(model, model.cfg, None, hf_dir)
  peer = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  # Dropout is 0 in this config; train() only matters for parity of code paths.
  return peer.train()


def make_peer(model, tokens_BxT, hf_dir: str, forward_only=False):
  """The user's step: `model(input_ids, labels=input_ids).loss.backward()` (transformers shifts
  the labels and takes the mean token cross-entropy in float32: the same loss as ours)."""
  import torch
  peer = build_peer(model, hf_dir)
  tokens = torch.from_numpy(np.asarray(tokens_BxT, np.int64))

  def step():
    if forward_only:
      with torch.no_grad():
        return peer(input_ids=tokens, labels=tokens, use_cache=False).loss.item()
    peer.zero_grad(set_to_none=True)
    loss = peer(input_ids=tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    return loss.item()
  return step


# Pause before each timed step, untimed. XLA:CPU frees a run's temporaries (2.5 GB here) on its
# own thread just after the outputs are ready; a step dispatched at once can find them still
# held, and then grows the heap by a second block: a 0.6M page-fault storm (+4 s). Measured here
# (AMD EPYC, 8 steps of ours alone): back to back, 3 such steps and 9.4 GB resident; with 0.3 s
# between steps, none and 4.3 GB. In training, rollouts separate the learner's steps anyway.
SETTLE_S = 0.3


def timed(fn, settle_s: float = SETTLE_S):
  """(seconds fn() took, its result), after an untimed pause of ``settle_s``."""
  time.sleep(settle_s)
  t0 = time.perf_counter()
  out = fn()
  return time.perf_counter() - t0, out


def faults() -> int:
  """Minor page faults of this process so far: a step that grows the heap pays ~0.6M of them."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--steps", type=int, default=2, help="steady steps per side per round")
  parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--quick", action="store_true", help="batch 2 x 256, 3 steps")
  parser.add_argument("--forward", action="store_true", help="also time forward-only steps")
  parser.add_argument("--kernels", default="auto", choices=("auto", "mkl", "xla"),
                      help="ModelConfig.kernels: our CPU products and attention")
  args = parser.parse_args()
  if args.quick:
    args.batch, args.seq, args.steps, args.warmup, args.rounds = 2, 256, 2, 1, 1
  import torch
  from rao_jax import host_memory
  from rao_jax.kernels import mkl
  from rao_jax.model import load_model
  # Importing rao_jax no longer changes malloc (host_memory.py): a CPU benchmark asks for it,
  # before JAX starts its backends, or every step page-faults its temporaries afresh.
  host_memory.keep_freed_memory()
  log(f"jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cpus), "
      f"torch {torch.__version__} with {torch.get_num_threads()} threads")
  t0 = time.time()
  model = load_model("smollm2-135m", dtype="float32", kernels=args.kernels)
  log(f"loaded SmolLM2-135M in {time.time() - t0:.1f}s")
  tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size,
                                             (args.batch, args.seq + 1))
  hf_dir = tempfile.mkdtemp(prefix="bench_model_hf_")
  atexit.register(shutil.rmtree, hf_dir, ignore_errors=True)
  ours, peer = make_ours(model, tokens), make_peer(model, tokens, hf_dir)
  t0 = time.time()
  loss_ours = float(ours()[0])
  log(f"ours: compiled + first step in {time.time() - t0:.1f}s, loss {loss_ours:.4f}")
  loss_peer = peer()
  log(f"peer loss {loss_peer:.4f} (|diff| {abs(loss_ours - loss_peer):.2e})")
  for _ in range(args.warmup):
    ours(), peer()
  t_ours, t_peer, s_ours, s_peer = [], [], [], []
  flt = {"ours": [], "peer": []}   # page faults per steady step
  for r in range(args.rounds):
    for fn, first, steady, name in ((ours, s_ours, t_ours, "ours"), (peer, s_peer, t_peer, "peer")):
      first.append(timed(fn)[0])
      for _ in range(args.steps):
        f0 = faults()
        steady.append(timed(fn)[0])
        flt[name].append(faults() - f0)
      log(f"round {r} {name}: after switch {first[-1]:.3f}s, then "
          + " ".join(f"{t:.3f}" for t in steady[-args.steps:])
          + f" ({' '.join(str(f) for f in flt[name][-args.steps:])} page faults)")
  result = {}
  if args.forward:
    f_ours, f_peer = make_ours(model, tokens, True), make_peer(model, tokens, hf_dir, True)
    f_ours(), f_peer()
    fo, fp = [], []
    for fn, times in ((f_ours, fo), (f_peer, fp)):   # one block each; its first step dropped
      times.extend(timed(fn)[0] for _ in range(args.steps + 2))
      del times[0]
    result.update(ours_forward_s=statistics.median(fo), peer_forward_s=statistics.median(fp),
                  ours_bwd_over_fwd=statistics.median(t_ours) / statistics.median(fo) - 1,
                  peer_bwd_over_fwd=statistics.median(t_peer) / statistics.median(fp) - 1)
  n_tok = args.batch * args.seq
  # Model FLOPs of the step (bench_peak.model_flops: forward + backward over the batch's
  # B x T predicted tokens, causal attention) per second of ours, as a share of the machine's
  # best GEMM (bench_peak.py).
  flops = bench_peak.model_flops(model.cfg, n_tok, bench_peak.causal_pairs([args.seq] * args.batch),
                                 train=True)
  ours_tps = n_tok / statistics.median(t_ours)
  peer_tps = n_tok / statistics.median(t_peer)
  result = {"benchmark": "model_fwd_bwd_smollm2_135m_f32", "batch": args.batch,
            "seq": args.seq, "steps": args.steps, "ours_step_s": statistics.median(t_ours),
            "peer_step_s": statistics.median(t_peer), "ours_tokens_per_s": round(ours_tps, 1),
            "peer_tokens_per_s": round(peer_tps, 1), "ratio": round(ours_tps / peer_tps, 3),
            "ours_after_switch_s": statistics.median(s_ours),
            "peer_after_switch_s": statistics.median(s_peer),
            "ratio_after_switch": round(statistics.median(s_peer) / statistics.median(s_ours), 3),
            "loss_ours": loss_ours, "loss_peer": loss_peer,
            "ours_faults_max": max(flt["ours"]), "peer_faults_max": max(flt["peer"]),
            "host_malloc_reuse": host_memory.in_effect(),
            "cpu_kernels": mkl.backend(args.kernels), "cpu": mkl.cpuinfo("model name"),
            "peer_threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2),
            **bench_peak.shares(flops_per_s=flops / statistics.median(t_ours)),
            "peer_share_of_peak_gemm": bench_peak.shares(
                flops_per_s=flops / statistics.median(t_peer)).get("share_of_peak_gemm"),
            **result}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
