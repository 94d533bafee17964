"""The RL loop over an embedded engine whose device call fails: the real `Trainer` (micro
environment, a random tiny policy, embedded engine, bwrap sandboxes, runner, learner,
checkpoints) with the fault injected at the jitted program the engine's scheduler calls.

One fault: the step completes, the trees whose requests were in flight end as infrastructure
errors (never the policy's failure) and are re-run, and the metrics count them. An engine that
keeps failing: the run stops with a checkpoint and a message naming the cause, not a hang and
not a bare traceback (the CLI prints the message and exits 1).
"""
import json
import os

import pytest

from experiments import micro_policy
from experiments.configs import micro as micro_config
from tests.test_rollout_engine_faults import DeviceFault

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
  """A random micro policy as an HF folder (no warm start: the model is not under test)."""
  from flax import nnx
  from rao_jax import experiment as X
  from rao_jax.model import Transformer, export_hf
  tok = micro_policy.tokenizer_for(X.make_env(micro_config.get_config()))
  cfg = micro_policy.model_config(tok.vocab_size, tok)
  out = str(tmp_path_factory.mktemp("micro_policy"))
  export_hf(Transformer(cfg, rngs=nnx.Rngs(0)), cfg, tok, out)
  return out


def _config(model_dir, total_steps):
  c = micro_config.get_config(f"model={model_dir}")
  c.total_steps = total_steps
  c.rl.group_size = 2
  c.rl.tasks_per_step = 2
  c.agent.max_new_tokens = 4        # the first token comes from a prefill, the rest from decodes
  c.rollout.num_slots = 4
  # One shape per program: few compilations.
  c.rollout.embedded.chunk_sizes = (64,)
  c.rollout.embedded.prefill_rows = (4,)
  c.rollout.embedded.decode_rows = (4,)
  c.sandbox.pool_size = 2
  c.warmup = False
  c.eval.every = 0
  return c


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if "train/success" in line]


def test_one_engine_fault_in_a_step_reruns_the_trees_it_hit(policy_dir, tmp_path, monkeypatch):
  from rao_jax import collection
  from rao_jax import trainer as tr
  from rao_jax.agent import records as R
  fault = DeviceFault("decode", lambda call: call == 1)   # the run's first decode call
  fault.install(monkeypatch)                               # before the trainer builds its engine
  wd = str(tmp_path / "run")
  res = tr.train(_config(policy_dir, 1), wd)
  assert fault.raised == 1 and res["step"] == 1 and not res["stopped"]
  (row,) = _rows(wd)
  every = R.load_trees_jsonl(os.path.join(wd, "trees", "step_000000.jsonl"))
  hit = [t for t in every if any(n.extras.get(R.ENGINE_ERROR) for n in t.nodes)]
  reruns = [t for t in every if ".retry" in t.tree_id]
  assert hit, [t.nodes[0].extras for t in every]
  # Each tree the fault hit was re-run once, in its own group, and the re-run is kept.
  assert sorted(t.tree_id + ".retry1" for t in hit) == sorted(t.tree_id for t in reruns)
  for t in hit:
    root = t.nodes[0]
    assert root.end_reason == R.END_ERROR
    assert "RESOURCE_EXHAUSTED" in root.extras[R.ENGINE_ERROR]
    assert root.extras[R.INFRA_ERROR] == root.extras[R.ENGINE_ERROR]
    assert t.meta["excluded"].startswith("infrastructure failure, retried: engine error")
    assert root.num_generated_tokens == 0   # the failed call's output is not kept
  for t in reruns:
    assert collection.infra_error(t) is None and "excluded" not in t.meta
  assert row["train/faults/engine_error_trees"] == len(hit)
  assert row["train/faults/infra_retries"] == len(hit)
  assert row["train/faults/infra_excluded_trees"] == 0
  assert row["train/faults/groups_dropped"] == 0
  assert row["train/rl/num_nodes"] == 4.0     # both groups train on two trees each


def test_an_engine_that_keeps_failing_stops_the_run_with_a_checkpoint(policy_dir, tmp_path,
                                                                      monkeypatch):
  from rao_jax import trainer as tr
  run = {}
  # Step 1 runs clean; once the engine serves step 1's weights, every prefill fails.
  fault = DeviceFault("prefill", lambda call: run["t"].engine.weight_version >= 1)
  fault.install(monkeypatch)
  wd = str(tmp_path / "run")
  c = _config(policy_dir, 3)
  c.rollout.embedded.max_consecutive_faults = 2
  t = run["t"] = tr.Trainer.from_config(c, wd)
  try:
    with pytest.raises(tr.RolloutEngineFailedError) as info:
      t.run()
  finally:
    t.learner.close()
  msg = str(info.value)
  assert fault.raised == 2 and t.engine.failure
  assert msg.startswith("The rollout engine stopped serving during step 2's rollouts")
  for part in ("2 device steps failed in a row", "max_consecutive_faults=2",
               "RESOURCE_EXHAUSTED", "--config.rollout.embedded.max_consecutive_faults",
               f"after step 1) is saved in {os.path.join(wd, 'checkpoints')}"):
    assert part in msg, (part, msg)
  # Step 1's metrics and checkpoint are there: the same command resumes from step 1.
  assert [r["step"] for r in _rows(wd)] == [1]
  ckpts = sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit())
  assert ckpts == [1]

  # The CLI prints a FatalRunError as one message and exits 1 (rao_jax.cli.train.train_or_exit;
  # run as a real command in tests/test_trainer_failover.py: importing the CLI here would define
  # its absl flags a second time beside the experiments' in this process).
  assert isinstance(info.value, tr.FatalRunError)
