"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): scale up the weight rows of the input channels that carry large activations
before rounding, and scale those activations down by as much, so the salient channels lose less
to rounding while X W is unchanged in float:

    X W = (X / s) (diag(s) W),    s = mean|X|^alpha, normalized so that max(s) min(s) = 1

`alpha` is searched on a grid of `n_grid` points in [0, 1) per group of linears that read one
input (one s for all of them, since it is folded into what produces that input: see
`jinfer/quant/folding.py`), minimizing ||X W - (X / s) Q(diag(s) W)||^2 over calibration rows,
each linear's output in the sum. alpha = 0 is plain RTN, so the search never does worse than RTN
on its own rows. AutoAWQ measures the loss after the whole block (attention, MLP); measuring each
linear's own output needs no re-run of the block and is what the scale is meant to protect.

Weight clipping (AutoAWQ's `auto_clip`), done too: after scaling, each (group, output channel)
clips its weights to +-r max|w| for the r in {1, 0.95, ..., 0.55} that best keeps that group's
partial output X_g w_g. Not for the query and key projections, whose errors the softmax
amplifies (AutoAWQ skips them too).

`fmt` ("mxfp4", "nvfp4"): the same searches against that micro-float format's rounding
(`microfloat.fake_quantize`, its own block size) instead of the int4 grid.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jinfer.quant import microfloat
from jinfer.quant.rtn import fake_quantize


def _fake(w, group_size, sym, fmt):
  return fake_quantize(w, group_size, sym) if fmt is None else microfloat.fake_quantize(w, fmt)


def _scales(x_mean: jax.Array, alpha: jax.Array) -> jax.Array:
  s = jnp.maximum(x_mean, 1e-4) ** alpha  # [K]; clamped so a dead channel stays finite
  return s / jnp.sqrt(s.max() * s.min())


def _search_one(x, x_mean, w, *, group_size, sym, n_grid, fmt):
  """x [n, K] calibration rows, x_mean [K] mean|x|, w [K, N] -> (s [K], loss per alpha)."""
  ref = x @ w  # [n, N]

  def loss(alpha):
    s = _scales(x_mean, alpha)
    wq = _fake(w * s[:, None], group_size, sym, fmt) / s[:, None]
    return jnp.mean((x @ wq - ref) ** 2)

  alphas = jnp.arange(n_grid, dtype=jnp.float32) / n_grid
  losses = jax.lax.map(loss, alphas)
  return _scales(x_mean, alphas[jnp.argmin(losses)]), losses


@functools.partial(jax.jit, static_argnames=("group_size", "sym", "n_grid", "fmt"))
def search_scales(x: jax.Array, x_mean: jax.Array, w: jax.Array, *, group_size: int = 128,
                  sym: bool = False, n_grid: int = 20,
                  fmt: str | None = None) -> tuple[jax.Array, jax.Array]:
  """Per-input-channel scales s [lead..., K] for the linears whose kernels, side by side along
  N, are w [lead..., K, N], and whose inputs x [lead..., n, K] (calibration rows) have mean
  magnitudes x_mean [lead..., K] (over all calibration rows). Returns (s, the loss of each alpha
  [lead..., n_grid]). Fold s in with `folding.fold`: the kernels' rows times s, their input
  divided by s."""
  *lead, k, n = w.shape
  one = functools.partial(_search_one, group_size=group_size, sym=sym, n_grid=n_grid, fmt=fmt)
  s, losses = jax.lax.map(lambda a: one(*a), (x.reshape(-1, *x.shape[-2:]),
                                              x_mean.reshape(-1, k), w.reshape(-1, k, n)))
  return s.reshape(*lead, k), losses.reshape(*lead, n_grid)


def _clip_one(x, w, *, group_size, sym, n_grid, max_shrink, fmt):
  """x [n, K], w [K, N] -> w clipped per (group, output channel)."""
  k, n = w.shape
  groups = k // group_size
  xg = x.reshape(-1, groups, group_size)  # [n, G, g]
  wg = w.reshape(groups, group_size, n)  # [G, g, N]
  ref = jnp.einsum("tgk,gkn->gtn", xg, wg)  # [G, n, N]: each group's partial outputs
  w_max = jnp.abs(wg).max(1, keepdims=True)  # [G, 1, N]

  def try_ratio(best, i):
    best_err, best_max = best
    m = w_max * (1.0 - i / n_grid)
    wc = jnp.clip(wg, -m, m).reshape(k, n)
    wq = _fake(wc, group_size, sym, fmt).reshape(groups, group_size, n)
    err = jnp.mean((jnp.einsum("tgk,gkn->gtn", xg, wq) - ref) ** 2, axis=1)[:, None]  # [G,1,N]
    better = err < best_err
    return (jnp.where(better, err, best_err), jnp.where(better, m, best_max)), None

  steps = jnp.arange(int(max_shrink * n_grid), dtype=jnp.float32)
  (_, best_max), _ = jax.lax.scan(try_ratio, (jnp.full_like(w_max, jnp.inf), w_max), steps)
  return jnp.clip(wg, -best_max, best_max).reshape(k, n)


@functools.partial(jax.jit, static_argnames=("group_size", "sym", "n_grid", "max_shrink", "fmt"))
def clip_weights(x: jax.Array, w: jax.Array, *, group_size: int = 128, sym: bool = False,
                 n_grid: int = 20, max_shrink: float = 0.5, fmt: str | None = None) -> jax.Array:
  """w [lead..., K, N] with each (group, output channel) clipped to the fraction of its max|w|
  (1, 1 - 1/n_grid, ... down to 1 - max_shrink) whose RTN quantization best keeps that group's
  share of the outputs on the calibration rows x [lead..., n, K] (as the kernel reads them, i.e.
  after any folded scales)."""
  *lead, k, n = w.shape
  one = functools.partial(_clip_one, group_size=group_size, sym=sym, n_grid=n_grid,
                          max_shrink=max_shrink, fmt=fmt)
  out = jax.lax.map(lambda a: one(*a), (x.reshape(-1, *x.shape[-2:]), w.reshape(-1, k, n)))
  return out.reshape(w.shape)
