"""Multi-host: two CPU processes joined by jax.distributed over loopback take the same learner
step as one process, on the same global batch (the path `experiments/*.py --coordinator_address
--num_processes --process_id` takes)."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
nproc, pid, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if nproc > 1:
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                             process_id=pid, local_device_ids=None)
import numpy as np
from rao_jax.model import ModelConfig
from rao_jax.model import sharding
from rao_jax.learner import Learner, LearnerConfig
from rao_jax.learner import testing as lt
cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=64, tie_embeddings=True)
assert jax.device_count() == 2, jax.devices()
lcfg = LearnerConfig(row_len=64, micro_batch_rows=2, bucket_rows=(2, 4, 8), lr=1e-2, seed=3)
learner = Learner(lcfg, cfg, mesh=sharding.make_mesh(2, 1, 1))
trees = lt.synthetic_trees(2, 2, vocab=97, seed=5, max_len=60, mean_len=30)
batch, _ = learner.prepare(trees)
m = learner.step(batch)
flat = jax.tree.leaves(learner.params)
from jax.experimental import multihost_utils
host = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in flat]
print("RESULT " + json.dumps({"loss": m["loss"], "grad_norm": m["grad_norm"],
                              "param_sums": [float(np.abs(h).sum()) for h in host],
                              "first": [float(h.ravel()[0]) for h in host]}), flush=True)
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(nproc, extra_env):
  port = str(_free_port())
  env = dict(os.environ, JAX_PLATFORMS="cpu", **extra_env)
  procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(nproc), str(i), port], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(nproc)]
  outs = [p.communicate(timeout=420)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
  return [json.loads(next(l for l in o.splitlines() if l.startswith("RESULT "))[7:])
          for o in outs]


def test_two_processes_match_one():
  # One process with two (fake) CPU devices, the same 2-device mesh...
  single = _run(1, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})[0]
  # ...and two processes with one CPU device each, joined over loopback.
  multi = _run(2, {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
  for r in multi:
    np.testing.assert_allclose(r["loss"], single["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["grad_norm"], single["grad_norm"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["param_sums"], single["param_sums"], rtol=1e-5)
    np.testing.assert_allclose(r["first"], single["first"], rtol=1e-5, atol=1e-7)
