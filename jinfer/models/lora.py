"""LoRA adapters on device: many per batch, each row with its own.

Every adaptable linear layer (attention's q/k/v/o, a dense MLP's gate/up/down) has slot stacks
beside its base kernel, in the model's `lora` variable collection at the layer's own path:
`a [L, M, K, r]` and `b [L, M, r, N]` (`K`, `N` the kernel's flattened input and output sizes,
`M = max_loras` slots, `r = max_lora_rank`; an adapter of a smaller rank is zero-padded, its
scaling folded into `b`). A step's rows say which slot they use (`LoraRows`, built on the host);
a row without an adapter adds nothing. The low-rank product runs for every row in one pass,
grouped by slot as Punica and S-LoRA do: the rows are put in slot order and go through the
grouped matmul (the MoE experts' op, its platform backend: Pallas on TPU and GPU), `x @ a[slot]`
then `@ b[slot]`, and back to their places. The rows without an adapter are sorted last, past
every group, where the grouped matmul computes nothing.

Over a mesh the product is the masked dense form instead (every slot's `a` as one matrix, each
row's other slots' columns zeroed before `b`): plain einsums that XLA's partitioner splits as
the slot stacks are laid out, `a`'s K and `b`'s N as their base kernel's (`lora_specs`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels import grouped_matmul

# The linear layers an adapter may adapt, by their module path under a layer: PEFT's short
# names are the last part.
TARGETS = (("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "o_proj"),
           ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


@struct.dataclass
class LoraRows:
  """Which adapter slot each of a step's T rows uses (0-based; `M` or more: none)."""
  slot: jax.Array  # [T] int32
  order: jax.Array  # [T] int32: the rows in slot order, the adapter-less rows last
  restore: jax.Array  # [T] int32: where each row went in `order` (its inverse)
  group_sizes: jax.Array  # [M] int32: rows per slot


def lora_rows(slots: np.ndarray, max_loras: int) -> dict[str, np.ndarray]:
  """The host's side: `slots [T]` (-1 for none, padding rows included) -> LoraRows' arrays."""
  key = np.where(slots < 0, max_loras, slots)
  order = np.argsort(key, kind="stable").astype(np.int32)
  restore = np.empty_like(order)
  restore[order] = np.arange(len(order), dtype=np.int32)
  return dict(slot=key.astype(np.int32), order=order, restore=restore,
              group_sizes=np.bincount(key, minlength=max_loras + 1)[:max_loras].astype(np.int32))


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, rows: LoraRows, *, backend: str,
               interpret, masked: bool) -> jax.Array:
  """x [T, K] -> each row's own adapter's x @ a[slot] @ b[slot], [T, N] (zero without one).
  a [M, K, r], b [M, r, N]."""
  a, b = a.astype(x.dtype), b.astype(x.dtype)
  m, k, r = a.shape
  if masked:
    h = x @ a.transpose(1, 0, 2).reshape(k, m * r)  # [T, M*r]
    mine = (jnp.arange(m)[None, :] == rows.slot[:, None])  # [T, M]
    h = (h.reshape(-1, m, r) * mine[..., None].astype(h.dtype)).reshape(-1, m * r)
    return h @ b.reshape(m * r, -1)
  mm = lambda lhs, rhs: grouped_matmul(lhs, rhs, rows.group_sizes, backend=backend,
                                       interpret=interpret)
  return mm(mm(x[rows.order], a), b)[rows.restore]


def target_shapes(shapes: dict, kinds: dict) -> dict[tuple[str, ...], tuple[int, int, int]]:
  """{module path: (layers, K, N)} of the adaptable linear layers, from the params' shapes and
  `linear_kernels`' `(n_in, ...)` of each kernel: the dense layer stack's (`layers`, or
  `mlp_layers` where dense and MoE layers mix), never experts."""
  out = {}
  for stack in ("layers", "mlp_layers"):
    for path in TARGETS:
      if stack == "mlp_layers" and path[0] != "mlp":
        continue
      own = path[1:] if stack == "mlp_layers" else path
      node, kind = shapes.get(stack), kinds.get(stack)
      for part in own:
        node = None if node is None else node.get(part)
        kind = None if kind is None else kind.get(part)
      if node is None or "kernel" not in node:
        continue
      w, (n_in, _, _, _) = node["kernel"], kind["kernel"]
      dims = w.shape[1:]
      out[(stack,) + own] = (w.shape[0], int(np.prod(dims[:n_in])), int(np.prod(dims[n_in:])))
  return out


def empty_slots(targets: dict, max_loras: int, max_rank: int, dtype) -> dict:
  """The `lora` collection with every slot empty (zeros): `{path...: {"a", "b"}}`."""
  out: dict = {}
  for path, (layers, k, n) in targets.items():
    node = out
    for part in path:
      node = node.setdefault(part, {})
    node["a"] = jnp.zeros((layers, max_loras, k, max_rank), dtype)
    node["b"] = jnp.zeros((layers, max_loras, max_rank, n), dtype)
  return out


def lora_targets(slots: dict, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
  """The module paths of a `lora` collection's slot stacks."""
  if "a" in slots:
    return [path]
  return [p for name, sub in slots.items() for p in lora_targets(sub, path + (name,))]
