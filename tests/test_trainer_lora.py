"""RL with a LoRA adapter end to end: the trainer trains the adapter alone, syncs it alone to the
embedded engine, checkpoints it (not the base), resumes, and evaluates from the checkpoint."""
import glob
import json
import os
import subprocess
import sys

import jax
import pytest

from test_trainer import _config, _metrics

pytestmark = pytest.mark.slow


def _lora_config(model_dir, total_steps):
  c = _config(model_dir, total_steps)
  c.model.lora.rank = 4
  c.model.lora.alpha = 8.0
  c.model.lora.targets = "q,v,down"
  c.optim.lr = 1e-2
  return c


def test_lora_run_trains_syncs_checkpoints_resumes_and_evaluates(tiny_hf_dir, tmp_path,
                                                                 monkeypatch):
  from rao_jax import evaluation, trainer
  from rao_jax.rollout.engine.frontend import EmbeddedEngine
  calls = {"adapter": 0, "weights": 0}
  real_adapter, real_weights = EmbeddedEngine.update_adapter, EmbeddedEngine.update_weights

  async def count_adapter(self, model, version):
    calls["adapter"] += 1
    return await real_adapter(self, model, version)

  async def count_weights(self, model, version):
    calls["weights"] += 1
    return await real_weights(self, model, version)
  monkeypatch.setattr(EmbeddedEngine, "update_adapter", count_adapter)
  monkeypatch.setattr(EmbeddedEngine, "update_weights", count_weights)

  wd = str(tmp_path / "run")
  res = trainer.train(_lora_config(tiny_hf_dir, 2), wd)
  assert res["step"] == 2 and not res["stopped"]
  # Every sync sent the adapter alone (the start's included): never the whole model.
  assert calls["adapter"] >= 3 and calls["weights"] == 0
  rows = [r for r in _metrics(wd) if "train/success" in r]
  assert [r["step"] for r in rows] == [1, 2]
  assert all(r["train/learner/update_applied"] == 1.0 for r in rows)

  # The checkpoint holds the adapter and its optimizer state, and names its base.
  step_dir = sorted(glob.glob(os.path.join(wd, "checkpoints", "[0-9]*")))[-1]
  with open(os.path.join(step_dir, "meta", "metadata")) as f:
    meta = json.load(f)
  assert meta["base_fingerprint"] and meta["model_config"]["lora"]["rank"] == 4
  with open(os.path.join(step_dir, "state", "_METADATA")) as f:
    keys = json.dumps(json.load(f))
  assert "params.lora.q_a" in keys and "params.layers.wq" not in keys

  # Evaluation loads the base and the checkpoint's adapter. (Whether the adapter moved depends
  # on the tiny model's rewards; test_learner_lora shows the learner moves it.)
  model, _, step, _ = evaluation.load_checkpoint(wd)
  assert step == 2 and model.cfg.lora.rank == 4
  assert model.lora.q_a[...].shape == (model.cfg.n_layers, model.cfg.d_model, 4)

  # Resume: one more step from the saved adapter and optimizer.
  res = trainer.train(_lora_config(tiny_hf_dir, 3), wd)
  assert res["step"] == 3
  assert [r["step"] for r in _metrics(wd) if "train/success" in r] == [1, 2, 3]
  ev = evaluation.evaluate_checkpoint(wd, num_tasks=1, modes=("recursive",))
  assert ev["step"] == 3
  # rao-evaluate itself, as a user runs it on the LoRA run: the same greedy trees.
  cli_out = str(tmp_path / "ev_cli")
  proc = subprocess.run([sys.executable, "-m", "rao_jax.cli.evaluate", f"--workdir={wd}",
                         "--num_tasks=1", "--modes=recursive", f"--out_dir={cli_out}"],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.strip().splitlines()[-1])["step"] == 3

  # The adapter exported in PEFT's format, applied on top of a full-parameter run's checkpoint
  # with the same base weights (lr 0): the same greedy trees as the LoRA run's own evaluation.
  from rao_jax.model import peft
  model, _, _, _ = evaluation.load_checkpoint(wd)
  peft.save_adapter(model, str(tmp_path / "adapter"))
  base_cfg = _config(tiny_hf_dir, 1)
  base_cfg.optim.lr = 0.0
  base_cfg.eval.every = 0
  assert not trainer.train(base_cfg, str(tmp_path / "base"))["stopped"]
  ev2 = evaluation.evaluate_checkpoint(str(tmp_path / "base"), num_tasks=1, modes=("recursive",),
                                       adapter=str(tmp_path / "adapter"),
                                       out_dir=str(tmp_path / "ev2"))
  assert ev2["adapter"] == str(tmp_path / "adapter")
  from rao_jax.agent import records as R
  tokens = lambda d: [[n.token_ids for n in t.nodes]   # noqa: E731
                      for t in R.load_trees_jsonl(os.path.join(d, "trees.jsonl"))]
  assert tokens(ev["out_dir"]) == tokens(str(tmp_path / "ev2")) == tokens(cli_out)
  # And the adapter is really applied: a large random one changes the greedy trees.
  import numpy as np
  rng = np.random.default_rng(0)
  for name, var in vars(model.lora).items():
    if name.endswith("_b"):
      var[...] = rng.normal(0, 1.0, var.shape).astype(np.float32)
  peft.save_adapter(model, str(tmp_path / "random_adapter"))
  for name, kw in (("ev_base", {}), ("ev_rand", {"adapter": str(tmp_path / "random_adapter")})):
    evaluation.evaluate_checkpoint(str(tmp_path / "base"), num_tasks=1, modes=("recursive",),
                                   out_dir=str(tmp_path / name), **kw)
  assert tokens(str(tmp_path / "ev_base")) != tokens(str(tmp_path / "ev_rand"))
  with pytest.raises(ValueError, match="is a LoRA run"):
    evaluation.evaluate_checkpoint(wd, num_tasks=1, adapter=str(tmp_path / "adapter"))
  jax.clear_caches()
