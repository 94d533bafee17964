"""The learner's memory plan: remat="auto" picks the least recomputation that fits."""
import pytest

from experiments.configs import textcraft_synth
from rao_jax import experiment
from rao_jax.learner import memory
from rao_jax.model import ModelConfig, resolve_model_path


@pytest.fixture(scope="module")
def smollm2_cfg():
  return ModelConfig.from_gguf(resolve_model_path("smollm2-135m"))


def test_more_recomputation_holds_less(smollm2_cfg):
  act = {r: memory.estimate(smollm2_cfg, 4096, 1, r, act_dtype="float32")["activations"]
         for r in memory.REMATS}
  assert act["none"] > act["dots"] > act["full"] > 0
  # Activations scale with the tokens of a micro-batch; the state does not.
  one = memory.estimate(smollm2_cfg, 2048, 1, "none", act_dtype="float32")
  two = memory.estimate(smollm2_cfg, 2048, 2, "none", act_dtype="float32")
  assert two["params"] == one["params"] and two["activations"] > 1.5 * one["activations"]
  # bfloat16 activations take about half the bytes of float32 ones.
  bf = memory.estimate(smollm2_cfg, 4096, 1, "none", act_dtype="bfloat16")["activations"]
  assert 0.45 < bf / act["none"] < 0.6


def test_choice_is_the_least_recomputation_that_fits(smollm2_cfg):
  total = {r: memory.estimate(smollm2_cfg, 4096, 1, r, act_dtype="float32")["total"]
           for r in memory.REMATS}
  fit = lambda b: memory.choose_remat(smollm2_cfg, 4096, 1, b, act_dtype="float32")  # noqa: E731
  assert fit(total["none"] / memory.HEADROOM * 1.01) == "none"
  assert fit(total["none"] / memory.HEADROOM * 0.99) == "dots"
  assert fit(total["dots"] / memory.HEADROOM * 0.99) == "full"
  assert fit(1.0) == "full"            # nothing fits: the least memory there is
  with pytest.raises(ValueError, match="remat='some'"):
    memory.estimate(smollm2_cfg, 4096, 1, "some")


def test_run_config_auto_plans_for_its_rows_and_device(smollm2_cfg, monkeypatch):
  c = textcraft_synth.get_config("recursive,smoke")
  c.learner.row_len = 4096
  c.agent.context_window = 4096
  c.learner.micro_batch_rows = 1
  c.learner.mesh = "data=1"
  need = memory.estimate(smollm2_cfg, 4096, 1, "none", act_dtype="float32")["total"]
  monkeypatch.setattr(memory, "device_budget", lambda device=None: 10 * need)
  assert experiment.planned_remat(c, smollm2_cfg) == "none"
  monkeypatch.setattr(memory, "device_budget", lambda device=None: 0.5 * need)
  assert experiment.planned_remat(c, smollm2_cfg) in ("dots", "full")
  # Twice the rows per device need more memory: the same budget can force more recompute.
  c.learner.micro_batch_rows = 8
  assert experiment.planned_remat(c, smollm2_cfg) == "full"
  assert memory.device_budget.__name__ == "<lambda>"
  monkeypatch.undo()
  assert memory.device_budget() > 0     # the real budget of this host


def test_a_bad_remat_is_named_with_the_choices():
  c = textcraft_synth.get_config("recursive,smoke")
  c.model.remat = "fulll"
  with pytest.raises(ValueError, match=r"config.model.remat='fulll': use auto .*none, dots or"):
    experiment.load_policy(c)
