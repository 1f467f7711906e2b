"""One weight quantized per output channel (int8 or float8 e4m3), held on the host (numpy).

Checkpoint readers (`compressed_tensors`) produce it in the checkpoint's layout, `values [N, K]`
with `scale [N]` (HF's `[out, in]`); `hf_layout` lays it out as the model's kernel, `[in...,
out...]` with `scale [out...]`, stacks the layers and places it on a device as the model's
`QArray`. Its values are never rounded again: a per-tensor scale is the same scale for every
channel.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax.numpy as jnp
import numpy as np

from jinfer.quant.qarray import QArray

DTYPES = (np.dtype(np.int8), np.dtype(jnp.float8_e4m3fn))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ChannelTensor:
  values: np.ndarray  # [N, K] as stored (n_in None); laid out: [lead..., in..., out...]
  scale: np.ndarray  # [N] float32; laid out: [lead..., out...]
  # None: the checkpoint's [N, K]; else the kernel's contracting and output axes (after `lead`)
  n_in: int | None = None
  n_out: int | None = None

  def __post_init__(self):
    if self.values.dtype not in DTYPES:
      raise ValueError(f"values must be int8 or float8_e4m3fn, got {self.values.dtype}")
    if self.scale.dtype != np.float32:
      raise ValueError(f"scale must be float32, got {self.scale.dtype}")

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def nbytes(self) -> int:
    return self.values.nbytes + self.scale.nbytes

  def laid_out(self, to: Callable | None, lead: int = 0) -> ChannelTensor:
    """The kernel in the model's layout: `to` maps the checkpoint's [N, K] to the float kernel
    `[in..., out...]` (np.transpose plus a reshape into heads); the values move the same way
    and the scale takes the output axes' shape."""
    values = (to or np.transpose)(self.values)
    n, k = self.values.shape
    # The first split whose leading axes hold K: a size-1 output axis (one KV head) stays out.
    n_in = next(i for i in range(1, values.ndim) if math.prod(values.shape[:i]) == k)
    return ChannelTensor(values=values, scale=self.scale.reshape(values.shape[n_in:]),
                         n_in=n_in, n_out=values.ndim - n_in)

  def dequantize(self) -> np.ndarray:
    """float32 values * scale in the held layout (a float stack's layer; tests)."""
    if self.n_in is None:
      return self.values.astype(np.float32) * self.scale[:, None]
    lead = self.scale.ndim - self.n_out
    shape = self.scale.shape[:lead] + (1,) * self.n_in + self.scale.shape[lead:]
    return self.values.astype(np.float32) * self.scale.reshape(shape)

  @classmethod
  def stack(cls, parts: list[ChannelTensor]) -> ChannelTensor:
    """Laid-out weights of one shape and dtype on a new leading axis (the layers of a stack)."""
    first = parts[0]
    for p in parts[1:]:
      if (p.values.dtype, p.values.shape) != (first.values.dtype, first.values.shape):
        raise ValueError(f"layers of {p.values.dtype} {p.values.shape} and "
                         f"{first.values.dtype} {first.values.shape} do not stack")
    return cls(values=np.stack([p.values for p in parts]),
               scale=np.stack([p.scale for p in parts]), n_in=first.n_in, n_out=first.n_out)

  def to_device(self) -> QArray:
    """The model's `QArray` (stored inputs first; the engine lays it out as its matmul reads
    it), on the default device."""
    return QArray(values=jnp.asarray(self.values), scale=jnp.asarray(self.scale),
                  n_in=self.n_in, n_out=self.n_out)
