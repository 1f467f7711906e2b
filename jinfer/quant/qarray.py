"""Quantized weights as a pytree leaf type, and the quantizer that makes them.

A `QArray` holds int8 or float8 (e4m3) values, one float32 scale per output channel, and how
many of its axes contract with the input. The values' dtype says which matmul reads them (the
int8 or the float8 one). Values are laid out `[lead..., in..., out...]`, or
`[lead..., out..., in...]` when `transposed` (a tied embedding `[vocab, embed]`, which the LM
head contracts over its last axis; on the CPU every linear kernel, see
`KernelOptions.int8_transposed`). Any leading axes (a stacked `layers` axis, an `expert`
axis) are batch axes: every layer's and every expert's channels get their own scales, so nothing
is ever mixed across them. Which weights quantize, and over which axes, comes from what each
linear layer declares about its kernel (`LinearKernel` boxes, see `jinfer/models/params.py`), never
from parameter names.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels import quantize_per_channel
from pallas_kernels.fp8_matmul import quantize_per_channel_fp8


@struct.dataclass
class QArray:
  values: jax.Array  # [lead..., in..., out...] int8 or float8_e4m3fn
  scale: jax.Array  # [lead..., out...] float32
  n_in: int = struct.field(pytree_node=False)  # how many axes after `lead` contract
  n_out: int = struct.field(pytree_node=False)
  transposed: bool = struct.field(pytree_node=False, default=False)  # out axes before in axes

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def nbytes(self) -> int:
    return self.values.nbytes + self.scale.nbytes

  def dequantize(self) -> jax.Array:
    """float32 values * scale, in the stored layout."""
    lead = self.scale.ndim - self.n_out
    ones = (1,) * self.n_in
    scale = (self.scale.reshape(self.scale.shape + ones) if self.transposed else
             self.scale.reshape(self.scale.shape[:lead] + ones + self.scale.shape[lead:]))
    return self.values.astype(jnp.float32) * scale


# One compiled program per weight shape. Run eagerly, each of its ops compiled on its own for
# every shape: a quantized SmolLM2 load took 6.2 s instead of 4.1 s on a 2-core CPU.
@functools.partial(jax.jit, static_argnames=("n_in", "n_out", "transposed", "store_transposed",
                                             "fmt"))
def quantize(w: jax.Array, n_in: int, n_out: int, transposed: bool = False,
             store_transposed: bool | None = None, fmt: str = "int8") -> QArray:
  """Per-output-channel symmetric int8 (`fmt="fp8"`: float8 e4m3) over the `n_in` contracting
  axes of w `[lead..., in..., out...]` (`[lead..., out..., in...]` when `transposed`). The
  values keep w's layout unless `store_transposed` says which to store."""
  store = transposed if store_transposed is None else store_transposed
  lead = w.shape[:w.ndim - n_in - n_out]
  first, second = w.shape[len(lead):len(lead) + (n_out if transposed else n_in)], \
      w.shape[len(lead) + (n_out if transposed else n_in):]
  ins, outs = (second, first) if transposed else (first, second)
  k, n = int(np.prod(ins)), int(np.prod(outs))
  flat = jnp.asarray(w, jnp.float32).reshape((-1, n, k) if transposed else (-1, k, n))
  rounding = quantize_per_channel_fp8 if fmt == "fp8" else quantize_per_channel
  q, scale = jax.vmap(rounding)(flat.swapaxes(1, 2) if transposed else flat)
  q = q.swapaxes(1, 2) if store else q  # [B, K, N] int8 / fp8 -> as stored; scale [B, N]
  return QArray(values=q.reshape(lead + (outs + ins if store else ins + outs)),
                scale=scale.reshape(lead + outs), n_in=n_in, n_out=n_out, transposed=store)


def from_int8(q: jax.Array, scale: jax.Array, shape: tuple[int, ...], n_in: int, n_out: int,
              store_transposed: bool = False) -> QArray:
  """A `QArray` from int8 values decided elsewhere (GPTQ): q [lead..., K, N] and scale
  [lead..., N] of a kernel of `shape` `[lead..., in..., out...]`, stored as `quantize` would."""
  lead = shape[:len(shape) - n_in - n_out]
  ins, outs = shape[len(lead):len(lead) + n_in], shape[len(lead) + n_in:]
  values = q.swapaxes(-1, -2) if store_transposed else q
  return QArray(values=values.astype(jnp.int8).reshape(
                    lead + (outs + ins if store_transposed else ins + outs)),
                scale=scale.astype(jnp.float32).reshape(lead + outs), n_in=n_in, n_out=n_out,
                transposed=store_transposed)


def relayout(q: QArray, store_transposed: bool) -> QArray:
  """`q` with its values stored outputs first (`store_transposed`) or inputs first: the same
  values and scales, moved."""
  if q.transposed == store_transposed:
    return q
  lead = q.scale.ndim - q.n_out
  first, second = (q.n_out, q.n_in) if q.transposed else (q.n_in, q.n_out)
  axes = (tuple(range(lead)) + tuple(range(lead + first, lead + first + second))
          + tuple(range(lead, lead + first)))
  return QArray(values=jnp.transpose(q.values, axes), scale=q.scale, n_in=q.n_in,
                n_out=q.n_out, transposed=store_transposed)


def quantize_params(params: dict, kernels: dict) -> dict:
  """Quantize every leaf that `kernels` (the params tree with each linear kernel's
  `(n_in, n_out, transposed[, store_transposed])`, None elsewhere, see `linear_kernels`) marks as
  a linear layer's kernel; kernels quantized already (`QArray`) stay as they are."""
  return jax.tree.map(lambda w, k: w if k is None or isinstance(w, QArray) else quantize(w, *k),
                      params, kernels, is_leaf=lambda x: x is None or isinstance(x, QArray))


def param_bytes(params: dict) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(params))
