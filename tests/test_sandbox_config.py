"""SandboxConfig validation, the bubblewrap command line, and the missing-bwrap error."""
import asyncio
import logging
import os
import sys

import pytest

from rao_jax.sandbox_host import (SandboxConfig, Sandbox, SandboxUnavailableError,
                                  bwrap_available, jail, process, seccomp)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("field,value", [
    ("isolation", "docker"), ("cell_timeout_s", 0), ("cell_timeout_s", -1.0),
    ("max_output_chars", 0), ("memory_mb", 64), ("open_files", 4), ("processes", -1),
    ("extra_ro_paths", ["/data"]), ("extra_ro_paths", ("relative/path",)),
    ("python", "python3"), ("max_concurrent_spawns", True),
])
def test_config_rejects_bad_values_naming_the_field(field, value):
  with pytest.raises(ValueError) as e:
    SandboxConfig(**{field: value})
  assert field in str(e.value)
  assert repr(value) in str(e.value) or str(value) in str(e.value)


def test_config_is_frozen():
  cfg = SandboxConfig()
  with pytest.raises(Exception):
    cfg.cell_timeout_s = 5  # type: ignore[misc]


def _bind_targets(argv):
  """(src, dest) of every bind in a bwrap command line."""
  out = []
  for i, a in enumerate(argv):
    if a in ("--ro-bind", "--bind", "--dev-bind", "--ro-bind-try", "--bind-try"):
      out.append((argv[i + 1], argv[i + 2], a))
  return out


def test_bwrap_command_line_isolates_and_binds_only_what_python_needs():
  argv = jail.bwrap_argv(SandboxConfig(), fd=7, seccomp_fd=9)
  cmd = argv[:argv.index("--")]
  for flag in ("--unshare-all", "--die-with-parent", "--new-session", "--clearenv"):
    assert flag in cmd
  if os.geteuid() == 0:
    assert cmd[cmd.index("--cap-drop") + 1] == "ALL"
  assert "--share-net" not in cmd
  binds = _bind_targets(cmd)
  # Nothing writable from the host, and nothing bound from the home or the project folder
  # at its own path; the REPL and the interpreter appear under neutral names.
  assert all(kind == "--ro-bind" for _, _, kind in binds)
  home = os.path.expanduser("~")
  for src, dest, _ in binds:
    assert not dest.startswith(REPO) and not dest.startswith(home), (src, dest)
    assert not dest.startswith(sys.prefix), (src, dest)
  dests = {dest for _, dest, _ in binds}
  assert "/sandbox/repl.py" in dests and "/python/bin/python3" in dests
  assert not any(d.startswith("/etc") and d != "/etc/ld.so.cache" for d in dests)
  # A private, size-limited /tmp is the one writable filesystem: every other tmpfs (/dev with
  # its /dev/shm, the site-packages masks) is sized and made read-only, and so is the root,
  # after all mounts.
  i = cmd.index("/tmp", cmd.index("--tmpfs"))
  assert cmd[i - 1] == "--tmpfs" and cmd[i - 3] == "--perms" and cmd[i - 5] == "--size"
  assert cmd[i - 4] == str(128 << 20)
  for k, a in enumerate(cmd):
    if a in ("--tmpfs", "--dev") and cmd[k + 1] != "/tmp":
      assert cmd[k + 2:k + 4] == ["--remount-ro", cmd[k + 1]], cmd[k - 2:k + 4]
  assert cmd[-4:] == ["--remount-ro", "/", "--seccomp", "9"]
  # The REPL gets its fd, limits and the exec rules (bwrap installs the main filter).
  tail = argv[argv.index("--") + 1:]
  assert "fd=7" in tail and "memory_mb=1024" in tail
  assert any(a.startswith("seccomp_after_ready=") for a in tail)
  assert "cpu_s=600" in tail and not any(a.startswith("uid=") for a in tail)
  with pytest.raises(ValueError, match="seccomp_fd"):
    jail.bwrap_argv(SandboxConfig(), fd=7)


def test_root_host_jail_enters_its_user_namespace_and_switches_uid():
  argv = jail.bwrap_argv(SandboxConfig(), fd=7, seccomp_fd=9, user=(11, 1005, 1_800_000_005))
  cmd, tail = argv[:argv.index("--")], argv[argv.index("--") + 1:]
  assert cmd[cmd.index("--userns") + 1] == "11" and "--unshare-all" not in cmd
  for flag in ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"):
    assert flag in cmd
  if os.geteuid() == 0:
    caps = [cmd[k + 1] for k, a in enumerate(cmd) if a == "--cap-add"]
    assert cmd[cmd.index("--cap-drop") + 1] == "ALL" and caps == ["CAP_SETUID", "CAP_SETGID"]
  assert "uid=1005" in tail


def test_seccomp_programs_are_compiled_once_and_well_formed():
  main, exec_, full = seccomp.main_program(), seccomp.exec_program(), seccomp.full_program()
  for prog in (main, exec_, full):
    assert len(prog) % 8 == 0 and len(prog) // 8 > 4
  assert len(full) > len(main) > len(exec_)
  assert seccomp.main_program() is main


def test_missing_bwrap_is_a_clear_error_naming_the_fix(monkeypatch):
  monkeypatch.setattr(jail.shutil, "which", lambda name: None)
  jail._bwrap_probe.cache_clear()
  try:
    assert not bwrap_available()
    with pytest.raises(SandboxUnavailableError) as e:
      asyncio.run(Sandbox.start(SandboxConfig(isolation="bwrap")))
    msg = str(e.value)
    assert "apt-get install bubblewrap" in msg
    assert "isolation='process'" in msg
  finally:
    jail._bwrap_probe.cache_clear()


def test_process_mode_is_never_silent(caplog, monkeypatch):
  monkeypatch.setattr(process, "_warned_process_mode", False)

  async def body():
    sb = await Sandbox.start(SandboxConfig(isolation="process"))
    try:
      res = await sb.run_cell("print(6 * 7)")
      assert res.output == "42\n"
    finally:
      await sb.close()

  with caplog.at_level(logging.WARNING, logger="rao_jax.sandbox_host.process"):
    asyncio.run(body())
  assert any("isolation='process'" in r.getMessage() and "WITHOUT bubblewrap" in r.getMessage()
             for r in caplog.records)


def test_a_jail_that_cannot_be_completed_never_runs_code(monkeypatch):
  """If the seccomp program cannot be loaded the REPL reports it and exits before any cell."""
  real_args = jail.repl_args
  monkeypatch.setattr(jail, "repl_args", lambda cfg, fd: [
      "seccomp=00000000000000ff" if a.startswith("seccomp=") else a
      for a in real_args(cfg, fd)])
  with pytest.raises(process.SandboxSpawnError, match="could not complete its jail"):
    asyncio.run(Sandbox.start(SandboxConfig(isolation="process")))
