"""Time the Pallas kernels against their XLA references on a real GPU or TPU; print JSON.

Attention: ragged paged attention with Llama-3-8B heads (32 q heads, 8 KV heads, head_dim 128,
bf16) at a decode batch, a prefill batch and a mixed batch (decodes plus chunked prefills), for the
platform's Pallas kernel and the jnp reference. Reports milliseconds, the bytes that must cross
HBM (KV of every live token once, plus q and the output) per second as a fraction of `--peak-bw`,
achieved TFLOP/s, and the max abs error against the reference (so a device run is also a check of
the compiled kernel).

int8 matmul: W8A16 and W8A8 kernels against a bf16 XLA matmul of the same weights (and the jnp
int8 reference), at decode and prefill M with Llama-3-8B MLP shapes.

  python examples/bench_kernels_device.py --out /tmp/bench.json            # on the device
  python examples/bench_kernels_device.py --smoke --out /tmp/smoke.json    # CPU: tiny, interpreted
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.int8_matmul import int8_matmul, quantize_per_channel
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

H200_PEAK_BW = 4.8e12  # bytes/s


def attention_batch(seqs: list[tuple[int, int]], num_tokens: int, hq: int, hkv: int, d: int,
                    page_size: int, dtype, seed: int = 0) -> dict:
  """A ragged batch: (q_len, kv_len) per sequence, pages drawn from a shuffled pool."""
  rng = np.random.default_rng(seed)
  pages_needed = [-(-kv // page_size) for _, kv in seqs]
  p = max(pages_needed)
  num_pages = 1 + sum(pages_needed)
  pool = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
  page_indices = np.zeros((len(seqs), p), np.int32)
  at = 0
  for s, n in enumerate(pages_needed):
    page_indices[s, :n] = pool[at:at + n]
    at += n
  q_lens = np.array([q for q, _ in seqs], np.int32)
  assert q_lens.sum() <= num_tokens
  key = jax.random.key(seed)
  kq, kc = jax.random.split(key)
  return dict(
      q=jax.random.normal(kq, (num_tokens, hq, d), dtype),
      kv_cache=jax.random.normal(kc, (num_pages, 2, hkv, page_size, d), dtype),
      kv_lens=jnp.asarray([kv for _, kv in seqs], jnp.int32),
      page_indices=jnp.asarray(page_indices),
      cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
      num_seqs=jnp.asarray([len(seqs)], jnp.int32),
      max_q_len=int(q_lens.max()),
  )


def attention_cost(seqs, hq: int, hkv: int, d: int, itemsize: int, num_tokens: int):
  kv_bytes = sum(kv for _, kv in seqs) * 2 * hkv * d * itemsize
  qo_bytes = 2 * num_tokens * hq * d * itemsize
  # Causal: the query at position p attends p + 1 keys; 2 matmuls of 2 flops per MAC.
  keys = sum(sum(kv - q + i + 1 for i in range(q)) for q, kv in seqs)
  return kv_bytes + qo_bytes, 4 * keys * hq * d


def time_fn(fn, args, iters: int) -> float:
  """Median wall time in ms of a compiled call, after one warm-up (which compiles)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def bench_attention(args, backends: list[str], interpret: bool) -> list[dict]:
  hq, hkv, d = (4, 2, 64) if args.smoke else (32, 8, 128)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  if args.smoke:
    shapes = {"decode": ([(1, 40), (1, 9), (1, 70)], 8),
              "prefill": ([(24, 24)], 32),
              "mixed": ([(1, 33), (12, 30), (1, 5)], 16)}
  else:
    rng = np.random.default_rng(0)
    decode = [(1, int(kv)) for kv in rng.integers(1024, 4097, 64)]
    shapes = {"decode": (decode, 64),
              "prefill": ([(2048, 2048), (2048, 2048)], 4096),
              "mixed": (decode[:56] + [(512, 1024), (512, 2048)], 2048)}
  results = []
  for name, (seqs, t) in shapes.items():
    b = attention_batch(seqs, t, hq, hkv, d, args.page_size, dtype)
    max_q_len = b.pop("max_q_len")
    nbytes, flops = attention_cost(seqs, hq, hkv, d, jnp.dtype(dtype).itemsize, t)
    ref = None
    for backend in ["reference"] + backends:
      configs = args.attn_blocks if backend != "reference" else [{}]
      for blocks in configs:
        kw = dict(blocks, interpret=interpret) if backend != "reference" else {}
        fn = jax.jit(lambda *a, backend=backend, kw=kw: ragged_paged_attention(
            *a, sm_scale=d ** -0.5, max_q_len=max_q_len, backend=backend, **kw))
        a = (b["q"], b["kv_cache"], b["kv_lens"], b["page_indices"], b["cu_q_lens"],
             b["num_seqs"])
        out = fn(*a)
        if ref is None:
          ref = out
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        ms = time_fn(fn, a, args.iters)
        results.append(dict(op="ragged_paged_attention", shape=name, backend=backend,
                            blocks=blocks, num_seqs=len(seqs), num_tokens=t,
                            kv_tokens=sum(kv for _, kv in seqs), ms=ms, bytes=nbytes,
                            hbm_fraction=nbytes / (ms * 1e-3) / args.peak_bw,
                            tflops=flops / (ms * 1e-3) / 1e12, max_abs_err_vs_reference=err))
        print(json.dumps(results[-1]), file=sys.stderr)
  return results


def bench_int8_matmul(args, backends: list[str], interpret: bool) -> list[dict]:
  k, n = (256, 384) if args.smoke else (4096, 14336)
  ms_list = (40,) if args.smoke else (16, 4096)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  kx, kw_ = jax.random.split(jax.random.key(1))
  w = jax.random.normal(kw_, (k, n), jnp.float32) * 0.02
  wq, ws = quantize_per_channel(w)
  w_bf16 = w.astype(dtype)
  results = []
  for m in ms_list:
    x = jax.random.normal(kx, (m, k), dtype)
    xla = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    ms = time_fn(xla, (x, w_bf16), args.iters)
    nbytes = k * n * w_bf16.dtype.itemsize + (m * k + m * n) * jnp.dtype(dtype).itemsize
    results.append(dict(op="matmul", backend="xla_dense", mode=str(jnp.dtype(dtype)), m=m, k=k,
                        n=n, ms=ms, bytes=nbytes, hbm_fraction=nbytes / (ms * 1e-3) / args.peak_bw,
                        tflops=2 * m * k * n / (ms * 1e-3) / 1e12))
    print(json.dumps(results[-1]), file=sys.stderr)
    for mode in ("w8a16", "w8a8"):
      ref = int8_matmul(x, wq, ws, mode=mode)
      for backend in ["reference"] + backends:
        kw = dict(interpret=interpret) if backend != "reference" else {}
        fn = jax.jit(lambda x, wq, ws, backend=backend, kw=kw, mode=mode: int8_matmul(
            x, wq, ws, mode=mode, backend=backend, **kw))
        out = fn(x, wq, ws)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        ms = time_fn(fn, (x, wq, ws), args.iters)
        nbytes = k * n + 4 * n + (m * k + m * n) * jnp.dtype(dtype).itemsize
        results.append(dict(op="int8_matmul", backend=backend, mode=mode, m=m, k=k, n=n, ms=ms,
                            bytes=nbytes, hbm_fraction=nbytes / (ms * 1e-3) / args.peak_bw,
                            tflops=2 * m * k * n / (ms * 1e-3) / 1e12,
                            max_abs_err_vs_reference=err))
        print(json.dumps(results[-1]), file=sys.stderr)
  return results


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True, help="where to write the JSON report")
  ap.add_argument("--peak-bw", type=float, default=H200_PEAK_BW,
                  help="peak HBM bandwidth in bytes/s (default: H200, 4.8e12)")
  ap.add_argument("--page-size", type=int, default=None,
                  help="KV page size (default 16 on GPU and CPU, 64 on TPU)")
  ap.add_argument("--iters", type=int, default=None, help="timed calls per case (median)")
  ap.add_argument("--attn-blocks", type=json.loads, action="append", default=None,
                  help='attention kernel block sizes as JSON, e.g. \'{"pages_per_block": 4}\'; '
                       "repeat to compare several")
  ap.add_argument("--skip", choices=["attention", "int8_matmul"], action="append", default=[])
  ap.add_argument("--smoke", action="store_true",
                  help="tiny shapes, f32; on CPU the kernels run in interpret mode")
  args = ap.parse_args(argv)

  plat = jax.default_backend()
  if args.page_size is None:
    args.page_size = 64 if plat == "tpu" and not args.smoke else (8 if args.smoke else 16)
  if args.iters is None:
    args.iters = 1 if args.smoke else 20
  if args.attn_blocks is None:
    args.attn_blocks = [{}]
  interpret = plat == "cpu"
  if interpret and not args.smoke:
    ap.error("on the CPU the kernels only run interpreted: pass --smoke")
  backends = {"tpu": ["pallas_tpu"], "gpu": ["pallas_gpu"]}.get(plat, ["pallas_tpu", "pallas_gpu"])

  results = []
  if "attention" not in args.skip:
    results += bench_attention(args, backends, interpret)
  if "int8_matmul" not in args.skip:
    results += bench_int8_matmul(args, backends, interpret)
  report = dict(
      machine=dict(platform=plat, device_kind=jax.devices()[0].device_kind,
                   num_devices=jax.device_count(), jax=jax.__version__,
                   python=platform.python_version(), host=platform.node()),
      args=vars(args), results=results)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print(json.dumps(report, indent=1))
  return report


if __name__ == "__main__":
  main()
