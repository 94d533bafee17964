"""The command line that starts one REPL: under bubblewrap, or (weaker) as a plain process.

Inside the jail the filesystem is a read-only tmpfs root holding only:
  /usr/lib, /usr/lib64 (+ /lib, /lib64 as on the host)  shared libraries (libc, libffi, ...)
  /etc/ld.so.cache                                       so the loader finds them
  /python/bin/python3, /python/lib/python3.X[, libpython]  the interpreter and its stdlib
                                                         (its own site-packages masked)
  /sandbox/repl.py, /sandbox/wire.py                     the REPL program and its protocol
                                                         (stdlib only; guest/ of this package)
  /dev (minimal, read-only: no /dev/shm, no ptys), /tmp (private tmpfs of tmp_size_mb)
/tmp is the only writable filesystem, so it bounds every file the jail can create (tmpfs
memory is the host's); the other ways to shared memory (memfd, SysV/POSIX IPC) are refused by
the seccomp filter. The interpreter is bound under /python rather than at its host path so
that neither the home folder nor the project folder appears inside, whatever layout the host
uses.

Uid. The kernel never applies RLIMIT_NPROC (the jail's thread limit) to uid 0. A host that is
not root gets a jail uid from bwrap's own user namespace, mapped to its own uid. A root host
instead creates, once per process, a user namespace mapping in-namespace 0 to host 0 (bwrap
needs it to build the jail) and JAIL_UID_BASE + k to HOST_UID_BASE + k; bwrap enters it and
keeps only CAP_SETUID/CAP_SETGID, and the REPL switches to its own uid JAIL_UID_BASE + k
before anything else (all capabilities go with it). Each live sandbox gets its own k, so the
kernel counts threads per sandbox, and what runs agents' code is an unprivileged host uid.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig

from rao_jax.sandbox_host import seccomp
from rao_jax.sandbox_host.config import SandboxConfig

# The program that runs inside and the one module it imports, shipped inside this package
# (a checkout and an installed wheel alike). Only these two files are bound into the jail.
GUEST_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guest")
REPL_PATH = os.path.join(GUEST_DIR, "repl.py")
GUEST_FILES = ("repl.py", "wire.py")

log = logging.getLogger(__name__)

JAIL_PY = "/python"
JAIL_DIR = "/sandbox"

# Root hosts only (see the module docstring): jail uids and the host uids they map to. The
# host range is far above the uids of real accounts and of the usual subordinate-id ranges.
JAIL_UID_BASE = 1000
HOST_UID_BASE = 1_800_000_000
UID_COUNT = 65536
_uid_counter = itertools.count()


class SandboxUnavailableError(RuntimeError):
  """The requested isolation cannot be set up on this machine."""


def missing_bwrap_message(detail: str = "") -> str:
  """The error text for a machine without a working bubblewrap; it names the fixes."""
  extra = f" ({detail})" if detail else ""
  return ("bubblewrap (`bwrap`) is needed for the agents' sandbox but is not usable here"
          f"{extra}. Fix: install it with `apt-get install bubblewrap` (or `make sysdeps`); "
          "or, knowing that it is much weaker (no filesystem or network namespace), run with "
          "SandboxConfig(isolation='process') (the sandbox isolation flag of the experiments).")


@functools.lru_cache(maxsize=None)
def _bwrap_probe() -> tuple[bool, str]:
  exe = shutil.which("bwrap")
  if exe is None:
    return False, "no `bwrap` on PATH"
  # Being installed is not enough: containers may forbid the namespaces bwrap needs.
  argv = [exe, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
          "--cap-drop", "ALL", "--ro-bind", "/", "/", "--", "/bin/true"]
  if os.geteuid() != 0:
    argv.remove("--cap-drop")
    argv.remove("ALL")
  try:
    r = subprocess.run(argv, capture_output=True, timeout=30, check=False, env={})
  except (OSError, subprocess.TimeoutExpired) as e:
    return False, f"running bwrap failed: {e}"
  if r.returncode != 0:
    return False, "bwrap could not create its namespaces: " + r.stderr.decode(
        "utf-8", "replace").strip()[:300]
  return True, ""


@functools.lru_cache(maxsize=None)
def _bwrap_options() -> frozenset:
  """Options this bwrap knows (--size and --clearenv are missing from older releases)."""
  exe = shutil.which("bwrap")
  if exe is None:
    return frozenset()
  try:
    out = subprocess.run([exe, "--help"], capture_output=True, timeout=30, check=False, env={})
  except (OSError, subprocess.TimeoutExpired):
    return frozenset()
  text = (out.stdout + out.stderr).decode("utf-8", "replace")
  opts = frozenset(w for w in text.split() if w.startswith("--"))
  if "--size" not in opts:
    # bwrap < 0.7: /tmp is then bounded only by RLIMIT_FSIZE per file.
    log.warning("this bwrap has no --size option; the sandbox's /tmp has no total size limit")
  return opts


def bwrap_available() -> bool:
  """True when bubblewrap is installed and can create its namespaces on this machine."""
  return _bwrap_probe()[0]


def require_bwrap() -> None:
  """Raises SandboxUnavailableError (naming the fix) unless bubblewrap works here."""
  ok, detail = _bwrap_probe()
  if not ok:
    raise SandboxUnavailableError(missing_bwrap_message(detail))


@dataclasses.dataclass(frozen=True)
class _Interpreter:
  exe: str          # real path of the interpreter binary
  version: str      # "3.11"
  stdlib: str       # stdlib folder (contains lib-dynload for the usual layouts)
  libpython: str    # shared libpython file, or "" when linked statically
  soname: str       # the name the interpreter asks the loader for (INSTSONAME)


@functools.lru_cache(maxsize=None)
def _interpreter(python: str) -> _Interpreter:
  if python and os.path.realpath(python) != os.path.realpath(sys.executable):
    # Another interpreter: ask it about its own layout.
    probe = ("import json,os,sys,sysconfig;print(json.dumps([os.path.realpath(sys.executable),"
             "'%d.%d'%sys.version_info[:2],sysconfig.get_paths()['stdlib'],"
             "sysconfig.get_config_var('LIBDIR') or '',sysconfig.get_config_var('INSTSONAME')"
             " or '',bool(sysconfig.get_config_var('Py_ENABLE_SHARED'))]))")
    out = subprocess.run([python, "-I", "-c", probe], capture_output=True, check=True,
                         timeout=60).stdout
    exe, version, stdlib, libdir, soname, shared = json.loads(out)
  else:
    exe = os.path.realpath(sys.executable)
    version = "%d.%d" % sys.version_info[:2]
    stdlib = sysconfig.get_paths()["stdlib"]
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    soname = sysconfig.get_config_var("INSTSONAME") or ""
    shared = bool(sysconfig.get_config_var("Py_ENABLE_SHARED"))
  libpython = ""
  if shared and libdir and soname and os.path.exists(os.path.join(libdir, soname)):
    libpython = os.path.realpath(os.path.join(libdir, soname))
  return _Interpreter(exe=exe, version=version, stdlib=stdlib, libpython=libpython,
                      soname=soname)


_USERNS_HELPER = (
    "import ctypes, os, sys\n"
    "if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:\n"
    "  sys.exit('unshare(CLONE_NEWUSER) failed: ' + os.strerror(ctypes.get_errno()))\n"
    "os.write(1, b'1')\nos.read(0, 1)\n")


@functools.lru_cache(maxsize=None)
def _root_userns() -> tuple[int, str]:
  """(fd of the jails' user namespace, "") on a root host, or (-1, why it is unavailable).

  A short-lived helper process unshares a user namespace; this (root) process writes its
  uid/gid maps and keeps an fd to it, which keeps the namespace alive after the helper exits.
  """
  interp = _interpreter("")
  try:
    helper = subprocess.Popen([interp.exe, "-I", "-S", "-c", _USERNS_HELPER], env={},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
  except OSError as e:
    return -1, f"could not start the helper: {e}"
  try:
    if helper.stdout.read(1) != b"1":
      return -1, helper.stderr.read().decode("utf-8", "replace").strip()[-300:]
    mapping = f"0 0 1\n{JAIL_UID_BASE} {HOST_UID_BASE} {UID_COUNT}\n"
    for name in ("uid_map", "gid_map"):
      with open(f"/proc/{helper.pid}/{name}", "w", encoding="ascii") as f:
        f.write(mapping)
    return os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC), ""
  except OSError as e:
    return -1, f"could not set up its uid map: {e}"
  finally:
    helper.stdin.close()
    helper.wait()
    helper.stdout.close()
    helper.stderr.close()


def jail_user(cfg: SandboxConfig) -> tuple[int, int, int] | None:
  """(user namespace fd, jail uid, host uid) for one new sandbox of a root host, else None.

  None on a host that is not root (bwrap's own user namespace does it) and in process mode.
  On a root host without user namespaces the jail runs as uid 0, with a warning: its threads
  are then bounded by nothing but memory.
  """
  if cfg.isolation != "bwrap" or os.geteuid() != 0:
    return None
  fd, why = _root_userns()
  if fd < 0:
    _warn_once(f"the sandbox runs agents' code as uid 0 (a user namespace for an "
               f"unprivileged jail uid could not be made: {why}); RLIMIT_NPROC does not apply "
               f"to uid 0, so `processes` does not bound the jail's threads")
    return None
  k = next(_uid_counter) % UID_COUNT
  return fd, JAIL_UID_BASE + k, HOST_UID_BASE + k


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
  log.warning(msg)


def repl_args(cfg: SandboxConfig, fd: int, jail_uid: int = 0) -> list[str]:
  """The key=value arguments of repl.py: its protocol fd, limits and seccomp program(s).

  Under bwrap the main filter is installed by bwrap (see bwrap_argv) and the REPL only adds
  the exec rules right after ready; in process mode the REPL installs the whole filter.
  """
  # RLIMIT_NPROC is counted per user namespace: under bwrap (its own user namespace) that is
  # the sandbox's threads alone; in process mode it would be every process of the host's uid,
  # so a sandbox could fail to start its own threads. There, seccomp alone stops forks.
  processes = cfg.processes if cfg.isolation == "bwrap" else 0
  args = [f"fd={fd}", f"memory_mb={cfg.memory_mb}", f"file_size_mb={cfg.file_size_mb}",
          f"open_files={cfg.open_files}", f"processes={processes}",
          f"cpu_s={cfg.cpu_time_s}", f"max_tool_bytes={cfg.tool_arg_max_bytes}"]
  if jail_uid:
    args.append(f"uid={jail_uid}")
  if cfg.seccomp:
    try:
      if cfg.isolation == "bwrap":
        args.append(f"seccomp_after_ready={seccomp.exec_program().hex()}")
      else:
        args.append(f"seccomp={seccomp.full_program().hex()}")
    except Exception as e:  # pylint: disable=broad-except
      raise SandboxUnavailableError(
          f"the sandbox's seccomp filter could not be compiled: {e!r}. Fix: `pip install "
          f"pyseccomp` and `apt-get install libseccomp2`") from e
  return args


def seccomp_pipe(cfg: SandboxConfig) -> int | None:
  """A pipe's read end holding the main filter for `bwrap --seccomp`, or None (no seccomp).

  The program is a few hundred bytes, far below a pipe's buffer, so it is written at once.
  """
  if not cfg.seccomp:
    return None
  try:
    prog = seccomp.main_program()
  except Exception as e:  # pylint: disable=broad-except
    raise SandboxUnavailableError(
        f"the sandbox's seccomp filter could not be compiled: {e!r}. Fix: `pip install "
        f"pyseccomp` and `apt-get install libseccomp2`") from e
  r, w = os.pipe()
  try:
    os.write(w, prog)
  finally:
    os.close(w)
  return r


def _mirror_system_libs() -> list[str]:
  """Shared-library folders, bound read-only; symlinks (merged /usr) recreated as symlinks."""
  args = []
  for path in ("/usr/lib", "/usr/lib64", "/lib", "/lib64"):
    if os.path.islink(path):
      args += ["--symlink", os.readlink(path), path]
    elif os.path.isdir(path):
      args += ["--ro-bind", path, path]
  if os.path.exists("/etc/ld.so.cache"):
    args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
  return args


def bwrap_argv(cfg: SandboxConfig, fd: int, seccomp_fd: int | None = None,
               user: tuple[int, int, int] | None = None) -> list[str]:
  """The full bubblewrap command line of one REPL whose protocol fd is `fd`.

  seccomp_fd: read end of seccomp_pipe(cfg); required when cfg.seccomp.
  user: jail_user(cfg) on a root host (its fd must be passed to bwrap too), else None.
  """
  if cfg.seccomp and seccomp_fd is None:
    raise ValueError("bwrap_argv: cfg.seccomp needs seccomp_fd (from seccomp_pipe(cfg))")
  interp = _interpreter(cfg.python)
  py_lib = f"{JAIL_PY}/lib"
  jail_stdlib = f"{py_lib}/python{interp.version}"
  opts = _bwrap_options()
  argv = ["bwrap"]
  if user is not None:
    # The host's user namespace instead of a new one (--unshare-all would make one).
    argv += ["--userns", str(user[0]), "--unshare-pid", "--unshare-net", "--unshare-ipc",
             "--unshare-uts", "--unshare-cgroup-try"]
  else:
    argv += ["--unshare-all"]
  argv += ["--die-with-parent", "--new-session"]
  if "--clearenv" in opts:
    argv.append("--clearenv")  # bwrap itself also starts with an empty environment
  if os.geteuid() == 0:
    # Started as root, the jailed process would otherwise keep every capability; with a jail
    # uid it keeps the two it needs to switch to it (the switch clears them).
    argv += ["--cap-drop", "ALL"]
    if user is not None:
      argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
  argv += ["--hostname", "sandbox"]
  # Folders bwrap creates on the way to a mount point are 0700 and owned by the namespace's
  # root; the jail uid must be able to walk them.
  for d in ("/usr", "/etc", JAIL_PY, f"{JAIL_PY}/bin", py_lib, JAIL_DIR):
    argv += ["--perms", "0755", "--dir", d]
  argv += _mirror_system_libs()
  argv += ["--ro-bind", interp.exe, f"{JAIL_PY}/bin/python3",
           "--ro-bind", interp.stdlib, jail_stdlib]
  # Empty masks: the smallest tmpfs bwrap can make (its --size arrived in 0.7), read-only.
  small = ["--size", "4096"] if "--size" in opts else []
  # The interpreter's own installed packages are not part of what the REPL needs. The mask
  # is read-only: a writable tmpfs there would be memory outside every limit.
  for sub in ("site-packages", "dist-packages"):
    if os.path.isdir(os.path.join(interp.stdlib, sub)):
      argv += small + ["--tmpfs", f"{jail_stdlib}/{sub}", "--remount-ro", f"{jail_stdlib}/{sub}"]
  if interp.libpython:
    argv += ["--ro-bind", interp.libpython,
             f"{py_lib}/{os.path.basename(interp.libpython)}"]
    if interp.soname and interp.soname != os.path.basename(interp.libpython):
      argv += ["--symlink", os.path.basename(interp.libpython), f"{py_lib}/{interp.soname}"]
    argv += ["--setenv", "LD_LIBRARY_PATH", py_lib]
  for name in GUEST_FILES:
    argv += ["--ro-bind", os.path.join(GUEST_DIR, name), f"{JAIL_DIR}/{name}"]
  for p in cfg.extra_ro_paths:
    argv += ["--ro-bind", p, p]
  # /dev is a tmpfs of its own with a world-writable /dev/shm in it, bounded by nothing: it is
  # made read-only (the device nodes are separate mounts and keep working).
  argv += ["--dev", "/dev", "--remount-ro", "/dev"]
  # Its devpts instance would let the jail allocate pseudo-terminals (kernel buffers, a
  # host-wide count); an empty read-only tmpfs hides it (/dev/ptmx then leads nowhere).
  argv += small + ["--tmpfs", "/dev/pts", "--remount-ro", "/dev/pts"]
  if "--size" in opts:
    argv += ["--size", str(cfg.tmp_size_mb * 1024 * 1024)]
  argv += ["--perms", "1777", "--tmpfs", "/tmp",
           "--chdir", "/tmp",
           "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
           "--setenv", "LANG", "C.UTF-8",
           # Fewer malloc arenas: each reserves 64 MiB of address space against RLIMIT_AS.
           "--setenv", "MALLOC_ARENA_MAX", "2",
           # Last: the root tmpfs (mount points made above) becomes read-only too.
           "--remount-ro", "/"]
  if seccomp_fd is not None:
    # bwrap installs it (with no_new_privs) just before it starts the interpreter.
    argv += ["--seccomp", str(seccomp_fd)]
  argv += ["--", f"{JAIL_PY}/bin/python3", "-I", "-S", "-B", f"{JAIL_DIR}/repl.py"]
  argv += repl_args(cfg, fd, jail_uid=user[1] if user is not None else 0)
  return argv


def process_argv(cfg: SandboxConfig, fd: int) -> list[str]:
  """The command line of the weaker mode: the REPL as a plain child process."""
  interp = _interpreter(cfg.python)
  return [interp.exe, "-I", "-S", "-B", REPL_PATH] + repl_args(cfg, fd)
