"""The TPU and GPU attention kernels of rao_jax.kernels.attention, run on this CPU in Pallas
interpret mode, against XLA's reference attention: values and gradients, causal, several
segments per row, padding, grouped-query heads; per device under a mesh; and the one entry point.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rao_jax.kernels import attention
from rao_jax.model import sharding
from rao_jax.model.transformer import make_packed_inputs

pytestmark = pytest.mark.slow

B, T, H, K, h = 2, 128, 4, 2, 16
# Row 0: two segments then padding (segment 0); row 1: three segments, the last one reaching the
# end of the row.
LENGTHS = [[50, 40], [30, 60, 38]]

KERNELS = {
    "tpu_splash": functools.partial(attention.tpu_splash_attention, interpret=True),
    "gpu_flash": functools.partial(attention.gpu_flash_attention, interpret=True),
}


def _inputs(b=B, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, T, H, h), jnp.float32)
  k = jax.random.normal(keys[1], (b, T, K, h), jnp.float32)
  v = jax.random.normal(keys[2], (b, T, K, h), jnp.float32)
  r = jax.random.normal(keys[3], (b, T, H, h), jnp.float32)   # a linear readout for gradients
  _, seg = make_packed_inputs((LENGTHS * b)[:b], T)
  return q, k, v, jnp.asarray(seg), r


def _value_and_grads(fn, q, k, v, seg, r):
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, seg) * r)
  out = fn(q, k, v, seg)
  return out, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.fixture(scope="module")
def reference():
  q, k, v, seg, r = _inputs()
  return _value_and_grads(jax.jit(attention.xla_causal_attention), q, k, v, seg, r)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_matches_reference_values_and_gradients(name, reference):
  q, k, v, seg, r = _inputs()
  out, grads = _value_and_grads(jax.jit(KERNELS[name]), q, k, v, seg, r)
  ref_out, ref_grads = reference
  np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
  for got, want, what in zip(grads, ref_grads, "qkv"):
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5, err_msg=f"d{what}")


def test_reference_is_causal_and_segmented():
  """What the kernels are compared with: an output depends only on earlier keys of its own
  segment (a change to a later key, or to another segment, leaves it unchanged)."""
  q, k, v, seg, _ = _inputs()
  out = attention.xla_causal_attention(q, k, v, seg)
  # Row 1: segment 2 spans [30, 90). Perturb key/value 70: outputs < 70, and those outside
  # the segment, must not move; those in [70, 90) must.
  k2, v2 = k.at[1, 70].add(1.0), v.at[1, 70].add(1.0)
  out2 = attention.xla_causal_attention(q, k2, v2, seg)
  moved = np.abs(np.asarray(out2 - out)[1]).max(axis=(1, 2)) > 1e-6
  assert not moved[:70].any() and moved[70:90].all() and not moved[90:].any()


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_per_device_under_a_mesh(name):
  """Under ``jax.set_mesh`` the kernel runs per device on whole rows and local kv heads."""
  mesh = sharding.make_mesh(2, 1, 2)
  q, k, v, seg, r = _inputs(b=2, seed=1)
  want = jax.jit(attention.xla_causal_attention)(q, k, v, seg)
  fn = jax.jit(lambda *a: attention._sharded(KERNELS[name], *a))   # pylint: disable=protected-access
  with jax.set_mesh(mesh):
    got = fn(q, k, v, seg)
    text = fn.lower(q, k, v, seg).as_text()
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  assert "shard_map" in text or "manual" in text


def test_entry_point_on_cpu_matches_reference(reference):
  q, k, v, seg, r = _inputs()
  out, grads = _value_and_grads(jax.jit(attention.causal_attention), q, k, v, seg, r)
  np.testing.assert_allclose(out, reference[0], atol=2e-5, rtol=2e-5)
  for got, want in zip(grads, reference[1]):
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


def test_entry_point_keeps_xla_where_a_kernel_cannot_run():
  """T = 96: neither kernel's blocks (splash 128, 256, 512; Triton 64, 128) divide it, so
  neither lowering holds a Pallas kernel: XLA's attention runs there."""
  q, k, v, seg, _ = _inputs()
  q, k, v, seg = q[:, :96], k[:, :96], v[:, :96], seg[:, :96]
  traced = jax.jit(attention.causal_attention).trace(q, k, v, seg)
  for platform in ("tpu", "cuda"):
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert "tpu_custom_call" not in text and "triton" not in text, platform


def test_entry_point_rejects_mismatched_shapes():
  q, k, v, seg, _ = _inputs()
  with pytest.raises(ValueError, match="do not fit"):
    attention.causal_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2),
                             seg)
  with pytest.raises(ValueError, match="segment ids"):
    attention.causal_attention(q, k, v, seg[:, :64])
