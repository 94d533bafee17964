"""Every command block a documentation page marks `<!-- runnable -->` runs as shown.

The block is run the way a user pastes it: line by line in bash, stopping at the first failure,
from a scratch directory where `experiments/` is the checkout's (so the pages' relative config
paths resolve) and `runs/` is the scratch directory's own. Pages write these blocks with smoke
settings (`,smoke`). The quickstart's block (a smoke training run, its evaluation, a tree page)
took 43 minutes of wall clock on a 2-core machine at load 7-11, 17 minutes of its CPU time, most
of it compiling: the test is marked slow and long.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("gen_docs",
                                               os.path.join(ROOT, "docs", "gen_docs.py"))
gen = importlib.util.module_from_spec(_spec)
sys.modules["gen_docs"] = gen   # its dataclasses look their module up by name
_spec.loader.exec_module(gen)

BLOCKS = gen.runnable_blocks()


@pytest.mark.slow
@pytest.mark.long   # a real training run: `make test-fast` leaves it out
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("page,cmds", BLOCKS, ids=[f"{p}#{i}" for i, (p, _) in
                                                   enumerate(BLOCKS)])
def test_runnable_block(page, cmds, tmp_path):
  os.symlink(os.path.join(ROOT, "experiments"), tmp_path / "experiments")
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  # As a user runs it: one CPU device, not the suite's eight fake ones (tests/conftest.py).
  if "xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""):
    env.pop("XLA_FLAGS")
  # `python` in a page is the one this suite runs under (the project's virtualenv).
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  for cmd in cmds:
    proc = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, (
        f"{page}: `{cmd}` exited {proc.returncode}\n--- stderr (tail) ---\n"
        f"{proc.stderr[-4000:]}\n--- stdout (tail) ---\n{proc.stdout[-2000:]}")
