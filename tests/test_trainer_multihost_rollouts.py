"""Multi-host RL steps: 2 CPU processes x 2 devices run the full trainer (rollouts, learner,
weight sync, checkpoint, resume) over jax.distributed, each rolling out its own share of tasks.

The scripted TextCraft policy stands in for the model in the rollouts (the model is not under
test: the trainer's task split, tree exchange, global batch, weight sync and checkpoints are);
the learner trains a random ModelConfig.tiny() of SmolLM2. Checked: disjoint task shares whose
union is the step's tasks, bit-identical parameters on both processes, every engine got every
version, and step 3 equals one 1-process (4-device) learner step from the step-2 checkpoint on
the union of the trees the processes exchanged.
"""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

# Two processes run 3 Trainer steps: 112 s on an idle 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.long]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMON = r"""
import hashlib, json, os, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
import numpy as np

def config(model_dir, total_steps):
  from experiments.configs import textcraft_synth
  c = textcraft_synth.get_config("single,smoke")
  c.model.name = model_dir
  c.total_steps = total_steps
  c.agent.context_window = 1024    # a node is at most one row: 8 trees fit the one bucket
  c.learner.row_len = 1024
  c.rollout.max_cache_len = 1024
  c.rl.tasks_per_step = 4          # 2 groups per process
  c.rl.group_size = 2
  c.rl.kl_coef = 0.01              # keeps every node (the scripted trees of a group are equal)
  c.rl.update_without_signal = True  # and steps on them although no node has an advantage
  c.rl.drop_equal_groups = False   # (its groups are all equal: keep them)
  c.learner.micro_batch_rows = 4   # whole rows per device of the 4-device mesh
  c.learner.bucket_rows = (8,)     # one compilation
  c.optim.lr = 1e-3
  c.optim.warmup_steps = 0
  c.sandbox.isolation = "process"
  c.sandbox.pool_size = 2
  c.ckpt.every = 1
  c.eval.every = 0
  c.log.progress = False
  c.log.tensorboard = False
  return c

def digest(params):
  from jax.experimental import multihost_utils
  h = hashlib.sha256()
  for x in jax.tree.leaves(params):
    h.update(np.ascontiguousarray(np.asarray(multihost_utils.process_allgather(x, tiled=True))))
  return h.hexdigest()
"""

WORKER = COMMON + r"""
nproc, pid, port, model_dir, wd, steps = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                          sys.argv[4], sys.argv[5], int(sys.argv[6]))
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                           process_id=pid)
assert jax.device_count() == 4 and jax.local_device_count() == 2
from rao_jax import experiment as X
from rao_jax import trainer
from rao_jax.agent import policies
from flax import nnx

shares, versions = [], []
real_collect = trainer.Trainer.collect

async def collect(self, runner, step):
  tasks = X.train_tasks_for_step(self.train_tasks, step, self.rl.tasks_per_step,
                                 self.parts.train_seed)
  shares.append([step, [t.task_id for t in trainer.process_share(tasks, self.process,
                                                                 self.num_processes)],
                 [t.task_id for t in tasks]])
  return await real_collect(self, runner, step)

class Versioned(policies.ScriptedTextCraftEngine):
  async def update_weights(self, model, version):
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(x.is_fully_addressable for x in leaves)   # a process-local copy
    self._weight_version = version
    versions.append([version, float(sum(np.abs(np.asarray(x, np.float64)).sum()
                                        for x in leaves))])

trainer.Trainer.collect = collect
X.EngineSpec.build = lambda self, model, tokenizer, **kw: Versioned(tokenizer)
t = trainer.Trainer.from_config(config(model_dir, steps), wd)
res = t.run()
print("RESULT " + json.dumps({"step": res["step"], "digest": digest(t.learner.params),
                              "shares": shares, "versions": versions,
                              "start": t.start_step}), flush=True)
t.learner.close()
"""

REFERENCE = COMMON + r"""
model_dir, wd = sys.argv[1], sys.argv[2]
assert jax.device_count() == 4 and jax.process_count() == 1
from rao_jax import experiment as X
from rao_jax.agent import records as R
from rao_jax.learner import Learner
c = config(model_dir, 3)
model, _ = X.load_policy(c)
learner = Learner(X.learner_config(c, wd + "_ref"), model.cfg, mesh=X.make_mesh("auto"),
                  params=model)
learner.restore(step=2, directory=os.path.join(wd, "checkpoints"))
every = R.load_trees_jsonl(os.path.join(wd, "trees", "step_000002.jsonl"))
trees = [t for t in every if "excluded" not in t.meta]
batch, _ = learner.prepare(trees)
learner.step(batch)
after = Learner(X.learner_config(c, wd + "_ref2"), model.cfg, mesh=X.make_mesh("auto"),
                params=model)
after.restore(step=3, directory=os.path.join(wd, "checkpoints"))
diffs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
         for a, b in zip(jax.tree.leaves(learner.params), jax.tree.leaves(after.params))]
print("RESULT " + json.dumps({"max_diff": max(diffs), "num_trees": len(trees)}), flush=True)
"""



def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _result(out):
  return json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])


def _run_pair(model_dir, wd, steps):
  port = str(_free_port())
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  logs = [open(f"{wd}.{steps}.p{i}.log", "w+") for i in range(2)]   # no pipe to fill up
  procs = [subprocess.Popen([sys.executable, "-c", WORKER, "2", str(i), port, model_dir, wd,
                             str(steps)], cwd=ROOT, env=env, stdout=logs[i],
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    # One process failing leaves the other waiting in a collective: end both then.
    deadline = time.time() + 1800
    while time.time() < deadline and any(p.poll() is None for p in procs):
      if any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(1)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  outs = []
  for p, f in zip(procs, logs):
    p.wait()
    f.seek(0)
    outs.append(f.read())
    f.close()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-6000:]
  return [_result(o) for o in outs]


def test_two_processes_split_rollouts_and_take_the_union_step(tiny_hf_dir, tmp_path):
  wd = str(tmp_path / "run")
  first = _run_pair(tiny_hf_dir, wd, 2)
  second = _run_pair(tiny_hf_dir, wd, 3)     # resumes from the step-2 checkpoint
  for runs in (first, second):
    assert runs[0]["digest"] == runs[1]["digest"]      # bit-identical parameters
  assert [r["start"] for r in second] == [2, 2] and [r["step"] for r in second] == [3, 3]
  for runs in (first, second):
    for (s0, share0, all0), (s1, share1, all1) in zip(runs[0]["shares"], runs[1]["shares"]):
      assert s0 == s1 and all0 == all1
      assert not set(share0) & set(share1) and sorted(share0 + share1) == sorted(all0)
      assert share0 and share1
    # Every process's engine got every version, the same weights.
    assert [v for v, _ in runs[0]["versions"]] == [v for v, _ in runs[1]["versions"]]
    np.testing.assert_allclose([w for _, w in runs[0]["versions"]],
                               [w for _, w in runs[1]["versions"]], rtol=0)
  assert [v for v, _ in first[0]["versions"]] == [0, 1, 2]
  assert [v for v, _ in second[0]["versions"]] == [2, 3]
  # Process 0 alone wrote the metrics, once per step.
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    assert [json.loads(l)["step"] for l in f if "train/success" in l] == [1, 2, 3]
  # Step 3 = one 1-process step on the union of the trees both processes rolled out.
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  out = subprocess.run([sys.executable, "-c", REFERENCE, tiny_hf_dir, wd], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
  assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
  ref = _result(out.stdout)
  assert ref["num_trees"] == 8
  assert ref["max_diff"] < 1e-6, ref
