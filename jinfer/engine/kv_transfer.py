"""`kv_transfer_config`: prefill and decode on separate device groups, and the one place that
copies KV pages from one engine's cache to another's.

vLLM spells disaggregation `kv_transfer_config={"kv_connector": ..., "kv_role": ...}`, one
process per role. Two connectors (see `jinfer/engine/disaggregated.py`):
- `"in_process"`: both roles in one process. The first `prefill_devices` devices prefill, the
  next `decode_devices` decode, each group split into engines of `*_tensor_parallel_size`
  devices; pages are copied device to device with `jax.device_put`.
- `"jax_transfer"`: one role per process, under `jax.distributed` (`num_processes` >= 2; the
  role follows the process, so every process is given the same option but its own `kv_ip`). Process 0 prefills on
  its first `prefill_devices` devices and serves; every other process decodes on its first
  `decode_devices` devices (default: all of them). Pages move between the processes' devices
  with JAX's transfer API, requests and tokens over a socket of their own; both listen on
  `kv_ip` (vLLM's name), which must be an address of this host the other hosts reach.
"""
from __future__ import annotations

import dataclasses
import itertools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.engine.json_option import parse_option
from jinfer.errors import ParameterError
from pallas_kernels.kv_cache_layout import SINK_PAGE

CONNECTORS = ("in_process", "jax_transfer")
NAME = "kv_transfer_config"


def _error(message: str) -> ParameterError:
  return ParameterError(NAME, f"{NAME}: {message}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVTransferConfig:
  # How pages move between the groups: "in_process" (both groups in this process, pages copied
  # device to device with jax.device_put) or "jax_transfer" (one group per process).
  kv_connector: str = "in_process"
  # in_process: the first this many devices prefill; jax_transfer: of process 0's devices.
  prefill_devices: int
  # in_process: the next this many decode (None: every device left); jax_transfer: of each
  # other process's devices (None: all).
  decode_devices: int | None = None
  # Devices per engine in each group (None: tensor_parallel_size); a group of more devices runs
  # several engines of this size (data parallel within the group).
  prefill_tensor_parallel_size: int | None = None
  decode_tensor_parallel_size: int | None = None
  # Pages of each prefill engine's pool (None: num_pages); a prefill engine holds only prompts
  # being computed, so it needs far fewer than a decode engine (which gets num_pages).
  prefill_num_pages: int | None = None
  # jax_transfer: the address of this host that the processes' transfer servers and request
  # socket listen on (ports the OS picks, shared at start).
  kv_ip: str = "127.0.0.1"

  def __post_init__(self):
    if self.kv_connector not in CONNECTORS:
      raise _error(f"kv_connector must be one of {', '.join(CONNECTORS)}, got "
                   f"{self.kv_connector!r}")
    if not isinstance(self.kv_ip, str) or not self.kv_ip:
      raise _error(f"kv_ip must be a host address, got {self.kv_ip!r}")
    for name in ("prefill_devices", "decode_devices", "prefill_tensor_parallel_size",
                 "decode_tensor_parallel_size", "prefill_num_pages"):
      v = getattr(self, name)
      if v is None and name != "prefill_devices":
        continue
      if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise _error(f"{name} must be an integer >= 1, got {v!r}")

  @classmethod
  def parse(cls, value: "KVTransferConfig | dict[str, Any] | str") -> "KVTransferConfig":
    """From a config, a dict, or JSON text (the CLI's --kv-transfer-config)."""
    return parse_option(cls, value, NAME, "prefill_devices")

  def to_dict(self) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

  @property
  def in_process(self) -> bool:
    return self.kv_connector == "in_process"

  def groups(self, tensor_parallel_size: int) -> tuple[list[list], list[list]]:
    """The devices of each prefill engine and of each decode engine this process runs. Raises
    a ParameterError naming the option at fault for a split that does not fit."""
    ptp = self.prefill_tensor_parallel_size or tensor_parallel_size
    dtp = self.decode_tensor_parallel_size or tensor_parallel_size
    devices, p = jax.local_devices(), self.prefill_devices
    if self.in_process:
      if jax.process_count() > 1:
        raise _error("kv_connector 'in_process' runs both groups in one process; with several "
                     "processes use 'jax_transfer'")
      d = self.decode_devices if self.decode_devices is not None else len(devices) - p
      if p + d > len(devices) or d < 1:
        raise _error(f"prefill_devices={p} + decode_devices={d} needs {p + max(d, 1)} "
                     f"devices; {len(devices)} are available")
    else:
      if jax.process_count() < 2:
        raise _error("kv_connector 'jax_transfer' runs each group in a process of its own: "
                     "start several processes (num_processes >= 2; process 0 prefills)")
      prefill = jax.process_index() == 0
      d = 0 if prefill else (self.decode_devices or len(devices))
      p = p if prefill else 0
      for name, n in (("prefill_devices", p), ("decode_devices", d)):
        if n > len(devices):
          raise _error(f"{name}={n}, but process {jax.process_index()} has {len(devices)} "
                       f"devices")
    for side, n, tp in (("prefill", p, ptp), ("decode", d, dtp)):
      if n == 0:
        continue
      if n < tp or n % tp:
        what = (f"{side}_tensor_parallel_size" if getattr(self, f"{side}_tensor_parallel_size")
                else "tensor_parallel_size")
        raise _error(f"{side}_devices={n} cannot hold engines of {what}={tp} devices (it must "
                     f"be a multiple of it)")
    split = lambda devs, tp: [devs[i:i + tp] for i in range(0, len(devs), tp)]
    return split(devices[:p], ptp), split(devices[p:p + d], dtp)


def _pad(ids: list[int]) -> np.ndarray:
  """Page ids padded to a power of two with the sink page: a handful of shapes compile, not one
  per prompt length."""
  n = 1 << max(0, len(ids) - 1).bit_length()
  return np.asarray(list(ids) + [SINK_PAGE] * (n - len(ids)), np.int32)


def _page_counts(max_pages: int):
  n = 1
  while True:
    yield n
    if n >= max_pages:
      return
    n *= 2


class PageGather:
  """On the sending side: the K/V of some pages of a cache (`src`, a ModelRunner), their KV heads
  laid out as a cache of `dst_num_kv_heads` holds them, on the sender's devices.

  Everything that knows where pages live in the cache is in this file: page ids index axis 1
  of every leaf of the cache pytree (an array, or a QuantizedKVCache's values and scales), KV
  heads axis 3."""

  def __init__(self, src, dst_num_kv_heads: int):
    hs, hd = src.config.num_kv_heads, dst_num_kv_heads
    h = min(hs, hd)  # the model's KV heads: a side with more repeats each (tensor parallel)
    # dst head j holds model head j // (hd // h), which src holds at (j // (hd // h)) * (hs // h).
    heads = None if hs == hd else np.arange(hd) // (hd // h) * (hs // h)
    take = (lambda a: a) if heads is None else (lambda a: jnp.take(a, heads, axis=3))
    # Laid out as the source cache is (pages unsharded, heads over its tensor axis).
    self._fn = jax.jit(lambda cache, ids: jax.tree.map(lambda a: take(a[:, ids]), cache),
                       out_shardings=jax.tree.map(lambda a: a.sharding, src.kv_cache))

  def __call__(self, cache, pages: list[int]):
    return self._fn(cache, _pad(pages))

  def compile(self, cache, max_pages: int) -> None:
    for n in _page_counts(max_pages):
      self._fn.lower(cache, np.zeros(n, np.int32)).compile()


class PageScatter:
  """On the receiving side: pages' K/V (a `PageGather`'s, on this side's devices) written into
  some pages of a cache (`dst`, a ModelRunner; donated, in place)."""

  def __init__(self, dst):
    self._fn = jax.jit(
        lambda cache, pages, ids: jax.tree.map(lambda c, p: c.at[:, ids].set(p), cache, pages),
        donate_argnums=(0,))
    self.sharding = jax.tree.map(lambda a: a.sharding, dst.kv_cache)
    self.bytes_per_page = sum(a.nbytes // a.shape[1] for a in jax.tree.leaves(dst.kv_cache))

  def specs(self, cache, num_pages: int, sharding=None):
    """What a gather of `num_pages` (padded) pages for this cache is: `sharding` (one for every
    leaf), or laid out as the cache is."""
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(
        (a.shape[0], num_pages, *a.shape[2:]), a.dtype, sharding=sharding or sh),
        cache, self.sharding)

  def receive(self, cache, staged, pages: list[int]):
    """`cache` with `staged` (as many pages as `pages`, or padded alike) in `pages`."""
    return self._fn(cache, staged, _pad(pages))

  def compile(self, cache, max_pages: int) -> None:
    for n in _page_counts(max_pages):
      self._fn.lower(cache, self.specs(cache, n), np.zeros(n, np.int32)).compile()


class PageCopier:
  """Both sides in this process (`src` and `dst`, ModelRunners): `send` gathers the pages on the
  source devices and starts their copy onto the destination's (both dispatched, neither waited
  for); `receive` (the `PageScatter`) writes them into the destination cache."""

  def __init__(self, src, dst):
    self.gather, self.scatter = PageGather(src, dst.config.num_kv_heads), PageScatter(dst)
    self.bytes_per_page = self.scatter.bytes_per_page

  def send(self, src_cache, src_pages: list[int]):
    """The pages' K/V, on their way to the destination's devices (an async copy)."""
    return jax.device_put(self.gather(src_cache, src_pages), self.scatter.sharding)

  def receive(self, dst_cache, staged, dst_pages: list[int]):
    return self.scatter.receive(dst_cache, staged, dst_pages)

  def compile(self, src_cache, dst_cache, max_pages: int) -> None:
    """Compile every padded page count up to `max_pages` ahead (warmup)."""
    self.gather.compile(src_cache, max_pages)
    self.scatter.compile(dst_cache, max_pages)


class TransferEndpoint:
  """This process's end of JAX's transfer API (`jax.experimental.transfer`), which moves arrays
  between the devices of two processes without a collective both enter: the sender `offer`s
  arrays under a number, the receiver `pull`s them by that number when it is ready. Works on
  the CPU over TCP and on accelerators over their network (DCN)."""

  def __init__(self, device, host: str):
    from jax.experimental import transfer
    self._server = transfer.start_transfer_server(device.client, f"{host}:0", [f"{host}:0"])
    self.address = self._server.address()
    self._uuids = itertools.count(1)
    self._conns: dict[str, Any] = {}

  def offer(self, arrays) -> int:
    """Hold `arrays` until a peer pulls them; the number to pull them by."""
    uuid = next(self._uuids)
    self._server.await_pull(uuid, arrays)
    return uuid

  def pull(self, address: str, uuid: int, specs):
    """The arrays `address` offered as `uuid`, onto the devices `specs` (ShapeDtypeStructs with
    shardings) name, laid out alike shard by shard."""
    if address not in self._conns:
      self._conns[address] = self._server.connect(address)
    return self._conns[address].pull(uuid, specs)


class PageSender:
  """Hand-overs from an engine of this process (`src`, a ModelRunner) to an engine of another
  (a cache of `dst_num_kv_heads` heads on `dst_num_devices` devices): the pages are gathered
  and offered on `endpoint` for the other side's `PageReceiver` to pull. A mesh laid out like
  the source's takes them shard by shard; any other through one device of each side."""

  def __init__(self, src, dst_num_kv_heads: int, dst_num_devices: int,
               endpoint: TransferEndpoint):
    self.gather, self.endpoint = PageGather(src, dst_num_kv_heads), endpoint
    devices = src.mesh.devices.flat
    self.sharded = (dst_num_devices == len(devices)
                    and dst_num_kv_heads == src.config.num_kv_heads)
    self._one = jax.sharding.SingleDeviceSharding(devices[0])

  def send(self, cache, pages: list[int]) -> tuple[int, int]:
    """Offer the pages' K/V: the number to pull them by, and their (padded) page count."""
    staged = self.gather(cache, pages)
    if not self.sharded:
      staged = jax.device_put(staged, self._one)
    return self.endpoint.offer(staged), jax.tree.leaves(staged)[0].shape[1]


class PageReceiver(PageScatter):
  """The other side of a `PageSender`: pulls the pages onto this engine's (`dst`) devices, then
  writes them into its cache (`receive`) when it has room."""

  def __init__(self, dst, endpoint: TransferEndpoint):
    super().__init__(dst)
    self.endpoint = endpoint
    self._one = jax.sharding.SingleDeviceSharding(dst.mesh.devices.flat[0])

  def pull(self, cache, address: str, uuid: int, num_pages: int, sharded: bool):
    """What `address` offered as `uuid` (`num_pages` padded pages for `cache`), on this
    engine's devices laid out as its cache is (the copy may still be running)."""
    staged = self.endpoint.pull(address, uuid, self.specs(
        cache, num_pages, None if sharded else self._one))
    return staged if sharded else jax.device_put(staged, self.sharding)
