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
  """A clean choice of CPU kernels (rao_jax.model.cpu_kernels), restored afterwards: the choice
  is cached per process and read from RAO_JAX_CPU_KERNELS."""
  from rao_jax.model import cpu_kernels
  # setenv, not delenv: monkeypatch then restores the variable even after cpu_kernels.select()
  # wrote os.environ directly (a delenv of an unset variable records nothing to undo).
  monkeypatch.setenv(cpu_kernels.ENV, "auto")
  cpu_kernels.ready.cache_clear()
  yield monkeypatch
  monkeypatch.undo()
  cpu_kernels.ready.cache_clear()
