"""Forward+backward of the mean token cross-entropy on SmolLM2-135M: rao_jax vs transformers.

Both run float32 on CPU over the same weights and the same batch (default 4 x 512 tokens):
ours is one jitted ``value_and_grad`` step over ``token_logprob_sum`` (what the learner runs
for the NLL and the RAO loss); the peer is transformers' LlamaForCausalLM on PyTorch
(``loss.backward()``). Both run in this one process, so both get the malloc configuration that
``import rao_jax`` applies (``host_malloc_reuse``; it speeds the peer up as well). The two run
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
rao_jax/host_memory.py), so a high count explains an outlier. Progress goes to stderr; the last
stdout line is JSON.

    python benchmarks/bench_model.py [--quick] [--batch 4] [--seq 512] [--steps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


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


def build_peer(model):
  """transformers' LlamaForCausalLM (SDPA attention, float32, train mode) with our weights."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  from rao_jax.model.weights import hf_state_dict
  torch.manual_seed(0)
  hf_cfg = LlamaConfig(**{k: v for k, v in model.cfg.to_hf_config().items()
                          if k not in ("architectures", "model_type", "torch_dtype")})
  hf_cfg._attn_implementation = "sdpa"
  peer = LlamaForCausalLM(hf_cfg)
  sd = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in hf_state_dict(model).items()}
  missing, unexpected = peer.load_state_dict(sd, strict=False)
  assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
  peer.tie_weights()
  # Dropout is 0 in this config; train() only matters for parity of code paths.
  return peer.float().train()


def make_peer(model, tokens_BxT, forward_only=False):
  import torch
  peer = build_peer(model)
  tokens = torch.from_numpy(np.asarray(tokens_BxT, np.int64))
  inputs, targets = tokens[:, :-1], tokens[:, 1:]

  def step():
    if forward_only:
      with torch.no_grad():
        logits = peer(input_ids=inputs, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1)).item()
    peer.zero_grad(set_to_none=True)
    logits = peer(input_ids=inputs, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1))
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
  ours, peer = make_ours(model, tokens), make_peer(model, tokens)
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
    f_ours, f_peer = make_ours(model, tokens, True), make_peer(model, tokens, True)
    f_ours(), f_peer()
    fo, fp = [], []
    for fn, times in ((f_ours, fo), (f_peer, fp)):   # one block each; its first step dropped
      times.extend(timed(fn)[0] for _ in range(args.steps + 2))
      del times[0]
    result.update(ours_forward_s=statistics.median(fo), peer_forward_s=statistics.median(fp),
                  ours_bwd_over_fwd=statistics.median(t_ours) / statistics.median(fo) - 1,
                  peer_bwd_over_fwd=statistics.median(t_peer) / statistics.median(fp) - 1)
  n_tok = args.batch * args.seq
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
            "cpu_kernels": mkl.backend(args.kernels), "cpu": mkl.cpuinfo("model name"), **result}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
