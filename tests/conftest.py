"""Test-wide setup. Runs before any test module imports JAX."""
import gc
import os
import sys

# Eight fake CPU devices so sharding tests can build a (data, fsdp, tensor) mesh; must be set
# before JAX initialises its backend. Unsharded code still runs on device 0 only.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the session and the subprocesses its tests start:
# the suite compiles the same programs again and again (a run and its lr=0 control, a run and
# its resume, a command and the same command after SIGTERM), and on 2 CPU cores compiling is
# much of a short run. Removed when the session ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit  # noqa: E402
  import shutil  # noqa: E402
  import tempfile  # noqa: E402
  _XLA_CACHE = tempfile.mkdtemp(prefix="rao_jax_tests_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
# No test may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402  (after the environment above)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drops JAX's in-memory compiled programs after each test module.

  XLA:CPU maps each executable's code into ~3 small memory regions, held until JAX's caches let
  it go. The whole suite compiles thousands of programs in one process, and past the kernel's
  limit on regions (vm.max_map_count, 65,530 by default) the next compilation crashes the
  process (SIGSEGV or SIGABRT in XLA). Cleared, the count falls from ~12,000 to ~900 after the
  trainer tests; the persistent compilation cache above brings programs back quickly.
  """
  yield
  if "jax" in sys.modules:   # JAX is never imported here: a test module that needs it does
    sys.modules["jax"].clear_caches()
    gc.collect()


@pytest.fixture
def fresh_kernels(monkeypatch):
  """A clean MKL kernel state (rao_jax.kernels.mkl), restored afterwards: whether the kernels
  build and load, and what each ModelConfig.kernels choice resolves to, is cached per process."""
  from rao_jax.kernels import mkl
  mkl.reset()
  yield monkeypatch
  monkeypatch.undo()
  mkl.reset()


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
  """An HF folder holding a tiny random model with SmolLM2's architecture and real tokenizer
  (`ModelConfig.tiny()`): what the Trainer, server and multi-process tests run, in seconds."""
  from flax import nnx
  from rao_jax.model import ModelConfig, Transformer, export_hf, resolve_model_path
  from rao_jax.model.tokenizer import Tokenizer
  gguf = resolve_model_path("smollm2-135m")
  cfg = ModelConfig.from_gguf(gguf).tiny()
  out = str(tmp_path_factory.mktemp("tiny_hf"))
  export_hf(Transformer(cfg, rngs=nnx.Rngs(0)), cfg, Tokenizer.from_gguf(gguf), out)
  return out
