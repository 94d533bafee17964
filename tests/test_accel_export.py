"""Kernels follow the LOWERING platform: the train step (float32 and bfloat16) and the embedded
engine's prefill and decode programs over its paged KV cache export (``jax.export``) for
``cuda`` and ``tpu`` from this CPU host with no CPU-only custom call inside, and carry the
platform's attention kernel (the decode program its paged decode attention over each row's live
pages); the same traces lowered for the CPU carry the MKL kernels and the CPU decode kernel
(where they are enabled).
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.learner import LearnerConfig
from rao_jax.learner import step as step_lib
from rao_jax.learner.testing import tiny_model_config
from rao_jax.kernels import decode_cpu, mkl
from rao_jax.model import sharding
from rao_jax.model.transformer import Transformer
from rao_jax.rollout.engine import programs

pytestmark = pytest.mark.slow

T = 128          # a multiple of both kernels' blocks, so the Pallas kernels are chosen
# Custom calls a GPU/TPU program may hold (jax.export checks these have stability guarantees).
PLATFORM_KERNELS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _targets(text: str) -> set[str]:
  return set(re.findall(r"custom_call @([\w$.]+)", text)) | set(
      re.findall(r'call_target_name = "([^"]+)"', text))


@pytest.fixture(scope="module")
def mkl_on_host():
  """The kernel choice that puts the MKL kernels into this host's traces where they can be built
  (any x86 CPU), so a CPU-only custom call is really in the traced program; else "xla"."""
  try:
    return "mkl" if mkl.available("mkl") else "xla"
  except mkl.CpuKernelsUnavailable:
    return "xla"


def _train_step_args(dtype, kernels, rows=2, mesh=None):
  """The jitted train step and abstract (state, batch); with ``mesh``, sharded as the Learner
  shards them."""
  model_cfg = tiny_model_config(dtype=dtype, vocab_size=256, d_model=64, head_dim=16,
                                mlp_dim=128, kernels=kernels)
  # Plain segments: the GPU/TPU flash kernels take them (rows with shared prefixes take XLA's
  # attention there, and share_prefix_min=-1 resolves by the CPU host this test runs on).
  cfg = LearnerConfig(row_len=T, micro_batch_rows=rows, bucket_rows=(rows,), lr=1e-5,
                      share_prefix_min=0)
  graphdef, params, _ = nnx.split(
      nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
  opt = step_lib.make_optimizer(cfg)
  state = jax.eval_shape(lambda p: step_lib.TrainState(
      step=jnp.zeros((), jnp.int32), params=p, opt_state=opt.init(p),
      rng=jax.random.PRNGKey(0)), params)
  arr = lambda dt, shape=(rows, T): jax.ShapeDtypeStruct(shape, dt)   # noqa: E731
  micro = None
  if mesh is not None:
    state = jax.tree.map(
        lambda s, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        sharding.state_shardings(state, mesh), state,
        is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    rows_sharding = sharding.batch_sharding(mesh, 2)
    arr = lambda dt, shape=(rows, T): jax.ShapeDtypeStruct(   # noqa: E731
        shape, dt, sharding=rows_sharding if shape else sharding.replicated(mesh))
    micro = jax.sharding.NamedSharding(
        mesh, sharding.logical_to_spec((None, "batch", None), mesh=mesh))
  batch = {k: arr(jnp.int32) for k in step_lib.BATCH_KEYS_2D}
  for k in ("coef_BxT", "kl_weight_BxT", "rollout_logp_BxT"):
    batch[k] = arr(jnp.float32)
  batch["loss_mask_BxT"] = arr(jnp.bool_)
  batch["normalizer"] = arr(jnp.float32, ())
  fn = jax.jit(functools.partial(step_lib.train_step,
                                 statics=step_lib.StepStatics(graphdef, cfg, micro)))
  return fn, (state, batch)


def _call_operands(text: str, target: str) -> list[str]:
  """The operand types of every call to ``target`` in exported StableHLO text."""
  return [m.group(1) for m in re.finditer(
      re.escape(target) + r'[^\n]*?:\s*\(([^)]*)\)\s*->', text)]


def test_train_step_under_its_mesh_exports_per_device_kernels():
  """The learner's step traced under an 8-device mesh (data 2 x fsdp 2 x tensor 2), as the
  Learner traces it, exports for cuda and tpu with each attention kernel on one device's rows
  and kv heads (shard_map), never on the gathered batch."""
  mesh = sharding.make_mesh(2, 2, 2)
  fn, (state, batch) = _train_step_args("bfloat16", "xla", rows=4, mesh=mesh)
  H, K, h = 4, 2, 16
  local_q = {"cuda": f"tensor<1x{T}x{H // 2}x{h}xbf16>",      # [rows, T, heads, h]
             "tpu": f"tensor<{H // 2}x{T}x{h}xbf16>"}         # one row's [heads, T, h]
  global_q = {"cuda": f"tensor<4x{T}x{H}x{h}xbf16>", "tpu": f"tensor<{H}x{T}x{h}xbf16>"}
  for platform, kernel in PLATFORM_KERNELS.items():
    with jax.set_mesh(mesh):
      allowed = [jax.export.DisabledSafetyCheck.custom_call(PLATFORM_KERNELS["cuda"])]
      text = jax.export.export(fn, platforms=(platform,), disabled_checks=allowed)(
          state, batch).mlir_module()
    operands = _call_operands(text, kernel)
    assert operands and all(local_q[platform] in o for o in operands), (platform, operands[:2])
    assert not any(global_q[platform] in o for o in operands), platform


def _engine_programs(dtype, kernels):
  model_cfg = tiny_model_config(dtype=dtype, vocab_size=256, d_model=64, head_dim=16,
                                mlp_dim=128, kernels=kernels)
  make = lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))
  fns = nnx.eval_shape(make).inference_fns()
  params = jax.eval_shape(lambda: make().inference_params())
  # The engine's cache: a pool of 16 pages of 64 slots; rows of up to 4 pages (256 slots).
  cache = jax.eval_shape(lambda: make().init_cache(batch_size=16, max_len=64))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  prefill = (programs.prefill, (fns, params, cache,
                                programs.PrefillBatch(i32(2, 2), i32(2, 64), i32(2), i32(2))))
  decode = (programs.decode, (fns, 2, params, cache,
                              programs.DecodeBatch(i32(4), i32(4),
                                                   jax.ShapeDtypeStruct((4,), jnp.bool_),
                                                   i32(4, 4)),
                              programs.SamplingArrays(f32(4), f32(4), i32(4),
                                                      jax.ShapeDtypeStruct((4,), jnp.uint32),
                                                      f32(4))))
  return {"prefill": prefill, "decode": decode}


def _check_export(fn, args, platform):
  # jax.export refuses custom calls without a stability guarantee; Triton IR has none, so the
  # Pallas GPU kernel alone is allowed by name (a serialized GPU program must be re-exported
  # with the jaxlib that runs it). A CPU-only call (MKL) would still fail here.
  allowed = [jax.export.DisabledSafetyCheck.custom_call(PLATFORM_KERNELS["cuda"])] \
      if platform == "cuda" else []
  exp = jax.export.export(fn, platforms=(platform,), disabled_checks=allowed)(*args)
  targets = _targets(exp.mlir_module())
  assert not any(t.startswith("rao_") for t in targets), targets   # rao_jax's CPU handlers
  assert targets <= set(PLATFORM_KERNELS.values()) | {"Sharding", "shape_assertion"}, targets
  return targets


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_step_exports_for_gpu_and_tpu_with_their_kernels(mkl_on_host, dtype):
  fn, args = _train_step_args(dtype, mkl_on_host)
  for platform, kernel in PLATFORM_KERNELS.items():
    targets = _check_export(fn, args, platform)
    assert kernel in targets, (platform, targets)   # the platform's flash attention
  # The same trace lowered for this CPU holds the MKL kernels (float32) and no GPU/TPU kernel.
  cpu_text = fn.trace(*args).lower(lowering_platforms=("cpu",)).as_text()
  cpu_targets = _targets(cpu_text)
  if mkl_on_host == "mkl" and dtype == "float32":
    assert {"rao_mkl_gemm", "rao_mkl_attention_fwd", "rao_mkl_attention_bwd"} <= cpu_targets
  else:
    assert not any(t.startswith("rao_mkl") for t in cpu_targets), cpu_targets
  assert not set(PLATFORM_KERNELS.values()) & cpu_targets


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_engine_programs_export_for_gpu_and_tpu(mkl_on_host, name, dtype):
  fn, args = _engine_programs(dtype, mkl_on_host)[name]
  for platform, kernel in PLATFORM_KERNELS.items():
    targets = _check_export(fn, args, platform)
    if name == "decode":   # the platform's decode attention over each row's live pages
      assert kernel in targets, (platform, targets)
  cpu_targets = _targets(fn.trace(*args).lower(lowering_platforms=("cpu",)).as_text())
  decode_kernel = name == "decode" and mkl_on_host != "xla" and decode_cpu.available(mkl_on_host)
  assert (decode_cpu.TARGET in cpu_targets) == decode_kernel, cpu_targets
  assert not set(PLATFORM_KERNELS.values()) & cpu_targets
