"""Quantized linear layers per tensor shard: the matmul kernel runs under `jax.shard_map` on
the shards the sharding rules give its weight, never partitioned by the compiler.

Why: a Mosaic kernel refuses to be partitioned ("wrap the call in a shard_map"), and a
quantized matmul left to XLA's partitioner relayouts stacked int8 weights on XLA:GPU (eight
H100s at TP 8 transposed every layer's int8 kernels each step: 10 GB of temporaries). Per shard,
every kernel reads its own slice in place. How a layer splits follows from which of its axes
the rules put on `tensor` (`sharding.partition_spec`):
  * an output axis (q/k/v, gate/up, the LM head's vocabulary): column parallel. Each shard
    multiplies the replicated activations by its columns; the output stays split there.
  * a contracting axis (o_proj's heads, down_proj's MLP rows): row parallel. Each shard
    multiplies its slice of the activations (split the same way, as the layer before left them)
    by its rows, and one all-reduce sums the partial products. W8A8 quantizes each shard's
    slice of a row on its own (a finer per-token scale than one device's).
  * neither: the plain call on every device.
A kernel's scales go with its outputs: split with them, or whole beside a split input.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jinfer.parallel.sharding import partition_spec

# (x [M, K'], weight, scale, offset) -> [M, N'] on one shard's slices
Matmul = Callable[..., jax.Array]


def tensor_parallel_matmul(
    matmul: Matmul,
    x: jax.Array,  # [..., in...]: the trailing `len(in_spec)` axes contract
    weight: jax.Array,  # any layout; `weight_spec` says how it splits
    scales: tuple[jax.Array, ...],  # each split like the outputs (`out_spec`), or whole
    *,
    in_spec: tuple,  # mesh axis (or None) of each contracting axis of x
    out_spec: tuple,  # mesh axis (or None) of each output axis
    weight_spec: P,
    scale_specs: tuple[P, ...],
    out_shape: tuple[int, ...],  # the whole output's trailing axes
    mesh: Mesh,
) -> jax.Array:  # [..., out...]
  lead = x.ndim - len(in_spec)
  row_parallel = "tensor" in in_spec
  tp = mesh.shape["tensor"]
  local_out = tuple(n // tp if a == "tensor" else n for n, a in zip(out_shape, out_spec))

  def local(x, w, *scales):
    y = matmul(x.reshape(-1, int(np.prod(x.shape[lead:]))), w, *scales)
    y = y.reshape(x.shape[:lead] + local_out)
    return jax.lax.psum(y, "tensor") if row_parallel else y

  return jax.shard_map(
      local, mesh=mesh,
      in_specs=(P(*(None,) * lead, *in_spec), weight_spec, *scale_specs),
      out_specs=P(*(None,) * lead, *(None if row_parallel else a for a in out_spec)),
      check_vma=False)(x, weight, *scales)


def int8_specs(axes: tuple[str, ...], n_in: int, transposed: bool) -> tuple[tuple, tuple, P, P]:
  """(in spec, out spec, values' spec, scale's spec) of a per-channel int8 kernel whose logical
  axes are `axes`, stored inputs first (or outputs first when `transposed`)."""
  spec = tuple(partition_spec(axes)) + (None,) * (len(axes) - len(partition_spec(axes)))
  n_out = len(axes) - n_in
  ins, outs = (spec[n_out:], spec[:n_out]) if transposed else (spec[:n_in], spec[n_in:])
  scale = P(*(None,) * n_out) if "tensor" in ins else P(*outs)
  return ins, outs, P(*spec), scale
