"""Test-wide setup. Runs before any test module imports JAX."""
import os

# Eight fake CPU devices so sharding tests can build a (data, fsdp, tensor) mesh; must be set
# before JAX initialises its backend. Unsharded code still runs on device 0 only.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No test may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402  (after the environment above)


@pytest.fixture
def fresh_kernels(monkeypatch):
  """A clean MKL kernel state (rao_jax.kernels.mkl), restored afterwards: whether the kernels
  build and load, and what each ModelConfig.kernels choice resolves to, is cached per process."""
  from rao_jax.kernels import mkl
  mkl.reset()
  yield monkeypatch
  monkeypatch.undo()
  mkl.reset()
