"""A sliding-window layer's prefill chunk costs the same at any depth of the prompt.

One sequence's `--chunk` new rows attend over 0, 1/4, 1/2 ... of `--context` cached tokens
(SmolLM2's heads, the XLA backend that runs on the CPU), with a `--window` (a local layer) and
without (a global layer). A windowed layer's walk starts at the first page the chunk's first row
can see, so its time should stay flat while the global layer's grows with the context. Medians
of `--repeats`; `vs_first` is each chunk's time over the first chunk's.

  python -m jinfer.bench.window_attention --context 16384 --chunk 2048 --window 512
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
from pallas_kernels import AttentionMetadata, ragged_paged_attention


def main(argv=None):
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--context", type=int, default=16384, help="the prompt's length")
  ap.add_argument("--chunk", type=int, default=2048, help="prefill rows per step")
  ap.add_argument("--window", type=int, default=512)
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  hq, hkv, d, ps = 9, 3, 64, args.page_size
  n_pages = -(-args.context // ps)
  rng = np.random.default_rng(0)
  table = jnp.asarray((1 + rng.permutation(n_pages))[None], jnp.int32)  # page 0 the sink
  cache = jnp.asarray(rng.standard_normal((1, n_pages + 1, 2, hkv, ps, d)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((args.chunk, hq, d)), jnp.float32)
  attend = jax.jit(lambda q, md, window: ragged_paged_attention(
      q, cache, md, sm_scale=d ** -0.5, sliding_window=window, backend="xla"))
  result = {"machine": machine_info(), **{k: getattr(args, k) for k in
                                           ("context", "chunk", "window", "page_size")},
            "chunks": []}
  for start in range(0, args.context, args.chunk):
    md = AttentionMetadata(
        slot_mapping=jnp.zeros(args.chunk, jnp.int32), block_table=table,
        kv_lens=jnp.asarray([start + args.chunk], jnp.int32),
        cu_q_lens=jnp.asarray([0, args.chunk], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32),
        max_q_len=args.chunk)
    row = {"cached": start}
    for name, window in (("local_s", jnp.int32(args.window)), ("global_s", None)):
      jax.block_until_ready(attend(q, md, window))  # compile
      times = []
      for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(attend(q, md, window))
        times.append(time.perf_counter() - t0)
      row[name] = statistics.median(times)
    result["chunks"].append(row)
  first = result["chunks"][0]
  for row in result["chunks"]:
    row["local_vs_first"] = row["local_s"] / first["local_s"]
    row["global_vs_first"] = row["global_s"] / first["global_s"]
  emit(result, args.out)


if __name__ == "__main__":
  main()
