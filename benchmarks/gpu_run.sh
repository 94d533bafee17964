#!/usr/bin/env bash
# The accelerator checks on one NVIDIA GPU (an H200 when one is lent), offline: parts 1-4 in
# under 10 minutes, part 5 up to 4 more (PARTS="5" runs it alone, PARTS="1 2 4" the others,
# so each command fits a 10-minute call). The machine has no package index but has jax
# (CUDA), flax, optax, orbax, chex, absl-py, transformers, tokenizers, safetensors, aiohttp
# and tqdm; rao_jax's learner, model and engine import nothing else, so the tree runs from
# PYTHONPATH (no install, no wheels).
#
#   OUT=/path bash benchmarks/gpu_run.sh              # on the GPU: JSON lines under $OUT
#   OUT=/path PARTS="5" bash benchmarks/gpu_run.sh    # only the paged KV cache's part
#   bash benchmarks/gpu_run.sh --cpu-dry-run          # here: the same steps at toy sizes on CPU
#
# It prints (and writes to $OUT/*.json) one JSON line per part:
#   1. learner MFU of a ~1.2B Llama-3.2-1B-shaped config at sequence 4,096, bfloat16 compute,
#      float32 masters (benchmarks/bench_learner.py --mfu; goal >= 40%);
#   2. decode tokens/s of the engine's cached forward at batch 64 against the HBM roofline
#      (bf16 weights + the KV cache read once per step; goal >= 50%);
#   3. the training attention's kernel (rao_jax.kernels.attention: Pallas/Triton on CUDA) against
#      XLA's blocked attention, forward + backward, at 4,096 and 8,192 tokens;
#   4. the decode attention over live slots (rao_jax.kernels.decode: Pallas/Triton on CUDA)
#      against XLA's attention over the whole cache window, one layer of Llama-3.2-1B's shape,
#      at batch 64 x 4,096 slots and at batch 8 x a 40,960-slot (40K) context, rows holding
#      a quarter to all of the window;
#   5. the paged KV cache (benchmarks/bench_paged_decode.py): its decode kernel
#      (rao_jax.kernels.paged, Pallas/Triton over each row's page table) against XLA's
#      attention over the gathered pages at batch 64 x 4,096 slots and batch 8 x 40K, and the
#      rows of a 40K context the embedded engine holds with its pool in the GPU's free memory
#      (TextCraft-length requests all running at once) against a fixed 40K window.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [[ "${1:-}" == "--cpu-dry-run" ]]; then DRY=1; fi
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if [[ $DRY == 1 ]]; then
  export JAX_PLATFORMS=cpu
  PY=${PYTHON:-.venv/bin/python}
  MFU_ARGS=(--mfu --mfu_smoke --seq 256 --rows 2 --micro_rows 2 --repeats 1)
  LIMIT_MFU=1800; LIMIT_REST=1800    # a shared 2-core CPU compiles slowly; no budget to keep
else
  # The lent machine runs one GPU: let XLA take most of it up front (no growth stalls).
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
  MFU_ARGS=(--mfu --seq 4096 --rows 8 --micro_rows 4 --repeats 3 --remat full)
  LIMIT_MFU=300; LIMIT_REST=240      # with start-up, inside the 10 minutes of a lent H200
fi
export GPU_RUN_DRY=$DRY
PARTS=${PARTS:-"1 2 4 5"}   # 2 is parts 2 and 3 (one program)
want() { [[ " $PARTS " == *" $1 "* ]]; }
status=0

"$PY" -c "import jax; print(jax.__version__, jax.devices())" | tee "$OUT/devices.txt" || exit 1

if want 1; then
echo "== 1/3 learner MFU" >&2
timeout "$LIMIT_MFU" "$PY" benchmarks/bench_learner.py "${MFU_ARGS[@]}" | tail -n 1 \
  > "$OUT/learner_mfu.json"
if [[ ! -s "$OUT/learner_mfu.json" ]]; then   # timed out or failed: say so in the JSON too
  echo "{\"bench\": \"learner_mfu\", \"error\": \"no result within ${LIMIT_MFU} s (see stderr)\"}" \
    > "$OUT/learner_mfu.json"
fi
cat "$OUT/learner_mfu.json"
fi

if want 2; then
echo "== 2/3 decode and 3/3 attention" >&2
timeout "$LIMIT_REST" "$PY" - "$OUT" <<'PYEOF'
"""Decode throughput against the HBM roofline, and the attention kernel against XLA's."""
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rao_jax.learner.testing import init_params
from rao_jax.kernels import attention as kernels
from rao_jax.model.config import ModelConfig
from rao_jax.model.transformer import Transformer

DRY = os.environ.get("GPU_RUN_DRY") == "1"
OUT = sys.argv[1]
HBM_BYTES_PER_S = 4.8e12          # H200 (HBM3e)
dev = jax.devices()[0]


def timed(fn, *args, repeats=5):
  jax.block_until_ready(fn(*args))     # compile + warm
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def emit(name, row):
  row = {"bench": name, "platform": dev.platform, "device": dev.device_kind, "dry_run": DRY,
         **row}
  line = json.dumps(row)
  print(line)
  with open(os.path.join(OUT, f"{name}.json"), "w") as f:
    f.write(line + "\n")


# ---- 2. decode at batch 64 -------------------------------------------------------------------
base = dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
            mlp_dim=8192, rope_theta=500000.0, tie_embeddings=True, param_dtype="bfloat16",
            dtype="bfloat16")
B, S = (64, 4096) if not DRY else (4, 128)
if DRY:
  base.update(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=512)
cfg = ModelConfig(**base)
model = nnx.merge(nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))),
                            nnx.Param)[0], init_params(cfg, 0))
fns, params = model.inference_fns(), model.inference_params()
cache = model.init_cache(batch_size=B, max_len=S)


def decode_step(params, cache, tokens_B, lengths_B):
  h, cache = fns(params, tokens_B[:, None], lengths_B[:, None], cache, lengths_B)
  logits = fns.logits(params, h)[:, 0]
  return jnp.argmax(logits, -1).astype(jnp.int32), cache, lengths_B + 1


step = jax.jit(decode_step, donate_argnums=(1,))
tokens = jnp.ones((B,), jnp.int32)
lengths = jnp.full((B,), S // 2, jnp.int32)
tokens, cache, lengths = step(params, cache, tokens, lengths)      # compile
jax.block_until_ready(tokens)
n_steps = 32 if not DRY else 4
t0 = time.perf_counter()
for _ in range(n_steps):
  tokens, cache, lengths = step(params, cache, tokens, lengths)
jax.block_until_ready(tokens)
step_s = (time.perf_counter() - t0) / n_steps
weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)
                   if x is not params["head"])           # the tied head is the embedding
# The decode attention reads only the slots each row holds (rao_jax.kernels.decode): half the
# window here (the steps add a few slots to S // 2).
cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)) * (S // 2) // S
roofline_s = (weight_bytes + cache_bytes) / HBM_BYTES_PER_S
emit("decode_roofline", {
    "batch": B, "cache_len": S, "filled": S // 2, "step_s": step_s,
    "tokens_per_s": B / step_s, "bytes_per_step": weight_bytes + cache_bytes,
    "roofline_tokens_per_s": B / roofline_s, "fraction_of_roofline": roofline_s / step_s,
    "note": "roofline: bf16 weights + the KV slots the rows hold (half the window)",
    "goals_met": {"fraction>=0.5": roofline_s / step_s >= 0.5}})

# ---- 3. attention kernel vs XLA ----------------------------------------------------------------
rows = []
for T in ((4096, 8192) if not DRY else (128,)):
  H, K, h = 32, 8, 64
  if DRY:
    H, K, h = 4, 2, 16
  k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(k0, (1, T, H, h), jnp.bfloat16)
  k = jax.random.normal(k1, (1, T, K, h), jnp.bfloat16)
  v = jax.random.normal(k2, (1, T, K, h), jnp.bfloat16)
  seg = jnp.asarray(np.repeat(np.arange(1, 5), T // 4)[None], jnp.int32)   # 4 packed segments
  kernel = (lambda *a: kernels.gpu_flash_attention(*a, interpret=True)) if DRY else \
      kernels.gpu_flash_attention

  def fwd_bwd(fn):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg).astype(jnp.float32)),
                            argnums=(0, 1, 2)))

  got = jax.jit(kernel)(q, k, v, seg).astype(jnp.float32)
  want = jax.jit(kernels.xla_causal_attention)(q, k, v, seg).astype(jnp.float32)
  err = float(jnp.max(jnp.abs(got - want)))
  t_kernel = timed(fwd_bwd(kernel), q, k, v)
  t_xla = timed(fwd_bwd(kernels.xla_causal_attention), q, k, v)
  rows.append({"T": T, "heads": H, "kv_heads": K, "head_dim": h, "segments": 4,
               "kernel_fwd_bwd_s": t_kernel, "xla_fwd_bwd_s": t_xla,
               "speedup": t_xla / t_kernel, "max_abs_diff_bf16": err})
emit("attention_kernel", {"kernel": "pallas gpu flash attention (segment ids, causal)",
                          "peer": "XLA blocked causal attention", "rows": rows})
PYEOF
status=$(( status || $? ))
fi

if want 4; then
echo "== 4/4 decode attention over live slots" >&2
timeout "$LIMIT_REST" "$PY" - "$OUT" <<'PYEOF'
"""The decode attention kernel over live slots against XLA's attention over the window."""
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rao_jax.kernels import decode

DRY = os.environ.get("GPU_RUN_DRY") == "1"
OUT = sys.argv[1]
HBM_BYTES_PER_S = 4.8e12          # H200 (HBM3e)
dev = jax.devices()[0]


def timed(fn, *args, repeats=7):
  jax.block_until_ready(fn(*args))     # compile + warm
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


H, K, h = (32, 8, 64) if not DRY else (4, 2, 16)      # Llama-3.2-1B's attention
cases = ((64, 4096), (8, 40960)) if not DRY else ((4, 256), (2, 1024))
kernel = (lambda *a: decode.gpu_decode_attention(*a, interpret=True)) if DRY else \
    decode.decode_attention                # the entry: Pallas on CUDA
rows = []
for B, S in cases:
  k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(k0, (B, 1, H, h), jnp.bfloat16)
  k = jax.random.normal(k1, (B, K, h, S), jnp.bfloat16)
  v = jax.random.normal(k2, (B, K, S, h), jnp.bfloat16)
  start = jnp.asarray(np.random.default_rng(0).integers(S // 4, S, B), jnp.int32)
  got = jax.jit(kernel)(q, k, v, start).astype(jnp.float32)
  want = jax.jit(decode.xla_decode_attention)(q, k, v, start).astype(jnp.float32)
  err = float(jnp.max(jnp.abs(got - want)))
  t_kernel = timed(jax.jit(kernel), q, k, v, start)
  t_xla = timed(jax.jit(decode.xla_decode_attention), q, k, v, start)
  live_bytes = int(jnp.sum(start + 1)) * K * h * 2 * 2          # keys + values, bf16
  rows.append({"batch": B, "window": S, "mean_held": float(jnp.mean(start + 1)),
               "kernel_s": t_kernel, "xla_s": t_xla, "speedup": t_xla / t_kernel,
               "kernel_live_kv_fraction_of_hbm": live_bytes / t_kernel / HBM_BYTES_PER_S,
               "max_abs_diff_bf16": err})
row = {"bench": "decode_attention_kernel", "platform": dev.platform,
       "device": dev.device_kind, "dry_run": DRY, "heads": H, "kv_heads": K, "head_dim": h,
       "kernel": "pallas triton decode over live slots (rao_jax.kernels.decode)",
       "peer": "XLA attention over the whole window (masked)", "rows": rows}
line = json.dumps(row)
print(line)
with open(os.path.join(OUT, "decode_attention_kernel.json"), "w") as f:
  f.write(line + "\n")
PYEOF
status=$(( status || $? ))
fi

if want 5; then
echo "== 5/5 paged KV cache: decode kernel and rows at 40K" >&2
SMOKE=()
if [[ $DRY == 1 ]]; then SMOKE=(--smoke); fi
timeout "$LIMIT_REST" "$PY" benchmarks/bench_paged_decode.py --out "$OUT" ${SMOKE[@]+"${SMOKE[@]}"} \
  | tail -n 1 > "$OUT/paged_decode.json"
paged=${PIPESTATUS[0]}
if [[ ! -s "$OUT/paged_decode.json" ]]; then
  echo "{\"bench\": \"paged_decode\", \"error\": \"no result within ${LIMIT_REST} s (see stderr)\"}" \
    > "$OUT/paged_decode.json"
fi
cat "$OUT/paged_decode.json"
status=$(( status || paged ))
fi
ls -l "$OUT" >&2
exit $status
