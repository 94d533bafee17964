"""`python -m rao_jax.rollout.serve --checkpoint RUN` serves a training run's checkpoint (not
the base weights it started from), SGLang- and OpenAI-shaped."""
import asyncio
import os

import jax
import pytest
import requests
from flax import nnx

from rao_jax import experiment as X
from rao_jax.rollout import GenerateRequest, SamplingParams, serve
from rao_jax.rollout.embedded import EmbeddedEngine
from rao_jax.testing import BackgroundServer


def _run_dir(tmp):
  """A run directory whose step-4 checkpoint holds weights unlike its config's base model."""
  from experiments.configs import textcraft_synth
  from rao_jax.learner import Learner
  from rao_jax.model import ModelConfig, Transformer, export_hf, resolve_model_path
  from rao_jax.model.tokenizer import Tokenizer
  gguf = resolve_model_path("smollm2-135m")
  cfg = ModelConfig.from_gguf(gguf).tiny()
  hf = os.path.join(tmp, "base")
  export_hf(Transformer(cfg, rngs=nnx.Rngs(0)), cfg, Tokenizer.from_gguf(gguf), hf)
  c = textcraft_synth.get_config("recursive,smoke")
  c.model.name = hf
  c.agent.context_window = 1024
  c.rollout.max_cache_len = 1024
  c.learner.row_len = 1024
  wd = os.path.join(tmp, "run")
  X.save_config(c, wd)
  base, _ = X.load_policy(c)
  graphdef, state = nnx.split(base)
  trained = nnx.merge(graphdef, jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, state))
  learner = Learner(X.learner_config(c, wd), trained.cfg, mesh=X.make_mesh("auto"),
                    params=trained)
  learner.save(4)
  learner.wait_for_checkpoints()
  learner.close()
  return wd, trained, base


@pytest.mark.slow
def test_serve_checkpoint_serves_the_trained_weights(tmp_path):
  wd, trained, base = _run_dir(str(tmp_path))
  # The command line's own path (argument parsing, checkpoint restore, engine, server), served
  # from a background event loop in this process.
  server, _ = serve.build_server(["--checkpoint", wd, "--num-slots", "2", "--max-len", "64",
                                  "--min-cache-len", "64", "--chunk-sizes", "16",
                                  "--prefill-rows", "1"])
  with BackgroundServer(server) as url:
    prompt = [5, 17, 300, 4000, 12, 9]
    out = requests.post(url + "/generate", json={
        "input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                 "ignore_eos": True}}, timeout=300).json()

    async def local(model):
      eng = EmbeddedEngine(model, num_slots=2, max_len=64, cache_lens=(64,), chunk_sizes=(16,),
                           prefill_rows=(1,))
      r = await eng.generate(GenerateRequest(prompt, SamplingParams(
          temperature=0.0, max_new_tokens=6, stop_token_ids=())))
      await eng.close()
      return r.token_ids
    want, base_ids = asyncio.run(local(trained)), asyncio.run(local(base))
    assert want != base_ids          # the test can tell the checkpoint from the base weights
    assert out["output_ids"] == want
    info = requests.get(url + "/get_model_info").json()
    assert info["model_path"].endswith("@step4")
    assert requests.get(url + "/v1/models").json()["data"][0]["id"] == wd
