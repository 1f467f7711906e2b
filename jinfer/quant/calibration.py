"""Calibration: what each linear layer's inputs look like on a calibration text, per layer of
the stacked params, from one run of the float model.

The model runs once over the calibration tokens (as a few sequences of a prefill batch) inside a
method interceptor: every call of a module whose `kernel` the model declares as a stacked linear
kernel (`linear_kernels`) gets statistics of its input computed in the same compiled program and
sent to the host (an ordered callback, so the calls of a scanned layer stack arrive layer by
layer). Nothing of the model is named here; the model and its kernel declarations come in as
arguments (quantization sits below the models in the layer map).

Per linear, stacked over the layers (`LinearStats`): mean|x| and max|x| per input channel (AWQ,
SmoothQuant), X^T X (GPTQ's Hessian), and a fixed random subset of rows (AWQ's searches).
Linears that read one input (q/k/v) share one set of statistics, computed once.

Mixture-of-experts expert kernels (called with their routing groups, not a plain input) get no
statistics: their rows differ per expert.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import sys
import time
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from pallas_kernels import AttentionMetadata, KVCacheSpec
from pallas_kernels.int8_matmul import quantize_per_token

TEXT = "calibration_text.txt"  # shipped beside this module: self-written English prose


def calibration_text() -> str:
  return importlib.resources.files(__package__).joinpath(TEXT).read_text(encoding="utf-8")


def calibration_tokens(tokenizer) -> list[int]:
  """The shipped calibration text as token ids (`tokenizer.encode`)."""
  return list(tokenizer.encode(calibration_text()))


@dataclasses.dataclass
class LinearStats:
  """Statistics of one linear's input x [rows, K] (its contracting axes flattened), each stacked
  over the layers it was called in: [L, ...]."""
  count: int  # rows seen per layer
  abs_mean: np.ndarray  # [L, K] mean |x|
  abs_max: np.ndarray  # [L, K] max |x|
  xtx: np.ndarray | None = None  # [L, K, K] X^T X
  rows: np.ndarray | None = None  # [L, n, K] the same n rows in every layer


def prefill_batch(token_ids: Sequence[int], seq_len: int, page_size: int = 16):
  """A prefill batch of the tokens cut into sequences of up to seq_len: (ids, positions, metadata,
  number of pages)."""
  chunks = [list(token_ids[i:i + seq_len]) for i in range(0, len(token_ids), seq_len)]
  pages_per_seq = -(-seq_len // page_size)
  block_table = 1 + np.arange(len(chunks) * pages_per_seq, dtype=np.int32).reshape(
      len(chunks), pages_per_seq)  # page 0 is the sink, never read
  pos = np.concatenate([np.arange(len(c)) for c in chunks]).astype(np.int32)
  seq = np.repeat(np.arange(len(chunks)), [len(c) for c in chunks])
  slots = block_table[seq, pos // page_size] * page_size + pos % page_size
  lens = np.array([len(c) for c in chunks], np.int32)
  md = AttentionMetadata(
      slot_mapping=jnp.asarray(slots, jnp.int32), block_table=jnp.asarray(block_table),
      kv_lens=jnp.asarray(lens), cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]),
                                                       jnp.int32),
      num_seqs=jnp.asarray([len(chunks)], jnp.int32), max_q_len=int(lens.max()))
  return (jnp.asarray(np.concatenate(chunks), jnp.int32), jnp.asarray(pos), md,
          1 + block_table.size, np.cumsum(lens) - 1)


def _round_per_token(x: jax.Array) -> jax.Array:
  """x [T, K] rounded as W8A8's per-token int8 quantization rounds it (back in float)."""
  q, scale = quantize_per_token(x)
  return q.astype(jnp.float32) * scale[:, None]


def _lookup(tree: Any, path: tuple[str, ...]):
  for p in path:
    if not isinstance(tree, dict) or p not in tree:
      return None
    tree = tree[p]
  return tree


def calibrate(model: nn.Module, params: dict, kernels: dict, token_ids: Sequence[int], *,
              xtx: bool | str = False, rows: int = 0, seq_len: int = 512, seed: int = 0,
              verbose: bool = True) -> dict[tuple[str, ...], LinearStats]:
  """Run `model` (a float `CausalLM` with a scanned layer stack) over `token_ids` and return
  each stacked linear's input statistics, keyed by the path of its params (e.g.
  `("layers", "attn", "q_proj")`). `kernels`: the params tree of linear-kernel declarations
  (`linear_kernels(config)`). `xtx`: also X^T X (`"w8a8"`: of the inputs rounded per token to
  int8, as the W8A8 kernel reads them, for GPTQ onto W8A8's grid); `rows`: also that many rows (fewer if fewer
  tokens), the same ones for every linear."""
  if not getattr(model, "scan_layers", True):
    raise ValueError("calibrate runs a scanned layer stack (scan_layers=True): its module paths "
                     "are the stacked params' paths")
  c = model.config
  ids, pos, md, num_pages, last_rows = prefill_batch(token_ids, seq_len)
  t = int(ids.shape[0])
  spec = KVCacheSpec(num_layers=c.num_layers, num_pages=num_pages, page_size=16,
                     num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=model.dtype)
  pick = np.sort(np.random.default_rng(seed).choice(t, min(rows, t), replace=False))
  got: dict[tuple[str, ...], list] = {}  # path -> each call's statistics, layer by layer
  aliases: dict[tuple[str, ...], tuple[str, ...]] = {}  # path -> the path it shares input with
  seen: dict[int, tuple] = {}  # id of a traced input -> (path, the input)
  start = time.perf_counter()
  if verbose:
    print(f"calibration: {t} tokens through {c.num_layers} layers", file=sys.stderr, flush=True)

  def record(path, *stats):
    got.setdefault(path, []).append([np.asarray(a) for a in stats])
    done = len(got[path])
    if verbose and path == next(iter(got)) and (done % max(1, c.num_layers // 10) == 0
                                                or done == c.num_layers):
      print(f"calibration: layer {done}/{c.num_layers} "
            f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)

  def intercept(f, args, kwargs, context):
    module = context.module
    path = tuple(module.path)
    decl = _lookup(kernels, path + ("kernel",))
    w = _lookup(params, path + ("kernel",))
    # A stacked linear called on one plain input (expert kernels also take routing groups; a
    # dense linear's second argument is its LoRA rows, None when no adapter runs).
    if (context.method_name != "__call__" or decl is None or not args
        or any(a is not None for a in args[1:]) or kwargs
        or not isinstance(w, (jax.Array, np.ndarray)) or w.ndim == decl[0] + decl[1]):
      return f(*args, **kwargs)
    x = args[0]
    if id(x) in seen:  # q/k/v read one array: its statistics once
      aliases[path] = seen[id(x)][0]
      return f(*args, **kwargs)
    seen[id(x)] = (path, x)  # holds x, so its id cannot be reused within this trace
    k = int(np.prod(x.shape[x.ndim - decl[0]:]))
    xf = x.reshape(-1, k).astype(jnp.float32)  # [T, K]
    ax = jnp.abs(xf)
    stats = [ax.mean(0), ax.max(0)]
    if xtx:
      xr = _round_per_token(xf) if xtx == "w8a8" else xf
      stats.append(xr.T @ xr)
    if rows:
      stats.append(xf[pick])
    io_callback(lambda *a, p=path: record(p, *a), None, *stats, ordered=True)
    return f(*args, **kwargs)

  @jax.jit
  def forward(params, ids, pos, md):
    with nn.intercept_methods(intercept):
      # Only the last row's logits: the statistics are what this run is for.
      return model.apply({"params": params}, ids, pos, spec.allocate(), md,
                         jnp.asarray(last_rows[-1:], jnp.int32))[0]

  jax.block_until_ready(forward(params, ids, pos, md))
  if verbose:
    print(f"calibration: {t} tokens in {len(last_rows)} sequences, {len(got)} inputs of "
          f"{len(got) + len(aliases)} linears, {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

  out = {}
  for path, calls in got.items():
    stacked = [np.stack(s) for s in zip(*calls)]  # each [L, ...]
    out[path] = LinearStats(count=t, abs_mean=stacked[0], abs_max=stacked[1],
                            xtx=stacked[2] if xtx else None,
                            rows=stacked[-1] if rows else None)
  for path, first in aliases.items():
    out[path] = out[first]
  return out
