"""The real SmolLM2-135M-Instruct grows a small tree end to end: embedded JAX engine, jailed
sandbox REPL, TextCraft-Synth tools (greedy, a few turns). Slow."""
import asyncio

import pytest

from rao_jax.agent import records as R, runner as rn, view
from rao_jax.envs import textcraft_synth as ts
from rao_jax.rollout import base as rollout

pytestmark = pytest.mark.slow


class Recording(rollout.Engine):
  def __init__(self, inner):
    self.inner, self.calls = inner, []

  @property
  def weight_version(self):
    return self.inner.weight_version

  async def generate(self, request):
    res = await self.inner.generate(request)
    self.calls.append((request, res))
    return res

  async def end_session(self, session_id):
    await self.inner.end_session(session_id)

  async def close(self):
    await self.inner.close()


def test_smollm2_grows_a_tree_in_the_sandbox(tmp_path):
  from rao_jax import sandbox_host
  if not sandbox_host.bwrap_available():
    pytest.skip(sandbox_host.missing_bwrap_message())
  from rao_jax.model import load_pretrained
  from rao_jax.rollout.embedded import EmbeddedEngine
  model, tok = load_pretrained("smollm2-135m", dtype="float32")
  env = ts.TextCraftSynthEnv(ts.SynthConfig(tasks_per_difficulty=1, items_per_tier=20))
  task = env.tasks("test/easy")[0]
  # Small shapes keep CPU compilation and decoding short: the ~700-token prompt, two turns of
  # 32 tokens per agent, the two trees of the group decoded together.
  cfg = rn.RunnerConfig(recursive=True, max_depth=1, max_steps_per_agent=2, context_window=1024,
                        max_new_tokens=32, temperature=0.0, observation_max_chars=300)

  async def go():
    # The engine keeps one prefill chunk of margin: 1152 - 128 = a 1024-token window. It holds the
    # tokenizer to end each turn at the close of the agent's code cell (the runner's stop string).
    eng = Recording(EmbeddedEngine(model, num_slots=4, max_len=1152, cache_lens=(1152,),
                                   chunk_sizes=(128,), prefill_rows=(1,), tokenizer=tok))
    pool = sandbox_host.SandboxPool(sandbox_host.SandboxConfig(cell_timeout_s=20), size=3)
    await pool.start()
    try:
      trees = await rn.TreeRunner(env, eng, tok, pool, cfg).run_tasks([task], group_size=2)
    finally:
      await pool.close()
      await eng.close()
    return trees, eng.calls

  trees, calls = asyncio.run(go())
  assert len(trees) == 2 and trees[0].group_id == trees[1].group_id
  nodes = {f"{t.tree_id}/{n.node_id}": n for t in trees for n in t.nodes}
  for t in trees:
    t.validate()
    for n in t.nodes:
      assert n.end_reason in R.END_REASONS and n.num_steps >= 1, (n.end_reason, n.extras)
      assert n.weight_version == 0 and n.success is not None
      assert n.extras["turns"][0]["observation"] or n.end_reason != "max_steps"
  # What the model saw is what the learner gets: prompts are prefixes of the node's tokens and
  # the sampled ids (with their logprobs) sit right after them.
  calls = [(req, res) for req, res in calls if res.token_ids]   # a full window yields none
  assert len(calls) == sum(n.num_steps for n in nodes.values())
  for req, res in calls:
    n = nodes[req.session_id]
    p = list(req.prompt_ids)
    assert n.token_ids[:len(p)] == p
    k = n.turn_starts.index(len(p))
    assert n.token_ids[len(p):len(p) + len(res.token_ids)] == list(res.token_ids)
    assert n.logprobs[len(p):len(p) + len(res.token_ids)] == pytest.approx(list(res.logprobs))
    assert all(x <= 1e-6 for x in res.logprobs) and k >= 0
  # The prompt is the chat template's rendering of the system + task messages.
  root = trees[0].root
  assert tok.decode(root.token_ids[:root.turn_starts[0]]).rstrip().endswith("assistant")
  # Greedy and seeded: the two trees of the group agree token for token at the root.
  assert trees[0].root.token_ids == trees[1].root.token_ids
  src = tmp_path / "trees.jsonl"
  R.save_trees_jsonl(str(src), trees)
  assert view.main([str(src), "-o", str(tmp_path / "t.html")]) == 0
