"""Where the embedded engine's batch-32 decode step goes, and the floor under it on this CPU.

    python benchmarks/bench_decode_floor.py

bench_rollout's ratio_b32 goal (2.0x transformers on PyTorch) needs a decode step of
1000 * 32 / (2 * torch tok/s) ms. This measures, on SmolLM2-135M float32:

1. the engine's jitted decode step over 32 rows at cache lengths 64, 384 and 768, with XLA's
   attention over the whole window (the step minus its attention is the intercept; attention
   over 384 slots is the slope times 384);
2. the step's weight products alone, as a chain over the 30 layers at M = 32 rows (q/k/v/o, gate/up,
   down), in one jitted XLA program, in PyTorch and in numpy's BLAS: what any engine on this
   machine pays per step for the weights (plus the LM head, timed the same way);
3. the decode attention alone (all layers, 32 rows, 384 slots) in XLA, as memory bandwidth;
4. with `--trees` (a held-out evaluation's trees.jsonl; default: the recursion experiment's
   warm-start evaluation, the workload of bench_eval.py), the floor under that evaluation's
   decode: every generated token in a full batch of 32 rows, each row's attention reading only
   the positions it has (not the whole window), at this CPU's peaks (bench_peak.py) and at the
   rates XLA reaches here (2 and 3), beside the engine's own step (at the 2,048-slot window it
   is configured with, and at 64 slots plus attention over the live slots), 32 rows always
   full. Prefill, cells and partly filled batches are left out, so each figure is below what a
   run of that engine could take;
5. the decode attention over live slots (``rao_jax.kernels.decode``: the C++ FFI kernel on this
   CPU) against XLA's attention over the whole window, in alternating rounds in one process:
   the engine's decode step at the 2,048-slot window with every row holding the evaluation's
   mean context (with ``--trees``; else 2,048 - 40 slots), each way. With ``--trees`` the
   evaluation's decode at the kernel's step is set against the live-slot floor of 4
   (``engine_kernel_over_live_floor``; the issue's goal: at most 1.15).

``--quick`` checks that it runs: fewer repeats and rounds, figures not for reporting.

Progress goes to stderr; the last stdout line is one JSON object. Medians over repeats.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peak  # noqa: E402  (this folder's: the machine's measured peak)

ROWS = 32
WINDOW = 2048   # the engine's cache window of the evaluation (its length bucket)
EVAL_TREES = "runs/recursion/recursive/eval_before/trees.jsonl"
EVAL_GOAL_S = 8 * 60   # the held-out evaluation goal: 64 recursive trees in 8 minutes


def say(*a):
  print(*a, file=sys.stderr, flush=True)


def median_s(fn, n):
  fn()
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def decode_steps(model, repeats=12):
  """ms of the engine's decode step with XLA's attention over the whole window (the engine
  before the live-slot kernel, so these figures keep their meaning across runs), per cache
  length, every row holding the length less 40 slots."""
  import jax
  import jax.numpy as jnp
  from rao_jax.model.transformer import CachedForward
  from rao_jax.rollout.engine import programs
  params, fns = model.inference_params(), CachedForward(model.cfg.replace(kernels="xla"))
  step = functools.partial(programs.decode, fns, 1)
  out = {}
  for S in (64, 384, 768, WINDOW):
    state = {"cache": model.init_cache(batch_size=ROWS, max_len=S)}
    R = ROWS
    # Row r is page r, of S slots (one page per row: the window): the engine's decode program.
    args = (programs.DecodeBatch(jnp.ones((R,), jnp.int32), jnp.full((R,), S - 40, jnp.int32),
                                 jnp.ones((R,), bool), jnp.arange(R, dtype=jnp.int32)[:, None]),
            programs.sampling_arrays(R))

    def run():
      state["cache"], toks, _ = step(params, state["cache"], *args)
      jax.block_until_ready(toks)
    out[S] = median_s(run, repeats) * 1000
    say(f"decode step, {ROWS} rows, cache {S}: {out[S]:.1f} ms")
  return out


def kernel_ab(model, held: int, rounds: int, repeats: int) -> dict:
  """The engine's decode step at the WINDOW-slot cache with every row holding ``held`` slots,
  with the decode attention over live slots (the model's kernel choice, "auto") and with XLA's
  over the whole window ("xla"), in alternating rounds; medians of the rounds' medians, ms."""
  import jax
  import jax.numpy as jnp
  from rao_jax.model.transformer import CachedForward
  from rao_jax.rollout.engine import programs
  params = model.inference_params()
  R = ROWS
  batch = programs.DecodeBatch(jnp.ones((R,), jnp.int32), jnp.full((R,), held, jnp.int32),
                               jnp.ones((R,), bool), jnp.arange(R, dtype=jnp.int32)[:, None])
  arrays = programs.sampling_arrays(R)
  steps = {way: functools.partial(programs.decode,
                                  CachedForward(model.cfg.replace(kernels=choice)), 1)
           for way, choice in (("kernel", "auto"), ("xla", "xla"))}
  state = {"cache": model.init_cache(batch_size=R, max_len=WINDOW)}

  def run(way):
    # Decoding writes slot `held` each time: the rows keep their length across repeats.
    state["cache"], toks, _ = steps[way](params, state["cache"], batch, arrays)
    jax.block_until_ready(toks)
  times = {way: [] for way in steps}
  for r in range(rounds):
    for way in (("kernel", "xla") if r % 2 == 0 else ("xla", "kernel")):
      times[way].append(median_s(lambda: run(way), repeats) * 1000)
  out = {way: round(statistics.median(ts), 2) for way, ts in times.items()}
  say(f"decode step, {R} rows holding {held} slots of a {WINDOW}-slot cache: live-slot kernel "
      f"{out['kernel']} ms, XLA over the window {out['xla']} ms ({rounds} alternating rounds)")
  return {"rows": R, "held_slots": held, "window": WINDOW, "rounds": rounds,
          "kernel_step_ms": out["kernel"], "xla_step_ms": out["xla"],
          "xla_over_kernel": round(out["xla"] / out["kernel"], 3)}


def weight_products(cfg):
  """ms per step for the layers' weight products at M = ROWS: (xla, torch, numpy), and the
  LM head's (xla, torch, numpy)."""
  n_layers = cfg.n_layers
  import jax
  import jax.numpy as jnp
  import torch
  D, F, H, K, h = cfg.d_model, cfg.mlp_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  rng = np.random.default_rng(0)
  # (in, out) of each product in a layer: q, k, v, o, gate, up, down.
  shapes = [(D, H * h), (D, K * h), (D, K * h), (H * h, D), (D, F), (D, F), (F, D)]
  ws = [[(rng.standard_normal(s, np.float32) * 0.02) for s in shapes] for _ in range(n_layers)]
  xs = {n: rng.standard_normal((ROWS, n), np.float32) for n in {s[0] for s in shapes}}

  def chain(mm, ws, xs):
    acc = 0.0
    for layer in ws:
      for w in layer:
        acc = acc + mm(xs[w.shape[0]], w)[0, 0]   # every product's result is used
    return acc

  jws = [[jnp.asarray(w) for w in layer] for layer in ws]
  jxs = {n: jnp.asarray(x) for n, x in xs.items()}
  jchain = jax.jit(lambda ws, xs: chain(jnp.matmul, ws, xs))
  tws = [[torch.from_numpy(w) for w in layer] for layer in ws]
  txs = {n: torch.from_numpy(x) for n, x in xs.items()}
  layers = (median_s(lambda: jax.block_until_ready(jchain(jws, jxs)), 15) * 1000,
            median_s(lambda: chain(torch.matmul, tws, txs), 15) * 1000,
            median_s(lambda: chain(np.matmul, ws, xs), 15) * 1000)
  head = rng.standard_normal((D, cfg.vocab_size), np.float32) * 0.02
  jhead, thead = jnp.asarray(head), torch.from_numpy(head)
  x = xs[D]
  jx, tx = jnp.asarray(x), torch.from_numpy(x)
  jmm = jax.jit(jnp.matmul)
  heads = (median_s(lambda: jax.block_until_ready(jmm(jx, jhead)), 15) * 1000,
           median_s(lambda: torch.matmul(tx, thead), 15) * 1000,
           median_s(lambda: np.matmul(x, head), 15) * 1000)
  flops = 2 * ROWS * n_layers * sum(a * b for a, b in shapes)
  say(f"weight products x{n_layers} layers at M={ROWS} ({flops / 1e9:.1f} GFLOP): "
      f"xla {layers[0]:.1f} ms, torch {layers[1]:.1f} ms, numpy {layers[2]:.1f} ms; "
      f"LM head: xla {heads[0]:.1f}, torch {heads[1]:.1f}, numpy {heads[2]:.1f} ms")
  return layers, heads


def attention_alone(cfg, S=384):
  """ms and GB/s of the decode attention of all layers over ROWS rows and S slots."""
  n_layers = cfg.n_layers
  import jax
  import jax.numpy as jnp
  from rao_jax.model.transformer import _attention  # pylint: disable=protected-access
  K, H, h = cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
  rng = np.random.default_rng(0)
  ks = [jnp.asarray(rng.standard_normal((ROWS, K, h, S), np.float32)) for _ in range(n_layers)]
  vs = [jnp.asarray(rng.standard_normal((ROWS, K, S, h), np.float32)) for _ in range(n_layers)]
  q = jnp.asarray(rng.standard_normal((ROWS, 1, H, h), np.float32))
  visible = jnp.ones((ROWS, 1, S), bool)

  @jax.jit
  def run(q, ks, vs):
    x = q
    for k, v in zip(ks, vs):
      x = _attention(x, k, v, visible, jnp.float32) * 0.1 + q
    return x
  ms = median_s(lambda: jax.block_until_ready(run(q, ks, vs)), 15) * 1000
  gb = 2 * ROWS * K * h * S * 4 * n_layers / 1e9
  say(f"decode attention alone, {n_layers} layers x {ROWS} rows x {S} slots: {ms:.1f} ms "
      f"({gb / ms * 1000:.1f} GB/s over {gb:.2f} GB of keys and values)")
  return ms, gb / ms * 1000


def eval_contexts(trees_path: str) -> list[int]:
  """The context each generated token of the evaluation attends over (positions before it and
  itself)."""
  contexts = []
  with open(trees_path) as f:
    for line in f:
      for node in json.loads(line)["nodes"]:
        contexts += [i + 1 for i, m in enumerate(node["gen_mask"]) if m]
  return contexts


def evaluation_floor(cfg, contexts: list[int], trees_path: str, step_ms_window: float,
                     step_ms_short: float, weights_ms: float, attention_gbps: float,
                     peak: dict | None, kernel_step_ms: float) -> dict:
  """Floors under the decode of the evaluation whose trees are in `trees_path` (see the module
  doc, 4), and its decode at the live-slot kernel's step (5)."""
  tokens = len(contexts)
  # bench_peak's bytes of one decode over these contexts, less the weights read once: the keys
  # and values every generated token reads.
  kv_bytes = bench_peak.decode_step_bytes(cfg, contexts) - 4 * bench_peak.matmul_params(cfg)
  product_flops = 2 * bench_peak.matmul_params(cfg) * tokens
  out = {"trees": trees_path, "generated_tokens": tokens,
         "mean_context": round(sum(contexts) / max(tokens, 1), 1), "max_context": max(contexts),
         "kv_gb_read": round(kv_bytes / 1e9, 1), "goal_s": EVAL_GOAL_S,
         # The engine with XLA's attention: each decode call reads the whole window of every row.
         "engine_full_batches_s": round(tokens / ROWS * step_ms_window / 1000, 1),
         # The engine's step without its window (at 64 slots: products, norms, sampling) with
         # attention reading live slots only, at the rate XLA's attention reaches alone.
         "engine_live_slots_s": round(tokens / ROWS * step_ms_short / 1000
                                      + kv_bytes / (attention_gbps * 1e9), 1),
         # XLA's products alone (this run's fastest library) and that attention: no norms,
         # no sampling.
         "xla_rates_live_slots_s": round(tokens / ROWS * weights_ms / 1000
                                         + kv_bytes / (attention_gbps * 1e9), 1)}
  # The engine with the decode attention over live slots: its step measured with every row at
  # the evaluation's mean context (the kernel's cost is linear in the slots a row holds).
  out["engine_kernel_s"] = round(tokens / ROWS * kernel_step_ms / 1000, 1)
  out["engine_kernel_over_live_floor"] = round(out["engine_kernel_s"]
                                               / out["engine_live_slots_s"], 3)
  if peak is not None:
    out["peak_live_slots_s"] = round(product_flops / (peak["peak_gflops"] * 1e9)
                                     + kv_bytes / (peak["peak_gbps"] * 1e9), 1)
    out["peak"] = {"gflops": peak["peak_gflops"], "gbps": peak["peak_gbps"]}
  say(f"evaluation floor ({tokens} generated tokens, mean context {out['mean_context']}): "
      f"engine as configured {out['engine_full_batches_s']} s, the engine on live slots "
      f"{out['engine_live_slots_s']} s, the engine with the live-slot kernel "
      f"{out['engine_kernel_s']} s, XLA's products and attention on live slots "
      f"{out['xla_rates_live_slots_s']} s, this CPU's peaks {out.get('peak_live_slots_s')} s; "
      f"goal {EVAL_GOAL_S} s")
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--trees", default=EVAL_TREES,
                  help="a held-out evaluation's trees.jsonl for the evaluation floor ('' = none)")
  ap.add_argument("--rounds", type=int, default=6,
                  help="alternating rounds of the live-slot kernel against XLA's attention")
  ap.add_argument("--quick", action="store_true",
                  help="fewer repeats and rounds: checks that it runs (figures not reported)")
  args = ap.parse_args()
  repeats, rounds = (3, 2) if args.quick else (12, args.rounds)
  from rao_jax.model import load_model
  model = load_model("smollm2-135m", dtype="float32")
  contexts = eval_contexts(args.trees) if args.trees and os.path.exists(args.trees) else None
  held = round(sum(contexts) / len(contexts)) if contexts else WINDOW - 40
  ab = kernel_ab(model, held, rounds, repeats)
  steps = decode_steps(model, repeats)
  slope = (steps[768] - steps[384]) / 384
  (l_xla, l_torch, l_np), (h_xla, h_torch, h_np) = weight_products(model.cfg)
  att_ms, att_gbs = attention_alone(model.cfg)
  floor = min(l_xla, l_torch, l_np) + min(h_xla, h_torch, h_np)
  result = {
      "benchmark": "decode_floor_b32_smollm2_135m_f32", "rows": ROWS,
      "step_ms_cache64": round(steps[64], 1), "step_ms_cache384": round(steps[384], 1),
      "step_ms_cache768": round(steps[768], 1), "step_ms_cache2048": round(steps[WINDOW], 1),
      "decode_kernel_ab": ab, "quick": args.quick,
      "attention_ms_per_384_slots_in_step": round(slope * 384, 1),
      "attention_alone_ms_384": round(att_ms, 1), "attention_alone_gb_s": round(att_gbs, 1),
      "layer_products_ms": {"xla": round(l_xla, 1), "torch": round(l_torch, 1),
                            "numpy": round(l_np, 1)},
      "lm_head_ms": {"xla": round(h_xla, 1), "torch": round(h_torch, 1),
                     "numpy": round(h_np, 1)},
      # The fastest of the three libraries for the weights alone, no attention, no sampling.
      "weights_floor_ms": round(floor, 1),
      "weights_floor_tok_s": round(ROWS / floor * 1000, 1),
      "cpu": bench_peak.cpu_model(), "load_avg_1m": round(os.getloadavg()[0], 2),
  }
  if contexts:
    result["evaluation_floor"] = evaluation_floor(
        model.cfg, contexts, args.trees, steps[WINDOW], steps[64], floor, att_gbs,
        bench_peak.load_peak(), ab["kernel_step_ms"])
  elif args.trees:
    say(f"no evaluation floor: {args.trees} does not exist (run the recursion experiment's "
        "eval_before stage, or pass --trees)")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
