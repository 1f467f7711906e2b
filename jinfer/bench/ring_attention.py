"""Attention work per context-parallel rank: does the ring divide it?

One long prompt's last prefill chunk (`--rows` new rows over `--context` cached tokens, SmolLM2's
heads) with its pages striped over CP ranks as the page allocator stripes them. For each CP and
each rank, the kernel runs every block the ring hands that rank (each hop's block and metadata
exactly as `jinfer/parallel/attention.py` builds them) on one device, timed alone, so the figure
is the rank's own attention time, not the host devices' share of two cores. Two ways per rank:
`walk_own` (its pages listed with their positions, what the ring does now) and `walk_all`
(every page of the table, the others marked absent: the ring before). Medians of `--repeats`.

  python -m jinfer.bench.ring_attention --context 8192 --rows 512 --cps 1,2,4,8
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.bench.machine import machine_info
from jinfer.bench.report import emit
from jinfer.parallel.attention import _chunk_metadata, _layout
from pallas_kernels import AttentionMetadata, ragged_paged_attention


def _timed(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def rank_times(args, cp: int, q, cache, md: AttentionMetadata, pages: np.ndarray, attend) -> dict:
  """{"walk_own": [s per rank], "walk_all": [...]}: each rank's blocks over its pages."""
  t = q.shape[0]
  chunks = _layout(t, cp, "zigzag")
  size = t // chunks.size
  owner = np.arange(pages.shape[1]) % cp  # page j of the sequence on rank j % cp
  out = {"walk_own": [], "walk_all": []}
  for rank in range(cp):
    table = jnp.asarray(np.where(owner == rank, pages, -1), jnp.int32)
    order = jnp.argsort(table < 0, axis=1, stable=True)
    own = jnp.take_along_axis(table, order, axis=1)
    own_pos = jnp.where(own >= 0, order, -1).astype(jnp.int32)
    totals = {"walk_own": 0.0, "walk_all": 0.0}
    for origin in range(cp):  # the blocks of every rank pass by once
      for start in chunks[origin] * size:
        block_md = _chunk_metadata(md, table, jnp.int32(start), size)
        qb = q[start:start + size]
        totals["walk_all"] += _timed(attend, (qb, cache, block_md), args.repeats)
        totals["walk_own"] += _timed(
            attend, (qb, cache, block_md.replace(context_pages=own, context_page_pos=own_pos)),
            args.repeats)
    for k, v in totals.items():
      out[k].append(v)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--context", type=int, default=8192, help="cached tokens before the chunk")
  ap.add_argument("--rows", type=int, default=512, help="the chunk's new rows")
  ap.add_argument("--cps", default="1,2,4,8")
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  hq, hkv, d, ps = 9, 3, 64, args.page_size  # SmolLM2's attention
  kv_len = args.context + args.rows
  n_pages = -(-kv_len // ps)
  rng = np.random.default_rng(0)
  pages = (1 + rng.permutation(n_pages)).astype(np.int32)[None]  # [1, P]; page 0 the sink
  cache = jnp.asarray(rng.standard_normal((1, n_pages + 1, 2, hkv, ps, d)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((args.rows, hq, d)), jnp.float32)
  md = AttentionMetadata(
      slot_mapping=jnp.zeros(args.rows, jnp.int32), block_table=jnp.asarray(pages),
      kv_lens=jnp.asarray([kv_len], jnp.int32),
      cu_q_lens=jnp.asarray([0, args.rows], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32),
      max_q_len=args.rows)
  attend = jax.jit(lambda q, cache, md: ragged_paged_attention(
      q, cache, md, sm_scale=d ** -0.5, backend="xla", return_softmax_state=True))
  result = {"machine": machine_info(), "context": args.context, "rows": args.rows,
            "heads": [hq, hkv, d], "page_size": ps, "cp": {}}
  for cp in map(int, args.cps.split(",")):
    times = rank_times(args, cp, q, cache, md, pages, attend)
    result["cp"][cp] = {k: {"max_rank_s": max(v), "mean_rank_s": statistics.mean(v)}
                        for k, v in times.items()}
  base = result["cp"].get(1)
  if base:
    for cp, r in result["cp"].items():
      for k in r:
        r[k]["vs_cp1"] = r[k]["max_rank_s"] / base[k]["max_rank_s"]
  emit(result, args.out)


if __name__ == "__main__":
  main()
