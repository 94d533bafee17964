"""The server's door: the API key, the bind check and the folders weight loads may read.

- API key (SGLang's ``--api-key``): when set, every route except the health checks (the
  server's ``open_paths``, as SGLang exempts /health*) needs ``Authorization: Bearer <key>``; a missing or
  wrong key gets 401 with a JSON error in the route's API shape (SGLang's or OpenAI's) that
  never repeats what was sent. Keys are compared with ``hmac.compare_digest`` so the answer's
  timing says nothing about how much of a guess was right.
- Bind check: a server reachable from other hosts without a key lets anyone generate and make
  it load weights; ``check_bind`` refuses that unless the operator asked for it.
- Weight roots: ``/update_weights_from_disk`` and ``/load_lora_adapter`` read a path from the
  request; ``WeightRoots`` resolves it (symlinks, ``..``, relative to the server's working
  directory) and admits it only inside the folders the server was started with, so a caller
  cannot make the server open arbitrary files (whose bytes would come back in the loader's
  error messages).
"""
from __future__ import annotations

import hmac
import ipaddress
import os
from typing import Iterable

from aiohttp import web

# The environment variable the server's --api-key defaults to, the one the clients read: SGLang
# takes its key from the flag only; a variable keeps the key out of process listings.
from rao_jax.rollout.sglang_client import API_KEY_ENV  # pylint: disable=unused-import


def is_loopback(host: str | None) -> bool:
  """Whether binding ``host`` serves this machine only (127.0.0.0/8, ::1, localhost).

  Host names other than ``localhost`` count as reachable from elsewhere: what they resolve to
  can change after the check.
  """
  if host is None or not str(host).strip():
    return False          # aiohttp binds every interface for an empty host
  host = str(host).strip()
  if host.lower() == "localhost":
    return True
  try:
    ip = ipaddress.ip_address(host.strip("[]"))
  except ValueError:
    return False
  if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
    ip = ip.ipv4_mapped
  return ip.is_loopback


def check_bind(host: str | None, api_key: str | None, allow_no_api_key: bool) -> str | None:
  """Why serving ``host`` as configured is refused, or None when it may start.

  Args:
    host: the address the server binds.
    api_key: the key (None or "" = no key).
    allow_no_api_key: the operator's explicit consent to an open non-loopback server.

  Returns:
    The error naming the flags to pass, or None.
  """
  if api_key or allow_no_api_key or is_loopback(host):
    return None
  return (f"--host {host!r} is reachable from other machines and no API key is set: anyone "
          f"who can reach the port could generate and load weights. Pass --api-key KEY (or "
          f"set {API_KEY_ENV}; clients send 'Authorization: Bearer KEY'), bind --host "
          "127.0.0.1, or pass --allow-no-api-key to serve it open on purpose.")


def _unauthorized(request: web.Request, message: str) -> web.Response:
  headers = {"WWW-Authenticate": 'Bearer realm="rao_jax"'}
  if request.path.startswith("/v1/"):
    # OpenAI's shape and code, so OpenAI clients raise their AuthenticationError.
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "invalid_api_key"}}
  else:
    body = {"error": {"message": message}}
  return web.json_response(body, status=401, headers=headers)


def bearer_token(header: str | None) -> str | None:
  """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive)."""
  if not header:
    return None
  scheme, _, token = header.strip().partition(" ")
  if scheme.lower() != "bearer" or not token.strip():
    return None
  return token.strip()


def api_key_middleware(api_key: str, open_paths: Iterable[str] = ()):
  """An aiohttp middleware that answers 401 unless the request carries ``api_key``.

  Args:
    api_key: the key clients send as ``Authorization: Bearer <key>`` (non-empty).
    open_paths: exact paths served without a key (the health checks).

  Returns:
    The middleware (``web.Application(middlewares=[...])``).
  """
  if not api_key:
    raise ValueError("api_key_middleware: api_key is empty; give the key, or add no "
                     "middleware to serve without one.")
  want = api_key.encode("utf-8")
  open_paths = frozenset(open_paths)

  @web.middleware
  async def check_api_key(request: web.Request, handler):
    if request.path in open_paths:
      return await handler(request)
    token = bearer_token(request.headers.get("Authorization"))
    if token is None:
      return _unauthorized(request, "missing API key: this server was started with --api-key; "
                                    "send the header 'Authorization: Bearer <key>'.")
    if not hmac.compare_digest(token.encode("utf-8"), want):
      return _unauthorized(request, "invalid API key: the bearer token is not this server's "
                                    "--api-key.")
    return await handler(request)

  return check_api_key


class PathOutsideRoots(ValueError):
  """A requested path resolves outside every weight root (the server answers 403)."""


class WeightRoots:
  """The folders weight loads may read from, resolved once at start.

  Args:
    roots: folders (relative ones against the working directory); symlinks resolved.
  """

  def __init__(self, roots: Iterable[str]):
    self.roots = tuple(dict.fromkeys(os.path.realpath(r) for r in roots if r))
    if not self.roots:
      raise ValueError("WeightRoots: give at least one folder weight loads may read from "
                       "(--weight-roots DIR[,DIR]).")

  def resolve(self, path: str, field: str = "model_path") -> str:
    """The real path of ``path`` when it lies inside a root.

    The caller loads the returned path, the one checked, so a symlink along the requested path
    cannot lead the load elsewhere.

    Args:
      path: the requested path.
      field: the request field it came from (named in the refusal).

    Raises:
      PathOutsideRoots: the resolved path is outside every root; the message names them.
    """
    real = os.path.realpath(path)
    for root in self.roots:
      if os.path.commonpath([real, root]) == root:
        return real
    raise PathOutsideRoots(
        f"{field} {path!r} resolves to {real!r}, outside the folders this server loads "
        f"weights from: {list(self.roots)}. Write checkpoints under one of them, or restart "
        "the server with --weight-roots naming the folder.")
