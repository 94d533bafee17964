"""Host side of the agents' isolated REPL.

The REPL program itself is ``guest/repl.py`` (it runs inside the jail and never imports
rao_jax; ``guest/wire.py`` is the fd protocol of both sides). This package starts it under
bubblewrap, speaks the fd protocol to it, forwards its tool calls to host callables, enforces
the per-cell wall-clock limit and keeps a pool of started sandboxes:

    cfg = SandboxConfig(isolation="bwrap", cell_timeout_s=30, max_output_chars=20_000)
    pool = SandboxPool(cfg, size=8); await pool.start()
    sb = await pool.acquire()
    await sb.set_variables({"context": text})
    res = await sb.run_cell("print(len(context))", tools={"craft": craft})
    await pool.release(sb); await pool.close()

Tools inside the REPL. Each name in `tools` is bound (again before every cell) to a proxy that
forwards the call, with its JSON arguments, to the host callable and returns its JSON result;
a host exception arrives as `ToolError("<Type>: <message>")`. A call blocks and returns the
result, except inside a running event loop (a cell that uses `await`, or async code it runs)
where it returns an awaitable when the call is directly awaited or when the host callable is
async, so `await launch_subagent(g)` and `asyncio.gather(launch_subagent(a),
launch_subagent(b))` run concurrently while `x = craft(...)` still just returns the value.
Calls still pending when a cell ends are cancelled, on both sides, with a note in the output.

Isolation (bwrap mode): namespaces (user, pid, net, ipc, uts, cgroup), read-only binds of the
interpreter and its stdlib only, a private sized /tmp as the one writable filesystem, an
unprivileged uid and no capabilities (also on a root host), rlimits (memory, threads, files,
CPU over the sandbox's life) and a seccomp filter, a host-enforced per-cell timeout that kills
the whole sandbox, the REPL stopped between requests, and a protocol whose every breach ends
the sandbox. BUILD.md ("Sandbox threat model") lists what is bounded and how. The weaker
isolation="process" mode keeps the rlimits, the seccomp filter, the stop between requests and
the protocol checks only.
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
