"""Rollout correction on bf16 rollouts: the log-prob gap a bf16 engine leaves and the weights
that correct it, against a float32 engine.

    python benchmarks/bench_rollout_correction.py [--steps=2] [--cap=2.0] [--quick] [--out=FILE]

SmolLM2-135M (the real weights). The learner runs in float32 with rollout correction on
(``LearnerConfig.tis_cap``, default cap 2). Each step samples the same chat prompts (temperature
1) from two embedded engines holding the learner's current weights: one in bfloat16 (as an
SGLang server serves them; SGLang's CPU engine runs bf16 only) and its peer in float32. For
each engine's rollouts the learner's own float32 log-probs of the sampled tokens give:

- the gap: mean and 99th percentile of |logp_learner - logp_rollout| per token, and the share
  of tokens whose gap exceeds 0.15 (the tolerance the real-server suite states);
- the correction: the mean truncated weight min(pi_learner / pi_rollout, cap), the share of
  tokens the cap truncates, and the k3 estimate of KL(rollout || learner).

The learner then takes one RL step on the bf16 rollouts (its own metrics report the same gap
and weights, read back as a check), and both engines load the new weights. Medians over the
steps; the ratio bf16 / float32 of the gap. The default run (2 steps of 16 samples, 32 new
tokens) takes about 5 minutes on 2 quiet CPU cores, most of it compiling.

A toy reward (every other sample of a prompt succeeds) gives every sample a non-zero advantage,
so the batch holds every sampled token (the learner leaves out nodes whose advantage is 0); the
reward is not what is measured.

Progress goes to stderr, ONE JSON line to stdout; --out writes it to a file too.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peak  # noqa: E402  (this folder's: the CPU's name)

TOPICS = ("rivers", "bread", "winter", "robots")
# The same gap threshold as tests/test_rollout_sglang_real.py's LOGP_TOL.
GAP_TOL = 0.15


def log(*a):
  print("[bench_rollout_correction]", *a, file=sys.stderr, flush=True)


def gap_stats(logp, rollout, mask, cap):
  """The gap and the correction over the loss tokens of one batch (numpy, float64)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  d = (np.asarray(logp, np.float64) - np.asarray(rollout, np.float64))[np.asarray(mask)]
  ratio = np.exp(d)
  return {"tokens": int(d.size),
          "gap_mean": float(np.mean(np.abs(d))),
          "gap_p99": float(np.quantile(np.abs(d), 0.99)),
          "gap_over_tol_frac": float(np.mean(np.abs(d) > GAP_TOL)),
          "tis_weight_mean": float(np.mean(np.minimum(ratio, cap))),
          "tis_clip_frac": float(np.mean(ratio > cap)),
          "rollout_kl": float(np.mean(ratio - 1.0 - d))}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=2)
  ap.add_argument("--cap", type=float, default=2.0)
  ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
  ap.add_argument("--max-new-tokens", type=int, default=32)
  ap.add_argument("--quick", action="store_true", help="one step, 16 new tokens")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  if args.quick:
    args.steps, args.max_new_tokens = 1, 16
  t_start = time.perf_counter()

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from rao_jax.learner import Learner, LearnerConfig  # pylint: disable=g-import-not-at-top
  from rao_jax.learner.testing import make_node, make_tree  # pylint: disable=g-import-not-at-top
  from rao_jax.model import load_pretrained  # pylint: disable=g-import-not-at-top
  from rao_jax.model.logprobs import token_logprobs  # pylint: disable=g-import-not-at-top
  from rao_jax.rollout import (EmbeddedEngine, GenerateRequest,  # pylint: disable=g-import-not-at-top
                               SamplingParams)

  model, tok = load_pretrained("smollm2-135m", dtype="float32")
  prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write one sentence about "
                                                                  f"{t}."}],
                                     add_generation_prompt=True) for t in TOPICS]
  longest = max(len(p) for p in prompts) + args.max_new_tokens
  cache = 1 << (longest - 1).bit_length()
  n_req = len(prompts) * args.samples
  engine_kw = dict(num_slots=n_req, max_len=cache, cache_lens=(cache,), chunk_sizes=(64,),
                   prefill_rows=(8,), decode_rows=(n_req,),
                   default_stop_token_ids=tuple(tok.stop_token_ids))
  engines = {}
  for dtype in ("bfloat16", "float32"):
    served, _ = load_pretrained("smollm2-135m", dtype=dtype)
    engines[dtype] = EmbeddedEngine(served, **engine_kw)
    del served
  cfg = LearnerConfig(row_len=cache * 2, micro_batch_rows=4, bucket_rows=(4, 8, 16), lr=1e-5,
                      tis_cap=args.cap, seed=0)
  learner = Learner(cfg, model.cfg, params=model)
  del model
  graphdef = nnx.graphdef(learner.model)
  shared = cfg.shared_prefix_tokens() > 0

  @jax.jit
  def row_logp(state, tokens, positions, segments, targets):
    m = nnx.merge(graphdef, state)
    return token_logprobs(m, m(tokens, positions, segments, shared_prefix=shared), targets)

  async def sample(engine, step):
    reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                                              seed=1000 * step + i))
            for i, p in enumerate(p for p in prompts for _ in range(args.samples))]
    t0 = time.perf_counter()
    out = await asyncio.gather(*[engine.generate(r) for r in reqs])
    return reqs, out, time.perf_counter() - t0

  def trees_of(reqs, outs):
    trees = []
    for i, (r, o) in enumerate(zip(reqs, outs)):
      node = make_node("0", None, 0, [], float(i % 2), "verifier",
                       list(r.prompt_ids) + o.token_ids,
                       [0] * len(r.prompt_ids) + [1] * len(o.token_ids),
                       [0.0] * len(r.prompt_ids) + list(o.logprobs))
      trees.append(make_tree(f"s{i}", f"g{i // args.samples}", [node]))
    return trees

  def measure(batch):
    a = batch.arrays()
    lp = row_logp(nnx.state(learner.model, nnx.Param), a["tokens_BxT"], a["positions_BxT"],
                  a["segment_ids_BxT"], a["targets_BxT"])
    return gap_stats(np.asarray(lp), a["rollout_logp_BxT"], a["loss_mask_BxT"], args.cap)

  async def run():
    per_step = []
    for step in range(1, args.steps + 1):
      row = {"step": step}
      for dtype, engine in engines.items():
        reqs, outs, secs = await sample(engine, step)
        batch, _ = learner.prepare(trees_of(reqs, outs))
        row[dtype] = {**measure(batch), "sample_s": round(secs, 2),
                      "gen_tokens": sum(len(o.token_ids) for o in outs)}
        if dtype == "bfloat16":
          bf16_batch = batch
      t0 = time.perf_counter()
      m = learner.step(bf16_batch)
      row["step_s"] = round(time.perf_counter() - t0, 2)
      row["learner_metrics"] = {k: float(m[k]) for k in (
          "rollout_logp_abs_diff", "tis_weight_mean", "tis_clip_frac", "rollout_kl",
          "update_applied")}
      for engine in engines.values():
        await engine.update_weights(learner.model, step)
      log(json.dumps(row))
      per_step.append(row)
    for engine in engines.values():
      await engine.close()
    return per_step

  per_step = asyncio.run(run())
  med = lambda dtype, k: statistics.median(r[dtype][k] for r in per_step)
  keys = ("gap_mean", "gap_p99", "gap_over_tol_frac", "tis_weight_mean", "tis_clip_frac",
          "rollout_kl")
  summary = {
      "bench": "rollout_correction", "model": "smollm2-135m", "learner_dtype": "float32",
      "cap": args.cap, "steps": args.steps, "samples": n_req,
      "max_new_tokens": args.max_new_tokens, "temperature": 1.0,
      "bf16_engine": {k: round(med("bfloat16", k), 6) for k in keys},
      "fp32_engine": {k: round(med("float32", k), 6) for k in keys},
      "gap_ratio_bf16_over_fp32": round(med("bfloat16", "gap_mean")
                                        / max(med("float32", "gap_mean"), 1e-12), 1),
      "learner_step_metrics_median": {k: round(statistics.median(
          r["learner_metrics"][k] for r in per_step), 6) for k in (
              "rollout_logp_abs_diff", "tis_weight_mean", "tis_clip_frac", "rollout_kl")},
      "tokens_per_step": statistics.median(r["bfloat16"]["tokens"] for r in per_step),
      "cpu": bench_peak.cpu_model(), "cpu_count": os.cpu_count(),
      "backend": jax.default_backend(), "wall_s": round(time.perf_counter() - t_start, 1),
      # Other work on the cores slows the timings (not the gap): the load says how quiet it was.
      "load_avg_1m_end": round(os.getloadavg()[0], 1),
      "per_step": per_step,
  }
  line = json.dumps(summary)
  print(line, flush=True)
  if args.out:
    with open(args.out, "w") as f:
      f.write(line + "\n")


if __name__ == "__main__":
  main()
