"""The learner's step is traced under its mesh: on 8 virtual CPU devices (data 2 x fsdp 2 x
tensor 2) the CPU attention kernel (MKL, through XLA FFI) runs per device on the device's rows
and kv heads, with no attention operand gathered, and the step's loss, gradient norm and
updated parameters equal the one-device step's.
"""
import re

import jax
import numpy as np
import pytest

from rao_jax.kernels import mkl
from rao_jax.learner import Learner, LearnerConfig, compute_rewards_and_advantages, pack_trees
from rao_jax.learner import testing
from rao_jax.model import sharding

pytestmark = pytest.mark.slow

VOCAB, T, ROWS, BATCH_ROWS = 64, 32, 4, 8   # micro-batches of 4 rows, batches of 8
MESH = (2, 2, 2)


@pytest.fixture(scope="module")
def model_cfg():
  try:
    if not mkl.available("mkl"):
      pytest.skip("the MKL kernels are off here")
  except mkl.CpuKernelsUnavailable as e:
    pytest.skip(f"the MKL kernels cannot be built here: {e}")
  # 4 query heads over 2 kv heads: one kv head (two query heads) per tensor shard.
  return testing.tiny_model_config(vocab_size=VOCAB, kernels="mkl")


def _cfg():
  # Adam's first update is lr * g / (|g| + eps): with the default eps (1e-8) a coordinate whose
  # gradient is near 0 moves by up to lr on a 1e-9 difference in g, which the sharded sum's
  # other order gives. eps = 1e-2 keeps the update smooth in g, so parameters compare to 1e-6.
  return LearnerConfig(row_len=T, micro_batch_rows=ROWS, bucket_rows=(BATCH_ROWS,), lr=1e-3,
                       eps=1e-2, seed=0)


def _batch():
  trees = testing.synthetic_trees(1, 2, VOCAB, seed=3, max_len=T, mean_len=10, max_depth=2,
                                  max_children=2)
  return pack_trees(trees, compute_rewards_and_advantages(trees), row_len=T,
                    bucket_rows=(BATCH_ROWS,))


def _kernel_shapes(hlo: str, target: str) -> list[tuple[int, ...]]:
  """The first result shape of every custom call to ``target`` in compiled HLO text."""
  shapes = []
  for line in hlo.splitlines():
    if f'custom_call_target="{target}"' in line:
      dims = re.search(r"=\s*\(?\s*f32\[([\d,]+)\]", line).group(1)
      shapes.append(tuple(int(d) for d in dims.split(",")))
  return shapes


def test_attention_kernel_runs_on_local_rows_and_heads(model_cfg):
  learner = Learner(_cfg(), model_cfg, mesh=sharding.make_mesh(*MESH),
                    params=testing.init_params(model_cfg, 0))
  dev_batch = jax.device_put({k: np.asarray(v) for k, v in _batch().arrays().items()},
                             learner._batch_shardings)   # pylint: disable=protected-access
  step = learner._step_fn   # pylint: disable=protected-access
  H, h = model_cfg.n_heads, model_cfg.head_dim
  local = (ROWS // (MESH[0] * MESH[1]), T, H // MESH[2], h)
  hlo = step.lower(learner.state, dev_batch).compile().as_text()
  for target in (mkl.ATTENTION_FWD, mkl.ATTENTION_BWD):
    shapes = _kernel_shapes(hlo, target)
    assert shapes and set(shapes) == {local}, (target, shapes)
  # The same jitted step traced without the mesh: the partitioner feeds the kernel whole
  # micro-batches (every device computes every row's attention), which the above rules out.
  bare_step = step._fn   # pylint: disable=protected-access
  bare = bare_step.lower(learner.state, dev_batch).compile().as_text()
  assert set(_kernel_shapes(bare, mkl.ATTENTION_FWD)) == {(ROWS, T, H, h)}


def test_sharded_step_equals_one_device_step(model_cfg):
  batch = _batch()
  one = Learner(_cfg(), model_cfg, params=testing.init_params(model_cfg, 0))
  eight = Learner(_cfg(), model_cfg, mesh=sharding.make_mesh(*MESH),
                  params=testing.init_params(model_cfg, 0))
  m1, m8 = one.step(batch), eight.step(batch)
  for key in ("loss", "grad_norm"):
    assert m8[key] == pytest.approx(m1[key], rel=2e-5, abs=1e-6), key
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(one.params),
                          jax.tree.leaves(eight.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))
