"""The transformers + PyTorch peer alone (no JAX in its process): forward + backward per token
for the batch shapes of bench_model (4 x 512) and bench_learner (1 x 1024 rows, accumulated
twice; and 2 x 1024 at once), alternating in rounds.

It answers why bench_model's peer once ran at a third of bench_learner's peer: if the shapes
run at about the same speed here, the gap came from the conditions of those runs (load), not
from how the peer is set up. The weights are SmolLM2-135M, exported to an HF folder by a
separate process so that this one never imports JAX.

    python benchmarks/bench_model_peer_shapes.py [--rounds 2]

Progress goes to stderr; the last stdout line is one JSON object.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SHAPES = {"4x512": (4, 512, 1), "1x1024x2": (1, 1024, 2), "2x1024": (2, 1024, 1)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=2)
  args = ap.parse_args()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as hf_dir:
    subprocess.run([sys.executable, "-c",
                    "import sys; from rao_jax.model import load_pretrained; "
                    "from rao_jax.model.weights import export_hf; "
                    "m, t = load_pretrained('smollm2-135m', dtype='float32'); "
                    "export_hf(m, m.cfg, None, sys.argv[1])", hf_dir],
                   check=True, cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    import torch
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    rng = np.random.default_rng(0)
    toks = {k: [torch.from_numpy(rng.integers(0, model.config.vocab_size, (b, t + 1)))
                for _ in range(n)] for k, (b, t, n) in SHAPES.items()}

    def step(k):
      model.zero_grad(set_to_none=True)
      for x in toks[k]:
        model(input_ids=x, labels=x, use_cache=False).loss.backward()

    for k in SHAPES:
      step(k)
    times = {k: [] for k in SHAPES}
    for r in range(args.rounds):
      for k in SHAPES:
        t0 = time.perf_counter()
        step(k)
        times[k].append(time.perf_counter() - t0)
        print(f"round {r} {k}: {times[k][-1]:.2f} s", file=sys.stderr, flush=True)
  out = {"benchmark": "model_peer_shapes", "torch": torch.__version__,
         "threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2)}
  for k, (b, t, n) in SHAPES.items():
    s = statistics.median(times[k])
    out[k] = {"step_s": round(s, 3), "tokens_per_s": round(b * t * n / s, 1)}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
