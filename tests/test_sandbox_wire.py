"""The one fd protocol module (rao_jax/sandbox_host/guest/wire.py) that host and REPL share."""
import asyncio
import json
import os
import subprocess
import sys

import pytest

from rao_jax.sandbox_host import (Sandbox, SandboxConfig, bwrap_available, jail,
                                  missing_bwrap_message)
from rao_jax.sandbox_host.guest import wire
from rao_jax.sandbox_host.process import ReplProcess


def test_frames_round_trip_and_name_their_op():
  msg = {"op": "tool", "cell": "c" * 32, "rid": "r", "name": "craft", "args": ["é", 1],
         "kwargs": {}}
  data = wire.encode(msg)
  size = wire.frame_size(data[:wire.HEADER_BYTES])
  assert size == len(data) - wire.HEADER_BYTES
  assert json.loads(data[wire.HEADER_BYTES:]) == msg
  assert wire.op_of(data[wire.HEADER_BYTES:][:wire.OP_PEEK_BYTES]) == "tool"
  assert wire.frame(b"{}") == b"\x00\x00\x00\x02{}"


@pytest.mark.parametrize("head", [b'{"op": "done', b'{"op":"done"', b'["op", "done"]', b"",
                                  b'{"pid": 1, "op": "ready"}'])
def test_op_of_refuses_what_does_not_start_with_a_whole_op(head):
  assert wire.op_of(head) is None


def test_every_op_fits_the_peek_and_every_repl_op_has_a_host_size_limit():
  for op in wire.TO_REPL_OPS + wire.FROM_REPL_OPS:
    head = wire.encode({"op": op, "id": "x"})[wire.HEADER_BYTES:][:wire.OP_PEEK_BYTES]
    assert wire.op_of(head) == op
  limits = ReplProcess(SandboxConfig())._frame_limits()  # pylint: disable=protected-access
  assert set(limits) == set(wire.FROM_REPL_OPS)


def test_the_guest_imports_the_same_module_with_the_stdlib_only():
  # As the host starts it: -I -S, so neither site-packages nor the checkout is importable.
  path = jail.REPL_PATH
  code = (f"import sys\ng = {{'__name__': 'guest', '__file__': {path!r}}}\n"
          f"exec(compile(open({path!r}).read(), {path!r}, 'exec'), g)\n"
          "print(g['wire'].__file__, 'rao_jax' in sys.modules, g['os'].path.dirname("
          f"{path!r}) in sys.path)")
  out = subprocess.run([sys.executable, "-I", "-S", "-B", "-c", code], capture_output=True,
                       text=True, check=True, cwd="/").stdout.split()
  assert out == [os.path.join(jail.GUEST_DIR, "wire.py"), "False", "False"]
  assert wire.__file__ == os.path.join(jail.GUEST_DIR, "wire.py")


def test_the_jail_binds_exactly_the_guest_files():
  argv = jail.bwrap_argv(SandboxConfig(), fd=7, seccomp_fd=9)
  binds = {argv[i + 2]: argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"}
  guest = {d: s for d, s in binds.items() if d.startswith(jail.JAIL_DIR + "/")}
  assert guest == {f"/sandbox/{n}": os.path.join(jail.GUEST_DIR, n)
                   for n in ("repl.py", "wire.py")}
  assert sorted(os.listdir(jail.GUEST_DIR)) >= ["__init__.py", "repl.py", "wire.py"]


@pytest.mark.skipif(not bwrap_available(), reason=missing_bwrap_message())
@pytest.mark.timeout(120)
def test_the_repl_reads_a_reply_while_the_cell_has_deleted_int():
  """The REPL's reader thread frames replies with wire.frame_size while agent code runs: the
  builtins it needs are bound in wire itself, so deleting them mid-cell breaks nothing."""
  async def slow(x):
    await asyncio.sleep(0.2)
    return x + 1

  async def main():
    sb = await Sandbox.start(SandboxConfig(isolation="bwrap", cell_timeout_s=20.0))
    try:
      return await sb.run_cell(
          "import builtins\nfut = slow(41)\nsaved = builtins.int\ndel builtins.int\n"
          "r = await fut\nbuiltins.int = saved\nprint(r)", tools={"slow": slow})
    finally:
      await sb.close()
  res = asyncio.run(main())
  assert (res.output, res.error, res.crashed) == ("42\n", None, False), res
