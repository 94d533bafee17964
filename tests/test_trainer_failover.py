"""The trainer with its rollouts on a real rao_jax.rollout.serve process (a tiny random SmolLM2
written as an HF folder, as tests/test_trainer.py runs it): trees no server could run are
infrastructure failures, never scored as the agent's; when the only server dies mid-run the run
stops with a checkpoint and one message naming the URL (the command line prints it without a
traceback), and the same run resumes from that checkpoint once the server is back."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from rao_jax import hooks as hooks_lib
from rao_jax import collection
from rao_jax import trainer as tr
from tests import test_trainer

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One cache length and one prompt chunk: few shapes for the server to compile.
ENGINE = ["--num-slots", "4", "--max-len", "1024", "--min-cache-len", "1024",
          "--chunk-sizes", "256", "--prefill-rows", "4"]


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Server:
  """One serve process on a fixed port, restartable (a restart loads the compilation cache)."""

  def __init__(self, model_dir, cache_dir, weight_root):
    self.port, self.model_dir, self.cache_dir = free_port(), model_dir, cache_dir
    self.weight_root = weight_root   # the runs' weight exports live under it
    self.url = f"http://127.0.0.1:{self.port}"
    self.proc = None

  def start(self):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_COMPILATION_CACHE_DIR=self.cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "rao_jax.rollout.serve", "--model", self.model_dir,
         "--port", str(self.port), "--weight-roots", self.weight_root, *ENGINE],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.time()
    while time.time() - t0 < 120:
      if self.proc.poll() is not None:
        raise RuntimeError("server died: " + self.proc.stderr.read().decode()[-3000:])
      try:
        with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
          if r.status == 200:
            return
      except OSError:
        time.sleep(0.2)
    raise TimeoutError("server did not become healthy")

  def kill(self):
    if self.proc is not None and self.proc.poll() is None:
      self.proc.send_signal(signal.SIGKILL)
      self.proc.wait(30)



@pytest.fixture(scope="module")
def server(tiny_hf_dir, tmp_path_factory):
  srv = Server(tiny_hf_dir, str(tmp_path_factory.mktemp("jaxcache")),
               str(tmp_path_factory.getbasetemp()))
  srv.start()
  yield srv
  srv.kill()


def _config(model_dir, url, total_steps=2):
  # The Trainer tests' tiny run, its rollouts on the server at `url`.
  c = test_trainer._config(model_dir, total_steps)
  c.rollout.engine = "sglang"
  c.rollout.urls = (url,)
  c.rollout.retry_timeout = 2.0
  c.rollout.health_interval = 0.2
  c.rl.tasks_per_step = 1
  c.warmup = False             # the learner compiles on step 1; nothing else to warm
  c.ckpt.every = 1000          # the only checkpoints: the ones the stop and the end save
  c.eval.every = 0
  c.log.progress = False
  c.log.tensorboard = False
  return c


def test_config_rejects_a_bad_retry_timeout():
  from rao_jax import experiment as X
  c = _config("unused", "http://127.0.0.1:1")
  c.rollout.retry_timeout = 0
  with pytest.raises(ValueError, match=r"config\.rollout\.retry_timeout=0(\.0)?: give a number"):
    X.make_engine(c, None, None)


def test_trees_no_server_could_run_are_infrastructure_failures_not_scored(server, tiny_hf_dir):
  from rao_jax import experiment as X
  from rao_jax.agent import local_exec
  from rao_jax.rollout import EngineUnavailableError
  c = _config(tiny_hf_dir, server.url)
  env = X.make_env(c)
  task = X.task_split(env, "train", c.env.train_difficulty)[0]
  _, tok = X.load_policy(c)
  dead = f"http://127.0.0.1:{free_port()}"      # nothing listens there

  async def go(urls):
    c.rollout.urls = tuple(urls)
    engine = X.make_engine(c, None, tok)
    runner = X.make_runner(c, env, engine, tok, local_exec.LocalReplPool())
    try:
      return await collection.collect_group(runner, task, 2, infra_retries=1), engine
    finally:
      await engine.close()

  # Both trees on a live server: kept and scored, whatever the random policy does.
  (kept, every, stats), _ = asyncio.run(go([server.url]))
  assert len(kept) == 2 and stats["infra_failed_trees"] == 0
  # Every server gone: each tree (and its re-run) is an infrastructure failure naming the URL,
  # left out of its group's baseline and of the loss, and counted.
  (kept, every, stats), engine = asyncio.run(go([dead]))
  assert kept == [] and len(every) == 4
  assert stats["infra_failed_trees"] == 2 and stats["infra_retries"] == 2
  assert stats["infra_excluded_trees"] == 2 and stats["groups_dropped"] == 1
  for t in every:
    err = collection.infra_error(t)
    assert err is not None and "EngineUnavailableError" in err and dead in err, err
    assert t.root.end_reason == "error" and t.meta["excluded"].startswith(
        "infrastructure failure")
  with pytest.raises(EngineUnavailableError, match=dead):
    engine.check_available()


def test_all_servers_gone_stops_with_a_checkpoint_and_the_run_resumes(server, tiny_hf_dir,
                                                                      tmp_path, monkeypatch):
  wd = str(tmp_path / "run")
  real_hooks = tr.Trainer.hooks

  def hooks(self, repls, stopper, state):
    # The server dies right after step 1 (its update, sync and metrics done).
    return real_hooks(self, repls, stopper, state) + [
        hooks_lib.Hook("kill the server", 1, lambda step, m: server.kill() if step == 1
                       else None)]
  monkeypatch.setattr(tr.Trainer, "hooks", hooks)
  t0 = time.monotonic()
  with pytest.raises(tr.RolloutUnavailableError) as err:
    tr.train(_config(tiny_hf_dir, server.url), wd)
  msg = str(err.value)
  assert server.url in msg and "Training stopped at step 1" in msg, msg
  assert "newest checkpoint is step 1" in msg and "run the same command" in msg, msg
  assert os.path.isdir(os.path.join(wd, "checkpoints", "1"))
  rows = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]
  steps = [r for r in rows if "train/success" in r]
  assert [r["step"] for r in steps] == [1]
  assert steps[0]["train/rollout/servers_up"] == 1.0
  print(f"stopped after {time.monotonic() - t0:.1f} s")

  # The command line reports the same stop as one readable line, exit status 1: resumed from
  # step 1, its first weight sync finds no server.
  cmd = [sys.executable, "-m", "experiments.train",
         "--config=experiments/configs/textcraft_synth.py:recursive,smoke", f"--workdir={wd}",
         f"--config.model.name={tiny_hf_dir}", "--config.total_steps=2",
         "--config.agent.max_new_tokens=16", "--config.agent.max_steps_per_agent=2",
         "--config.agent.context_window=1024", "--config.rollout.max_cache_len=1024",
         "--config.learner.row_len=1024", "--config.learner.mesh=data=2",
         "--config.rl.tasks_per_step=1", "--config.rl.kl_coef=0.01",
         "--config.rl.update_without_signal=True",
         "--config.rl.drop_equal_groups=False",
         "--config.rollout.engine=sglang", f"--config.rollout.urls=('{server.url}',)",
         "--config.rollout.retry_timeout=1", "--config.warmup=False",
         "--config.eval.every=0", "--config.log.progress=False"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stdout + out.stderr
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("rao-train: Training stopped at step 1") and server.url in last, last

  # The server is back: the same run resumes from step 1's checkpoint and finishes step 2.
  monkeypatch.setattr(tr.Trainer, "hooks", real_hooks)
  server.start()
  res = tr.train(_config(tiny_hf_dir, server.url), wd)
  assert res["step"] == 2 and not res["stopped"]
  rows = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]
  assert [r["step"] for r in rows if "train/success" in r] == [1, 2]
