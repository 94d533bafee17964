"""Host side of the agents' isolated REPL.

The REPL program itself is ``sandbox/repl.py`` (it runs inside the jail and never imports
rao_jax). This package starts it under bubblewrap, speaks the fd protocol to it, forwards its
tool calls to host callables, enforces the per-cell wall-clock limit and keeps a pool of
started sandboxes:

    cfg = SandboxConfig(isolation="bwrap", cell_timeout_s=30, max_output_chars=20_000)
    pool = SandboxPool(cfg, size=8); await pool.start()
    sb = await pool.acquire()
    await sb.set_variables({"context": text})
    res = await sb.run_cell("print(len(context))", tools={"craft": craft})
    await pool.release(sb); await pool.close()
"""
from rao_jax.sandbox_host.config import SandboxConfig
from rao_jax.sandbox_host.jail import SandboxUnavailableError
from rao_jax.sandbox_host.jail import bwrap_available
from rao_jax.sandbox_host.jail import missing_bwrap_message
from rao_jax.sandbox_host.jail import require_bwrap
from rao_jax.sandbox_host.pool import SandboxPool
from rao_jax.sandbox_host.process import SandboxSpawnError
from rao_jax.sandbox_host.sandbox import CellResult
from rao_jax.sandbox_host.sandbox import Sandbox

__all__ = [
    "CellResult", "Sandbox", "SandboxConfig", "SandboxPool", "SandboxSpawnError",
    "SandboxUnavailableError", "bwrap_available", "missing_bwrap_message", "require_bwrap",
]
