"""Messages between two processes that run different programs (disaggregated serving: the
prefill process and a decode process), as pickled Python objects over one TCP connection.

The processes of a `jax.distributed` run share one coordination service, but its collectives
need every process to enter them together, and a prefill and a decode process step on their
own schedules. So they talk over a socket of their own: process 0 listens, the others connect
(`listen` / `connect`, the address and key shared once by a broadcast at start). A reader thread
queues what arrives; `ready` is a future a loop can wait on beside its own steps' futures.

A peer that exits or crashes closes its socket, and the survivor's next `receive` raises
`PeerLost` naming it; a host that goes silent without closing is caught by the coordination
service's heartbeat, as in every multi-process run.
"""
from __future__ import annotations

import concurrent.futures
import io
import pickle
import secrets
import threading
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

class PeerLost(RuntimeError):
  """The process at the other end is gone."""


class PeerLink:
  """One end of the connection. `local`: objects that never travel, by name (a tokenizer: each
  side has its own); a message that holds one carries its name instead."""

  def __init__(self, conn: Connection, peer: str, local: dict[str, Any] | None = None):
    self.peer, self._conn, self._local = peer, conn, dict(local or {})
    self._lock = threading.Lock()  # guards the inbox and `ready`
    self._send_lock = threading.Lock()
    self._inbox: list[Any] = []
    self._lost: str | None = None
    self.ready: concurrent.futures.Future = concurrent.futures.Future()
    threading.Thread(target=self._read, name=f"jinfer-link-{peer}", daemon=True).start()

  def send(self, message: Any) -> None:
    data = dumps(message, self._local)
    try:
      with self._send_lock:
        self._conn.send_bytes(data)
    except OSError as e:
      raise PeerLost(f"{self.peer} is gone: {e}") from e

  def receive(self) -> list[Any]:
    """What arrived since the last call (maybe nothing); raises PeerLost once the peer is gone
    and everything it sent has been read."""
    with self._lock:
      out, self._inbox = self._inbox, []
      if not out and self._lost is not None:
        raise PeerLost(self._lost)
      if self._lost is None:
        self.ready = concurrent.futures.Future()
    return out

  def _read(self):
    while True:
      try:
        data = self._conn.recv_bytes()
        message, lost = loads(data, self._local), None
      except (EOFError, OSError) as e:
        message, lost = None, (f"{self.peer} is gone ({type(e).__name__}: the process exited, "
                               f"crashed or closed the connection)")
      except Exception as e:  # noqa: BLE001 - a message this side cannot read ends the link
        message, lost = None, f"a message from {self.peer} could not be read: {e!r}"
      with self._lock:
        if lost is not None:
          self._lost = lost
        else:
          self._inbox.append(message)
        if not self.ready.done():
          self.ready.set_result(None)
      if lost is not None:
        return

  def close(self):
    self._conn.close()


class _Pickler(pickle.Pickler):
  def __init__(self, file, local: dict[str, Any]):
    super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
    self._names = {id(obj): name for name, obj in local.items()}

  def persistent_id(self, obj):
    return self._names.get(id(obj))


class _Unpickler(pickle.Unpickler):
  def __init__(self, file, local: dict[str, Any]):
    super().__init__(file)
    self._local = local

  def persistent_load(self, name):
    return self._local[name]


def dumps(message: Any, local: dict[str, Any]) -> bytes:
  """`message` as sent: the objects in `local` by name."""
  buf = io.BytesIO()
  _Pickler(buf, local).dump(message)
  return buf.getvalue()


def loads(data: bytes, local: dict[str, Any]) -> Any:
  """A message as received: names of `local` objects resolved to this side's own."""
  return _Unpickler(io.BytesIO(data), local).load()


def listen(host: str) -> tuple[Listener, str, bytes]:
  """A listener on `host` (an OS-chosen port): it, its "host:port", and the key peers need."""
  key = secrets.token_bytes(16)
  listener = Listener((host, 0), authkey=key)
  h, port = listener.address[:2]
  return listener, f"{h}:{port}", key


def connect(address: str, key: bytes) -> Connection:
  host, port = address.rsplit(":", 1)
  return Client((host, int(port)), authkey=key)
