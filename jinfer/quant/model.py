"""Whole-model quantization: a float model's params -> params whose stacked linear kernels are
4-bit group-wise (`quantize_model`: RTN, AWQ or GPTQ), or smoothed float params for W8A8
(`smooth_model`).

Which leaves are linear kernels comes from the model's declarations (`linear_kernels(config)`,
passed in as `kernels`); quantization sits below the models in the layer map, so the model
itself (a float `CausalLM` with a scanned stack) is an argument too, needed only to calibrate.

What gets 4 bits: every linear kernel with leading (stacked) axes, i.e. the decoder layers'
projections and MoE experts. The embedding and the LM head stay as they are (AWQ and GPTQ leave
them in float too). Kernels that calibration does not see take RTN under every method: MoE
experts (their rows are routed), and the separate `mlp_layers` / `moe_layers` stacks of a model
that mixes dense and MoE layers (each runs inside a conditional, outside the layer scan's paths).
AWQ scales only the groups `folding` knows (attention; dense MLPs in `layers`).

`fmt` ("mxfp4", "nvfp4"): the kernels round onto that micro-float format instead of int4
(`jinfer/quant/microfloat.py`, its block size for the group size), by RTN or after AWQ's
scales and clipping searched against its rounding; not GPTQ.

Group size: K must be a multiple of it (the format has no ragged last group). Where the asked
group size does not divide a kernel's K (SmolLM2's hidden size 576 = 4.5 x 128) the kernel takes
the largest half, quarter, ... of it that does (576: 64), and the verbose log says so.
"""
from __future__ import annotations

import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.quant import awq, folding, microfloat, smoothquant
from jinfer.quant.calibration import LinearStats, calibrate, calibration_tokens
from jinfer.quant.gptq import gptq, gptq_int8, hessian
from jinfer.quant.qarray import from_int8
from jinfer.quant.rtn import quantize_rtn

METHODS = ("rtn", "awq", "gptq")
STACK = "layers"  # the params subtree of the decoder layers, each leaf [layers, ...]
GPTQ_INT8_DAMP = 0.01  # see smooth_model


def _tokens(calibration) -> list[int]:
  if calibration is None:
    raise ValueError("calibration: token ids or a tokenizer (for the shipped text) are needed")
  if hasattr(calibration, "encode"):
    return calibration_tokens(calibration)
  return [int(t) for t in calibration]


def group_size_for(k: int, group_size: int) -> int:
  """The group size a kernel with K inputs takes: `group_size`, or its largest even fraction
  (halving) that divides K."""
  g = group_size
  while k % g:
    g //= 2
    if g < 2 or g % 2:
      raise ValueError(f"no even group size up to {group_size} divides K={k}")
  return g


def _stacked_kernels(params: dict, kernels: dict) -> list[tuple[tuple[str, ...], tuple]]:
  """(path of the params dict holding `kernel`, its declaration) of every linear kernel with
  leading axes."""
  out = []
  flat, _ = jax.tree_util.tree_flatten_with_path(kernels, is_leaf=lambda x: isinstance(x, tuple))
  for keypath, decl in flat:  # (None leaves, not kernels, flatten to nothing)
    path = tuple(k.key for k in keypath)
    w = folding.get(params, path)
    # Float kernels only: a checkpoint may bring some already quantized.
    if isinstance(w, (jax.Array, np.ndarray)) and w.ndim > decl[0] + decl[1]:
      assert not decl[2], f"{path}: a stacked kernel stored outputs first"
      out.append((path[:-1], decl))
  return out


def _calibrate(params, model, kernels, calibration, verbose, **kw):
  if model is None:
    raise ValueError("calibration needs the float model (a scanned CausalLM)")
  return calibrate(model, params, kernels, _tokens(calibration), verbose=verbose, **kw)


def apply_awq(params: dict, kernels: dict, stats: dict[tuple[str, ...], LinearStats], *,
              group_size: int, sym: bool, clip: bool = True, n_grid: int = 20,
              norm_offset: float = 0.0, fmt: str | None = None, verbose: bool = True) -> dict:
  """AWQ's scales searched and folded into every scale group of the layer stack, then (`clip`)
  each kernel's clipping search (`fmt`: onto a micro-float format's grid, see `quantize_model`).
  Returns float params (the same function as before, but for the clipping) ready for
  `quantize_rtn`."""
  folded, in_scale = fold_awq(params, kernels, stats, group_size=group_size, sym=sym,
                              n_grid=n_grid, norm_offset=norm_offset, fmt=fmt, verbose=verbose)
  if not clip:
    return folded
  return clip_awq(folded, kernels, stats, in_scale, group_size=group_size, sym=sym,
                  n_grid=n_grid, fmt=fmt, verbose=verbose)


def fold_awq(params: dict, kernels: dict, stats: dict[tuple[str, ...], LinearStats], *,
             group_size: int, sym: bool, n_grid: int = 20, norm_offset: float = 0.0,
             fmt: str | None = None, verbose: bool = True) -> tuple[dict, dict]:
  """AWQ's scales searched and folded in: (float params computing the same function, the
  scales [L, K] folded into each linear's input, by path relative to the stack)."""
  stack, kst = params[STACK], kernels[STACK]
  in_scale = {}  # linear path -> the scales folded into its input [L, K]
  for grp in folding.layer_groups(stack, kst):
    t = time.perf_counter()
    st = stats[(STACK,) + grp.linears[0]]
    w = folding.group_kernel(stack, kst, grp)  # [L, K, N]
    g = group_size_for(w.shape[-2], group_size)
    s, losses = awq.search_scales(jnp.asarray(st.rows), jnp.asarray(st.abs_mean), w,
                                  group_size=g, sym=sym, n_grid=n_grid, fmt=fmt)
    stack = folding.fold(stack, kst, grp, s, norm_offset)
    for p in grp.linears:
      in_scale[p] = s
    if verbose:
      best = np.asarray(jnp.argmin(losses, -1)) / n_grid
      names = "+".join(p[-1] for p in grp.linears)
      print(f"awq: {names} scales, alpha {best.min():.2f}..{best.max():.2f} over layers "
            f"({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)
  return {**params, STACK: stack}, in_scale


def clip_awq(params: dict, kernels: dict, stats: dict[tuple[str, ...], LinearStats],
             in_scale: dict, *, group_size: int, sym: bool, n_grid: int = 20,
             fmt: str | None = None, verbose: bool = True) -> dict:
  """AWQ's clipping search on every calibrated kernel of `fold_awq`'s params (`in_scale`: its
  scales, by which the calibration rows are divided to match)."""
  stack = params[STACK]
  for path, decl in _stacked_kernels(params, kernels):
    rel = path[1:]
    if path[0] != STACK or rel in folding.SCORE_LINEARS or path not in stats:
      continue
    t = time.perf_counter()
    w = folding.get(stack, rel + ("kernel",))
    flat = folding.flat_kernel(w, decl)
    x = jnp.asarray(stats[path].rows)  # [L, n, K]
    if rel in in_scale:
      x = x / in_scale[rel][:, None, :]
    clipped = awq.clip_weights(x, flat, group_size=group_size_for(flat.shape[-2], group_size),
                               sym=sym, n_grid=n_grid, fmt=fmt)
    stack = folding.replace(stack, rel + ("kernel",), clipped.reshape(w.shape).astype(w.dtype))
    if verbose:
      print(f"awq: {rel[-1]} clipped ({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)
  return {**params, STACK: stack}


def quantize_model(params: dict, kernels: dict, *, method: str = "rtn", model=None,
                   calibration: Sequence[int] | object | None = None,
                   stats: dict[tuple[str, ...], LinearStats] | None = None, group_size: int = 128,
                   sym: bool = False, act_order: bool = True, percdamp: float = 0.1,
                   clip: bool = True,
                   n_grid: int = 20, rows: int = 512, seq_len: int = 512,
                   norm_offset: float = 0.0, fmt: str | None = None,
                   verbose: bool = True) -> dict:
  """Params with every stacked linear kernel replaced by a `GroupwiseArray` (4-bit, groups of
  `group_size` along K; see the module docstring for K it does not divide; `fmt`: a
  micro-float format, see there).

  method: "rtn" (no calibration), "awq" (scales folded into the norms and up_proj, which come
    back changed; `clip`: also AWQ's clipping search) or "gptq" (`act_order`: desc_act with
    static groups, see `jinfer/quant/gptq.py`; on SmolLM2 it halved GPTQ's perplexity
    increase, at no cost at run time; `percdamp`: the damping, a fraction of the mean diagonal
    of H added to it, see below).
  model: the float model (`CausalLM(config)`, scanned), for "awq" and "gptq".
  calibration: token ids, or a tokenizer to encode the shipped calibration text.
  stats: `calibrate`'s statistics of these params (with `xtx` for GPTQ, `rows` for AWQ) instead
    of model and calibration: one calibration run serves several quantizations.
  rows: calibration rows AWQ's searches measure on; seq_len: calibration sequence length.
  norm_offset: what the model's norms add to their scale (`folding.fold`).

  GPTQ's damping is 0.1, not AutoGPTQ's default 0.01 (GPTQModel's is 0.05; 0.1 is what most
  published GPTQ checkpoints used, "slightly better accuracy"): the shipped text's ~2.6k tokens
  leave H of a 1,536-wide input poorly determined, and with 0.01 GPTQ fitted the calibration
  text's inputs at the cost of others (on SmolLM2: 0.90x RTN's increase on one of six texts,
  0.64x with 0.1; the docs' table).
  """
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
  if fmt is not None:
    if method == "gptq":
      raise ValueError(f"{fmt} weights take method rtn or awq, not gptq")
    group_size = microfloat.block_size(fmt)
  start = time.perf_counter()
  if method == "rtn":
    stats = {}
  elif stats is None:
    stats = _calibrate(params, model, kernels, calibration, verbose, seq_len=seq_len,
                       **({"xtx": True} if method == "gptq" else {"rows": rows}))
  need = "xtx" if method == "gptq" else "rows"
  if method != "rtn" and any(getattr(st, need) is None for st in stats.values()):
    raise ValueError(f"{method} needs calibration statistics with `{need}`")
  if method == "awq":
    params = apply_awq(params, kernels, stats, group_size=group_size, sym=sym, clip=clip,
                       n_grid=n_grid, norm_offset=norm_offset, fmt=fmt, verbose=verbose)
  out = params
  for path, decl in _stacked_kernels(params, kernels):
    t = time.perf_counter()
    w = folding.flat_kernel(folding.get(params, path + ("kernel",)), decl)  # [lead..., K, N]
    if fmt is not None and w.shape[-2] % group_size:
      raise ValueError(f"{'/'.join(path)}: {fmt} blocks of {group_size} do not divide its "
                       f"K={w.shape[-2]}")
    g = group_size if fmt is not None else group_size_for(w.shape[-2], group_size)
    if method == "gptq" and path in stats:
      st = stats[path]
      q = gptq(w, hessian(jnp.asarray(st.xtx), st.count), group_size=g, sym=sym,
               act_order=act_order, percdamp=percdamp, block_size=max(128, g))
    elif fmt is not None:
      q = microfloat.quantize(w, fmt)
    else:
      q = quantize_rtn(w, g, sym)
    out = folding.replace(out, path + ("kernel",), jax.block_until_ready(q))
    if verbose:
      how = "gptq" if method == "gptq" and path in stats else fmt or "rtn"
      print(f"{how}: {'/'.join(path)} {tuple(w.shape)} g{g} "
            f"({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)
  if verbose:
    print(f"quantize_model ({method}): {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
  return out


def smooth_model(params: dict, kernels: dict, *, model=None,
                 calibration: Sequence[int] | object | None = None,
                 stats: dict[tuple[str, ...], LinearStats] | None = None, alpha: float = 0.7,
                 gptq: bool = True, percdamp: float = GPTQ_INT8_DAMP,
                 store_kernels: dict | None = None, seq_len: int = 512,
                 norm_offset: float = 0.0, verbose: bool = True) -> dict:
  """SmoothQuant: float params with each scale group's smoothing scales folded in (the same
  function as before), for W8A8 (`qarray.quantize_params` quantizes them as usual).

  alpha: the migration strength, one for every group. On SmolLM2 (with `gptq`) 0.5-0.7 are
  within the perplexity measurements' noise of each other (docs/quantization.md); 0.7 was best
  on four held-out texts and the only one of 0.3 / 0.5 / 0.7 whose greedy answer to "What is
  the capital of France?" stayed Paris. model, calibration, stats: as `quantize_model`'s.

  gptq: round the calibrated linears onto W8A8's int8 grid by GPTQ (`gptq_int8`), with H
  from a second calibration run of the smoothed model whose inputs are rounded per token as
  the W8A8 kernel rounds them; those kernels come back as `QArray`s (stored as `store_kernels`,
  `linear_kernels(config, transposed)`, says; `kernels` by default), the rest float. Needs
  model and calibration even with stats."""
  start = time.perf_counter()
  if stats is None:
    stats = _calibrate(params, model, kernels, calibration, verbose, seq_len=seq_len)
  stack, kst = params[STACK], kernels[STACK]
  for grp in folding.layer_groups(stack, kst):
    s = smoothquant.smooth_scales(jnp.asarray(stats[(STACK,) + grp.linears[0]].abs_max),
                                  folding.group_kernel(stack, kst, grp), alpha)
    stack = folding.fold(stack, kst, grp, s, norm_offset)
  out = {**params, STACK: stack}
  if gptq:
    rounded = _calibrate(out, model, kernels, calibration, verbose, seq_len=seq_len, xtx="w8a8")
    for path, decl in _stacked_kernels(out, kernels):
      if path not in rounded:
        continue
      t = time.perf_counter()
      w = folding.get(out, path + ("kernel",))
      q, scale = gptq_int8(folding.flat_kernel(w, decl),
                           hessian(jnp.asarray(rounded[path].xtx), rounded[path].count),
                           percdamp=percdamp)
      store = folding.get(store_kernels or kernels, path + ("kernel",))
      out = folding.replace(out, path + ("kernel",), jax.block_until_ready(
          from_int8(q, scale, w.shape, decl[0], decl[1], len(store) > 3 and store[3])))
      if verbose:
        print(f"gptq int8: {'/'.join(path)} ({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)
  if verbose:
    print(f"smooth_model: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
  return out
