"""Memory plan of the RAO train step at real sizes on an 8-device mesh (fsdp=4 x tensor=2).

For Llama-3.2-1B, Qwen3-1.7B and Qwen3-4B shapes, rows of 8,192 and 40,960 tokens, bfloat16
compute with float32 masters and AdamW moments, and each remat policy, it reports per-device
bytes of parameters, optimizer state, gradient accumulators and activations, and whether they
fit an H200 (141 GB), a TPU v5p (95 GB) and a TPU v5e (16 GB) chip with 10% headroom; each
full fine-tuning row has a LoRA twin (rank 16 on every projection: moments and gradients of the
adapter alone, the frozen base stored once), on the same shapes.

The per-device figures come from an estimate (``estimate``, below); XLA's own memory analysis
(``compiled.memory_analysis()``) of the same train step, compiled (not run) for a fake 8-device
CPU mesh, checks it on configurations small enough to compile here: each model's real widths
and vocabulary with 2 layers and rows of 1,024 and 2,048 tokens. A full-size compile on the
CPU would lower XLA's blocked attention (the CPU branch), whose [query block, T] scores are what
the TPU/GPU kernels never hold, so XLA's figure at full size would describe the CPU, not the
accelerator. Nothing is executed: no weights are allocated.

    python benchmarks/bench_memory_plan.py [--quick]

Progress on stderr; one JSON line on stdout (rows of the plan, the checks, the recommended
remat policy per model, row length and chip).
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


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="one model, two XLA checks")
  args = ap.parse_args()
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
