"""The rollout server's one-adapter slot without HTTP: fitting PEFT folders of another rank or
alpha into it (the merged weights match the adapter's own), its refusals, the lora_path checks
and the SGLang body parsing of lora_path and the LoRA admin bodies."""
import jax
import numpy as np
import pytest
from flax import nnx

from rao_jax.model import lora as lora_lib
from rao_jax.model.peft import save_adapter
from rao_jax.rollout.serve import adapters
from rao_jax.rollout.serve.schema import (BadRequest, LoadLoraAdapterIn, UnloadLoraAdapterIn,
                                          parse_generate)
from rao_jax.testing import tiny_model


def _adapted(rank, alpha, targets=lora_lib.TARGETS, seed=1):
  """A tiny model with an adapter of random (non-zero) A and B."""
  model = lora_lib.add_adapters(tiny_model(), lora_lib.LoraConfig(rank=rank, alpha=alpha,
                                                                  targets=targets), seed=seed)
  rng = np.random.default_rng(seed)
  for name, var in vars(model.lora).items():
    if isinstance(var, nnx.LoRAParam):
      var.set_value(jax.numpy.asarray(rng.normal(0, 0.1, var.shape), var[...].dtype))
  return model


def _deltas(cfg, arrays):
  """target -> the merged update scale * A B of pure-dict adapter arrays."""
  return {t: np.einsum("lir,lro->lio", np.asarray(arrays[f"{t}_a"], np.float64),
                       np.asarray(arrays[f"{t}_b"], np.float64)) * cfg.lora.scale
          for t in cfg.lora.targets}


def test_fit_pads_rank_rescales_alpha_and_zeroes_missing_targets(tmp_path):
  slot_model = lora_lib.add_adapters(tiny_model(), lora_lib.LoraConfig(rank=4, alpha=32.0))
  slot = adapters.AdapterSlot(slot_model)
  small = _adapted(rank=2, alpha=6.0, targets=("q", "down"))
  save_adapter(small, str(tmp_path / "a"))
  state = slot.fit(str(tmp_path / "a"))
  got = _deltas(slot_model.cfg, state.to_pure_dict()["lora"])
  want = _deltas(small.cfg, {k: v[...] for k, v in vars(small.lora).items()
                             if isinstance(v, nnx.LoRAParam)})
  for t in lora_lib.TARGETS:
    if t in want:
      np.testing.assert_allclose(got[t], want[t], rtol=1e-5, atol=1e-8, err_msg=t)
      assert np.abs(want[t]).max() > 1e-3           # the adapter does change the weights
    else:
      assert not got[t].any(), t
  # Equal rank and alpha: the arrays go in exactly as saved.
  same = _adapted(rank=4, alpha=32.0)
  save_adapter(same, str(tmp_path / "b"))
  fitted = slot.fit(str(tmp_path / "b")).to_pure_dict()["lora"]
  for name, var in vars(same.lora).items():
    if isinstance(var, nnx.LoRAParam):
      np.testing.assert_array_equal(np.asarray(fitted[name]), np.asarray(var[...]))
  assert not any(np.asarray(v).any() for v in slot.zero().to_pure_dict()["lora"].values())


def test_fit_refuses_what_the_slot_cannot_hold(tmp_path):
  slot = adapters.AdapterSlot(lora_lib.add_adapters(
      tiny_model(), lora_lib.LoraConfig(rank=2, targets=("q", "v"))))
  save_adapter(_adapted(rank=4, alpha=8.0, targets=("q",)), str(tmp_path / "big"))
  with pytest.raises(ValueError, match="--max-lora-rank 4"):
    slot.fit(str(tmp_path / "big"))
  save_adapter(_adapted(rank=2, alpha=8.0, targets=("q", "up")), str(tmp_path / "up"))
  with pytest.raises(ValueError, match=r"\['up_proj'\].*--lora-target-modules"):
    slot.fit(str(tmp_path / "up"))
  with pytest.raises(FileNotFoundError, match="adapter_config.json"):
    slot.fit(str(tmp_path))
  with pytest.raises(ValueError, match="no adapter slot"):
    adapters.AdapterSlot(tiny_model())
  assert adapters.parse_target_modules("q_proj, down_proj") == ("q", "down")
  assert adapters.parse_target_modules("all") == lora_lib.TARGETS
  with pytest.raises(ValueError, match="qproj"):
    adapters.parse_target_modules("qproj")


def test_check_names_the_active_adapter():
  slot = adapters.AdapterSlot(lora_lib.add_adapters(tiny_model(), {"rank": 2}))
  slot.check(None)                                  # the base: no adapter named
  with pytest.raises(BadRequest, match="'x' is not loaded.*none \\(the base model\\)"):
    slot.check("x")
  slot.activate("a", "/w/a", "")
  slot.check("a")
  assert slot.loaded == {"a": "/w/a"}
  with pytest.raises(BadRequest, match="missing, but adapter 'a' is active") as e:
    slot.check(None)
  assert e.value.param == "lora_path"
  slot.activate("b", "/w/b", "/load_lora_adapter replaced it with 'b'")
  with pytest.raises(BadRequest, match="'a' is no longer loaded: /load_lora_adapter replaced "
                                       "it with 'b'.*one LoRA adapter at a time.*'b'"):
    slot.check("a")
  with pytest.raises(BadRequest, match="'c' is not loaded.*active adapter is 'b'"):
    slot.check("c")
  with pytest.raises(BadRequest, match="without LoRA support.*--max-lora-rank"):
    adapters.check_without_slot("a")
  adapters.check_without_slot(None)


def test_lora_path_in_bodies():
  items, _, _ = parse_generate({"input_ids": [[1], [2]], "lora_path": ["a", None]}, None, 10,
                               ())
  assert [it.lora for it in items] == ["a", None]
  items, _, _ = parse_generate({"input_ids": [[1], [2]], "lora_path": "a",
                                "sampling_params": {"n": 2}}, None, 10, ())
  assert [it.lora for it in items] == ["a"] * 4
  for body in ({"input_ids": [[1], [2]], "lora_path": ["a"]}, {"input_ids": [1], "lora_path": 3},
               {"input_ids": [1], "lora_path": " "}):
    with pytest.raises(BadRequest) as e:
      parse_generate(body, None, 10, ())
    assert e.value.param == "lora_path", body
  body = LoadLoraAdapterIn.from_json({"lora_name": "n", "lora_path": "/p", "pinned": True,
                                      "weight_version": 3})
  assert (body.lora_name, body.lora_path, body.weight_version) == ("n", "/p", 3)
  for bad, field in (({"lora_path": "/p"}, "lora_name"), ({"lora_name": "n"}, "lora_path")):
    with pytest.raises(BadRequest) as e:
      LoadLoraAdapterIn.from_json(bad)
    assert e.value.param == field
  with pytest.raises(BadRequest):
    UnloadLoraAdapterIn.from_json({})
