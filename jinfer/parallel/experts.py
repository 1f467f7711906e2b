"""Expert parallelism: each tensor-axis device holds `num_experts / TP` whole experts.

A MoE layer's rows arrive sorted by expert and replicated on every device (as every activation is
under tensor parallelism). Each device multiplies the contiguous run of rows that belongs to its
own experts (the run is rotated to the front, so the grouped matmul sees only local groups and
leaves every other row zero) and one all-reduce over the tensor axis sums the devices' disjoint
outputs. Dropless like the one-device path: every row meets its expert whatever the batch, so
the all-reduce stands in for the dispatch and combine all-to-alls, with no capacity to overflow.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P


def expert_parallel_matmul(
    matmul: Callable[[jax.Array, object, jax.Array], jax.Array],  # (rows, w, group_sizes) -> out
    x: jax.Array,  # [R, K] rows sorted by expert
    w,  # [X, K, N] (or a QArray with the expert axis first)
    group_sizes: jax.Array,  # [X] int32
    mesh: Mesh,
) -> jax.Array:  # [R, N]
  tp = mesh.shape["tensor"]

  def local(x, w, group_sizes):  # w: [X/TP, ...] this device's experts
    per = group_sizes.shape[0] // tp
    first = jax.lax.axis_index("tensor") * per
    mine = jax.lax.dynamic_slice(group_sizes, (first,), (per,))
    start = jnp.sum(jnp.where(jnp.arange(group_sizes.shape[0]) < first, group_sizes, 0))
    y = matmul(jnp.roll(x, -start, axis=0), w, mine)  # rows past its groups come out zero
    return jax.lax.psum(jnp.roll(y, start, axis=0), "tensor")

  return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("tensor"), P()), out_specs=P(),
                       check_vma=False)(x, w, group_sizes)
