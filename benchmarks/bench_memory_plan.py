"""Memory plans at real sizes: the RAO train step on an 8-device mesh, and (``--engine``) how many
rows the embedded engine's paged KV cache holds on one chip against a fixed window.

The train step (the default run): for Llama-3.2-1B, Qwen3-1.7B and Qwen3-4B shapes, rows of
8,192 and 40,960 tokens, bfloat16 compute with float32 masters and AdamW moments, and each
remat policy, it reports per-device bytes of parameters, optimizer state, gradient accumulators
and activations, and whether they fit an H200 (141 GB), a TPU v5p (95 GB) and a TPU v5e (16 GB)
chip with 10% headroom; each full fine-tuning row has a LoRA twin (rank 16 on every projection:
moments and gradients of the adapter alone, the frozen base stored once), on the same shapes.

The per-device figures come from an estimate (``estimate``, below); XLA's own memory analysis
(``compiled.memory_analysis()``) of the same train step, compiled (not run) for a fake 8-device
CPU mesh, checks it on configurations small enough to compile here: each model's real widths
and vocabulary with 2 layers and rows of 1,024 and 2,048 tokens. A full-size compile on the
CPU would lower XLA's blocked attention (the CPU branch), whose [query block, T] scores are what
the TPU/GPU kernels never hold, so XLA's figure at full size would describe the CPU, not the
accelerator. Nothing is executed: no weights are allocated.

The engine (``--engine``, arithmetic only, seconds): for SmolLM2-135M, Llama-3.2-1B and Qwen3-4B
at 8K and 40K contexts on an H100 (80 GB), an H200 (141 GB) and a TPU v5e (16 GB), v5p (95 GB)
and v6e (32 GB) chip, the engine alone on the chip (an evaluation, a rollout server: with the
learner beside it, subtract the train step's plan), bfloat16 weights and KV: the KV budget is
90% of the chip less the weights and a prefill call's gathered view (``prefill_rows`` rows at
the full context, one layer); each decoding row also holds its float32 logits. A fixed window
holds every row at the full context (the unpaged engine's largest bucket); the paged cache holds
a row by the pages its length takes (``EngineConfig.page_size`` 64: half a page lost on
average). Two length assumptions: the held-out TextCraft evaluation's measured mean context
(``bench_decode_floor.json``'s ``evaluation_floor.mean_context``: 702.6 positions, at most 925;
the KV a decoding row holds, averaged over its generated tokens), and rows holding half the
context on average. It writes ``benchmarks/results/bench_memory_plan.engine.json``.

    python benchmarks/bench_memory_plan.py [--quick]
    python benchmarks/bench_memory_plan.py --engine

Progress on stderr; one JSON line on stdout (rows of the plan, the checks, the recommended
remat policy per model, row length and chip; or the engine's rows per model, context and chip).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from rao_jax.learner import LearnerConfig  # noqa: E402
from rao_jax.learner import memory  # noqa: E402
from rao_jax.learner import step as step_lib  # noqa: E402
from rao_jax.model import ModelConfig, sharding  # noqa: E402
from rao_jax.model import lora as lora_lib  # noqa: E402
from rao_jax.model.transformer import Transformer  # noqa: E402

GB = 1e9
CHIPS = {"h200": 141e9, "tpu_v5p": 95e9, "tpu_v5e": 16e9}
HEADROOM = memory.HEADROOM
FSDP, TENSOR = 4, 2
LORA_RANK = 16   # the LoRA rows: every projection adapted at this rank (alpha = 2 x rank)
MODELS = {
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                         hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    "qwen3-1.7b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                       hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144,
                       tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=40960),
    "qwen3-4b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                     hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                     tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                     max_position_embeddings=40960),
}
REMATS = memory.REMATS
# The engine plan (--engine): SmolLM2-135M's shape (its native context is 8,192; the 40K rows
# are arithmetic on its shape), and the chips one model is served from.
SMOLLM2_135M = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
                    hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                    tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                    max_position_embeddings=8192)
ENGINE_MODELS = {"smollm2-135m": SMOLLM2_135M, "llama-3.2-1b": MODELS["llama-3.2-1b"],
                 "qwen3-4b": MODELS["qwen3-4b"]}
ENGINE_CHIPS = {"h100_80gb": 80e9, "h200_141gb": 141e9, "tpu_v5e_16gb": 16e9,
                "tpu_v5p_95gb": 95e9, "tpu_v6e_32gb": 32e9}
ENGINE_CONTEXTS = (8192, 40960)
ENGINE_RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                             "bench_memory_plan.engine.json")


def model_config(name: str, **overrides) -> ModelConfig:
  cfg = ModelConfig.from_hf_config(MODELS[name])
  return dataclasses.replace(cfg, param_dtype="float32", dtype="bfloat16", **overrides)


def n_params(cfg: ModelConfig) -> tuple[int, int]:
  return memory.n_params(cfg)


def estimate(cfg: ModelConfig, T: int, rows: int, remat: str) -> dict[str, float]:
  """Per-device bytes of one train step on the fsdp x tensor mesh (``rao_jax.learner.memory``,
  the plan the learner's remat="auto" uses), bfloat16 activations."""
  return memory.estimate(cfg, T, rows, remat, shards=FSDP * TENSOR, tensor=TENSOR,
                         act_dtype="bfloat16")


def train_step_program(cfg: ModelConfig, T: int, rows: int, mesh):
  """The learner's jitted train step for these shapes, lowered from abstract values only."""
  lcfg = LearnerConfig(row_len=T, micro_batch_rows=rows * FSDP, bucket_rows=(rows * FSDP,),
                       lr=1e-6)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, _ = nnx.split(abstract, nnx.Param, ...)
  opt = step_lib.make_optimizer(lcfg)
  state = jax.eval_shape(lambda p: step_lib.TrainState(
      step=jnp.zeros((), jnp.int32), params=p, opt_state=opt.init(p),
      rng=jax.random.PRNGKey(0)), params)
  state_sh = sharding.state_shardings(state, mesh)
  B = rows * FSDP
  batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32) for k in step_lib.BATCH_KEYS_2D}
  for k in ("coef_BxT", "kl_weight_BxT", "rollout_logp_BxT"):
    batch[k] = jax.ShapeDtypeStruct((B, T), jnp.float32)
  batch["loss_mask_BxT"] = jax.ShapeDtypeStruct((B, T), jnp.bool_)
  batch["normalizer"] = jax.ShapeDtypeStruct((), jnp.float32)
  batch_sh = {k: sharding.batch_sharding(mesh, 2) for k in step_lib.BATCH_KEYS_2D}
  batch_sh["normalizer"] = sharding.replicated(mesh)
  micro = jax.sharding.NamedSharding(
      mesh, sharding.logical_to_spec((None, "batch", None), mesh=mesh))
  fn = jax.jit(functools.partial(step_lib.train_step,
                                 statics=step_lib.StepStatics(graphdef, lcfg, micro)),
               in_shardings=(state_sh, batch_sh),
               out_shardings=(state_sh, sharding.replicated(mesh)), donate_argnums=(0,))
  return fn, (state, batch)


def xla_check(name: str, T: int, remat: str, mesh) -> dict:
  """XLA's memory analysis of a 2-layer model of this family against the estimate."""
  cfg = model_config(name, n_layers=2, remat=remat, attention_block=128)
  t0 = time.perf_counter()
  fn, args = train_step_program(cfg, T, 1, mesh)
  mem = fn.trace(*args).lower().compile().memory_analysis()
  est = estimate(cfg, T, 1, remat)
  xla_args = mem.argument_size_in_bytes          # the sharded state and batch, per device
  xla_temp = mem.temp_size_in_bytes              # everything else the step allocates
  est_args = est["params"] + est["optimizer"]
  est_temp = est["total"] - est_args
  # The CPU lowering's blocked attention holds one [rows, heads, 128, T] float32 score block
  # (and its probabilities) that the accelerator kernels do not; counted out of XLA's figure.
  xla_attn = 2 * 128 * T * cfg.n_heads // TENSOR * 4
  row = {"model": name, "layers": 2, "T": T, "remat": remat,
         "xla_args_gb": round(xla_args / GB, 3), "est_args_gb": round(est_args / GB, 3),
         "xla_temp_gb": round(xla_temp / GB, 3),
         "xla_temp_minus_cpu_attention_gb": round((xla_temp - xla_attn) / GB, 3),
         "est_temp_gb": round(est_temp / GB, 3),
         "temp_ratio_est_over_xla": round(est_temp / max(xla_temp - xla_attn, 1), 3),
         "compile_s": round(time.perf_counter() - t0, 1)}
  print(json.dumps(row), file=sys.stderr)
  return row


def plan(quick: bool) -> dict:
  rows = []
  names = list(MODELS) if not quick else ["qwen3-1.7b"]
  for name in names:
    for T in (8192, 40960):
      for remat, lora in [(r, 0) for r in REMATS] + [(r, LORA_RANK) for r in REMATS]:
        cfg = model_config(name, lora=lora_lib.LoraConfig(rank=lora, alpha=2.0 * max(lora, 1),
                                                          targets=lora_lib.TARGETS))
        est = estimate(cfg, T, 1, remat)
        row = {"model": name, "T": T, "remat": remat, "lora_rank": lora, "params_b": round(
            n_params(model_config(name))[0] / 1e9, 3)}
        row.update({f"{k}_gb": round(v / GB, 2) for k, v in est.items()})
        row.update({f"fits_{chip}": bool(est["total"] <= HEADROOM * cap)
                    for chip, cap in CHIPS.items()})
        rows.append(row)
  # The least recomputation that fits: none < dots < full.
  recommend = {}
  for name in names:
    for T in (8192, 40960):
      for chip in CHIPS:
        ok = [r["remat"] for r in rows if r["model"] == name and r["T"] == T
              and not r["lora_rank"] and r[f"fits_{chip}"]]
        recommend[f"{name}/T={T}/{chip}"] = ok[0] if ok else "does not fit (more devices)"
  return {"rows": rows, "recommended_remat": recommend}


def measured_mean_context() -> tuple[float, int, str]:
  """(mean, max) context of the held-out evaluation's decode steps, from bench_decode_floor's
  committed result, and where it came from."""
  path = os.path.join(os.path.dirname(ENGINE_RESULT), "bench_decode_floor.json")
  with open(path) as f:
    for line in reversed(f.read().splitlines()):
      floor = json.loads(line).get("evaluation_floor") if line.strip() else None
      if floor and "mean_context" in floor:
        return (float(floor["mean_context"]), int(floor["max_context"]),
                f"benchmarks/results/bench_decode_floor.json evaluation_floor ({floor['trees']})")
  raise ValueError(f"{path} has no evaluation_floor.mean_context; run bench_decode_floor.py "
                   "--trees first.")


def engine_rows(name: str, context: int, chip_bytes: float, mean_lengths: dict) -> dict:
  """Rows of ``context`` the engine holds on one chip: fixed window against paged."""
  from rao_jax.rollout.engine import EngineConfig  # pylint: disable=g-import-not-at-top
  ecfg = EngineConfig(num_slots=4, max_len=context)    # the defaults: page size, prefill rows
  cfg = ModelConfig.from_hf_config(ENGINE_MODELS[name])
  weights = n_params(cfg)[0] * 2                                          # bfloat16
  kv_per_position = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * 2   # keys, values
  view = ecfg.prefill_rows[-1] * context * cfg.n_kv_heads * cfg.head_dim * 2 * 2
  logits = cfg.vocab_size * 4                                             # per decoding row
  budget = HEADROOM * chip_bytes - weights - view

  def rows(held: float) -> int:
    return max(int(budget // (held * kv_per_position + logits)), 0) if budget > 0 else 0
  fixed = rows(context)
  row = {"model": name, "context": context, "weights_gb": round(weights / GB, 2),
         "kv_per_token_kb": round(kv_per_position / 1e3, 1),
         "kv_row_at_context_gb": round(context * kv_per_position / GB, 3),
         "prefill_view_gb": round(view / GB, 3), "kv_budget_gb": round(budget / GB, 2),
         "fixed_window_rows": fixed}
  for label, mean in mean_lengths.items():
    held = min(mean(context), context) + (ecfg.page_size - 1) / 2    # half a page lost
    row[f"paged_rows_{label}"] = rows(held)
    row[f"paged_over_fixed_{label}"] = round(rows(held) / fixed, 1) if fixed else None
  return row


def engine_plan() -> dict:
  mean, longest, source = measured_mean_context()
  lengths = {"textcraft": lambda ctx: mean, "half_context": lambda ctx: ctx / 2}
  rows = []
  for name in ENGINE_MODELS:
    for context in ENGINE_CONTEXTS:
      for chip, cap in ENGINE_CHIPS.items():
        rows.append({"chip": chip, **engine_rows(name, context, cap, lengths)})
        print(json.dumps(rows[-1]), file=sys.stderr)
  from rao_jax.rollout.engine import EngineConfig  # pylint: disable=g-import-not-at-top
  return {"bench": "memory_plan_engine", "chips_gb": {k: v / GB for k, v in ENGINE_CHIPS.items()},
          "headroom": HEADROOM, "dtype": "bfloat16 weights and KV, float32 logits",
          "page_size": EngineConfig.page_size,
          "prefill_rows": EngineConfig(num_slots=4).prefill_rows[-1],
          "assumptions": {
              "textcraft": f"every row holds the held-out TextCraft evaluation's mean context, "
                           f"{mean} positions (at most {longest}), from {source}",
              "half_context": "rows hold half the context on average",
              "fixed_window": "every row holds the whole context (the unpaged engine's largest "
                              "cache bucket, or any fixed-window cache)",
              "alone": "the engine alone on the chip; the learner's step, when it shares the "
                       "chip, takes the train step's plan first"},
          "rows": rows}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="one model, two XLA checks")
  ap.add_argument("--engine", action="store_true",
                  help="the embedded engine's KV rows per chip (arithmetic; writes "
                       "benchmarks/results/bench_memory_plan.engine.json)")
  args = ap.parse_args()
  if args.engine:
    out = engine_plan()
    line = json.dumps(out)
    with open(ENGINE_RESULT, "w") as f:
      f.write(line + "\n")
    print(line)
    return
  mesh = sharding.make_mesh(1, FSDP, TENSOR)
  out = {"bench": "memory_plan", "mesh": {"fsdp": FSDP, "tensor": TENSOR},
         "chips_gb": {k: v / GB for k, v in CHIPS.items()}, "headroom": HEADROOM,
         "dtype": "bfloat16 compute, float32 masters and AdamW moments",
         "micro_batch_rows_per_device": 1}
  out.update(plan(args.quick))
  checks = []
  names = ["qwen3-1.7b"] if args.quick else list(MODELS)
  for name in names:
    for T, remat in ((1024, "full"), (2048, "none")) if not args.quick else ((1024, "full"),):
      print(f"compiling {name} T={T} remat={remat} (2 layers) ...", file=sys.stderr)
      checks.append(xla_check(name, T, remat, mesh))
  out["xla_checks"] = checks
  print(json.dumps(out))


if __name__ == "__main__":
  main()
