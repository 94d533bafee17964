"""rao_jax/cli: config files loaded by path import their own package, from any directory."""
import os
import subprocess
import sys
import textwrap

import pytest

from rao_jax.cli import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("argv,path", [
    (["--workdir=w", "--config=a/b.py:recursive,smoke"], "a/b.py"),
    (["--config", "a/b.py", "--workdir=w"], "a/b.py"),
    (["--config.rl.lr=1", "--workdir=w"], None),
    (["--configs=x.py"], None),
])
def test_config_path_is_read_from_argv(argv, path):
  assert common.config_path(argv) == path


def _config_package(tmp_path):
  """tmp/proj/cfgpkg/configs/{base,good,typo}.py, the shape of a checkout's experiments/."""
  configs = tmp_path / "proj" / "cfgpkg" / "configs"
  configs.mkdir(parents=True)
  (configs.parent / "__init__.py").write_text("")
  (configs / "__init__.py").write_text("")
  (configs / "base.py").write_text(textwrap.dedent("""\
      from ml_collections import config_dict
      def base_config():
        c = config_dict.ConfigDict()
        c.seed = 0
        return c
      def check_keys(config):
        for k in config.keys():
          if k not in base_config():
            raise ValueError(f"config.{k} is not a known setting")
      """))
  for name, extra in (("good", ""), ("typo", "  c.sede = 3\n")):
    (configs / f"{name}.py").write_text(
        "from cfgpkg.configs import base\ndef get_config(arg=None):\n"
        f"  c = base.base_config()\n{extra}  return c\n")
  return configs


def test_config_package_walks_up_to_the_first_folder_without_init(tmp_path):
  configs = _config_package(tmp_path)
  assert common.config_package(str(configs / "good.py")) == (str(tmp_path / "proj"),
                                                             "cfgpkg.configs")
  (tmp_path / "loose.py").write_text("")
  assert common.config_package(str(tmp_path / "loose.py")) is None
  assert common.config_package(os.path.join(ROOT, "experiments", "configs", "base.py")) == (
      ROOT, "experiments.configs")


def _train(config, cwd):
  # As the rao-train console script runs it: neither the config's project nor the checkout
  # on sys.path (-c puts only the working directory there).
  code = ("import sys\nfrom rao_jax.cli import train\n"
          f"sys.argv = ['rao-train', '--config={config}', '--workdir={cwd}/wd']\ntrain.run()")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                        timeout=120, env=env)


@pytest.mark.parametrize("arg", ["", ":model=/a/folder/elsewhere"])
def test_a_config_imports_its_package_from_elsewhere_and_its_schema_rejects_a_typo(tmp_path, arg):
  # An argument may hold a path (`model=DIR`): the schema is still found beside the file.
  configs = _config_package(tmp_path)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  out = _train(f"{configs / 'typo.py'}{arg}", elsewhere)
  assert out.returncode != 0
  assert "config.sede is not a known setting" in out.stderr, out.stderr[-3000:]
  assert "ModuleNotFoundError" not in out.stderr


def test_a_config_without_a_schema_is_loaded_with_a_warning(tmp_path, caplog):
  from ml_collections import config_dict  # pylint: disable=import-outside-toplevel
  loose = tmp_path / "loose.py"
  loose.write_text("")
  common.check_keys(config_dict.ConfigDict({"anything": 1}), str(loose))
  assert "are not checked" in caplog.text
  configs = _config_package(tmp_path)
  with pytest.raises(ValueError, match="config.sede"):
    sys.path.insert(0, str(tmp_path / "proj"))
    try:
      common.check_keys(config_dict.ConfigDict({"sede": 1}), str(configs / "typo.py"))
    finally:
      sys.path.remove(str(tmp_path / "proj"))
      for name in [m for m in sys.modules if m.startswith("cfgpkg")]:
        del sys.modules[name]


@pytest.mark.parametrize("value,arg", [("textcraft_synth", ":recursive,smoke"),
                                       ("textcraft_synth.py", ":recursive"), ("micro", "")])
@pytest.mark.parametrize("spaced", [False, True])
def test_a_shipped_config_is_named_without_its_folder(tmp_path, monkeypatch, value, arg, spaced):
  monkeypatch.chdir(tmp_path)   # no file of that name here: the name is looked up
  argv = ["rao-train", "--workdir=w"] + (["--config", value + arg] if spaced
                                         else [f"--config={value}{arg}"])
  out = common.resolve_config(argv)
  full = os.path.join(ROOT, "experiments", "configs", value.removesuffix(".py") + ".py")
  assert out == argv[:2] + (["--config", full + arg] if spaced else [f"--config={full}{arg}"])
  assert common.shipped_configs() == os.path.dirname(full)


def test_a_config_file_or_no_config_is_left_as_given(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "micro").write_text("def get_config(arg=None): ...\n")  # a file wins over a name
  for argv in (["x", "--config=micro:a"], ["x", "--workdir=w"],
               ["x", f"--config={ROOT}/experiments/configs/micro.py"]):
    assert common.resolve_config(argv) == argv


@pytest.mark.parametrize("value", ["textcraft_sinth:recursive", "configs/textcraft_synth.py"])
def test_an_unknown_config_names_the_shipped_ones(tmp_path, monkeypatch, value):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit) as e:
    common.resolve_config(["x", f"--config={value}"])
  msg = str(e.value)
  assert value.split(":")[0] in msg and "no such file" in msg
  assert "delegation, delegation_deep, longcontext, micro, search, textcraft, textcraft_synth" in msg, msg
  assert "base" not in msg.split("one of")[1], msg
