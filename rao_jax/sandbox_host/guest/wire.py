"""The fd protocol between the host and the REPL: its one definition, used by both sides.

Standard library only, and nothing imported at module level: the REPL (`repl.py` beside this
file) imports it inside the jail, where rao_jax is not installed, before its ready message,
whose start-up time every sandbox pays; the host (`rao_jax/sandbox_host/process.py`) imports
it as `rao_jax.sandbox_host.guest.wire`.

The channel is ONE dedicated file descriptor of the REPL (a UNIX socketpair end), never its
stdout. A frame is a 4-byte big-endian length followed by that many bytes of a JSON object
whose first key is "op" (json.dumps's default separators, so every frame starts with
OP_PREFIX):

    host -> repl   {"op": "run", "id": NONCE, "code": str, "tools": [[name, is_async], ...],
                    "max_output": int}
                   {"op": "vars", "id": NONCE, "vars": {name: json value}}
                   {"op": "reply", "rid": RID, "ok": bool, "value": json | "error": str}
    repl -> host   {"op": "ready", "pid": int, "seccomp": bool, "limits": {...}}
                   {"op": "fatal", "error": str}   (the jail could not be completed)
                   {"op": "tool", "cell": NONCE, "rid": RID, "name": str, "args": [...],
                    "kwargs": {...}}
                   {"op": "cancel", "rid": RID}
                   {"op": "done", "id": NONCE, "output": str, "error": str | null}
                   {"op": "vars_done", "id": NONCE, "error": str | null}

NONCE is chosen by the host for every request and RID by the REPL for every tool request, so
a reply is matched to its request, and nothing the agent's code prints (its fds 1 and 2 end in
a pipe that the REPL reads into the cell's output) can pass for a message. The host trusts no
frame: it reads the op first and checks it and the frame's size before it reads the rest.
"""

HEADER_BYTES = 4
BYTE_ORDER = "big"
# Every frame's first bytes, up to the op's name (json.dumps puts the "op" key first because
# every message is built with it first).
OP_PREFIX = b'{"op": "'
TO_REPL_OPS = ("run", "vars", "reply")
FROM_REPL_OPS = ("ready", "fatal", "done", "vars_done", "tool", "cancel")
# How many bytes of a frame hold its op: the prefix, the longest op name and its closing quote.
OP_PEEK_BYTES = len(OP_PREFIX) + max(len(op) for op in TO_REPL_OPS + FROM_REPL_OPS) + 1


# The builtins of frame and frame_size are bound when they are defined: in the REPL they run
# in threads while the agent's code may delete or replace builtins (`del builtins.len`).
def frame(data: bytes, _len=len) -> bytes:
  """One frame: the length header and `data` (a UTF-8 JSON object)."""
  return _len(data).to_bytes(HEADER_BYTES, BYTE_ORDER) + data


def frame_size(header: bytes, _int=int) -> int:
  """The body length a frame's HEADER_BYTES-byte header announces."""
  return _int.from_bytes(header, BYTE_ORDER)


def encode(msg) -> bytes:
  """The frame of a JSON-serialisable message (raises TypeError / ValueError otherwise)."""
  import json  # pylint: disable=import-outside-toplevel  (see the module docstring)
  return frame(json.dumps(msg).encode("utf-8"))


def op_of(head: bytes):
  """The op named by a frame's first bytes (at most OP_PEEK_BYTES of them), else None."""
  end = head.find(b'"', len(OP_PREFIX))
  if not head.startswith(OP_PREFIX) or end < 0:
    return None
  return head[len(OP_PREFIX):end].decode("ascii", "replace")
