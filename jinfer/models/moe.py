"""Mixture-of-experts feed-forward: a router, routed experts, and optionally a shared expert.

Routing as transformers does it for Mixtral, Qwen2-MoE and Qwen3-MoE: router logits in the
model dtype, softmax in float32, top-k, the top-k weights renormalized when `norm_topk_prob`
(always for Mixtral), summed with the experts' outputs in float32.

Dropless: every live row's k (row, expert) pairs are sorted by expert, each projection of every
expert's rows is one grouped matmul (`pallas_kernels.grouped_matmul`), and the outputs are
gathered back into (row, choice) order and summed with the routing weights. There is no
capacity factor and nothing is dropped, so a row's output never depends on the other rows in
the batch. Padding rows (past the step's live tokens) are routed to no expert: they sort past
every group, cost nothing and never count as expert load.

Expert weights are stacked on an `expert` axis; gate and up projections are one kernel
`[expert, embed, 2, mlp]` (gate first, as transformers fuses them), so one grouped matmul does
both and sharding `mlp` splits gate and up alike.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig
from jinfer.models.kernel_options import KernelOptions
from jinfer.models.params import LinearKernel, default_init, kernel, param
from jinfer.parallel.experts import expert_parallel_matmul
from jinfer.quant.groupwise import GroupwiseArray
from jinfer.quant.qarray import QArray
from pallas_kernels import grouped_matmul


class Experts(nn.Module):
  """One linear layer per expert, kernel `[expert, in, out...]`: row r of `x` times the
  kernel of the expert whose group holds it (rows sorted by expert, `group_sizes` per expert)."""
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  kernels: KernelOptions
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    g, k, out_shape = self.shape[0], self.shape[1], self.shape[2:]
    kn = self.kernels
    if kn.quantization in ("int8", "w8a8"):  # per expert and output channel scales (int4: below)
      init = lambda _, shape, dtype: QArray(values=jnp.zeros(shape, jnp.int8),
                                            scale=jnp.ones((g,) + out_shape, jnp.float32),
                                            n_in=1, n_out=len(out_shape))
    else:
      init = default_init
    w = kernel(self, "kernel", lambda *a: LinearKernel(init(*a), self.axes, n_in=1,
                                                       n_out=len(out_shape)), self.shape,
               self.dtype)
    n = int(np.prod(out_shape))

    def matmul(x, w, group_sizes):  # w: [G, K, *out] for G of the experts
      g = group_sizes.shape[0]
      if isinstance(w, GroupwiseArray):  # [G, K(/2), N] with its group-wise scale and offset
        # The grouped kernels have no codebook form: its codes widen to int8 exactly, here.
        w = w.affine()
        return grouped_matmul(x, w.q, group_sizes, w.scale, w.offset, bits=w.bits,
                              quant_group_size=w.group_size, backend=kn.grouped_matmul,
                              interpret=kn.interpret)
      if isinstance(w, QArray):
        return grouped_matmul(x, w.values.reshape(g, k, n), group_sizes, w.scale.reshape(g, n),
                              mode=kn.matmul_mode, backend=kn.grouped_matmul,
                              interpret=kn.interpret)
      return grouped_matmul(x, w.astype(x.dtype).reshape(g, k, n), group_sizes,
                            backend=kn.grouped_matmul, interpret=kn.interpret)

    if kn.expert_parallel and kn.mesh is not None:
      y = expert_parallel_matmul(matmul, x, w, group_sizes, kn.mesh)
    else:
      y = matmul(x, w, group_sizes)
    return y.reshape(x.shape[:1] + out_shape)


class MoE(nn.Module):
  """`shared_expert`: Qwen2-MoE's dense MLP over every row, scaled by a sigmoid gate."""
  config: ModelConfig
  kernels: KernelOptions
  dtype: Any
  shared_expert: nn.Module | None = None

  @nn.compact
  def __call__(self, x: jax.Array, live: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, E], live [T] bool -> (output [T, E], tokens routed to each expert [X] int32)."""
    c, kn = self.config, self.kernels
    t, e = x.shape
    ne, k, f = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
    # The router stays a plain param, never quantized: routing decisions are discrete.
    router = param(self, "router", (e, ne), ("embed", "expert"), self.dtype)
    probs = jax.nn.softmax((x @ router.astype(x.dtype)).astype(jnp.float32), axis=-1)  # [T, X]
    weights, chosen = jax.lax.top_k(probs, k)  # [T, k]
    if c.norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)

    choice = jnp.where(live[:, None], chosen, ne).reshape(-1)  # [T*k]; padding -> no expert
    order = jnp.argsort(choice, stable=True)  # [T*k]: (row, choice) pairs grouped by expert
    group_sizes = jnp.bincount(choice, length=ne + 1)[:ne].astype(jnp.int32)  # [X]
    rows = x[order // k]  # [T*k, E]
    gate_up = Experts((ne, e, 2, f), ("expert", "embed", "gate_up", "mlp"), kn, self.dtype,
                      name="gate_up")(rows, group_sizes)  # [T*k, 2, F]
    y = Experts((ne, f, e), ("expert", "mlp", "embed"), kn, self.dtype, name="down")(
        nn.silu(gate_up[:, 0]) * gate_up[:, 1], group_sizes)  # [T*k, E]; padding pairs zero
    y = y[jnp.argsort(order)].reshape(t, k, e)  # back in (row, choice) order
    out = jnp.einsum("tke,tk->te", y.astype(jnp.float32), weights).astype(x.dtype)
    if self.shared_expert is not None:
      gate = param(self, "shared_expert_gate", (e,), ("embed",), self.dtype)
      out = out + jax.nn.sigmoid(x @ gate.astype(x.dtype))[:, None] * self.shared_expert(x)
    return out, group_sizes
