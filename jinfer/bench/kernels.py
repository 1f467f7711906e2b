"""Time the Pallas kernels against jnp baselines on a real GPU or TPU; print JSON.

Attention: ragged paged attention with Llama-3-8B heads (32 q heads, 8 KV heads, head_dim 128,
bf16) over layer 1 of a two-layer cache, at a decode batch, a prefill batch, a mixed batch
(decodes plus chunked prefills) and a speculative-decoding batch (a tree of 8 verify rows per
sequence), for the platform's Pallas kernel and a baseline backend (`--baseline`: the tuned `xla`
path by default; the dense `reference` oracle, which only fits small shapes, with `--smoke`).
Reports milliseconds, the bytes that must cross HBM (KV of every live token once, plus q and the
output) per second as a fraction of `--peak-bw`, achieved TFLOP/s, and the max abs error against
the baseline (`max_abs_err_vs_reference`; so a device run is also a check of the compiled kernel).

Attention over an int8 KV cache (`decode_int8kv`): the decode batch with K/V stored int8 with a
scale per token and head (`kv_cache_dtype="int8"`); its bytes count the int8 values and scales.

int8 matmul: W8A16 and W8A8 kernels against a bf16 XLA matmul of the same weights (and the jnp
int8 reference), at M = 1, 8, 64 (decode) and 4096 (prefill) with Llama-3-8B MLP shapes.

int4 matmul: the group-wise kernel (4-bit weights packed per group of 128, a scale and offset
per group and channel; `pallas_kernels/groupwise_matmul`) against the same bf16 XLA matmul, at
M = 1, 8, 64 and 4096 with Llama-3-8B's MLP up (4096 x 14336) and down (14336 x 4096) shapes;
checked against the jnp oracle. At M = 1 a memory-bound kernel should approach the ratio of
bytes, ~3.6x bf16.

Grouped matmul (MoE experts): Mixtral-8x7B's gate/up projection (8 experts, hidden 4096, 2 x
14336 wide, top-2) over the rows a decode and a prefill batch route to the experts (a softmax
router over random activations, so the groups are uneven), for every backend that runs on the
platform (`ragged_dot` everywhere; `pallas_tpu` on a TPU, interpreted on the CPU with --smoke),
float, int8 (W8A16, W8A8) and group-wise int4 experts (groups of 128, packed; the TPU kernel
reads them packed, ragged_dot dequantizes every expert first), against the dense matmul of the
same active rows (one expert's weights). The bytes are the weights of the experts that got
rows (with their scales and offsets), plus activations in and out.

  python -m jinfer.bench.kernels --out bench.json            # on the device
  python -m jinfer.bench.kernels --smoke --out smoke.json    # CPU: tiny, interpreted
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

from pallas_kernels import AttentionMetadata
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.groupwise_matmul import dequantize, groupwise_matmul, pack_int4
from pallas_kernels.int8_matmul import int8_matmul, quantize_per_channel
from pallas_kernels.kv_cache_layout import quantize_pages
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

H200_PEAK_BW = 4.8e12  # bytes/s


def random_tree(rng, n: int) -> np.ndarray:  # [n, n] bool: node i sees its ancestors and itself
  parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
  bits = np.zeros((n, n), bool)
  for i in range(n):
    j = i
    while j >= 0:
      bits[i, j] = True
      j = parent[j]
  return bits


def attention_batch(seqs: list[tuple[int, int]], num_tokens: int, hq: int, hkv: int, d: int,
                    page_size: int, dtype, *, num_layers: int = 2, verify_width: int = 1,
                    tree: bool = False, seed: int = 0) -> dict:
  """A ragged batch: (q_len, kv_len) per sequence, pages drawn from a shuffled pool, in a cache of
  `num_layers` layers. With `tree`, sequences of up to `verify_width` rows get a random tree of
  verify rows (else their rows are causal)."""
  rng = np.random.default_rng(seed)
  pages_needed = [-(-kv // page_size) for _, kv in seqs]
  p = max(pages_needed)
  num_pages = 1 + sum(pages_needed)  # page 0 is the sink
  pool = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
  block_table = np.zeros((len(seqs), p), np.int32)
  at = 0
  for s, n in enumerate(pages_needed):
    block_table[s, :n] = pool[at:at + n]
    at += n
  q_lens = np.array([q for q, _ in seqs], np.int32)
  assert q_lens.sum() <= num_tokens
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  slots = np.zeros(num_tokens, np.int32)  # padding rows write to the sink page
  tree_mask = np.zeros((num_tokens, verify_width), bool) if tree else None
  for s, (ql, kv) in enumerate(seqs):
    pos = np.arange(kv - ql, kv)
    slots[cu[s]:cu[s + 1]] = block_table[s, pos // page_size] * page_size + pos % page_size
    if tree and ql <= verify_width:
      tree_mask[cu[s]:cu[s + 1], :ql] = random_tree(rng, ql)
  kq, kc = jax.random.split(jax.random.key(seed))
  md = AttentionMetadata(
      slot_mapping=jnp.asarray(slots), block_table=jnp.asarray(block_table),
      kv_lens=jnp.asarray([kv for _, kv in seqs], jnp.int32), cu_q_lens=jnp.asarray(cu),
      num_seqs=jnp.asarray([len(seqs)], jnp.int32),
      tree_mask=None if tree_mask is None else jnp.asarray(tree_mask),
      max_q_len=int(q_lens.max()), max_prefill_seqs=int((q_lens > verify_width).sum()),
      verify_width=verify_width)
  return dict(
      q=jax.random.normal(kq, (num_tokens, hq, d), dtype),
      kv_cache=jax.random.normal(kc, (num_layers, num_pages, 2, hkv, page_size, d), dtype),
      md=md, tree_mask=tree_mask)


def attention_cost(seqs, tree_mask, verify_width: int, hq: int, hkv: int, d: int, itemsize: int,
                   num_tokens: int):
  kv_bytes = sum(kv for _, kv in seqs) * 2 * hkv * d * itemsize
  qo_bytes = 2 * num_tokens * hq * d * itemsize
  # A row sees its context and the new rows before it (causal), or those its tree bits name;
  # 2 matmuls of 2 flops per MAC.
  keys, row = 0, 0
  for q, kv in seqs:
    tree = tree_mask is not None and q <= verify_width
    for i in range(q):
      keys += kv - q + (int(tree_mask[row + i].sum()) if tree else i + 1)
    row += q
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
  # name: (sequences, tokens T, verify_width, tree mask)
  if args.smoke:
    shapes = {"decode": ([(1, 40), (1, 9), (1, 70)], 8, 1, False),
              "prefill": ([(24, 24)], 32, 1, False),
              "mixed": ([(1, 33), (12, 30), (1, 5)], 16, 1, False),
              "verify_tree": ([(4, 20), (1, 9), (3, 14)], 8, 4, True)}
  else:
    rng = np.random.default_rng(0)
    kv_lens = [int(kv) for kv in rng.integers(1024, 4097, 64)]
    decode = [(1, kv) for kv in kv_lens]
    shapes = {"decode": (decode, 64, 1, False),
              "prefill": ([(2048, 2048), (2048, 2048)], 4096, 1, False),
              "mixed": (decode[:56] + [(512, 1024), (512, 2048)], 2048, 1, False),
              # Speculative decoding: 8 tree nodes on top of each cached context.
              "verify_tree": ([(8, kv) for kv in kv_lens], 512, 8, True)}
  shapes["decode_int8kv"] = shapes["decode"]
  layer = jnp.int32(1)  # of 2, traced like a layer scan's index
  results = []
  for name, (seqs, t, verify_width, tree) in shapes.items():
    b = attention_batch(seqs, t, hq, hkv, d, args.page_size, dtype, verify_width=verify_width,
                        tree=tree)
    itemsize = jnp.dtype(dtype).itemsize
    if name.endswith("int8kv"):  # values 1 byte, plus a 4-byte scale per row of D
      b["kv_cache"] = quantize_pages(b["kv_cache"], jnp.int8)
      itemsize = 1 + 4 / d
    nbytes, flops = attention_cost(seqs, b["tree_mask"], verify_width, hq, hkv, d, itemsize, t)
    ref = None
    for backend in [args.baseline] + backends:
      kernel = backend.startswith("pallas")
      for blocks in args.attn_blocks if kernel else [{}]:
        kw = dict(blocks, interpret=interpret) if kernel else {}
        fn = jax.jit(lambda q, cache, md, layer, backend=backend, kw=kw: ragged_paged_attention(
            q, cache, md, layer=layer, sm_scale=d ** -0.5, backend=backend, **kw))
        a = (b["q"], b["kv_cache"], b["md"], layer)
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
  ms_list = (40,) if args.smoke else (1, 8, 64, 4096)
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


def rtn_int4(w: jax.Array, g: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """w [..., K, N] -> (packed q [..., K/2, N], scale, offset [..., K/g, N]): round to nearest,
  asymmetric over each group's [min, max]."""
  *lead, k, n = w.shape
  wg = w.reshape(*lead, k // g, g, n)
  lo, hi = wg.min(-2), wg.max(-2)
  scale = (hi - lo) / 15
  codes = jnp.clip(jnp.round((wg - lo[..., None, :]) / scale[..., None, :]), 0, 15)
  return pack_int4(codes.reshape(*lead, k, n).astype(jnp.uint8), g), scale, lo


def bench_int4_matmul(args, backends: list[str], interpret: bool) -> list[dict]:
  g = 32 if args.smoke else 128
  shapes = [(256, 384)] if args.smoke else [(4096, 14336), (14336, 4096)]
  ms_list = (40,) if args.smoke else (1, 8, 64, 4096)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  results = []
  for k, n in shapes:
    kx, kw_ = jax.random.split(jax.random.key(2))
    w = jax.random.normal(kw_, (k, n), jnp.float32) * 0.02
    q, scale, lo = rtn_int4(w, g)
    w_bf16 = dequantize(q, scale, lo, bits=4, group_size=g).astype(dtype)
    for m in ms_list:
      x = jax.random.normal(kx, (m, k), dtype)
      xla = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
      dense_ms = time_fn(xla, (x, w_bf16), args.iters)
      act = (m * k + m * n) * jnp.dtype(dtype).itemsize
      nbytes = k * n * jnp.dtype(dtype).itemsize + act
      results.append(dict(op="matmul", backend="xla_dense", mode=str(jnp.dtype(dtype)), m=m, k=k,
                          n=n, ms=dense_ms, bytes=nbytes,
                          hbm_fraction=nbytes / (dense_ms * 1e-3) / args.peak_bw,
                          tflops=2 * m * k * n / (dense_ms * 1e-3) / 1e12))
      print(json.dumps(results[-1]), file=sys.stderr)
      ref = groupwise_matmul(x, q, scale, lo, bits=4, group_size=g, backend="reference")
      for backend in backends:
        fn = jax.jit(lambda x, q, s, o, backend=backend: groupwise_matmul(
            x, q, s, o, bits=4, group_size=g, backend=backend, interpret=interpret))
        out = fn(x, q, scale, lo)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        ms = time_fn(fn, (x, q, scale, lo), args.iters)
        nbytes = k * n // 2 + 2 * 4 * (k // g) * n + act
        results.append(dict(op="int4_matmul", backend=backend, group_size=g, m=m, k=k, n=n,
                            ms=ms, bytes=nbytes, speedup_vs_dense=dense_ms / ms,
                            hbm_fraction=nbytes / (ms * 1e-3) / args.peak_bw,
                            tflops=2 * m * k * n / (ms * 1e-3) / 1e12,
                            max_abs_err_vs_reference=err))
        print(json.dumps(results[-1]), file=sys.stderr)
  return results


def routed_rows(rng, tokens: int, hidden: int, experts: int, top_k: int) -> tuple:
  """(token of each routed row [tokens*top_k], rows per expert [experts]): the rows sorted by
  expert as the MoE layer sorts them, chosen by a softmax router over random activations."""
  x = rng.standard_normal((tokens, hidden)).astype(np.float32)
  logits = x @ (rng.standard_normal((hidden, experts)).astype(np.float32) / np.sqrt(hidden))
  chosen = np.argsort(-logits, axis=1)[:, :top_k].reshape(-1)  # [tokens*top_k]
  order = np.argsort(chosen, kind="stable")
  return order // top_k, np.bincount(chosen, minlength=experts).astype(np.int32)


def bench_grouped_matmul(args, backends: list[str], interpret: bool) -> list[dict]:
  experts, top_k = 8, 2
  hidden, n = (256, 384) if args.smoke else (4096, 2 * 14336)
  batches = (24,) if args.smoke else (64, 4096)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  blocks = dict(block_m=32, block_n=128, block_k=128) if args.smoke else {}
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.standard_normal((experts, hidden, n), np.float32) * 0.02)
  wq, ws = jax.vmap(quantize_per_channel)(w)  # [G, K, N] int8, [G, N]
  g4 = 32 if args.smoke else 128
  q4, s4, o4 = rtn_int4(w, g4)  # [G, K/2, N] packed, [G, K/g4, N] twice
  # mode: (weights, scale (per channel or group-wise), offset, static keyword arguments,
  # weight bytes per expert)
  weights = {
      None: (w.astype(dtype), None, None, {}, hidden * n * jnp.dtype(dtype).itemsize),
      "w8a16": (wq, ws, None, dict(mode="w8a16"), hidden * n + 4 * n),
      "w8a8": (wq, ws, None, dict(mode="w8a8"), hidden * n + 4 * n),
      "int4": (q4, s4, o4, dict(bits=4, quant_group_size=g4),
               hidden * n // 2 + 2 * 4 * (hidden // g4) * n),
  }
  results = []
  for tokens in batches:
    token_of_row, sizes = routed_rows(rng, tokens, hidden, experts, top_k)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    rows = x[jnp.asarray(token_of_row)]  # [tokens*top_k, K]
    gs = jnp.asarray(sizes)
    m, used = rows.shape[0], int(np.count_nonzero(sizes))
    flops = 2 * m * hidden * n
    act_bytes = m * (hidden + n) * jnp.dtype(dtype).itemsize
    dense = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    ms = time_fn(dense, (rows, weights[None][0][0]), args.iters)
    nbytes = hidden * n * jnp.dtype(dtype).itemsize + act_bytes
    results.append(dict(op="matmul", backend="xla_dense_one_expert", mode=str(jnp.dtype(dtype)),
                        m=m, k=hidden, n=n, ms=ms, bytes=nbytes,
                        hbm_fraction=nbytes / (ms * 1e-3) / args.peak_bw,
                        tflops=flops / (ms * 1e-3) / 1e12))
    print(json.dumps(results[-1]), file=sys.stderr)
    for mode, (wt, scale, offset, wkw, expert_bytes) in weights.items():
      a = (rows, wt, gs, scale, offset)
      w_bytes = used * expert_bytes
      ref = None
      for backend in ["ragged_dot"] + backends:  # ragged_dot, the oracle, first
        kw = dict(blocks, interpret=interpret) if backend.startswith("pallas") else {}
        fn = jax.jit(lambda *a, backend=backend, kw={**wkw, **kw}: grouped_matmul(
            *a, backend=backend, **kw))
        out = fn(*a)
        if ref is None:
          ref = out
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        ms = time_fn(fn, a, args.iters)
        results.append(dict(op="grouped_matmul", backend=backend,
                            mode=mode or str(jnp.dtype(dtype)), m=m, k=hidden, n=n,
                            **({"group_size": g4} if mode == "int4" else {}),
                            groups=experts, group_sizes=sizes.tolist(), ms=ms,
                            bytes=w_bytes + act_bytes,
                            hbm_fraction=(w_bytes + act_bytes) / (ms * 1e-3) / args.peak_bw,
                            tflops=flops / (ms * 1e-3) / 1e12, max_abs_err_vs_reference=err))
        print(json.dumps(results[-1]), file=sys.stderr)
  return results


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                              description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True, help="where to write the JSON report")
  ap.add_argument("--peak-bw", type=float, default=H200_PEAK_BW,
                  help="peak HBM bandwidth in bytes/s (default: H200, 4.8e12)")
  ap.add_argument("--page-size", type=int, default=None,
                  help="KV page size (default 16 on GPU and CPU, 64 on TPU)")
  ap.add_argument("--iters", type=int, default=None, help="timed calls per case (median)")
  ap.add_argument("--attn-blocks", type=json.loads, action="append", default=None,
                  help='attention kernel block sizes as JSON, e.g. \'{"pages_per_block": 4}\'; '
                       "repeat to compare several")
  ap.add_argument("--baseline", choices=["xla", "reference"], default=None,
                  help="attention backend the kernels are timed and checked against "
                       "(default: reference with --smoke, else xla)")
  ap.add_argument("--skip", choices=["attention", "int8_matmul", "int4_matmul",
                                     "grouped_matmul"],
                  action="append", default=[])
  ap.add_argument("--smoke", action="store_true",
                  help="tiny shapes, f32; on CPU the kernels run in interpret mode")
  args = ap.parse_args(argv)

  plat = jax.default_backend()
  if args.page_size is None:
    args.page_size = 64 if plat == "tpu" and not args.smoke else (8 if args.smoke else 16)
  if args.iters is None:
    args.iters = 1 if args.smoke else 20
  if args.baseline is None:
    args.baseline = "reference" if args.smoke else "xla"
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
  if "int4_matmul" not in args.skip:
    results += bench_int4_matmul(args, backends, interpret)
  if "grouped_matmul" not in args.skip:
    gmm_backends = {"tpu": ["pallas_tpu"], "gpu": ["pallas_gpu"]}.get(plat, ["pallas_tpu"])
    results += bench_grouped_matmul(args, gmm_backends, interpret)
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
