"""The command line that starts one REPL: under bubblewrap, or (weaker) as a plain process.

Inside the jail the filesystem is a read-only tmpfs root holding only:
  /usr/lib, /usr/lib64 (+ /lib, /lib64 as on the host)  shared libraries (libc, libffi, ...)
  /etc/ld.so.cache                                       so the loader finds them
  /python/bin/python3, /python/lib/python3.X[, libpython]  the interpreter and its stdlib
                                                         (its own site-packages masked)
  /sandbox/repl.py                                       the REPL program (stdlib only)
  /dev (minimal), /tmp (private tmpfs of tmp_size_mb)
The interpreter is bound under /python rather than at its host path so that neither the home
folder nor the project folder appears inside, whatever layout the host uses.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig

from rao_jax.sandbox_host import seccomp
from rao_jax.sandbox_host.config import SandboxConfig

# The program that runs inside, found from this package's location (works from any clone).
REPL_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "sandbox", "repl.py")

log = logging.getLogger(__name__)

JAIL_PY = "/python"
JAIL_DIR = "/sandbox"


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


def repl_args(cfg: SandboxConfig, fd: int) -> list[str]:
  """The key=value arguments of repl.py: its protocol fd, limits and seccomp program(s).

  Under bwrap the main filter is installed by bwrap (see bwrap_argv) and the REPL only adds
  the exec rules right after ready; in process mode the REPL installs the whole filter.
  """
  # RLIMIT_NPROC is counted per user namespace: under bwrap (its own user namespace) that is
  # the sandbox's threads alone; in process mode it would be every process of the host's uid,
  # so a sandbox could fail to start its own threads. There, seccomp alone stops forks.
  processes = cfg.processes if cfg.isolation == "bwrap" else 0
  args = [f"fd={fd}", f"memory_mb={cfg.memory_mb}", f"file_size_mb={cfg.file_size_mb}",
          f"open_files={cfg.open_files}", f"processes={processes}"]
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


def bwrap_argv(cfg: SandboxConfig, fd: int, seccomp_fd: int | None = None) -> list[str]:
  """The full bubblewrap command line of one REPL whose protocol fd is `fd`.

  seccomp_fd: read end of seccomp_pipe(cfg); required when cfg.seccomp.
  """
  if cfg.seccomp and seccomp_fd is None:
    raise ValueError("bwrap_argv: cfg.seccomp needs seccomp_fd (from seccomp_pipe(cfg))")
  interp = _interpreter(cfg.python)
  py_lib = f"{JAIL_PY}/lib"
  jail_stdlib = f"{py_lib}/python{interp.version}"
  opts = _bwrap_options()
  argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
  if "--clearenv" in opts:
    argv.append("--clearenv")  # bwrap itself also starts with an empty environment
  if os.geteuid() == 0:
    # Started as root, the jailed process would otherwise keep every capability.
    argv += ["--cap-drop", "ALL"]
  argv += ["--hostname", "sandbox"]
  argv += _mirror_system_libs()
  argv += ["--ro-bind", interp.exe, f"{JAIL_PY}/bin/python3",
           "--ro-bind", interp.stdlib, jail_stdlib]
  # The interpreter's own installed packages are not part of what the REPL needs.
  for sub in ("site-packages", "dist-packages"):
    if os.path.isdir(os.path.join(interp.stdlib, sub)):
      argv += ["--tmpfs", f"{jail_stdlib}/{sub}"]
  if interp.libpython:
    argv += ["--ro-bind", interp.libpython,
             f"{py_lib}/{os.path.basename(interp.libpython)}"]
    if interp.soname and interp.soname != os.path.basename(interp.libpython):
      argv += ["--symlink", os.path.basename(interp.libpython), f"{py_lib}/{interp.soname}"]
    argv += ["--setenv", "LD_LIBRARY_PATH", py_lib]
  argv += ["--ro-bind", REPL_PATH, f"{JAIL_DIR}/repl.py"]
  for p in cfg.extra_ro_paths:
    argv += ["--ro-bind", p, p]
  argv += ["--dev", "/dev"]
  if "--size" in opts:
    argv += ["--size", str(cfg.tmp_size_mb * 1024 * 1024)]
  argv += ["--tmpfs", "/tmp",
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
  argv += repl_args(cfg, fd)
  return argv


def process_argv(cfg: SandboxConfig, fd: int) -> list[str]:
  """The command line of the weaker mode: the REPL as a plain child process."""
  interp = _interpreter(cfg.python)
  return [interp.exe, "-I", "-S", "-B", REPL_PATH] + repl_args(cfg, fd)
