"""How the model declares its params: every leaf with its logical axis names, every linear
kernel in a `LinearKernel` box that says what contracts. Sharding rules and the quantizer read
these declarations, never parameter names."""
from __future__ import annotations

import flax.linen as nn
import jax
from flax import struct

from jinfer.quant.groupwise import GroupwiseArray
from jinfer.quant.qarray import QArray

default_init = nn.initializers.normal(0.02)


class LinearKernel(nn.LogicallyPartitioned):
  """A linear layer's kernel box: logical names plus how many leading (after any stacked
  `layers`/`expert` axes) axes contract with the input and how many are outputs, and whether
  the outputs come first (a tied embedding `[vocab, embed]` as the LM head's kernel), and whether
  the layer also reads its quantized values stored outputs first (`linear_kernels`)."""
  n_in: int = struct.field(pytree_node=False, default=1)
  n_out: int = struct.field(pytree_node=False, default=1)
  transposed: bool = struct.field(pytree_node=False, default=False)
  reads_transposed: bool = struct.field(pytree_node=False, default=False)


def kernel(mod: nn.Module, name: str, init, *args):
  """`mod.param(name, init, *args)`, except that params holding a quantized kernel are taken as
  stored. Their shapes (bits, group size, packing; a per-channel kernel's layout, inputs or
  outputs first) come from the checkpoint or the quantizer, not from the layer, so flax's check
  of the stored shapes against `init`'s does not apply; the matmuls check them against their
  input instead."""
  if mod.has_variable("params", name):
    stored = mod.get_variable("params", name)
    quantized = lambda x: isinstance(x, (GroupwiseArray, QArray))
    if any(map(quantized, jax.tree.leaves(stored, is_leaf=quantized))):
      return stored
  return mod.param(name, init, *args)


def param(mod: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...], dtype,
          init=default_init) -> jax.Array:
  return mod.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)
