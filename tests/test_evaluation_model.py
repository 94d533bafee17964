"""evaluation.evaluate_model: a model with no run directory, served by rao_jax.rollout.serve
(tiny random weights, real tokenizer), evaluated greedy and sampled (pass@k) on TextCraft's
held-out split and on a task file, through the real agent runtime and sandboxes."""
import asyncio
import json
import os

import pytest
from flax import nnx

from rao_jax import evaluation
from rao_jax.envs import textcraft as tc
from rao_jax.model import Transformer
from rao_jax.rollout import serve
from rao_jax.rollout.embedded import EmbeddedEngine
from rao_jax.testing import BackgroundServer, tiny_config


@pytest.fixture(scope="module")
def server_url():
  from rao_jax.model.tokenizer import Tokenizer
  from rao_jax.model.weights import resolve_model_path
  tok = Tokenizer.from_gguf(resolve_model_path("smollm2-135m"))
  engine = EmbeddedEngine(Transformer(tiny_config(), rngs=nnx.Rngs(0)), num_slots=8,
                          max_len=4096, cache_lens=(2048, 4096), chunk_sizes=(256,),
                          prefill_rows=(4,), default_stop_token_ids=tuple(tok.stop_token_ids))
  with BackgroundServer(serve.Server(engine, tok, model_path="tiny")) as url:
    yield url


def _config():
  from experiments.configs import textcraft as cfg_mod
  c = cfg_mod.get_config("single,smoke")
  c.agent.max_new_tokens = 12          # random weights: keep the turns short
  c.agent.max_steps_per_agent = 2
  c.agent.context_window = 3072
  c.sandbox.pool_size = 2
  return c


@pytest.mark.slow
def test_evaluate_model_from_server_with_pass_at_k(server_url, tmp_path):
  res = evaluation.evaluate_model(_config(), server_urls=[server_url], num_tasks=2,
                                  modes=("single",), samples=2, out_dir=str(tmp_path / "a"))
  per = res["modes"]["single"]["all"]
  assert res["step"] is None and res["model"] == server_url and res["num_tasks"] == 2
  assert per["num_tasks"] == 2 and 0.0 <= per["success"] <= 1.0
  assert set(per["pass_at_k"]) == {"1", "2"} and per["samples"] == 2
  assert 0.0 <= per["pass_at_k"]["1"] <= per["pass_at_k"]["2"] <= 1.0
  # The held-out split: the first two "test" tasks, never training ones.
  held = [t.task_id for t in tc.TextCraftEnv().tasks("test")[:2]]
  assert sorted(per["per_task"]) == sorted(held) == sorted(per["per_task_passes"])
  saved = json.load(open(tmp_path / "a" / "results.json"))
  assert saved["modes"]["single"]["all"]["pass_at_k"] == per["pass_at_k"]
  assert os.path.getsize(tmp_path / "a" / "trees.jsonl") > 0
  # The K samples of a task are distinct draws (a fixed seed would repeat one tree K times).
  from rao_jax.agent import records as R
  sampled = R.load_trees_jsonl(str(tmp_path / "a" / "sampled_trees.jsonl"))
  assert len(sampled) == 4
  for tid in held:
    roots = [t.root.token_ids for t in sampled if t.task_id == tid]
    assert len(roots) == 2 and roots[0] != roots[1]

  # A task file for the test split replaces the held-out tasks.
  env = tc.TextCraftEnv()
  path = tmp_path / "mine.jsonl"
  tc.save_textcraft_jsonl(str(path), env.tasks("train")[5:6])
  res = evaluation.evaluate_model(_config(), server_urls=[server_url], num_tasks=5,
                                  modes=("single",), out_dir=str(tmp_path / "b"),
                                  task_files={"test": str(path)})
  per = res["modes"]["single"]["all"]
  assert list(per["per_task"]) == [env.tasks("train")[5].task_id] and "pass_at_k" not in per


@pytest.mark.slow
def test_evaluate_model_from_an_openai_compatible_server(server_url, tmp_path):
  res = evaluation.evaluate_model(_config(), server_urls=[server_url], num_tasks=1,
                                  modes=("single",), out_dir=str(tmp_path / "c"),
                                  server_api="openai")
  per = res["modes"]["single"]["all"]
  assert per["num_tasks"] == 1 and 0.0 <= per["success"] <= 1.0
  with pytest.raises(ValueError, match="one server URL"):
    evaluation.evaluate_model(_config(), server_urls=[server_url, server_url],
                              server_api="openai")


def test_openai_engine_matches_the_served_engine(server_url):
  """Through /v1/completions with return_token_ids, the ids are the engine's own."""
  from rao_jax.rollout import GenerateRequest, SamplingParams
  from rao_jax.rollout.openai_client import OpenAIEngine
  from rao_jax.rollout.sglang_client import SGLangEngine

  async def go():
    a = OpenAIEngine(server_url, tokenizer=None)
    b = SGLangEngine(server_url)
    req = GenerateRequest(list(range(20, 40)), SamplingParams(temperature=0, max_new_tokens=7))
    ra, rb = await a.generate(req), await b.generate(req)
    await a.close()
    await b.close()
    return ra, rb
  ra, rb = asyncio.run(go())
  assert ra.token_ids == rb.token_ids and len(ra.token_ids) == len(ra.logprobs)
  assert ra.logprobs == pytest.approx(rb.logprobs, abs=1e-5)
