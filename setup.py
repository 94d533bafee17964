"""rao_jax: Recursive Agent Optimization in JAX. See README.md and BUILD.md."""
import glob
import os

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

# The experiment configs (and the micro-runs' warm start they call) as the wheel ships them:
# `rao-train --config=textcraft_synth:recursive` runs one by name (rao_jax/cli/common.py). They
# go under rao_jax/cli/shipped/, which only rao_jax's entry points put on sys.path, so the wheel
# installs no top-level `experiments` package.
_HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = ["experiments/__init__.py", "experiments/micro_policy.py",
           *sorted(os.path.relpath(p, _HERE)
                   for p in glob.glob(os.path.join(_HERE, "experiments", "configs", "*.py")))]


class BuildPyShippingConfigs(build_py):
  """build_py that also copies SHIPPED into rao_jax/cli/shipped/ (not for editable installs:
  those find the configs in their checkout)."""

  def run(self):
    super().run()
    if getattr(self, "editable_mode", False):
      return
    for rel in SHIPPED:
      dst = os.path.join(self.build_lib, "rao_jax", "cli", "shipped", rel)
      self.mkpath(os.path.dirname(dst))
      self.copy_file(os.path.join(_HERE, rel), dst)

setup(
    name="rao_jax",
    version="0.1.0",
    description="Recursive Agent Optimization (RAO): RL for recursive LLM agents, in JAX",
    python_requires=">=3.11",
    # rao_jax only: a top-level `experiments` package in site-packages would collide with
    # others; the configs ship inside rao_jax (SHIPPED above), the demo and wrappers do not.
    cmdclass={"build_py": BuildPyShippingConfigs},
    # Namespace discovery lists the data folders (kernels/csrc, envs/data/...) as packages too:
    # Python can import them, and setuptools warns a page per folder when they ship as data of
    # a package that does not list them (what `make demo` printed on a fresh clone).
    packages=find_namespace_packages(include=["rao_jax", "rao_jax.*"],
                                     exclude=["*.__pycache__", "*.__pycache__.*"]),
    package_data={"rao_jax.kernels.csrc": ["*.cc", "*.h"],
                  "rao_jax.envs.data.textcraft": ["*"],
                  "rao_jax.envs.data.textcraft.recipes": ["*.json"]},
    include_package_data=True,
    entry_points={"console_scripts": [
        "rao-train = rao_jax.cli.train:run",
        "rao-evaluate = rao_jax.cli.evaluate:run",
        "rao-sft = rao_jax.cli.sft:run",
        "rao-export = rao_jax.cli.export:run",
        "rao-serve = rao_jax.rollout.serve:main",
    ]},
    install_requires=[
        "jax>=0.7",
        "flax>=0.11",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "chex>=0.1.90",
        "absl-py>=2.1",
        "ml_collections>=1.0",
        "numpy>=1.26",
        "transformers>=4.50",
        "tokenizers>=0.21",
        "gguf>=0.16",
        "safetensors>=0.5",
        "aiohttp>=3.10",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "tensorboardX>=2.6",
        "bm25s>=0.2",
        "pyseccomp>=0.1.2",
        # MKL for the model's float32 products and attention on x86 CPUs (rao_jax/kernels/mkl.py).
        "mkl>=2024; platform_system == 'Linux' and platform_machine == 'x86_64'",
    ],
    extras_require={
        # Tests, benchmarks and the PyTorch peer that parity tests and benchmarks compare against.
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "torch==2.13.0",
            "accelerate>=1.0",
            # The OpenAI client: tests drive serve's /v1 endpoints the way users' tools do.
            "openai>=1.40",
            # Raw HTTP in serve's tests (SSE streams line by line); only gguf pulls it in otherwise.
            "requests>=2.28",
            # Hugging Face PEFT: the tests that rao_jax's LoRA adapter folders load in PEFT (and
            # PEFT's in rao_jax) with the same logits (tests/test_model_peft.py).
            "peft>=0.21",
        ],
        # The SGLang rollout server for GPU nodes; a CPU machine never needs it.
        # 0.5.6: the first release with everything SGLANG_API.md uses: pause_generation modes
        # (abort/retract/in_place, sgl-project/sglang#10071, merged after 0.5.5), weight_version
        # on update_weights_from_disk and meta_info, and /get_weight_version (later releases
        # replace it with /model_info). slime, the contract's reference driver, pins 0.5.6 too.
        "sglang": ["sglang[all]==0.5.6"],
    },
)
