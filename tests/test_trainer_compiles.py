"""The trainer compiles before its first step and never inside a later one.

A tiny random SmolLM2 through the real loop (engine, sandbox, runner, learner): the warm-up
compiles the engine's shapes and the learner's row buckets, so steps 2 and 3 trace and compile
nothing, and the step reports compile seconds apart from its rates.
"""
import pytest

from rao_jax import metrics as metrics_lib
from rao_jax import trainer
from rao_jax.learner import step as step_lib
from tests.test_trainer import _config

pytestmark = pytest.mark.slow

BACKEND = "/jax/core/compile/backend_compile_duration"


class Counting(trainer.Trainer):
  """Counts traces and compilations over each step."""

  def __init__(self, *args, **kwargs):
    self.per_step = []
    self.clock = metrics_lib.compile_clock()
    self.backend = []
    import jax  # pylint: disable=g-import-not-at-top
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *a, **k: self.backend.append(event) if event == BACKEND else None)
    super().__init__(*args, **kwargs)

  async def rl_step(self, runner, state, guard=None):
    programs = dict(self.engine.trace_counts)
    before = (step_lib.TRACE_COUNT, len(self.backend))
    m = await super().rl_step(runner, state, guard)
    traced = {k: v - programs.get(k, 0) for k, v in self.engine.trace_counts.items()
              if v != programs.get(k, 0)}
    self.per_step.append(({"engine_traces": sum(traced.values()),
                           "learner_traces": step_lib.TRACE_COUNT - before[0],
                           "compilations": len(self.backend) - before[1],
                           "engine_programs": traced}, m))
    return m


def test_no_compilation_inside_steps_after_the_first(tiny_hf_dir, tmp_path):
  c = _config(tiny_hf_dir, 3)
  c.eval.every = 0
  c.compile_cache = ""            # the suite's own cache is in the environment; no new one
  t = Counting.from_config(c, str(tmp_path / "run"))
  res = t.run()
  assert res["step"] == 3 and len(t.per_step) == 3
  counts = [x for x, _ in t.per_step]
  # Warm-up compiled every engine shape: no step traces an engine program.
  assert all(x["engine_traces"] == 0 for x in counts), counts
  for x in counts[1:]:
    assert x == {"engine_traces": 0, "learner_traces": 0, "compilations": 0,
                 "engine_programs": {}}, counts
  first = t.per_step[0][1]
  assert first["time/warmup_s"] > 0 and "time/warmup_s" not in t.per_step[1][1]
  for _, m in t.per_step[1:]:
    assert m["time/rollout_compile_s"] == 0.0 and m["time/learner_compile_s"] == 0.0


def test_without_warmup_the_first_step_compiles(tiny_hf_dir, tmp_path):
  # The control: the counters above do see compilation when it happens inside a step.
  c = _config(tiny_hf_dir, 1)
  c.eval.every = 0
  c.warmup = False
  c.compile_cache = ""
  c.rollout.num_slots = 3         # a shape no other test of this process compiled
  c.rollout.embedded.prefill_rows = (1,)   # the default (1, 4) needs 4 slots
  t = Counting.from_config(c, str(tmp_path / "run"))
  t.run()
  (x, m), = t.per_step
  assert x["engine_traces"] > 0 and m["time/rollout_compile_s"] > 0
