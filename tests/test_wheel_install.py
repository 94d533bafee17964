"""The wheel works without the checkout: it ships the REPL, runs a sandboxed cell, installs the
console scripts, runs the project's experiment configs by name and installs no top-level
`experiments` package.

The wheel is built from a copy of the source (so no stale build/ folder of the checkout can slip
into it) and installed with --no-deps into a fresh virtual environment. Its dependencies come
from the test's own environment through a .pth file: that adds their folder to sys.path but
runs none of its .pth files, so the checkout's editable install of rao_jax stays invisible.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from rao_jax.sandbox_host import bwrap_available, missing_bwrap_message

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("rao-train", "rao-evaluate", "rao-sft", "rao-serve")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(not bwrap_available(), reason=missing_bwrap_message())]

_CELL = textwrap.dedent("""\
    import asyncio, json, os, sys
    import rao_jax
    from rao_jax.sandbox_host import Sandbox, SandboxConfig, jail

    async def double(x):
      return 2 * x

    async def main():
      sb = await Sandbox.start(SandboxConfig(isolation="bwrap", cell_timeout_s=60.0))
      try:
        res = await sb.run_cell("import os\\nprint(sorted(os.listdir('/sandbox')), "
                                "await double(21))", tools={"double": double})
      finally:
        await sb.close()
      print(json.dumps({"rao_jax": rao_jax.__file__, "guest": jail.GUEST_DIR,
                        "output": res.output, "error": res.error, "crashed": res.crashed,
                        "path": sys.path}))

    asyncio.run(main())
    """)


def _run(argv, cwd, **kw):
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                        **kw)


def _ok(out):
  assert out.returncode == 0, (out.args, out.stdout[-3000:], out.stderr[-3000:])
  return out


def test_the_wheel_runs_a_sandboxed_cell_and_installs_only_rao_jax(tmp_path):
  src = tmp_path / "src"
  skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
  src.mkdir()
  shutil.copy(os.path.join(ROOT, "setup.py"), src / "setup.py")
  for folder in ("rao_jax", "experiments"):
    shutil.copytree(os.path.join(ROOT, folder), src / folder, ignore=skip)
  wheels = tmp_path / "wheels"
  _ok(_run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
            "-w", str(wheels), str(src)], cwd=tmp_path))
  (wheel,) = wheels.glob("rao_jax-*.whl")

  venv = tmp_path / "venv"
  _ok(_run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path))
  py = venv / "bin" / "python"
  _ok(_run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
            "--no-index", str(wheel)], cwd=tmp_path))
  site = _ok(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  cwd=tmp_path)).stdout.strip()
  with open(os.path.join(site, "rao_deps.pth"), "w") as f:
    f.write(sysconfig.get_paths()["purelib"] + "\n")

  # What the wheel put into site-packages: rao_jax and its metadata, nothing generic.
  top = {n for n in os.listdir(site) if not n.endswith((".pth", ".dist-info", "__pycache__"))}
  assert top == {"rao_jax"}, top
  for name in ("repl.py", "wire.py"):
    assert os.path.isfile(os.path.join(site, "rao_jax", "sandbox_host", "guest", name))

  work = tmp_path / "work"  # outside the checkout: nothing of it is importable from here
  work.mkdir()
  (work / "cell.py").write_text(_CELL)
  res = json.loads(_ok(_run([str(py), "cell.py"], cwd=work)).stdout.splitlines()[-1])
  assert res["rao_jax"].startswith(site), res["rao_jax"]
  assert res["guest"] == os.path.join(site, "rao_jax", "sandbox_host", "guest")
  deps = sysconfig.get_paths()["purelib"]  # the test's own environment may lie in the checkout
  assert not any(p == ROOT or p.startswith(ROOT + os.sep) and p != deps
                 for p in res["path"]), res["path"]
  assert (res["output"], res["error"], res["crashed"]) == (
      "['repl.py', 'wire.py'] 42\n", None, False), res
  found = _ok(_run([str(py), "-c", "import importlib.util as u; "
                    "print(u.find_spec('experiments'), u.find_spec('sandbox'))"], cwd=work))
  assert found.stdout.split() == ["None", "None"]

  # The console scripts: installed, and rao-train runs a checkout's config from elsewhere,
  # importing the checkout's experiments.configs and checking keys against its base.
  for script in SCRIPTS:
    assert os.access(venv / "bin" / script, os.X_OK), script
  for script in SCRIPTS[:3]:  # absl's --help exits with status 1
    helped = _run([str(venv / "bin" / script), "--help"], cwd=work)
    assert f"{script} --" in helped.stdout and "--workdir" in helped.stdout, helped
    assert "Traceback" not in helped.stderr, helped.stderr
  served = _ok(_run([str(venv / "bin" / "rao-serve"), "--help"], cwd=work))
  assert served.stdout.startswith("usage:") and "--model" in served.stdout, served.stdout
  (src / "experiments" / "configs" / "typo.py").write_text(
      "from experiments.configs import textcraft_synth\n"
      "def get_config(arg=None):\n  c = textcraft_synth.get_config(arg)\n"
      "  c.rl.lerning_rate = 1.0\n  return c\n")
  typo = _run([str(venv / "bin" / "rao-train"),
               f"--config={src}/experiments/configs/typo.py:recursive,smoke",
               f"--workdir={work}/run"], cwd=work)
  assert typo.returncode != 0
  assert "config.rl.lerning_rate is not a known setting" in typo.stderr, typo.stderr[-3000:]

  # The project's configs ship inside rao_jax (not as a top-level package) and run by name:
  # this one imports its base from the wheel, passes its key check and reaches model loading.
  shipped = os.path.join(site, "rao_jax", "cli", "shipped", "experiments", "configs")
  assert os.path.isfile(os.path.join(shipped, "textcraft_synth.py")), os.listdir(site)
  named = _run([str(venv / "bin" / "rao-train"), "--config=textcraft_synth:recursive,smoke",
                f"--workdir={work}/named", "--config.model.name=/nonexistent/model"], cwd=work)
  assert named.returncode != 0
  assert "Unknown model '/nonexistent/model'" in named.stderr, named.stderr[-3000:]
  unknown = _run([str(venv / "bin" / "rao-train"), "--config=textcraft_sinth:recursive",
                  f"--workdir={work}/named"], cwd=work)
  assert unknown.returncode != 0 and "micro, search, textcraft" in unknown.stderr, unknown.stderr
