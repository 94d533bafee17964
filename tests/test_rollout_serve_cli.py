"""serve's command line (engine flags generated from EngineConfig) and its engine protocol
(ServedEngine names everything the routes call on an engine). No engine runs here."""
import ast
import dataclasses
import glob
import os
import typing

import pytest

from rao_jax.rollout import EngineConfig
from rao_jax.rollout.serve import cli
from rao_jax.rollout.serve.protocol import ServedEngine

SERVE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "rao_jax", "rollout", "serve")


def test_engine_flags_have_engine_config_defaults():
  args = cli.parser().parse_args([])
  # One set of defaults: with no flag, the server's engine is EngineConfig's default.
  assert cli.engine_config(args) == EngineConfig()
  flags = {a.dest for a in cli.parser()._actions}   # pylint: disable=protected-access
  fields = {f.name for f in dataclasses.fields(EngineConfig)}
  assert fields - flags == {"default_stop_token_ids"}     # set from the tokenizer


def test_engine_flags_parse_into_engine_config():
  args = cli.parser().parse_args([
      "--num-slots", "4", "--max-len", "64", "--min-cache-len", "32", "--chunk-sizes", "16",
      "--prefill-rows", "1,2", "--decode-rows", "2,4", "--decode-steps", "2", "--seed", "3",
      "--share-prefix-min", "0", "--tiny", "--port", "9"])
  cfg = cli.engine_config(args, default_stop_token_ids=(2,))
  assert cfg == EngineConfig(num_slots=4, max_len=64, min_cache_len=32, chunk_sizes=(16,),
                             prefill_rows=(1, 2), decode_rows=(2, 4), decode_steps=2, seed=3,
                             share_prefix_min=0, default_stop_token_ids=(2,))
  assert cfg.cache_lens == (32, 64)          # "" / absent: derived by EngineConfig
  assert cli.parser().parse_args(["--cache-lens", "16,64", "--max-len", "64"]).cache_lens == (
      16, 64)


def test_bad_engine_flags_name_the_flag(capsys):
  with pytest.raises(SystemExit):
    cli.parser().parse_args(["--chunk-sizes", "16,x"])
  assert "--chunk-sizes" in capsys.readouterr().err
  with pytest.raises(ValueError, match="prefill_rows"):
    cli.engine_config(cli.parser().parse_args(["--num-slots", "2", "--prefill-rows", "1,4"]))


def test_help_text_comes_from_the_engine_config_docstring():
  text = cli.parser().format_help()
  assert "concurrent contexts" in " ".join(text.split())           # num_slots' docstring
  assert "(default: 32,256)" in text                               # chunk_sizes' default


def _engine_members_used() -> set[str]:
  """Every ``self.engine.X`` / ``server.engine.X`` attribute the serve package reads."""
  used = set()
  for path in glob.glob(os.path.join(SERVE, "*.py")):
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
          and node.value.attr == "engine"):
        used.add(node.attr)
  return used


def test_protocol_names_exactly_what_the_server_uses():
  members = set(typing.get_type_hints(ServedEngine)) | {
      n for n in vars(ServedEngine) if not n.startswith("_")}
  used = _engine_members_used()
  assert used, "the scan found no engine use: the test would pass vacuously"
  assert used <= members, f"the server uses engine members the protocol lacks: {used - members}"
  assert members - {"close"} <= used, f"protocol members no route uses: {members - used}"


def test_embedded_engine_has_every_protocol_member():
  from rao_jax.rollout import EmbeddedEngine
  missing = [n for n in set(vars(ServedEngine)) | set(typing.get_type_hints(ServedEngine))
             if not n.startswith("_") and n not in ("config", "vocab_size", "stats")
             and not hasattr(EmbeddedEngine, n)]
  assert not missing, missing
