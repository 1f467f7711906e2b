"""How much a model's loss on the calibration text grows when some of its linears are quantized:
the measurement mixed precision allocates by (`jinfer/quant/mixed.py`).

`loss_of_choices` compiles the float model's mean next-token loss once, with every stacked
kernel chosen per layer among its float, int8 and int4 versions (the quantized ones dequantized:
what the W8A16 / W4A16 kernels compute with); any assignment then costs one forward pass and
no compile. `measure` runs it with one unit quantized at a time.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.quant import folding
from jinfer.quant.allocation import FLOAT, INT4, INT8
from jinfer.quant.calibration import prefill_batch
from pallas_kernels import KVCacheSpec

Path = tuple[str, ...]


def loss_of_choices(model, params: dict, paths: Sequence[Path], stacks: Sequence[tuple],
                    token_ids: Sequence[int], *, seq_len: int = 512
                    ) -> Callable[[np.ndarray], float]:
  """f(choice [L, P] of precisions) -> the mean next-token loss (nats) of `model` (a float,
  scanned `CausalLM`) over `token_ids`, with stacked kernel `paths[j]` (relative to
  `params["layers"]`) of layer i taken from `stacks[j][choice[i, j]]` (float, int8, int4
  versions, each [L, ...] in the kernel's float shape)."""
  ids, pos, md, num_pages, last = prefill_batch(token_ids, seq_len)
  c = model.config
  t = int(ids.shape[0])
  spec = KVCacheSpec(num_layers=c.num_layers, num_pages=num_pages, page_size=16,
                     num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=model.dtype)
  valid = np.ones(t, bool)
  valid[last] = False  # a sequence's last row has no next token
  target = jnp.concatenate([ids[1:], ids[:1]])  # [T]: the next token of each row

  @jax.jit
  def loss(params, stacks, choice):
    for j, (path, (f, q8, q4)) in enumerate(zip(paths, stacks)):
      pick = choice[:, j].reshape((-1,) + (1,) * (f.ndim - 1))  # [L, 1...]
      w = jnp.where(pick == INT4, q4, jnp.where(pick == INT8, q8, f))
      params = folding.replace(params, ("layers",) + path + ("kernel",), w)
    logits = model.apply({"params": params}, ids, pos, spec.allocate(), md,
                         jnp.arange(t, dtype=jnp.int32))[0]  # [T, V]
    lp = jax.nn.log_softmax(logits, axis=-1)
    got = jnp.take_along_axis(lp, target[:, None], axis=-1)[:, 0]  # [T]
    return -jnp.sum(jnp.where(valid, got, 0.0)) / valid.sum()

  return lambda choice: float(loss(params, stacks, jnp.asarray(choice, jnp.int32)))


def measure(loss_of: Callable[[np.ndarray], float], units: Sequence[np.ndarray], *,
            verbose: bool = True) -> np.ndarray:
  """[U, 3] the loss increase (nats per token) with unit u alone quantized at each precision
  (float: 0). `units`: boolean masks [L, P] of the cells each unit holds."""
  start = time.perf_counter()
  base_choice = np.full(units[0].shape, FLOAT, np.int32)
  base = loss_of(base_choice)
  out = np.zeros((len(units), 3))
  for u, mask in enumerate(units):
    for p in (INT8, INT4):
      out[u, p] = loss_of(np.where(mask, p, base_choice)) - base
    if verbose:
      print(f"sensitivity: unit {u + 1}/{len(units)}: int8 {out[u, INT8]:+.5f}, int4 "
            f"{out[u, INT4]:+.5f} nats/token ({time.perf_counter() - start:.1f} s)",
            file=sys.stderr, flush=True)
  return out
