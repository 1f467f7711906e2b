"""`kv_transfer_config`: prefill and decode on separate device groups, and the one place that
copies KV pages from one engine's cache to another's.

vLLM spells disaggregation `kv_transfer_config={"kv_connector": ..., "kv_role": ...}`, one
process per role. Here both roles run in one process (`kv_connector: "in_process"`): the first
`prefill_devices` devices prefill, the next `decode_devices` decode, each group split into
engines of `*_tensor_parallel_size` devices (see `jinfer/engine/disaggregated.py`).
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.engine.json_option import parse_option
from jinfer.errors import ParameterError
from pallas_kernels.kv_cache_layout import SINK_PAGE

CONNECTORS = ("in_process",)
NAME = "kv_transfer_config"


def _error(message: str) -> ParameterError:
  return ParameterError(NAME, f"{NAME}: {message}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVTransferConfig:
  # How pages move between the groups: "in_process" (both groups in this process, pages copied
  # device to device with jax.device_put).
  kv_connector: str = "in_process"
  prefill_devices: int  # the first this many devices prefill
  decode_devices: int | None = None  # the next this many decode (None: every device left)
  # Devices per engine in each group (None: tensor_parallel_size); a group of more devices runs
  # several engines of this size (data parallel within the group).
  prefill_tensor_parallel_size: int | None = None
  decode_tensor_parallel_size: int | None = None
  # Pages of each prefill engine's pool (None: num_pages); a prefill engine holds only prompts
  # being computed, so it needs far fewer than a decode engine (which gets num_pages).
  prefill_num_pages: int | None = None

  def __post_init__(self):
    if self.kv_connector not in CONNECTORS:
      raise _error(f"kv_connector must be one of {', '.join(CONNECTORS)}, got "
                   f"{self.kv_connector!r} (across processes is not built yet)")
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

  def groups(self, tensor_parallel_size: int, devices: list) -> tuple[list[list], list[list]]:
    """The devices of each prefill engine and of each decode engine. Raises a ParameterError
    naming the option at fault for a split that does not fit."""
    ptp = self.prefill_tensor_parallel_size or tensor_parallel_size
    dtp = self.decode_tensor_parallel_size or tensor_parallel_size
    p = self.prefill_devices
    d = self.decode_devices if self.decode_devices is not None else len(devices) - p
    if p + d > len(devices) or d < 1:
      raise _error(f"prefill_devices={p} + decode_devices={d} needs {p + max(d, 1)} devices; "
                   f"{len(devices)} are available")
    for side, n, tp in (("prefill", p, ptp), ("decode", d, dtp)):
      if n < tp or n % tp:
        what = (f"{side}_tensor_parallel_size" if getattr(self, f"{side}_tensor_parallel_size")
                else "tensor_parallel_size")
        raise _error(f"{side}_devices={n} cannot hold engines of {what}={tp} devices (it must "
                     f"be a multiple of it)")
    split = lambda devs, tp: [devs[i:i + tp] for i in range(0, len(devs), tp)]
    return split(devices[:p], ptp), split(devices[p:p + d], dtp)


class PageCopier:
  """Copies KV pages from one engine's cache (`src`, a ModelRunner) into another's (`dst`).

  Everything that knows where pages live in the cache is here: page ids index axis 1 of every
  leaf of the cache pytree (an array, or a QuantizedKVCache's values and scales), KV heads
  axis 3. `send` gathers the pages on the source devices and starts the copy onto the
  destination's (both dispatched, neither waited for); `receive` writes them into the
  destination cache (donated, in place). Page counts are padded to a power of two with the sink
  page, so a handful of shapes compile, not one per prompt length.
  """

  def __init__(self, src, dst):
    hs, hd = src.config.num_kv_heads, dst.config.num_kv_heads
    h = min(hs, hd)  # the model's KV heads: a side with more repeats each (tensor parallel)
    # dst head j holds model head j // (hd // h), which src holds at (j // (hd // h)) * (hs // h).
    heads = None if hs == hd else np.arange(hd) // (hd // h) * (hs // h)
    take = (lambda a: a) if heads is None else (lambda a: jnp.take(a, heads, axis=3))
    self._gather = jax.jit(lambda cache, ids: jax.tree.map(lambda a: take(a[:, ids]), cache))
    self._scatter = jax.jit(
        lambda cache, pages, ids: jax.tree.map(lambda c, p: c.at[:, ids].set(p), cache, pages),
        donate_argnums=(0,))
    self._dst_sharding = jax.tree.map(lambda a: a.sharding, dst.kv_cache)
    leaves = jax.tree.leaves(dst.kv_cache)
    self.bytes_per_page = sum(a.nbytes // a.shape[1] for a in leaves)

  @staticmethod
  def _pad(ids: list[int]) -> np.ndarray:
    n = 1 << max(0, len(ids) - 1).bit_length()
    return np.asarray(list(ids) + [SINK_PAGE] * (n - len(ids)), np.int32)

  def send(self, src_cache, src_pages: list[int]):
    """The pages' K/V, on their way to the destination's devices (an async copy)."""
    pages = self._gather(src_cache, self._pad(src_pages))
    return jax.device_put(pages, self._dst_sharding)

  def receive(self, dst_cache, staged, dst_pages: list[int]):
    """`dst_cache` with `staged` (from `send`, as many pages or padded alike) in `dst_pages`."""
    return self._scatter(dst_cache, staged, self._pad(dst_pages))

  def compile(self, src_cache, dst_cache, max_pages: int) -> None:
    """Compile every padded page count up to `max_pages` ahead (warmup)."""
    n = 1
    while True:
      ids = np.zeros(n, np.int32)
      staged = jax.eval_shape(self._gather, src_cache, ids)
      self._gather.lower(src_cache, ids).compile()
      self._scatter.lower(dst_cache, jax.tree.map(
          lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), staged,
          self._dst_sharding), ids).compile()
      if n >= max_pages:
        return
      n *= 2
