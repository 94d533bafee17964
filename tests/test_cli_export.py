"""rao-export: a training run's checkpoint as a PEFT adapter folder or an HF folder.

The runs are real: a Learner over a tiny SmolLM2-architecture HF folder saves a checkpoint into
a workdir with the config.json the loaders read; the exports are loaded by transformers / PEFT
and must give the logits of the policy the learner held.
"""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.cli import export as export_cli
from rao_jax.learner import Learner, LearnerConfig
from rao_jax.model import ModelConfig, Transformer, export_hf, resolve_model_path
from rao_jax.model import lora as lora_lib
from rao_jax.model.tokenizer import Tokenizer
from rao_jax.model.weights import load_model

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# float32 logits of magnitude ~20 moved by ~30 by the adapter: ours and torch sum in different
# orders (torch's own PeftModel and its merged model differ by 5e-5 here); a wrong scale or
# factor moves them by O(1).
TOL = dict(atol=2e-4, rtol=0)
STEP = 3
# As a run's config.json holds it (experiments/configs/base.py: targets as one string).
LORA = {"rank": 4, "alpha": 12.0, "targets": "q,v,o,up,down", "dropout": 0.0}


def _make_run(root, base_folder, lora, init_from=None):
  """A run directory holding config.json and a checkpoint of step STEP; returns (workdir, the
  policy's model as the learner held it). With `init_from` (a full run) the run adapts that
  run's weights, as `ckpt.init_from` makes it."""
  workdir = os.path.join(root, "run")
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"model": {"name": base_folder, "dtype": "float32", "lora": lora},
               **({"ckpt": {"init_from": init_from}} if init_from else {})}, f)
  if init_from:
    from rao_jax.rollout.serve import loading  # pylint: disable=g-import-not-at-top
    model = loading.load_run_checkpoint(init_from)[0]
  else:
    model = load_model(base_folder, dtype="float32")
  rng = np.random.default_rng(0)
  if lora:
    lora_lib.add_adapters(model, lora)
    for name, var in lora_lib._attrs(model.lora).items():  # pylint: disable=protected-access
      std = 0.1 if name.endswith("_b") else 0.3
      var.set_value(jnp.asarray(rng.normal(0, std, var.shape), jnp.float32))
  else:   # a full fine-tuning run's weights: the base moved a little everywhere
    for var in jax_leaves(nnx.state(model, nnx.Param)):
      var.set_value(var[...] + jnp.asarray(rng.normal(0, 0.02, var.shape), var[...].dtype))
  cfg = LearnerConfig(row_len=32, micro_batch_rows=4, bucket_rows=(4,), seed=0,
                      ckpt_dir=os.path.join(workdir, "checkpoints"), ckpt_async=False)
  learner = Learner(cfg, model.cfg, params=model)
  learner.save(step=STEP)
  learner.close()
  return workdir, model


def jax_leaves(state):
  return [v for _, v in nnx.to_flat_state(state)]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  """A tiny random SmolLM2-architecture HF folder with the real tokenizer. Not conftest's
  base_dir: transformers refuses its d_model 64 with 3 heads (not a multiple); here
  d_model 96 with 3 heads of 16 (q is 96 -> 48: a transposed factor cannot pass). The
  embedding is scaled up from the init so the logits are O(1)."""
  gguf = resolve_model_path("smollm2-135m")
  cfg = ModelConfig.from_gguf(gguf).tiny(d_model=96, head_dim=16, mlp_dim=128).replace(
      dtype="float32", param_dtype="float32")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  model.embed.set_value(model.embed[...] * 25.0)
  out = str(tmp_path_factory.mktemp("base"))
  export_hf(model, cfg, Tokenizer.from_gguf(gguf), out)
  return out


@pytest.fixture(scope="module")
def lora_run(base_dir, tmp_path_factory):
  return _make_run(str(tmp_path_factory.mktemp("lora")), base_dir, LORA)


@pytest.fixture(scope="module")
def prompts():
  return np.random.default_rng(5).integers(3, 49152, (2, 9))


@pytest.fixture(scope="module")
def lora_logits(lora_run, prompts):
  return _our_logits(lora_run[1], prompts)


def _our_logits(model, ids):
  B, T = ids.shape
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  fwd = nnx.jit(lambda m, t, p: m.logits(m(t, p, jnp.ones((B, T), jnp.int32))))
  return np.asarray(fwd(model, jnp.asarray(ids), pos))


def _hf(folder):
  return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _torch_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.float().numpy()


def test_lora_run_exports_a_peft_adapter(lora_run, base_dir, prompts, lora_logits,
                                         tmp_path):
  workdir, _ = lora_run
  out = str(tmp_path / "adapter")
  summary = export_cli.export_run(workdir, out)
  assert summary == {"workdir": workdir, "step": STEP, "out": out, "kind": "adapter",
                     "base_model": base_dir,
                     "bytes": os.path.getsize(os.path.join(out, "adapter_model.safetensors"))}
  assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
  cfg = json.load(open(os.path.join(out, "adapter_config.json")))
  assert cfg["base_model_name_or_path"] == base_dir
  # The adapter is all the file holds: far smaller than the model.
  assert summary["bytes"] < os.path.getsize(os.path.join(base_dir, "model.safetensors")) / 10
  base = _torch_logits(_hf(base_dir), prompts)
  assert np.abs(lora_logits - base).max() > 2e-2, "the adapter barely changes the logits"
  policy = peft.PeftModel.from_pretrained(_hf(base_dir), out)
  np.testing.assert_allclose(_torch_logits(policy, prompts), lora_logits, **TOL)
  with pytest.raises(ValueError, match=r"already holds \['adapter_config.json', "
                     r"'adapter_model.safetensors'\]"):
    export_cli.export_run(workdir, out, merge=True)


def test_lora_run_merged_export_is_a_plain_hf_model(lora_run, prompts, lora_logits, tmp_path):
  workdir, _ = lora_run
  out = str(tmp_path / "merged")
  summary = export_cli.export_run(workdir, out, step=STEP, merge=True)
  assert (summary["kind"], summary["step"]) == ("merged", STEP)
  np.testing.assert_allclose(_torch_logits(_hf(out), prompts), lora_logits, **TOL)
  assert transformers.AutoTokenizer.from_pretrained(out).encode("hi") is not None
  with pytest.raises(ValueError, match="--base_out=.* goes with a LoRA run's adapter export"):
    export_cli.export_run(workdir, str(tmp_path / "m2"), merge=True, base_out=str(tmp_path / "b"))


def test_adapter_export_with_base_out_names_the_written_base(lora_run, prompts, lora_logits,
                                                             tmp_path):
  workdir, _ = lora_run
  out, base = str(tmp_path / "adapter"), str(tmp_path / "base")
  summary = export_cli.export_run(workdir, out, base_out=base)
  assert summary["base_model"] == base
  assert json.load(open(os.path.join(out, "adapter_config.json")))[
      "base_model_name_or_path"] == base
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(base))
  policy = peft.PeftModel.from_pretrained(_hf(base), out)
  np.testing.assert_allclose(_torch_logits(policy, prompts), lora_logits, **TOL)


def test_adapter_of_a_run_started_from_another_run_names_and_writes_that_base(
    base_dir, prompts, tmp_path):
  """A LoRA run with ckpt.init_from adapted that run's weights: the export names it as the
  base, and --base_out writes its weights (not model.name's)."""
  full, _ = _make_run(str(tmp_path / "full"), base_dir, None)
  workdir, model = _make_run(str(tmp_path / "lora"), base_dir, LORA, init_from=full)
  summary = export_cli.export_run(workdir, str(tmp_path / "a1"))
  assert summary["base_model"] == os.path.abspath(full)
  out, base = str(tmp_path / "a2"), str(tmp_path / "base")
  export_cli.export_run(workdir, out, base_out=base)
  policy = peft.PeftModel.from_pretrained(_hf(base), out)
  np.testing.assert_allclose(_torch_logits(policy, prompts), _our_logits(model, prompts), **TOL)


@pytest.mark.slow
def test_full_fine_tuning_run_and_the_command_line(base_dir, prompts, tmp_path):
  workdir, model = _make_run(str(tmp_path), base_dir, None)
  ours = _our_logits(model, prompts)
  assert np.abs(ours - _torch_logits(_hf(base_dir), prompts)).max() > 2e-2
  out = str(tmp_path / "hf")
  # The command itself, as a user runs it; --merge is accepted and changes nothing here.
  cmd = [sys.executable, "-m", "rao_jax.cli.export", f"--workdir={workdir}", f"--out={out}",
         "--merge"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert (summary["kind"], summary["step"], summary["out"]) == ("full", STEP, out)
  assert "full fine-tuning run" in proc.stderr
  np.testing.assert_allclose(_torch_logits(_hf(out), prompts), ours, **TOL)
  bad = subprocess.run(cmd[:-1] + ["--step=99"], capture_output=True, text=True, timeout=300)
  assert bad.returncode != 0
  assert "rao-export: step=99: no such checkpoint" in bad.stderr, bad.stderr[-3000:]
