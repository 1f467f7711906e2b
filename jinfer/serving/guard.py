"""The checks every HTTP request passes before a route sees it.

A web page in a browser on this machine can send requests to a loopback server: a "simple"
cross-origin POST (a text/plain body, no preflight) reaches it, and a page whose DNS name is
rebound to 127.0.0.1 can read the answers. So: POST bodies must be `application/json` (which
no page can send cross-origin without a CORS preflight this server refuses), requests from an
Origin other than the server's own or an allowed one are refused, and without an API key the
Host must name the bound address. Bodies are read here, bounded in size and time, so that no
route waits on a slow client or buffers an unbounded one.
"""
from __future__ import annotations

import asyncio
import ipaddress
import urllib.parse

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jinfer.serving.errors import APIError
from jinfer.serving.options import ServerOptions

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
  try:
    return ipaddress.ip_address(name)
  except ValueError:
    return None


class HostCheck:
  """Which Host headers name this server: the bound address, localhost when that is a loopback
  or wildcard address, any IP address when it is a wildcard, and `allowed` ("*": anything)."""

  def __init__(self, bound: str, allowed: tuple[str, ...]):
    bound = bound.strip("[]").lower()
    ip = _ip(bound)
    self.any = "*" in allowed
    self.any_ip = bound == "" or (ip is not None and ip.is_unspecified)
    self.names = {bound} | {a.lower().rstrip(".") for a in allowed}
    if self.any_ip or (ip is not None and ip.is_loopback) or bound == "localhost":
      self.names |= _LOOPBACK_NAMES

  def __call__(self, host: str | None) -> bool:
    if self.any:
      return True
    if not host or "@" in host:
      return False
    try:
      parts = urllib.parse.urlsplit("//" + host)
    except ValueError:
      return False
    if parts.netloc != host:  # a path, query or fragment
      return False
    name = (parts.hostname or "").rstrip(".")
    return name in self.names or (self.any_ip and _ip(name) is not None)


class RequestGuard:
  """ASGI middleware: Host, Origin and Content-Type checks, then the body read in full within
  `max_request_bytes` and `body_timeout` and handed to the app."""

  def __init__(self, app: ASGIApp, options: ServerOptions):
    self.app, self.options = app, options
    # With a key, a page cannot authenticate, whatever name it reached the server by.
    self.host_ok = HostCheck(options.host, options.allowed_hosts) if options.api_key is None \
        else None
    self.origins = {o.lower().rstrip("/") for o in options.allowed_origins}

  async def __call__(self, scope: Scope, receive: Receive, send: Send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    try:
      self._check_headers(scope, Headers(scope=scope))
      if scope["method"] == "POST":
        body = await self._read_body(receive)
        if body is None:  # the client left
          return
        receive = _replay(body, receive)
    except APIError as e:
      # The client may still be sending: close the connection rather than read on.
      return await e.response({"Connection": "close"})(scope, receive, send)
    await self.app(scope, receive, send)

  def _check_headers(self, scope: Scope, headers: Headers):
    host = headers.get("host")
    if self.host_ok is not None and not self.host_ok(host):
      raise APIError(400, f"Host {host!r} is not allowed: without an API key this server "
                     f"answers only to its own address (see allowed_hosts)",
                     code="host_not_allowed")
    origin = headers.get("origin")
    if origin is not None and "*" not in self.origins:
      own = f"{scope['scheme']}://{host}".lower()
      if origin.lower().rstrip("/") not in self.origins | {own}:
        raise APIError(403, f"requests from origin {origin!r} are not allowed "
                       f"(see allowed_origins)", type="permission_error",
                       code="origin_not_allowed")
    if scope["method"] == "POST":
      kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
      if kind != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {kind or 'none'!r}",
                       code="unsupported_media_type")
      length = headers.get("content-length")
      if length is not None and length.isdigit() and int(length) > self.options.max_request_bytes:
        raise self._too_large()

  def _too_large(self) -> APIError:
    return APIError(413, f"the request body is larger than {self.options.max_request_bytes} "
                    f"bytes (see max_request_bytes)", code="request_too_large")

  async def _read_body(self, receive: Receive) -> bytes | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + self.options.body_timeout
    chunks, size = [], 0
    while True:
      try:
        message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
      except TimeoutError:
        raise APIError(408, f"the request body did not arrive within "
                       f"{self.options.body_timeout:g} s (see body_timeout)",
                       code="request_timeout") from None
      if message["type"] == "http.disconnect":
        return None
      chunk = message.get("body", b"")
      size += len(chunk)
      if size > self.options.max_request_bytes:
        raise self._too_large()
      chunks.append(chunk)
      if not message.get("more_body", False):
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
  """A `receive` that yields the body already read, then whatever the client sends next (its
  disconnect)."""
  pending = [{"type": "http.request", "body": body, "more_body": False}]

  async def replay() -> Message:
    return pending.pop() if pending else await receive()

  return replay
