"""Where bench_model's gap is: the SmolLM2 training step's parts, rao_jax vs transformers.

Each part runs forward+backward (gradients for its weights and its input) on the same weights
and the same [B, T] activations in both frameworks, float32, in this one process, in
alternating rounds like bench_model.py (the first step after a switch dropped):

  mlp      one block's SwiGLU MLP (our ``_mlp``; the peer's ``LlamaMLP``)
  layer    one decoder block (our ``_block``; the peer's ``LlamaDecoderLayer``, SDPA attention)
  layers   all L blocks and the final norm (our ``forward_embeddings``; the peer's
           ``LlamaModel`` from input embeddings)
  head     the LM head and the mean token cross-entropy over given hidden states (our
           ``token_logprob_sum``; the peer's ``lm_head`` and ``cross_entropy``)

Both sides' losses must agree (relative difference <= 1e-3, recorded per part) or the script
stops. ``ratio`` per part is peer seconds / our seconds (above 1: we are faster). The last stdout
line is JSON; progress goes to stderr.

    python benchmarks/bench_model_parts.py [--batch 4] [--seq 512] [--rounds 3] [--steps 2]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import build_peer, log, timed   # noqa: E402  (a sibling script)


class HeadOnly:
  """What token_logprob_sum reads of a model: its config and its [V, D] head weight."""

  def __init__(self, w_VxD, cfg):
    self._w, self.cfg = w_VxD, cfg

  def head_weight(self):
    return self._w


def our_parts(model, x_BxTxD, targets_BxT):
  """name -> a function running that part's forward+backward once; returns the loss."""
  from rao_jax.model import token_logprob_sum, transformer
  cfg = model.cfg
  B, T, _ = x_BxTxD.shape
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  segments = jnp.ones((B, T), jnp.int32)
  mask = jnp.tril(jnp.ones((T, T), bool))[None].repeat(B, 0)
  cos, sin = transformer.rope_cos_sin(cfg, positions)
  stacked = model.layers.arrays()
  layer0 = {k: v[0] for k, v in stacked.items()}
  probe = x_BxTxD   # each part's loss is sum(out * probe): every output element gets a gradient
  coef = jnp.full((B, T), -1.0 / (B * T), jnp.float32)

  def mlp(p, x):
    return jnp.sum(transformer._mlp(x, p["w_gate"], p["w_up"], p["w_down"]) * probe)

  def layer(p, x):
    return jnp.sum(transformer._block(cfg, p, x, cos, sin, mask) * probe)

  def layers(model, x):
    return jnp.sum(model.forward_embeddings(x, positions, segments) * probe)

  def head(w, h):
    # The head weight enters as an argument so that its gradient is taken like the peer's.
    return token_logprob_sum(HeadOnly(w, cfg), h, targets_BxT, coef)[0]

  # Gradients for the blocks and the final norm only: the peer's embedding gets none either.
  graphdef, blocks, rest = nnx.split(model, lambda path, _: path[0] in ("layers", "final_norm"),
                                     ...)
  fns = {"mlp": (mlp, (layer0, x_BxTxD)),
         "layer": (layer, (layer0, x_BxTxD)),
         "layers": (lambda s, x: layers(nnx.merge(graphdef, s, rest), x), (blocks, x_BxTxD)),
         "head": (head, (model.head_weight(), x_BxTxD))}

  def run(step, args):
    return float(jax.block_until_ready(step(*args))[0])
  return {k: functools.partial(run, jax.jit(jax.value_and_grad(f, (0, 1))), a)
          for k, (f, a) in fns.items()}


def peer_parts(peer, x_BxTxD, targets_BxT):
  import torch
  B, T, D = x_BxTxD.shape
  probe = torch.from_numpy(np.array(x_BxTxD))   # a constant, as in our_parts
  x = probe.clone().requires_grad_(True)
  targets = torch.from_numpy(np.asarray(targets_BxT, np.int64)).reshape(-1)
  positions = torch.arange(T)[None].expand(B, T)
  rope = peer.model.rotary_emb(x, positions)
  block = peer.model.layers[0]

  def run(fn):
    def step():
      peer.zero_grad(set_to_none=True)
      x.grad = None
      loss = fn()
      loss.backward()
      return loss.item()
    return step

  def layer_out():
    out = block(x, position_ids=positions, position_embeddings=rope)
    return out[0] if isinstance(out, tuple) else out

  def head():
    logits = peer.lm_head(x.reshape(B * T, D))
    return torch.nn.functional.cross_entropy(logits.float(), targets)

  return {"mlp": run(lambda: (block.mlp(x) * probe).sum()),
          "layer": run(lambda: (layer_out() * probe).sum()),
          "layers": run(lambda: (peer.model(inputs_embeds=x, use_cache=False)
                                 .last_hidden_state * probe).sum()),
          "head": run(head)}


def main():
  from rao_jax import host_memory   # before JAX starts: freed step buffers are reused, not
  host_memory.keep_freed_memory()   # returned to the OS and page-faulted in again each step
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=2, help="steady steps per side per round")
  parser.add_argument("--parts", default="mlp,layer,head,layers")
  args = parser.parse_args()
  from rao_jax.model import load_model
  model = load_model("smollm2-135m", dtype="float32")
  peer = build_peer(model)
  rng = np.random.default_rng(0)
  # Unit-RMS activations, like the residual stream after a norm.
  x = rng.standard_normal((args.batch, args.seq, model.cfg.d_model)).astype(np.float32)
  targets = rng.integers(0, model.cfg.vocab_size, (args.batch, args.seq))
  ours, theirs = our_parts(model, jnp.asarray(x), jnp.asarray(targets)), peer_parts(peer, x, targets)
  result = {"benchmark": "model_parts_fwd_bwd_smollm2_135m_f32", "batch": args.batch,
            "seq": args.seq}
  for part in args.parts.split(","):
    # Warm-up, and a check that both sides compute the same loss (float32 rounding apart).
    loss_ours, loss_peer = ours[part](), theirs[part]()
    rel = abs(loss_ours - loss_peer) / max(abs(loss_peer), 1e-12)
    if rel > 1e-3:
      raise SystemExit(f"{part}: our loss {loss_ours} differs from the peer's {loss_peer}")
    t_ours, t_peer = [], []
    for _ in range(args.rounds):
      for fn, times in ((ours[part], t_ours), (theirs[part], t_peer)):
        fn()   # the first step after a switch is dropped (see bench_model.py)
        times.extend(timed(fn)[0] for _ in range(args.steps))
    o, p = statistics.median(t_ours), statistics.median(t_peer)
    log(f"{part}: ours {o:.3f}s peer {p:.3f}s ratio {p / o:.3f}")
    result.update({f"{part}_ours_s": round(o, 4), f"{part}_peer_s": round(p, 4),
                   f"{part}_ratio": round(p / o, 3), f"{part}_loss_rel_diff": float(f"{rel:.1e}")})
  print(json.dumps(result))


if __name__ == "__main__":
  main()
