"""Mixed precision: each linear across all layers (`granularity="linear"`, the default) or each
decoder layer's linears (`"layer"`) int4, int8 or float, picked by measured sensitivity to meet
a budget. "linear" measured better on held-out text for the same bytes (SmolLM2 at 6 bits:
+7.3% perplexity against +9.1%, docs/quantization.md), needs 7 units' measurements instead of
30, and keeps one stack.

1. Candidates: every stacked linear kernel in its three forms. int4 by `method` (AWQ, GPTQ or
   RTN, as `quantize_model` makes it; AWQ's scales are folded into the float params first, which
   computes the same function, so its float and int8 forms are of the folded weights), int8 per
   output channel (W8A16), float as loaded.
2. Sensitivity (`jinfer/quant/sensitivity.py`): the loss increase on the calibration text with
   one unit alone at int8 and at int4, the rest float.
3. Allocation (`jinfer/quant/allocation.py`) to a budget: `bits`, the average bits per weight of
   the decoder layers' linear kernels counting everything stored (int4's float32 scale and offset
   per group, int8's scale per channel), or `max_ppl_increase`, the perplexity increase on the
   calibration text, measured: the fewest bits whose allocation meets it, found by bisection.
4. The params: a stack whose layers differ in type cannot be one scanned stack, so consecutive
   layers with one assignment form a run, each its own stack (`params["layers"]["run_i"]`, read
   by `CausalLM`'s `LayerRuns`); one run is the usual single stack. Granularity "linear" always
   gives one run.

The embedding (the tied LM head) is not part of the budget: like int4's, it is int8.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.quant import allocation, folding, sensitivity
from jinfer.quant.allocation import FLOAT, INT4
from jinfer.quant.calibration import LinearStats
from jinfer.quant.groupwise import GroupwiseArray
from jinfer.quant.model import (STACK, _stacked_kernels, clip_awq, fold_awq, group_size_for,
                                quantize_model)
from jinfer.quant.qarray import QArray, quantize

PRECISIONS = ("float", "int8", "int4")  # indexed by allocation.FLOAT, INT8, INT4
GRANULARITIES = ("layer", "linear")
SENSITIVITY_TOKENS = 1024  # of the calibration text: 2 sequences of 512 per forward pass
# Forward passes that look for the fewest bits meeting `max_ppl_increase`: the bits are found
# to (all float - all int4) / 2**10, about 0.03 bits.
BISECTIONS = 10

Path = tuple[str, ...]


def stack_kernels(params: dict, kernels: dict) -> list[tuple[Path, tuple]]:
  """(path relative to the layer stack of each dict holding a stacked linear `kernel`, its
  declaration)."""
  return [(path[1:], decl) for path, decl in _stacked_kernels(params, kernels)
          if path[0] == STACK]


def kernel_shapes(params: dict, kernels: dict) -> list[tuple[tuple[int, ...], np.dtype, int]]:
  """(one layer's shape, dtype, how many axes contract) of each stacked linear kernel."""
  return [(w.shape[1:], w.dtype, decl[0]) for w, decl in
          ((folding.get(params[STACK], p + ("kernel",)), decl)
           for p, decl in stack_kernels(params, kernels))]


def cell_bytes(shapes: Sequence[tuple[tuple[int, ...], np.dtype, int]],
               group_size: int) -> np.ndarray:
  """[3, P] bytes of one layer's kernel j (`kernel_shapes`) as float (its dtype), int8 (values
  and a float32 scale per output channel) and int4 (packed values, a float32 scale and offset
  per group)."""
  out = []
  for shape, dtype, n_in in shapes:
    k, n = int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))
    g = group_size_for(k, group_size)
    out.append((k * n * np.dtype(dtype).itemsize, k * n + 4 * n,
                k * n // 2 + 2 * 4 * (k // g) * n))
  return np.asarray(out, np.int64).T


def bits_range(params: dict, kernels: dict, group_size: int) -> tuple[float, float]:
  """The fewest and most average bits per weight an allocation can take: all int4, all float."""
  shapes = kernel_shapes(params, kernels)
  cells = cell_bytes(shapes, group_size)
  weights = sum(int(np.prod(s)) for s, _, _ in shapes)
  return 8 * cells[INT4].sum() / weights, 8 * cells[FLOAT].sum() / weights


def stack_bits(params: dict, num_weights: int) -> float:
  """Average bits per weight of the linear kernels of a layer stack as stored (`params["layers"]`,
  runs or one stack) over `num_weights` float weights."""
  is_q = lambda x: isinstance(x, (QArray, GroupwiseArray))
  total = 0
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(params[STACK], is_leaf=is_q)[0]:
    if any(getattr(k, "key", None) == "kernel" for k in keypath):
      total += leaf.nbytes
  return 8 * total / num_weights


def units(granularity: str, num_layers: int, num_kernels: int) -> list[np.ndarray]:
  """Boolean masks [L, P] of the cells each unit holds."""
  if granularity not in GRANULARITIES:
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
  eye = np.eye(num_layers if granularity == "layer" else num_kernels, dtype=bool)
  return [np.broadcast_to(r[:, None] if granularity == "layer" else r[None, :],
                          (num_layers, num_kernels)) for r in eye]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidates:
  params: dict  # the float params (AWQ: its scales folded in); the float form of every kernel
  paths: tuple[Path, ...]  # the stacked linear kernels, relative to `params["layers"]`
  int8: tuple[QArray, ...]  # per path, [L, ...], stored as the engine reads it
  int4: tuple[GroupwiseArray, ...]  # per path, [L, K/2, N] packed

  def float_kernel(self, j: int) -> jax.Array:
    return folding.get(self.params[STACK], self.paths[j] + ("kernel",))

  def shapes(self) -> list[tuple[tuple[int, ...], np.dtype, int]]:
    """As `kernel_shapes`."""
    return [(self.float_kernel(j).shape[1:], self.float_kernel(j).dtype, q8.n_in)
            for j, q8 in enumerate(self.int8)]

  def forms(self) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """Per path its (float, int8, int4) forms as float32 [L, ...] in the kernel's float shape."""
    out = []
    for j in range(len(self.paths)):
      f = self.float_kernel(j)
      q8 = self.int8[j]
      d8 = q8.dequantize()
      if q8.transposed:  # [L, out..., in...] -> the float layout [L, in..., out...]
        n_out = q8.n_out
        d8 = jnp.moveaxis(d8, tuple(range(1, 1 + n_out)), tuple(range(d8.ndim - n_out, d8.ndim)))
      out.append((f, d8.reshape(f.shape).astype(f.dtype),
                  self.int4[j].dequantize().reshape(f.shape).astype(f.dtype)))
    return out


def candidates(params: dict, kernels: dict, store_kernels: dict, *, method: str, group_size: int,
               sym: bool, stats: dict[Path, LinearStats] | None, norm_offset: float = 0.0,
               verbose: bool = True) -> Candidates:
  """Every stacked linear kernel as float, int8 and int4 (`method`'s; `stats`: `calibrate`'s
  with `rows` for AWQ, `xtx` for GPTQ). `store_kernels`: how the engine stores int8 kernels
  (`linear_kernels(config, transposed)`)."""
  base = params
  if method == "awq":
    base, in_scale = fold_awq(params, kernels, stats, group_size=group_size, sym=sym,
                              norm_offset=norm_offset, verbose=verbose)
    q4 = quantize_model(clip_awq(base, kernels, stats, in_scale, group_size=group_size, sym=sym,
                                 verbose=verbose), kernels, method="rtn", group_size=group_size,
                        sym=sym, verbose=verbose)
  else:
    q4 = quantize_model(params, kernels, method=method, stats=stats, group_size=group_size,
                        sym=sym, verbose=verbose)
  paths = tuple(p for p, _ in stack_kernels(params, kernels))
  kernel = lambda tree, p: folding.get(tree[STACK], p + ("kernel",))
  return Candidates(
      params=base, paths=paths, int4=tuple(kernel(q4, p) for p in paths),
      int8=tuple(quantize(kernel(base, p), *kernel(store_kernels, p)) for p in paths))


def build(c: Candidates, choice: np.ndarray) -> dict:
  """The params with kernel j of layer i in precision choice[i, j] (choice [L, P]), the stack
  split into runs of layers with one assignment (one run: the usual stack)."""
  forms = lambda j: (c.float_kernel(j), c.int8[j], c.int4[j])

  def layer(i: int) -> dict:
    own = jax.tree.map(lambda a: a[i], c.params[STACK])
    for j, path in enumerate(c.paths):
      own = folding.replace(own, path + ("kernel",),
                            jax.tree.map(lambda a: a[i], forms(j)[choice[i, j]]))
    return own

  starts = [0] + [i for i in range(1, len(choice)) if (choice[i] != choice[i - 1]).any()]
  ends = starts[1:] + [len(choice)]
  runs = [jax.tree.map(lambda *a: jnp.stack(a), *[layer(i) for i in range(s, e)])
          for s, e in zip(starts, ends)]
  return {**c.params, STACK: runs[0] if len(runs) == 1 else
          {f"run_{r}": run for r, run in enumerate(runs)}}


def describe(c: Candidates, choice: np.ndarray, granularity: str) -> list[str]:
  """The allocation, a line per layer ("layer") or per linear ("linear")."""
  names = ["/".join(p) for p in c.paths]
  if granularity == "linear":
    return [f"{n}: {PRECISIONS[choice[0, j]]}" for j, n in enumerate(names)]
  return [f"layer {i}: {PRECISIONS[row[0]]}" for i, row in enumerate(choice)]


def allocate(c: Candidates, loss_of: Callable[[np.ndarray], float], sens: np.ndarray, *,
             granularity: str, group_size: int, bits: float | None = None,
             max_ppl_increase: float | None = None) -> np.ndarray:
  """choice [L, P] meeting `bits` (average bits per weight) or `max_ppl_increase` (measured on
  the calibration text through `loss_of`). sens: `sensitivity.measure`'s [U, 3]."""
  num_layers = c.float_kernel(0).shape[0]
  masks = units(granularity, num_layers, len(c.paths))
  cells = np.broadcast_to(cell_bytes(c.shapes(), group_size).T[None],
                          (num_layers, len(c.paths), 3))  # [L, P, 3]
  nbytes = np.stack([cells[m].sum(0) for m in masks])  # [U, 3]
  expand = lambda per_unit: sum(np.where(m, p, 0) for m, p in zip(masks, per_unit)).astype(np.int32)
  weights = sum(int(np.prod(c.float_kernel(j).shape)) for j in range(len(c.paths)))
  at_bits = lambda b: expand(allocation.within_bytes(sens, nbytes, b * weights / 8))
  if bits is not None:
    return at_bits(bits)
  base = loss_of(np.full((num_layers, len(c.paths)), FLOAT, np.int32))
  meets = lambda choice: np.expm1(loss_of(choice) - base) <= max_ppl_increase
  lo, hi = 8 * nbytes[:, INT4].sum() / weights, 8 * nbytes[:, FLOAT].sum() / weights
  if meets(at_bits(lo)):
    return at_bits(lo)
  for _ in range(BISECTIONS):  # hi meets (all float: no increase), lo does not
    mid = (lo + hi) / 2
    lo, hi = (lo, mid) if meets(at_bits(mid)) else (mid, hi)
  return at_bits(hi)


def mixed_quantize(params: dict, kernels: dict, store_kernels: dict, *, model,
                   calibration: Sequence[int], method: str = "awq", group_size: int = 128,
                   sym: bool = False, granularity: str = "linear", bits: float | None = None,
                   max_ppl_increase: float | None = None,
                   sensitivity_cache: Callable[[Callable[[], np.ndarray]], np.ndarray] | None = None,
                   calibrate: Callable[..., dict] | None = None, norm_offset: float = 0.0,
                   verbose: bool = True) -> dict:
  """The float params quantized mixed (module docstring) to meet `bits` or
  `max_ppl_increase`, exactly one of them. model: the float `CausalLM` (scanned);
  calibration: the calibration token ids. `sensitivity_cache(compute)`: the sensitivities kept
  across runs (they do not depend on the budget). `calibrate(**kw)`: the calibration run of
  `jinfer/quant/calibration.py` on these params (AWQ and GPTQ need it)."""
  start = time.perf_counter()
  stats = None
  if method != "rtn":
    stats = calibrate(**({"xtx": True} if method == "gptq" else {"rows": 512}))
  c = candidates(params, kernels, store_kernels, method=method, group_size=group_size, sym=sym,
                 stats=stats, norm_offset=norm_offset, verbose=verbose)
  loss_of = sensitivity.loss_of_choices(model, c.params, c.paths, c.forms(),
                                        list(calibration)[:SENSITIVITY_TOKENS])
  num_layers = c.float_kernel(0).shape[0]
  measure = lambda: sensitivity.measure(loss_of, units(granularity, num_layers, len(c.paths)),
                                        verbose=verbose)
  sens = sensitivity_cache(measure) if sensitivity_cache else measure()
  choice = allocate(c, loss_of, sens, granularity=granularity, group_size=group_size,
                    bits=bits, max_ppl_increase=max_ppl_increase)
  out = build(c, choice)
  if verbose:
    weights = sum(int(np.prod(c.float_kernel(j).shape)) for j in range(len(c.paths)))
    base = loss_of(np.full_like(choice, FLOAT))
    got = np.expm1(loss_of(choice) - base)
    for line in describe(c, choice, granularity):
      print(f"mixed: {line}", file=sys.stderr, flush=True)
    print(f"mixed: {stack_bits(out, weights):.3f} bits per weight, calibration perplexity "
          f"{100 * got:+.2f}% ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
  return out
