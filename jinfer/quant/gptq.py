"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): quantize a linear layer's weights one input channel at a time and
push each column's rounding error onto the columns not yet quantized, weighted by the inverse
Hessian of the layer's reconstruction loss ||X W - X W_q||^2, H = 2 X^T X / n.

As AutoGPTQ / GPTQModel do it:
* dead input channels (diag(H) == 0) get H_jj = 1 and zero weights;
* dampening: `percdamp` times the mean diagonal added to the diagonal (`quantize_model` uses
  0.1: a short calibration text leaves H poorly determined);
* the upper Cholesky factor of H^-1 drives the updates;
* columns in blocks of `block_size`, the error inside a block applied column by column and to the
  later columns once per block (lazy batch updates: the same result, fewer passes over W);
* without act-order, a group's scale and zero point are computed when the sweep enters the group,
  from the group's weights as the earlier columns' errors left them (`static_groups=False`).
  AutoGPTQ reads those weights from before the current block's own updates whenever a group starts
  inside a block (g < block); here they include them, since those are the weights being rounded.
* act-order (`desc_act`): columns are processed in order of decreasing diag(H), the channels with
  the most input energy first, while they still have every other column to absorb their error.
  The groups stay contiguous runs of g channels in the original order and their scales come from
  the weights before any update ("static groups"): the stored weights then need no row
  permutation (no `g_idx`) at run time, which the format does not have.

The grid is RTN's (`jinfer/quant/rtn.py`): GPTQ decides the rounding, not the grid's shape.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jinfer.quant.groupwise import GroupwiseArray
from jinfer.quant.rtn import check_group_size, grid, round_to_grid, to_groupwise


def hessian(xtx: jax.Array, count: int | jax.Array) -> jax.Array:
  """H = 2 X^T X / n from the calibration inputs' X^T X [..., K, K] over n rows."""
  return 2.0 * xtx / count


def _gptq_one(w: jax.Array, h: jax.Array, *, group_size: int, sym: bool, act_order: bool,
              percdamp: float, block_size: int):
  """One weight w [K, N] and its H [K, K] -> (q [K, N] in [0, 15], scale, zero [K/g, N]).

  The paper's columns (input channels of W [N, K]) are w's rows here: each is contiguous."""
  k, n = w.shape
  g, b = group_size, block_size
  kp = -(-k // b) * b  # K padded to whole blocks
  dead = jnp.diagonal(h) == 0
  h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
  w = jnp.where(dead[:, None], 0.0, w.astype(jnp.float32))
  h = h + percdamp * jnp.mean(jnp.diagonal(h)) * jnp.eye(k)
  # Padding rows: zero weights, an identity block in H, so nothing couples them to the rest.
  w = jnp.pad(w, ((0, kp - k), (0, 0)))  # [Kp, N]
  h = jnp.pad(h, ((0, kp - k), (0, kp - k))) + jnp.diag(jnp.arange(kp) >= k).astype(h.dtype)

  groups = kp // g
  if act_order:
    # Static groups: each group's grid from the weights as they are, in the original order.
    wg = w.reshape(groups, g, n)
    static_scale, static_zero = grid(wg.min(1), wg.max(1), sym)  # [Kp/g, N]
    perm = jnp.argsort(-jnp.diagonal(h), stable=True)  # processing order -> channel
    w, h = w[perm], h[perm][:, perm]
    # Each processed row's grid, in processing order.
    row_scale, row_zero = static_scale[perm // g], static_zero[perm // g]  # [Kp, N]

  u = _upper_cholesky_of_inverse(h)  # [Kp, Kp]: H^-1 = U^T U

  def block(bi, carry):
    w, q, scale, zero = carry  # w [Kp, N] updated so far; q [Kp, N]; scale, zero [Kp/g, N]
    i1 = bi * b
    w1 = jax.lax.dynamic_slice_in_dim(w, i1, b)  # [B, N]
    u1 = jax.lax.dynamic_slice(u, (i1, i1), (b, b))  # [B, B]
    if act_order:
      s1 = jax.lax.dynamic_slice_in_dim(row_scale, i1, b)
      z1 = jax.lax.dynamic_slice_in_dim(row_zero, i1, b)

    def row(i, c):
      w1, q1, err1, scale, zero = c
      if act_order:
        s, z = s1[i], z1[i]  # [N]
      else:
        gi = (i1 + i) // g

        def enter_group():  # the group's grid from its weights as the errors so far left them
          grp = jax.lax.dynamic_slice_in_dim(w1, i, g)  # [g, N]; i % g == 0 here
          s, z = grid(grp.min(0), grp.max(0), sym)
          return scale.at[gi].set(s), zero.at[gi].set(z)

        scale, zero = jax.lax.cond(i % g == 0, enter_group, lambda: (scale, zero))
        s, z = scale[gi], zero[gi]
      r = w1[i]  # [N]
      qi = round_to_grid(r, s, z)
      err = (r - (qi - z) * s) / u1[i, i]  # [N]
      # u1 is upper triangular: only this and later rows of the block move.
      w1 = w1 - u1[i][:, None] * err[None, :]
      return w1, q1.at[i].set(qi), err1.at[i].set(err), scale, zero

    init = (w1, jnp.zeros((b, n), jnp.float32), jnp.zeros((b, n), jnp.float32), scale, zero)
    _, q1, err1, scale, zero = jax.lax.fori_loop(0, b, row, init)
    q = jax.lax.dynamic_update_slice_in_dim(q, q1, i1, 0)
    # The block's errors onto every later row at once (U's rows are zero left of i1; the
    # block's own rows also move, but they are quantized already).
    w = w - jax.lax.dynamic_slice_in_dim(u, i1, b).T @ err1
    return w, q, scale, zero

  zeros = jnp.zeros((groups, n), jnp.float32)
  _, q, scale, zero = jax.lax.fori_loop(
      0, kp // b, block, (w, jnp.zeros((kp, n), jnp.float32), zeros, zeros))
  if act_order:
    q = q[jnp.argsort(perm)]
    scale, zero = static_scale, static_zero
  return q[:k], scale[:k // g], zero[:k // g]


def _upper_cholesky_of_inverse(h: jax.Array) -> jax.Array:
  """U upper triangular with H^-1 = U^T U, from one Cholesky factorization: with J the
  reversal, J H J = L L^T gives H = V V^T for the upper V = J L J, so U = V^-1."""
  rev = jnp.linalg.cholesky(h[::-1, ::-1])[::-1, ::-1]  # V, upper
  eye = jnp.eye(h.shape[0], dtype=h.dtype)
  return jax.scipy.linalg.solve_triangular(rev, eye, lower=False)


@functools.partial(jax.jit, static_argnames=("group_size", "sym", "act_order", "block_size",
                                             "batch_size"))
def gptq(w: jax.Array, h: jax.Array, *, group_size: int = 128, sym: bool = False,
         act_order: bool = False, percdamp: float = 0.01, block_size: int = 128,
         batch_size: int = 8) -> GroupwiseArray:
  """w [lead..., K, N] (K contracts with the input) and its Hessian h [lead..., K, K] (`hessian`)
  -> 4-bit group-wise weights. `group_size` must divide both K and `block_size`. Leading indices
  are quantized `batch_size` at a time (memory: a few [K, K] and [N, K] arrays each)."""
  *lead, k, n = w.shape
  check_group_size(k, group_size)
  if block_size % group_size:
    raise ValueError(f"group_size {group_size} must divide block_size {block_size}")
  one = functools.partial(_gptq_one, group_size=group_size, sym=sym, act_order=act_order,
                          percdamp=percdamp, block_size=block_size)
  flat_w = w.reshape(-1, k, n).astype(jnp.float32)
  flat_h = h.reshape(-1, k, k).astype(jnp.float32)
  q, scale, zero = jax.lax.map(lambda a: one(*a), (flat_w, flat_h),
                               batch_size=min(batch_size, flat_w.shape[0]))
  out = to_groupwise(q, scale, zero, group_size)
  return jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), out)


def _gptq_int8_one(w: jax.Array, h: jax.Array, *, percdamp: float, block_size: int):
  """w [K, N], h [K, K] -> (q [K, N] int8, scale [N]): symmetric int8 per output channel (the
  grid `qarray.quantize` uses: max|w| / 127), rows in act-order, errors fed forward."""
  k, n = w.shape
  b = block_size
  kp = -(-k // b) * b
  dead = jnp.diagonal(h) == 0
  h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
  w = w.astype(jnp.float32)
  amax = jnp.abs(w).max(0)  # the grid from the weights as they are, dead rows included
  scale = jnp.where(amax == 0, 1.0, amax / 127.0)  # [N]
  w = jnp.where(dead[:, None], 0.0, w)
  h = h + percdamp * jnp.mean(jnp.diagonal(h)) * jnp.eye(k)
  w = jnp.pad(w, ((0, kp - k), (0, 0)))
  h = jnp.pad(h, ((0, kp - k), (0, kp - k))) + jnp.diag(jnp.arange(kp) >= k).astype(h.dtype)
  perm = jnp.argsort(-jnp.diagonal(h), stable=True)
  w, h = w[perm], h[perm][:, perm]
  u = _upper_cholesky_of_inverse(h)

  def block(bi, carry):
    w, q = carry
    i1 = bi * b
    w1 = jax.lax.dynamic_slice_in_dim(w, i1, b)
    u1 = jax.lax.dynamic_slice(u, (i1, i1), (b, b))

    def row(i, c):
      w1, q1, err1 = c
      r = w1[i]
      qi = jnp.clip(jnp.round(r / scale), -127, 127)
      err = (r - qi * scale) / u1[i, i]
      return (w1 - u1[i][:, None] * err[None, :], q1.at[i].set(qi), err1.at[i].set(err))

    zeros = jnp.zeros((b, n), jnp.float32)
    _, q1, err1 = jax.lax.fori_loop(0, b, row, (w1, zeros, zeros))
    q = jax.lax.dynamic_update_slice_in_dim(q, q1, i1, 0)
    return w - jax.lax.dynamic_slice_in_dim(u, i1, b).T @ err1, q

  _, q = jax.lax.fori_loop(0, kp // b, block, (w, jnp.zeros((kp, n), jnp.float32)))
  return q[jnp.argsort(perm)][:k].astype(jnp.int8), scale


@functools.partial(jax.jit, static_argnames=("block_size", "batch_size"))
def gptq_int8(w: jax.Array, h: jax.Array, *, percdamp: float = 0.01, block_size: int = 64,
              batch_size: int = 8) -> tuple[jax.Array, jax.Array]:
  """GPTQ onto W8A8's weight grid: w [lead..., K, N], h [lead..., K, K] -> (q [lead..., K, N]
  int8, scale [lead..., N]) with w ~= q * scale, symmetric per output channel. The grid is
  plain rounding's (each channel's max|w| / 127), act-order, no groups. Build the `QArray`
  from q and scale (`qarray.from_int8`): requantizing q * scale would round again wherever the
  error feedback moved a channel's largest weight.

  For W8A8, h should come from the inputs as the kernel sees them, rounded per token to int8
  (`calibrate(..., xtx="w8a8")`): GPTQ then fits the weights to what the int8 matmul reads.
  With H from the float inputs its error feedback did not survive the activation rounding
  (docs/quantization.md)."""
  *lead, k, n = w.shape
  one = functools.partial(_gptq_int8_one, percdamp=percdamp, block_size=block_size)
  flat_w = w.reshape(-1, k, n).astype(jnp.float32)
  flat_h = h.reshape(-1, k, k).astype(jnp.float32)
  q, scale = jax.lax.map(lambda a: one(*a), (flat_w, flat_h),
                         batch_size=min(batch_size, flat_w.shape[0]))
  return q.reshape(*lead, k, n), scale.reshape(*lead, n)
