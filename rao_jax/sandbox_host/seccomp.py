"""The sandbox's seccomp filter, compiled on the host with pyseccomp (libseccomp).

Compiling here (trusted side, once per host process) keeps pyseccomp, typing and ctypes.util
out of every sandbox's start-up. Two programs:

  main_program()  everything except exec. Under bubblewrap, bwrap itself installs it
                  (`--seccomp FD`) right before it starts the interpreter, so the REPL is
                  filtered from its first instruction; in process mode the REPL loads it
                  (prctl, before any thread exists).
  exec_program()  denies execve/execveat. bwrap must still exec the interpreter after
                  installing the main program, so under bwrap the REPL loads this one itself,
                  right after reporting ready and before it reads any request, still on
                  its only thread (threads inherit the filters in force when created).
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
    "fork", "vfork",
    "open_by_handle_at", "name_to_handle_at",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "iopl", "ioperm",
    # Memory the host pays for outside RLIMIT_AS: anonymous files and System V / POSIX IPC
    # objects live in kernel memory (shmem) and none of them is bounded by the jail's limits
    # (a memfd grows past them by write(), a SysV segment outlives its mapping).
    "memfd_create", "memfd_secret",
    "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl",
    "semget", "semop", "semtimedop", "semctl",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    # A channel between two live jails: file locks and change notifications on the read-only
    # files they all share (the REPL, the interpreter, the libraries). See BUILD.md.
    "flock", "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init",
    "fanotify_mark",
)

# fcntl commands that take or query a record lock (POSIX and open-file-description locks).
F_GETLK, F_SETLK, F_SETLKW = 5, 6, 7
F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW = 36, 37, 38
LOCK_FCNTL_CMDS = (F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW)
# Growing a pipe's buffer (to 1 MiB each, kernel memory outside RLIMIT_AS): pipes keep their
# 64 KiB default, so open_files bounds what they can hold.
F_SETPIPE_SZ = 1031


EXEC_SYSCALLS = ("execve", "execveat")


def _compile(main: bool, exec_: bool) -> bytes:
  """Builds a default-allow filter with the main rules and/or the exec rules."""
  import pyseccomp as sc  # pylint: disable=import-outside-toplevel
  filt = sc.SyscallFilter(sc.ALLOW)
  eperm = sc.ERRNO(errno.EPERM)
  names = (DENIED_SYSCALLS if main else ()) + (EXEC_SYSCALLS if exec_ else ())
  for name in names:
    try:
      filt.add_rule(eperm, name)
    except (OSError, ValueError):
      pass  # not a syscall on this architecture
  if main:
    # Only UNIX sockets: no TCP/UDP, raw, netlink or packet sockets even if a network existed.
    eacces = sc.ERRNO(errno.EACCES)
    filt.add_rule(eacces, "socket", sc.Arg(0, sc.NE, AF_UNIX))
    filt.add_rule(eacces, "socketpair", sc.Arg(0, sc.NE, AF_UNIX))
    # Threads yes, processes no: a clone without CLONE_THREAD is a fork.
    filt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
    # clone3 passes its flags in memory, which seccomp cannot read; ENOSYS makes glibc fall
    # back to clone for new threads, where the rule above applies.
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for cmd in LOCK_FCNTL_CMDS + (F_SETPIPE_SZ,):
      filt.add_rule(eperm, "fcntl", sc.Arg(1, sc.EQ, cmd))
  with tempfile.TemporaryFile() as f:
    filt.export_bpf(f)
    f.flush()
    f.seek(0)
    prog = f.read()
  if not prog or len(prog) % 8:
    raise RuntimeError(f"libseccomp exported a malformed BPF program ({len(prog)} bytes)")
  return prog


@functools.lru_cache(maxsize=None)
def main_program() -> bytes:
  """The BPF program (struct sock_filter[]) of the main filter.

  Default allow; EPERM for DENIED_SYSCALLS, for fcntl's record-lock commands and
  F_SETPIPE_SZ, and for clone
  without CLONE_THREAD (threads yes,
  processes no: this is what stops a fork bomb, also for root where RLIMIT_NPROC does not
  apply); EACCES for socket/socketpair of any family but AF_UNIX; ENOSYS for clone3.
  Foreign-architecture syscalls (int 0x80, x32) are killed by libseccomp's default.
  """
  return _compile(main=True, exec_=False)


@functools.lru_cache(maxsize=None)
def exec_program() -> bytes:
  """The BPF program that denies starting programs (EPERM for execve and execveat)."""
  return _compile(main=False, exec_=True)


@functools.lru_cache(maxsize=None)
def full_program() -> bytes:
  """Main and exec rules in one program (process mode: the REPL loads it before ready)."""
  return _compile(main=True, exec_=True)
