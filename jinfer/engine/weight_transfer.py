"""Weights from a trainer in another process (other devices, another host) to an engine, with
no file in between: JAX's transfer API (`jax.experimental.transfer`, the channel disaggregated
serving moves KV pages over, `kv_transfer.TransferEndpoint`) carries the arrays device to
device, and a socket of their own (`jinfer.parallel.peer_link`) says what to pull.

The engine's process makes a `WeightReceiver` and hands its `address` and `key` to the trainer
(a command line, a file); the trainer's `WeightSender(address, key)` connects. The two need no
`jax.distributed` run in common.

    # engine process                          # trainer process
    rx = WeightReceiver()                      tx = WeightSender(address, key)
    llm.update_weights(rx.receive())           tx.send(params)  # back once pulled

`send` returns once the engine has pulled the arrays, so the trainer may then overwrite or
donate its own. Each array arrives on the receiver's device (one device: the engine's first);
`update_weights` puts it onto the engine's mesh.
"""
from __future__ import annotations

import concurrent.futures
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jinfer.engine.kv_transfer import TransferEndpoint
from jinfer.errors import ParameterError
from jinfer.parallel import peer_link
from jinfer.parallel.peer_link import PeerLink


def _wait(link: PeerLink, timeout: float | None) -> list[Any]:
  """What `link` has received, waiting up to `timeout` seconds for something."""
  while not (messages := link.receive()):
    try:
      link.ready.result(timeout)
    except concurrent.futures.TimeoutError:
      raise TimeoutError(f"nothing from {link.peer} in {timeout} s") from None
  return messages


class WeightReceiver:
  """The engine's end: listens on `host` (an address of this host the trainer reaches) for one
  trainer; its weights land on `device` (default: this process's first)."""

  def __init__(self, device=None, host: str = "127.0.0.1"):
    self.device = device or jax.local_devices()[0]
    self._endpoint = TransferEndpoint(self.device, host)
    self._listener, self.address, self.key = peer_link.listen(host)
    self._link: PeerLink | None = None
    self._inbox: list[dict] = []

  def receive(self, timeout: float | None = None) -> dict:
    """The next params tree the trainer sends (waiting for its connection first), on this
    receiver's device; a TimeoutError after `timeout` seconds without one."""
    if self._link is None:
      self._link = PeerLink(self._listener.accept(), "the trainer")
    if not self._inbox:
      self._inbox = _wait(self._link, timeout)
    offer = self._inbox.pop(0)
    one = SingleDeviceSharding(self.device)
    specs = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=one)
             for shape, dtype in offer["leaves"]]
    arrays = jax.block_until_ready(self._endpoint.pull(offer["address"], offer["uuid"], specs))
    self._link.send(offer["uuid"])  # pulled: the trainer's arrays are its own again
    tree: dict = {}
    for keys, a in zip(offer["paths"], arrays):
      node = tree
      for k in keys[:-1]:
        node = node.setdefault(k, {})
      node[keys[-1]] = a
    return tree

  def close(self):
    if self._link is not None:
      self._link.close()
    self._listener.close()


class WeightSender:
  """The trainer's end, connected to a `WeightReceiver`'s `address` with its `key`; arrays are
  offered from `device` (default: this process's first) on `host`'s transfer server."""

  def __init__(self, address: str, key: bytes, device=None, host: str = "127.0.0.1"):
    self.device = device or jax.local_devices()[0]
    self._endpoint = TransferEndpoint(self.device, host)
    self._link = PeerLink(peer_link.connect(address, key), "the engine")

  def send(self, params: dict, timeout: float | None = None) -> int:
    """Offer `params` (a nested dict of arrays: jinfer's params tree) and return once the
    engine has pulled them; the bytes sent."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = []
    for path, _ in flat:
      if not all(isinstance(k, jax.tree_util.DictKey) for k in path):
        raise ParameterError("params", f"params{jax.tree_util.keystr(path)}: only nested dicts "
                                       f"of arrays are sent")
      paths.append(tuple(k.key for k in path))
    arrays = jax.device_put([a for _, a in flat], SingleDeviceSharding(self.device))
    uuid = self._endpoint.offer(arrays)
    self._link.send({"address": self._endpoint.address, "uuid": uuid, "paths": paths,
                     "leaves": [(a.shape, str(a.dtype)) for a in arrays]})
    if _wait(self._link, timeout) != [uuid]:
      raise RuntimeError(f"the engine answered offer {uuid} out of turn")
    return sum(a.nbytes for a in arrays)

  def close(self):
    self._link.close()
