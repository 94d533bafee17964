"""A turn's generation ends where its code cell closes: the runner asks the engine to stop at
the closing fence, and the turn that runs on past it keeps only the cell."""
import asyncio

from rao_jax.agent import code as code_lib
from rao_jax.agent import local_exec, runner as rn
from rao_jax.rollout import base as rollout
from tests.test_agent_runner import TOK, _task, synth_env

RUNAWAY = "Working.\n```python\nprint('hi')\nfinish('done')\n```\nAnd then I keep talking "


class RunOn(rollout.Engine):
  """Writes a cell and keeps going past its fence, as a sampled model can; honours the
  request's stop strings as SGLang does (the match kept), so the runner's request decides."""

  def __init__(self):
    self.requests = []

  @property
  def weight_version(self):
    return 0

  async def generate(self, request):
    self.requests.append(request)
    ids = TOK.encode(RUNAWAY + "x" * 400)[:request.params.max_new_tokens]
    for k in range(1, len(ids) + 1):
      if any(s in TOK.decode(ids[:k]) for s in request.params.stop):
        return rollout.GenerateResult(ids[:k], [-0.5] * k, rollout.FinishReason.STOP, 0)
    return rollout.GenerateResult(ids, [-0.5] * len(ids), rollout.FinishReason.LENGTH, 0)


def run(stop_at_cell_close):
  env, engine = synth_env(), RunOn()
  r = rn.TreeRunner(env, engine, TOK, local_exec.LocalReplPool(),
                    rn.RunnerConfig(recursive=False, max_new_tokens=300,
                                    stop_at_cell_close=stop_at_cell_close))
  (tree,) = asyncio.run(r.run_tasks([_task(env)]))
  return tree, engine


def test_generation_stops_at_the_cells_close():
  tree, engine = run(True)
  assert engine.requests[0].params.stop == code_lib.CELL_CLOSE_STOP
  turn = tree.root.extras["turns"][0]
  assert turn["text"].endswith("finish('done')\n```\n")
  assert turn["code"] == "print('hi')\nfinish('done')"
  assert tree.root.num_generated_tokens == len(TOK.encode(turn["text"]))
  # Off, the same turn runs to max_new_tokens: what the stop saves.
  tree_off, engine_off = run(False)
  assert engine_off.requests[0].params.stop == ()
  assert tree_off.root.num_generated_tokens == 300 > tree.root.num_generated_tokens
  assert tree_off.root.extras["turns"][0]["code"] == turn["code"]
