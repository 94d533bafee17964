"""A LoRA run's weight sync to SGLang-style servers: the adapter alone against the full model.

    python benchmarks/bench_lora_sync.py [--rank=8] [--rounds=3] [--quick] [--out=FILE]

SmolLM2-135M (the real weights, float32 on CPU) with a rank ``--rank`` adapter on every
projection (random B, so it is not the zero adapter). Two ways to sync it, alternating in
``--rounds`` rounds:

- adapter: ``SGLangEngine.update_adapter``: ``peft.save_adapter`` writes adapter_config.json and
  adapter_model.safetensors, then every server loads it with /load_lora_adapter (pause -> load
  -> relabel -> continue) and merges it into its own base;
- full (the peer): ``SGLangEngine.update_weights``: ``export_hf`` writes the merged model as an
  HF folder (config, safetensors, tokenizer files), then /update_weights_from_disk loads it.

Each side reports the bytes written, the seconds of the write alone, and (unless --quick) the
seconds of the whole sync against one real ``python -m rao_jax.rollout.serve --model
smollm2-135m --max-lora-rank R`` process on this machine (the server loads the files back from
the same disk). Medians over the rounds; ratios full / adapter.

Progress goes to stderr, ONE JSON line to stdout; --out writes it to a file too.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peak  # noqa: E402  (this folder's: the CPU's name)


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def folder_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def start_server(port: int, roots: str, rank: int) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.Popen(
      [sys.executable, "-m", "rao_jax.rollout.serve", "--model", "smollm2-135m", "--port",
       str(port), "--weight-roots", roots, "--max-lora-rank", str(rank), "--dtype", "float32",
       "--num-slots", "2", "--max-len", "256", "--prefill-rows", "1", "--decode-rows", "2"],
      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_healthy(proc, url: str, timeout: float = 600) -> None:
  import urllib.request
  t0 = time.time()
  while time.time() - t0 < timeout:
    if proc.poll() is not None:
      raise RuntimeError("the server died: " + proc.stderr.read().decode()[-3000:])
    try:
      with urllib.request.urlopen(url + "/health", timeout=1) as r:
        if r.status == 200:
          return
    except OSError:
      time.sleep(0.5)
  raise TimeoutError(f"{url} did not become healthy in {timeout} s")


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--rank", type=int, default=8)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--quick", action="store_true",
                  help="time the writes only (no server)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  if args.rounds < 1:
    ap.error(f"--rounds {args.rounds}: give at least 1.")

  import jax
  import numpy as np
  from rao_jax.model import load_pretrained
  from rao_jax.model import lora as lora_lib
  from rao_jax.model.peft import adapter_bytes, save_adapter
  from rao_jax.model.weights import export_hf
  from rao_jax.rollout.sglang_client import SGLangEngine

  model, tokenizer = load_pretrained("smollm2-135m", dtype="float32")
  lora_lib.add_adapters(model, lora_lib.LoraConfig(rank=args.rank))
  rng = np.random.default_rng(0)
  for t in model.cfg.lora.targets:
    var = getattr(model.lora, f"{t}_b")
    var.set_value(jax.numpy.asarray(rng.normal(0, 0.01, var.shape), var[...].dtype))
  log(f"smollm2-135m + rank-{args.rank} adapter on {list(model.cfg.lora.targets)}: "
      f"{adapter_bytes(model) / 2**20:.1f} MiB of adapter arrays")

  work = tempfile.mkdtemp(prefix="bench_lora_sync_")
  roots = os.path.join(work, "weights")
  os.makedirs(roots)
  res = {"adapter": {"bytes": [], "write_s": [], "sync_s": []},
         "full": {"bytes": [], "write_s": [], "sync_s": []}}
  proc = None
  try:
    for r in range(args.rounds):
      for kind in ("adapter", "full"):
        out = os.path.join(work, f"{kind}{r}")
        t0 = time.perf_counter()
        if kind == "adapter":
          save_adapter(model, out)
        else:
          export_hf(model, None, tokenizer, out)
        res[kind]["write_s"].append(time.perf_counter() - t0)
        res[kind]["bytes"].append(folder_bytes(out))
        shutil.rmtree(out)
        log(f"round {r} {kind}: {res[kind]['bytes'][-1] / 2**20:.1f} MiB written in "
            f"{res[kind]['write_s'][-1]:.3f} s")

    if not args.quick:
      with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
      url = f"http://127.0.0.1:{port}"
      proc = start_server(port, roots, args.rank)
      t0 = time.perf_counter()
      wait_healthy(proc, url)
      log(f"server up in {time.perf_counter() - t0:.1f} s")

      async def syncs():
        client = SGLangEngine(url, export_root=roots, retry_timeout=600,
                              request_timeout=600, tokenizer=tokenizer)
        version = 0
        for r in range(args.rounds):
          for kind in ("adapter", "full"):
            version += 1
            t0 = time.perf_counter()
            if kind == "adapter":
              await client.update_adapter(model, version)
            else:
              await client.update_weights(model, version)
            res[kind]["sync_s"].append(time.perf_counter() - t0)
            assert (await client.get_weight_versions())[url] == str(version)
            shutil.rmtree(client.export_dir(version))
            log(f"round {r} {kind}: whole sync {res[kind]['sync_s'][-1]:.3f} s")
        await client.close()
      asyncio.run(syncs())
  finally:
    if proc is not None and proc.poll() is None:
      proc.send_signal(signal.SIGTERM)
      try:
        proc.wait(30)
      except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(work, ignore_errors=True)

  med = {k: {m: (statistics.median(v) if v else None) for m, v in d.items()}
         for k, d in res.items()}
  ratio = {m: (med["full"][m] / med["adapter"][m] if med["adapter"][m] else None)
           for m in ("bytes", "write_s", "sync_s")}
  line = {"bench": "lora_sync", "model": "smollm2-135m", "param_dtype": "float32",
          "lora_rank": args.rank, "lora_targets": list(model.cfg.lora.targets),
          "rounds": args.rounds, "cpu": bench_peak.cpu_model(), "cpu_count": os.cpu_count(),
          "backend": jax.default_backend(),
          "adapter_bytes": int(med["adapter"]["bytes"]),
          "adapter_write_s": round(med["adapter"]["write_s"], 4),
          "adapter_sync_s": (round(med["adapter"]["sync_s"], 4)
                             if med["adapter"]["sync_s"] is not None else None),
          "full_bytes": int(med["full"]["bytes"]),
          "full_write_s": round(med["full"]["write_s"], 4),
          "full_sync_s": (round(med["full"]["sync_s"], 4)
                          if med["full"]["sync_s"] is not None else None),
          "ratio_full_over_adapter": {k: (round(v, 2) if v is not None else None)
                                      for k, v in ratio.items()},
          "sync": ("SGLangEngine.update_adapter / update_weights against one local "
                   "rao_jax.rollout.serve process" if not args.quick else None)}
  text = json.dumps(line)
  print(text, flush=True)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return line


if __name__ == "__main__":
  main()
