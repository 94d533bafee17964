"""A checkpoint save the filesystem refuses: reported with the directory and the cause, training
goes on, the next save tries again, and a restart resumes from the last good checkpoint; a step
directory that holds no finished save is never restored.

The failures are real where the machine allows it (a full tmpfs, mounted in a private mount
namespace of a child process), else raised at Orbax's own file write
(`orbax.checkpoint._src.path.async_path.write_text`, under the learner's Checkpointer).
"""
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from orbax.checkpoint._src.path import async_path
from rao_jax.learner import Learner, LearnerConfig
from rao_jax.learner.checkpoint import is_committed, restore_params
from rao_jax.learner.testing import init_params, tiny_model_config

# The records test's tiny SmolLM2 and its small run config (one fixture per module).
from test_trainer_records_once import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_CFG = tiny_model_config()


def lcfg(ckpt_dir, use_async=True):
  return LearnerConfig(row_len=32, micro_batch_rows=4, bucket_rows=(4,), ckpt_dir=str(ckpt_dir),
                       ckpt_async=use_async)


@pytest.fixture
def refuse(monkeypatch):
  """Steps whose checkpoint files Orbax's write is refused with EACCES (as a directory the
  process may not write to would); add steps to the returned set."""
  steps = set()
  real = async_path.write_text

  async def write_text(path, text):
    name = str(path)
    if any(f"/{s}.orbax-checkpoint-tmp" in name for s in steps):
      raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
    return await real(path, text)
  monkeypatch.setattr(async_path, "write_text", write_text)
  return steps


@pytest.mark.parametrize("use_async", [True, False])
def test_a_refused_save_is_reported_and_the_next_one_is_tried(tmp_path, refuse, caplog, use_async):
  ckpt = tmp_path / "ckpt"
  learner = Learner(lcfg(ckpt, use_async), MODEL_CFG, params=init_params(MODEL_CFG, 0))
  assert learner.save(1, extra={"data_position": 1})
  refuse.add(2)
  with caplog.at_level(logging.ERROR, logger="rao_jax.learner.checkpoint"):
    started = learner.save(2, extra={"data_position": 2})
    # Synchronous: refused at once. Asynchronous: started, refused in the background, and
    # known once waited for; neither raises.
    assert started is use_async
    deadline = time.time() + 30
    while use_async and not learner.checkpoint_failures and time.time() < deadline:
      learner.poll_checkpoints()          # never waits: sees the save once it has ended
      time.sleep(0.05)
    assert len(learner.checkpoint_failures) == 1
    learner.wait_for_checkpoints()
  (failure,) = learner.checkpoint_failures
  assert (failure.step, failure.errno, failure.directory) == (2, errno.EACCES, str(ckpt))
  assert "Permission denied" in failure.cause
  (line,) = [r.getMessage() for r in caplog.records if r.name == "rao_jax.learner.checkpoint"]
  assert f"step 2 to {ckpt} failed (EACCES)" in line and "tries again" in line
  # Step 1 is what this process and a restart see. (Orbax's writers of the failed save may
  # still be running and recreate its temporary directory, which no listing takes for a step.)
  assert "2" not in os.listdir(ckpt) and learner.latest_checkpoint_step() == 1
  restarted = Learner(lcfg(ckpt, use_async), MODEL_CFG, params=init_params(MODEL_CFG, 1))
  assert restarted.latest_checkpoint_step() == 1
  assert restarted.restore() == {"data_position": 1}
  restarted.close()
  # The next save of the same step goes through.
  refuse.clear()
  assert learner.save(2, extra={"data_position": 2})
  learner.close()
  assert sorted(os.listdir(ckpt)) == ["1", "2"] and len(learner.checkpoint_failures) == 1


def test_a_half_written_step_directory_is_never_restored(tmp_path):
  ckpt = tmp_path / "ckpt"
  learner = Learner(lcfg(ckpt), MODEL_CFG, params=init_params(MODEL_CFG, 0))
  learner.save(1, extra={"data_position": 1})
  learner.save(2, extra={"data_position": 2})
  learner.close()
  # Step 3 as a copy cut short leaves it: the files, but not the marker of a finished save.
  shutil.copytree(ckpt / "2", ckpt / "3")
  for dirpath, _, files in os.walk(ckpt / "3"):
    if "commit_success.txt" in files:
      os.remove(os.path.join(dirpath, "commit_success.txt"))
  meta = json.load(open(ckpt / "3" / "_CHECKPOINT_METADATA"))
  meta["commit_timestamp_nsecs"] = None
  json.dump(meta, open(ckpt / "3" / "_CHECKPOINT_METADATA", "w"))
  assert is_committed(str(ckpt / "2")) and not is_committed(str(ckpt / "3"))
  # Orbax alone takes it for the newest checkpoint: on a local disk the name is all it checks.
  import orbax.checkpoint as ocp
  assert ocp.CheckpointManager(str(ckpt)).latest_step() == 3

  from flax import nnx
  from rao_jax.model import Transformer
  _, step = restore_params(str(ckpt), nnx.state(Transformer(MODEL_CFG, rngs=nnx.Rngs(0)),
                                                nnx.Param))
  assert step == 2
  resumed = Learner(lcfg(ckpt), MODEL_CFG, params=init_params(MODEL_CFG, 1))
  assert resumed.latest_checkpoint_step() == 2
  assert resumed.restore() == {"data_position": 2}
  leftovers = sorted(os.listdir(ckpt))
  assert leftovers[:2] == ["1", "2"] and leftovers[2].startswith("3.incomplete-"), leftovers
  assert resumed.save(3, extra={"data_position": 3})   # step 3 is saved anew
  resumed.close()
  assert is_committed(str(ckpt / "3"))


CHILD = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {root!r})
    from rao_jax.learner import Learner, LearnerConfig
    from rao_jax.learner.testing import init_params, tiny_model_config
    ckpt = sys.argv[1]
    cfg = LearnerConfig(row_len=32, micro_batch_rows=4, bucket_rows=(4,), ckpt_dir=ckpt)
    learner = Learner(cfg, tiny_model_config(), params=init_params(tiny_model_config(), 0))
    learner.save(1, extra={{"data_position": 1}})
    learner.wait_for_checkpoints()
    fd = os.open(os.path.join(ckpt, "ballast"), os.O_CREAT | os.O_WRONLY)
    try:                                   # the disk fills up
      while True:
        os.write(fd, bytes(1 << 16))
    except OSError:
      os.close(fd)
    out = {{"save_2_raised": False}}
    try:
      learner.save(2, extra={{"data_position": 2}})
      learner.wait_for_checkpoints()
    except Exception as e:
      out["save_2_raised"] = repr(e)
    out["failures"] = [[f.step, f.errno, f.directory] for f in learner.checkpoint_failures]
    out["after_failure"] = sorted(os.listdir(ckpt))
    restarted = Learner(cfg, tiny_model_config(), params=init_params(tiny_model_config(), 1))
    out["restart_latest"] = restarted.latest_checkpoint_step()
    out["restart_extra"] = restarted.restore()
    restarted.close()
    os.remove(os.path.join(ckpt, "ballast"))   # space freed: the next save goes through
    learner.save(3, extra={{"data_position": 3}})
    learner.close()
    out["final"] = sorted(os.listdir(ckpt))
    print("RESULT " + json.dumps(out), flush=True)
""")


def _can_mount_tmpfs(where) -> bool:
  probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"],
                         capture_output=True)
  return probe.returncode == 0


def test_a_full_disk_fails_the_save_and_the_next_save_succeeds(tmp_path):
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  if shutil.which("unshare") is None or not _can_mount_tmpfs(ckpt):
    pytest.skip("no private mount namespace here (needs root and unshare); the refused-write "
                "tests above cover the same code paths")
  # A 1 MiB tmpfs seen by the child alone: one ~0.2 MB checkpoint fits, then it is filled.
  cmd = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$0" -c "$2" '
         '"$1"', sys.executable, str(ckpt), CHILD.format(root=ROOT)]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  out = json.loads(lines[0][len("RESULT "):])
  assert out["save_2_raised"] is False
  assert out["failures"] == [[2, errno.ENOSPC, str(ckpt)]]
  assert f"step 2 to {ckpt} failed (ENOSPC)" in proc.stderr
  assert "2" not in out["after_failure"]                  # step 2 is nowhere a step
  assert out["restart_latest"] == 1 and out["restart_extra"] == {"data_position": 1}
  assert out["final"] == ["1", "3"]


@pytest.mark.slow
def test_training_goes_on_past_a_refused_save(tiny_hf_dir, tmp_path, refuse, caplog):
  from rao_jax import metrics as metrics_lib
  from rao_jax import trainer
  c = config(tiny_hf_dir)
  c.eval.every = 0
  refuse.add(2)                           # step 2's save, however often it is tried
  wd = str(tmp_path / "run")
  with caplog.at_level(logging.ERROR, logger="rao_jax.learner.checkpoint"):
    res = trainer.train(c, wd)
  assert res["step"] == 3 and res["checkpoint"] == 3 and res["checkpoint_failures"] == 1
  rows = metrics_lib.read_metrics(os.path.join(wd, "metrics.jsonl"))
  assert [r["step"] for r in rows if "train/success" in r] == [1, 2, 3]
  # The background save of step 2 failed; it tells once it has ended: at step 2's own hook
  # when it failed that fast, else at the save of step 3, which waits for it.
  (failed,) = [r for r in rows if "ckpt/save_failed" in r]
  assert failed.pop("step") in (2, 3)
  assert failed == {"ckpt/save_failed": 1.0, "ckpt/failed_step": 2.0,
                    "ckpt/errno": float(errno.EACCES), "ckpt/save_failures": 1.0}
  ckpt = os.path.join(wd, "checkpoints")
  assert any(f"step 2 to {ckpt} failed (EACCES)" in r.getMessage() for r in caplog.records)
  assert sorted(d for d in os.listdir(ckpt) if d.isdigit()) == ["1", "3"]
