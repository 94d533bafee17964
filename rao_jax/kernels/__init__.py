"""Platform kernels: each behind one function that picks the implementation of the platform the
program is lowered for (``jax.lax.platform_dependent``), plus a static CPU choice.

Modules: matmul (``dense``: the model's 2-D products; MKL's sgemm on x86 CPUs, else XLA's dot),
attention (``causal_attention``: the training forward's attention of packed rows; MKL on CPU,
Pallas splash on TPU, Pallas (Triton) flash on GPU, else XLA's blocked attention; and
``cached_attention``, XLA's attention against the KV cache), segments (the segment ids of packed
rows and the shared prefixes they name: which key a query sees), mkl (building, loading and choosing
the MKL kernels of ``csrc/``), mkl_attention (the MKL attention's forward and backward), decode
(``decode_attention``: the engine's decode step over the cache slots each row holds; a C++ FFI
kernel on CPU, Pallas on GPU and TPU, else XLA's masked attention), paged (the engine's paged
KV cache: writes through a page table, the gathered view a prefill attends over, and
``paged_decode_attention``, the decode step over each row's live pages by the same kernels),
decode_cpu (building and calling that CPU kernel, ``csrc/decode_attention.cc``, which reads
through a page table; no MKL).

The CPU choice is the ``kernels`` argument ("auto" | "mkl" | "xla"), which the model passes from
its static ``ModelConfig.kernels``: it is part of every trace's static configuration, so two
models with different choices in one process compile separately. Nothing here reads the
environment at trace time.

Importing this package loads none of its modules; ``from rao_jax.kernels import dense`` loads
the one it names.
"""
import importlib

_EXPORTS = {
    "dense": "matmul", "causal_attention": "attention", "cached_attention": "attention",
    "MASK_VALUE": "attention", "MODES": "mkl", "CpuKernelsUnavailable": "mkl",
    "decode_attention": "decode", "paged_decode_attention": "paged",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
