"""SandboxConfig: the validated settings of the agents' REPL sandbox."""
from __future__ import annotations

import dataclasses
import os

ISOLATION_MODES = ("bwrap", "process")


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Settings of one sandboxed REPL (and of every sandbox of a pool).

  Attributes:
    isolation: "bwrap" (bubblewrap jail: namespaces, read-only binds, private /tmp, no caps) or
      "process" (a plain child process with rlimits and seccomp only; weaker, used only when
      the user asks for it, and logged as a warning).
    cell_timeout_s: wall-clock seconds one cell may run; past it the whole sandbox is killed
      and replaced by a fresh one. Time while a host tool call is in flight (a subagent the
      cell awaits) is not counted unless timeout_counts_tool_time; those calls are bounded
      by the host's own limits.
    timeout_counts_tool_time: count time spent waiting for host tools against
      cell_timeout_s too.
    max_output_chars: characters of stdout+stderr kept per cell (a note says what was cut).
    memory_mb: address-space limit of the REPL process (RLIMIT_AS), MiB.
    file_size_mb: largest file the REPL may write (RLIMIT_FSIZE), MiB.
    tmp_size_mb: size of the private /tmp tmpfs (bwrap mode), MiB: the one writable
      filesystem in the jail, so it bounds the host memory the jail can hold outside
      memory_mb (/dev is read-only; memfd and SysV/POSIX IPC are refused by seccomp).
    open_files: RLIMIT_NOFILE of the REPL process.
    processes: RLIMIT_NPROC of the REPL, i.e. its threads (bwrap mode; 0 leaves it unset).
      The kernel never applies it to uid 0, so a host running as root starts the jail in a
      user namespace of its own where agents' code runs under an unprivileged uid (see
      jail.py); a host that is not root gets that from bwrap itself. The seccomp filter, which
      refuses every fork, is what stops a fork bomb in all modes.
    cpu_time_s: CPU seconds (all threads) one sandbox may use over its whole life
      (RLIMIT_CPU): past it the sandbox is killed and replaced. It bounds what background
      threads burn while a cell waits for host tools (that time is not on the cell clock);
      between cells the host stops the sandbox altogether (SIGSTOP).
    seccomp: install the syscall filter (no non-UNIX sockets, ptrace, mount, namespaces, bpf,
      io_uring, exec, fork). Only tests of the layers beneath turn it off.
    spawn_timeout_s: seconds a new sandbox may take to report ready.
    tool_arg_max_bytes: largest tool call (its JSON) the sandbox may send. The REPL refuses
      a bigger one with an error inside; a bigger frame on the wire is a protocol violation
      and the sandbox is replaced. It also bounds what parsing one frame costs the host's
      event loop (4 MiB of `0,` items, the costliest JSON per byte: 0.12 s on a 2-core VM).
    max_pending_tool_calls: tool calls one sandbox may have in flight at once; more are
      refused with an error inside the sandbox.
    max_pending_tool_bytes: total JSON bytes of the tool calls one sandbox has in flight
      (what the host holds for it); a call past it is refused with an error inside.
    max_concurrent_spawns: sandboxes started at the same time by one pool (CPU-bound).
    extra_ro_paths: more host paths bound read-only at the same place (bwrap mode), e.g. a
      data folder the agents may read.
    python: interpreter to run in the sandbox; "" means the one running the host.
  """
  isolation: str = "bwrap"
  cell_timeout_s: float = 30.0
  timeout_counts_tool_time: bool = False
  max_output_chars: int = 20_000
  memory_mb: int = 1024
  file_size_mb: int = 64
  tmp_size_mb: int = 128
  open_files: int = 256
  processes: int = 256
  seccomp: bool = True
  spawn_timeout_s: float = 30.0
  cpu_time_s: int = 600
  tool_arg_max_bytes: int = 4 * 1024 * 1024
  max_pending_tool_calls: int = 64
  max_pending_tool_bytes: int = 32 * 1024 * 1024
  max_concurrent_spawns: int = 8
  extra_ro_paths: tuple[str, ...] = ()
  python: str = ""

  def __post_init__(self):
    if self.isolation not in ISOLATION_MODES:
      raise ValueError(f"SandboxConfig.isolation={self.isolation!r} is not one of "
                       f"{ISOLATION_MODES}; use 'bwrap' (default), or 'process' only when "
                       f"bubblewrap cannot be installed")
    positive = {
        "cell_timeout_s": self.cell_timeout_s, "max_output_chars": self.max_output_chars,
        "memory_mb": self.memory_mb, "file_size_mb": self.file_size_mb,
        "tmp_size_mb": self.tmp_size_mb, "open_files": self.open_files,
        "spawn_timeout_s": self.spawn_timeout_s, "tool_arg_max_bytes": self.tool_arg_max_bytes,
        "max_concurrent_spawns": self.max_concurrent_spawns,
        "max_pending_tool_calls": self.max_pending_tool_calls,
        "max_pending_tool_bytes": self.max_pending_tool_bytes,
    }
    for name, value in positive.items():
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"SandboxConfig.{name}={value!r} must be a positive number")
    for name in ("seccomp", "timeout_counts_tool_time"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"SandboxConfig.{name}={getattr(self, name)!r} must be True or False")
    if self.memory_mb < 128:
      raise ValueError(f"SandboxConfig.memory_mb={self.memory_mb} is too small for a Python "
                       f"REPL; use at least 128 (default 1024)")
    if self.open_files < 16:
      raise ValueError(f"SandboxConfig.open_files={self.open_files} is too small; the REPL "
                       f"needs at least 16 (default 256)")
    if isinstance(self.cpu_time_s, bool) or not isinstance(self.cpu_time_s, int) \
        or self.cpu_time_s < 1:
      raise ValueError(f"SandboxConfig.cpu_time_s={self.cpu_time_s!r} must be an int >= 1 "
                       f"(CPU seconds over the sandbox's life; default 600)")
    if self.max_pending_tool_bytes < self.tool_arg_max_bytes:
      raise ValueError(f"SandboxConfig.max_pending_tool_bytes={self.max_pending_tool_bytes} "
                       f"is below tool_arg_max_bytes={self.tool_arg_max_bytes}: one call of "
                       f"the largest allowed size could never run; raise it")
    if isinstance(self.processes, bool) or not isinstance(self.processes, int) \
        or self.processes < 0:
      raise ValueError(f"SandboxConfig.processes={self.processes!r} must be an int >= 0 "
                       f"(0 leaves RLIMIT_NPROC unset)")
    if not isinstance(self.extra_ro_paths, tuple):
      raise ValueError(f"SandboxConfig.extra_ro_paths={self.extra_ro_paths!r} must be a tuple "
                       f"of absolute paths")
    for p in self.extra_ro_paths:
      if not isinstance(p, str) or not os.path.isabs(p):
        raise ValueError(f"SandboxConfig.extra_ro_paths={self.extra_ro_paths!r} has {p!r}; "
                         f"every entry must be an absolute host path")
    if self.python and not os.path.isabs(self.python):
      raise ValueError(f"SandboxConfig.python={self.python!r} must be an absolute path to a "
                       f"Python >= 3.11 interpreter, or '' for the host's own")
