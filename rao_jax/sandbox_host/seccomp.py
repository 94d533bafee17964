"""The sandbox's seccomp filter, compiled on the host with pyseccomp (libseccomp).

The REPL loads the resulting BPF program with one prctl at start-up, before any thread
exists, so every thread of the agent's code runs under it. Compiling here (trusted side, once
per host process) keeps pyseccomp, typing and ctypes.util out of every sandbox's start-up.
"""
from __future__ import annotations

import errno
import functools
import tempfile

AF_UNIX = 1
CLONE_THREAD = 0x00010000

# Syscalls the agents' code never needs and that would let it leave or probe the jail:
# debugging other processes, (un)mounting, creating or entering namespaces, loading kernel
# code, io_uring (it performs socket operations without the socket syscall, so the socket
# rule below would not see them), and starting programs or processes.
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsmount", "fsconfig", "fspick", "mount_setattr",
    "unshare", "setns",
    "bpf", "perf_event_open", "userfaultfd",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "fork", "vfork", "execve", "execveat",
    "open_by_handle_at", "name_to_handle_at",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "iopl", "ioperm",
)


@functools.lru_cache(maxsize=None)
def filter_program() -> bytes:
  """The BPF program (struct sock_filter[]) of the sandbox's syscall filter.

  Default allow; EPERM for DENIED_SYSCALLS and for clone without CLONE_THREAD (threads yes,
  processes no: this is what stops a fork bomb, also for root where RLIMIT_NPROC does not
  apply); EACCES for socket/socketpair of any family but AF_UNIX; ENOSYS for clone3, whose
  flags live in memory where seccomp cannot read them, so glibc falls back to clone.
  Foreign-architecture syscalls (int 0x80, x32) are killed by libseccomp's default.
  """
  import pyseccomp as sc  # pylint: disable=import-outside-toplevel
  filt = sc.SyscallFilter(sc.ALLOW)
  eperm = sc.ERRNO(errno.EPERM)
  for name in DENIED_SYSCALLS:
    try:
      filt.add_rule(eperm, name)
    except (OSError, ValueError):
      pass  # not a syscall on this architecture
  eacces = sc.ERRNO(errno.EACCES)
  filt.add_rule(eacces, "socket", sc.Arg(0, sc.NE, AF_UNIX))
  filt.add_rule(eacces, "socketpair", sc.Arg(0, sc.NE, AF_UNIX))
  filt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
  filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
  with tempfile.TemporaryFile() as f:
    filt.export_bpf(f)
    f.flush()
    f.seek(0)
    prog = f.read()
  if not prog or len(prog) % 8:
    raise RuntimeError(f"libseccomp exported a malformed BPF program ({len(prog)} bytes)")
  return prog


def filter_hex() -> str:
  """filter_program() as hex, the form it travels in on the REPL's command line."""
  return filter_program().hex()
