"""Compile-only tier, kernels: every Pallas kernel built by the real compiler of each claimed
target (Mosaic for TPU v5e and v6e, Triton for the H100) at production shapes, with its
temporaries bounded by its tiles, never by the KV cache.

Interpret mode checks the kernels' arithmetic (tests/test_ragged_paged_attention.py and the
matmul files); this tier checks what only the hardware's compiler knows: lowering rules, VMEM,
shared memory and registers, layouts. Shapes: Llama-3.1-8B's heads (32 query, 8 KV, head_dim
128) unless a case says otherwise; the GQA ratios of the shipped configs per device.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import AttentionMetadata, fp8_matmul, ragged_paged_attention
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.groupwise_matmul import groupwise_matmul
from pallas_kernels.int8_matmul import int8_matmul
from pallas_kernels.fp8_matmul import FP8
from tests.compile_targets import GPUS, TPUS, build, devices, on

pytestmark = [pytest.mark.slow, pytest.mark.compile_only]

BACKEND = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}
PLATFORM = {**{t: "tpu" for t in TPUS}, **{g: "gpu" for g in GPUS}}
KV_DTYPES = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class Attn:
  name: str
  tokens: int = 64  # T
  seqs: int = 64  # S: T == S is a decode step, S < T prefill or mixed
  verify_width: int = 1
  tree: bool = False
  kv: str = "bf16"
  window: bool = False
  soft_cap: float | None = None
  page_size: int = 16
  heads: tuple[int, int] = (32, 8)
  lse: bool = False  # the softmax state, as ring attention asks for it
  num_pages: int = 2048
  listed: bool = False  # a context rank's own pages listed (`context_pages`), walked alone
  gpu: bool = True  # the case applies to the GPU kernel too
  tpu: bool = True


CASES = [
    Attn("decode"),
    Attn("prefill", tokens=512, seqs=8),
    Attn("mixed", tokens=512, seqs=64),
    Attn("verify_chain", tokens=64, seqs=16, verify_width=5),
    Attn("verify_tree", tokens=128, seqs=2, verify_width=64, tree=True),
    Attn("decode_int8", kv="int8"),
    Attn("mixed_int8", tokens=512, kv="int8"),
    Attn("decode_int8_page32", kv="int8", page_size=32),
    Attn("decode_fp8", kv="fp8"),
    Attn("mixed_fp8_page32", tokens=512, kv="fp8", page_size=32),
    Attn("window", window=True),
    Attn("mixed_window_softcap", tokens=512, window=True, soft_cap=50.0),
    Attn("page128", page_size=128, num_pages=256),
    Attn("lse", tokens=512, lse=True),
    Attn("decode_listed", lse=True, listed=True),  # a ring hop
    Attn("mixed_window_listed_int8", tokens=512, window=True, listed=True, kv="int8", lse=True),
    # GQA per device: Llama-3.1-70B at TP 8, Qwen3-30B-A3B, Gemma-3-27B at TP 4, SmolLM2
    Attn("gqa_8_1", heads=(8, 1)),
    Attn("gqa_32_4", heads=(32, 4)),
    Attn("gqa_8_4", heads=(8, 4)),
    Attn("gqa_9_3", heads=(9, 3)),
]
TARGET_CASES = [(t, c) for t in (*TPUS, *GPUS) for c in CASES
                if (c.tpu if PLATFORM[t] == "tpu" else c.gpu)]


def _attention(target: str, c: Attn, num_pages: int | None = None):
  dev = devices(target)[0]
  spec = on(dev)
  hq, hkv, d, layers = *c.heads, 128, 2
  pages_per_seq = 4096 // c.page_size
  shape = (layers, num_pages or c.num_pages, 2, hkv, c.page_size, d)
  values = spec(shape, KV_DTYPES[c.kv])
  cache = values if c.kv == "bf16" else (values, spec(shape[:-1], jnp.float32))

  def fn(q, cache, slots, table, lens, cu, n, tree_mask, layer, window, pages, pos):
    from pallas_kernels import QuantizedKVCache
    if isinstance(cache, tuple):
      cache = QuantizedKVCache(*cache)
    md = AttentionMetadata(slot_mapping=slots, block_table=table, kv_lens=lens, cu_q_lens=cu,
                           num_seqs=n, tree_mask=tree_mask, verify_width=c.verify_width,
                           max_q_len=c.tokens // c.seqs if c.tokens > c.seqs else 1,
                           context_pages=pages, context_page_pos=pos)
    return ragged_paged_attention(q, cache, md, layer=layer, sm_scale=d ** -0.5,
                                  sliding_window=window if c.window else None,
                                  soft_cap=c.soft_cap, return_softmax_state=c.lse,
                                  backend=BACKEND[PLATFORM[target]])

  t, s = c.tokens, c.seqs
  return build(fn, spec((t, hq, d), jnp.bfloat16), cache, spec((t,)),
               spec((s, pages_per_seq)), spec((s,)), spec((s + 1,)), spec((1,)),
               spec((t, c.verify_width), jnp.bool_) if c.tree else None, spec(()), spec(()),
               *[spec((s, pages_per_seq)) if c.listed else None] * 2)


@pytest.mark.parametrize("target,case", TARGET_CASES, ids=lambda x: getattr(x, "name", x))
def test_attention_builds(target, case):
  compiled = _attention(target, case)
  m = compiled.memory_analysis()
  # Scratch for a tile's worth of pages and the query block, never a copy of the cache: the
  # cache is 2 layers x 2048 pages (256 MiB in bf16 at page 16), the tile is 8 pages.
  assert m.temp_size_in_bytes < 16 << 20, f"{m.temp_size_in_bytes / 2**20:.1f} MiB of temps"


@pytest.mark.parametrize("target", [*TPUS, *GPUS])
@pytest.mark.parametrize("kv", ["bf16", "int8", "fp8"])
def test_attention_temps_do_not_grow_with_the_cache(target, kv):
  """4x the pages, the same temporaries: nothing in the kernel or around it relayouts or copies
  the cache (the int8 TPU build once needed 262 MB of temps at decode)."""
  case = Attn("decode", kv=kv, num_pages=512)
  small, large = (_attention(target, case, n).memory_analysis().temp_size_in_bytes
                  for n in (512, 2048))
  page = 2 * 2 * 8 * 16 * (128 * jnp.dtype(KV_DTYPES[kv]).itemsize + 4 * (kv != "bf16"))
  # XLA's buffer assignment moves by a few bytes per page; a copy of the cache would add the
  # 1536 pages' ~100 MB.
  assert large - small < 1536 * page // 1000


# Projections at production shapes: Llama-3.1-8B's MLP (4096 -> 14336, and back) and 70B's at
# TP 8 (8192 -> 28672 / 8); decode and prefill rows.
MATMULS = [(m, k, n) for m in (8, 512) for k, n in ((4096, 14336), (14336, 4096), (8192, 3584))]


@pytest.mark.parametrize("target", [*TPUS, *GPUS])
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_int8_matmul_builds(target, mode):
  spec = on(devices(target)[0])
  for m, k, n in MATMULS:
    build(lambda x, w, s: int8_matmul(x, w, s, mode=mode, backend=BACKEND[PLATFORM[target]]),
          spec((m, k), jnp.bfloat16), spec((k, n), jnp.int8), spec((n,), jnp.float32))


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_fp8_matmul_reads_fp8_weights_on_h100(mode, transpose_w):
  """XLA's float8 dot builds into one GEMM fusion that reads the float8 weights in place:
  the temporaries (split-K partial sums, the f32 product before its scales) stay under the
  weights' own bytes, so no copy of them, float or float8, is made (docs/quantization.md says
  what the fusion computes with)."""
  spec = on(devices("h100")[0])
  for m, k, n in MATMULS:
    compiled = build(lambda x, w, s: fp8_matmul(x, w, s, mode=mode, transpose_w=transpose_w),
                     spec((m, k), jnp.bfloat16), spec((n, k) if transpose_w else (k, n), FP8),
                     spec((n,), jnp.float32))
    hlo = compiled.as_text()
    assert "__triton_nested_gemm_fusion" in hlo and "f8e4m3fn" in hlo
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < k * n, f"{m}x{k}x{n}: {temp / 2**20:.1f} MiB of temps"


@pytest.mark.parametrize("target", TPUS)
def test_fp8_matmul_on_tpu_is_no_slower_than_int8_by_the_estimate(target):
  """v5e and v6e have no float8 matrix unit: XLA widens the float8 operands in the dot's
  fusion. By the compiler's own estimate W8A8-FP8 costs what the int8 XLA form costs (the
  int8 Pallas kernel declares no estimate); no temporaries. (W8A16-FP8 widens the same way:
  its estimates match too, docs/quantization.md.)"""
  mode = "w8a8"
  spec = on(devices(target)[0])
  for m, k, n in MATMULS[::3]:  # decode and prefill rows of one shape: ~15 s a build
    x, s = spec((m, k), jnp.bfloat16), spec((n,), jnp.float32)
    seconds = []
    for fn, w in ((lambda x, w, s: fp8_matmul(x, w, s, mode=mode), spec((k, n), FP8)),
                  (lambda x, w, s: int8_matmul(x, w, s, mode=mode, backend="reference"),
                   spec((k, n), jnp.int8))):
      compiled = build(fn, x, w, s)
      assert compiled.memory_analysis().temp_size_in_bytes == 0
      cost = compiled.cost_analysis()
      seconds.append((cost[0] if isinstance(cost, list) else cost)["optimal_seconds"])
    assert seconds[0] <= 1.01 * seconds[1], (m, k, n, seconds)


@pytest.mark.parametrize("target", [*TPUS, *GPUS])
@pytest.mark.parametrize("bits", [4, 8])
def test_groupwise_matmul_builds(target, bits):
  spec, g = on(devices(target)[0]), 128
  for m, k, n in MATMULS:
    q = spec((k // 2, n), jnp.uint8) if bits == 4 else spec((k, n), jnp.int8)
    build(lambda x, q, s, o: groupwise_matmul(x, q, s, o, bits=bits, group_size=g,
                                              backend=BACKEND[PLATFORM[target]]),
          spec((m, k), jnp.bfloat16), q, spec((k // g, n), jnp.float32),
          spec((k // g, n), jnp.float32))


@pytest.mark.parametrize("target", [*TPUS, *GPUS])
def test_groupwise_codebook_matmul_builds(target):
  """The codebook form (MXFP4/NVFP4/IQ4: a [16] table, no offsets), groups of 32 (MXFP4's and
  IQ4's blocks) and 16 (NVFP4's), decode and prefill rows of one 8B projection: its table
  lookups lower (SMEM scalars on TPU, scalar loads in Triton) and its tiles fit."""
  spec = on(devices(target)[0])
  k, n = 4096, 14336
  for m, g in ((8, 32), (512, 16)):
    compiled = build(lambda x, q, s, t: groupwise_matmul(x, q, s, None, bits=4, group_size=g,
                                                         table=t,
                                                         backend=BACKEND[PLATFORM[target]]),
                     spec((m, k), jnp.bfloat16), spec((k // 2, n), jnp.uint8),
                     spec((k // g, n), jnp.float32), spec((16,), jnp.float32))
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 16 << 20, f"{m} rows, g{g}: {temp / 2**20:.1f} MiB of temporaries"


@pytest.mark.parametrize("target", TPUS)
@pytest.mark.parametrize("quantized", [False, True])
def test_grouped_matmul_builds(target, quantized):
  """Mixtral-8x7B's experts (8 of 4096 -> 14336, and back), 2 per token, decode and prefill."""
  spec = on(devices(target)[0])
  for tokens in (8, 512):
    for k, n in ((4096, 14336), (14336, 4096)):
      m = 2 * tokens
      rhs = spec((8, k, n), jnp.int8 if quantized else jnp.bfloat16)
      scale = spec((8, n), jnp.float32) if quantized else None
      build(lambda x, w, gs, s: grouped_matmul(x, w, gs, s, backend="pallas_tpu"),
            spec((m, k), jnp.bfloat16), rhs, spec((8,)), scale)


# MoE expert projections (experts, K, N) with top-k, decode (8 tokens) and prefill (4096):
# Mixtral-8x7B's gate/up (4096 -> 14336) and down, Qwen3-30B-A3B's fused gate/up (2048 -> 2 x 768)
# and down.
EXPERTS = {"mixtral": (2, [(8, 4096, 14336), (8, 14336, 4096)]),
           "qwen3_30b_a3b": (8, [(128, 2048, 1536), (128, 768, 2048)])}


@pytest.mark.parametrize("target", GPUS)
@pytest.mark.parametrize("model", EXPERTS)
@pytest.mark.parametrize("kind", ["bf16", "w8a16", "w8a8", "int4", "int8_g128"])
def test_grouped_matmul_builds_for_gpu(target, model, kind):
  """Every projection at decode, the first at prefill too. Temporaries: none beyond the
  per-token int8 activations of W8A8, never a dequantized copy of the experts (one Mixtral
  expert is 112 MiB in bf16)."""
  spec = on(devices(target)[0])
  top_k, projections = EXPERTS[model]
  qg = 128
  for tokens, (g, k, n) in [(8, p) for p in projections] + [(4096, projections[0])]:
    m = top_k * tokens
    if kind in ("bf16", "w8a16", "w8a8"):
      rhs = spec((g, k, n), jnp.bfloat16 if kind == "bf16" else jnp.int8)
      scale = None if kind == "bf16" else spec((g, n), jnp.float32)
      offset, kw = None, {} if kind == "bf16" else dict(mode=kind)
    else:
      bits = 4 if kind == "int4" else 8
      rhs = spec((g, k // 2, n), jnp.uint8) if bits == 4 else spec((g, k, n), jnp.int8)
      scale = offset = spec((g, k // qg, n), jnp.float32)
      kw = dict(bits=bits, quant_group_size=qg)
    compiled = build(lambda x, w, gs, s, o: grouped_matmul(x, w, gs, s, o, backend="pallas_gpu",
                                                           **kw),
                     spec((m, k), jnp.bfloat16), rhs, spec((g,)), scale, offset)
    temp = compiled.memory_analysis().temp_size_in_bytes
    bound = (m * (k + 4) if kind == "w8a8" else 0) + (1 << 20)
    assert temp <= bound, f"{m} rows, {g}x{k}x{n}: {temp / 2**20:.1f} MiB of temps"


def test_a_refusal_comes_out_as_one_line():
  """A kernel whose blocks overflow VMEM (three 256 MiB windows on a 128 MiB v6e core): the
  compiler's multi-line refusal comes out as one line that keeps its cause."""
  from jax.experimental import pallas as pl
  from jinfer.engine.compile_only import short_error
  spec = on(devices("v6e-1")[0])
  block = pl.BlockSpec((8192, 8192), lambda i: (0, 0))
  f = pl.pallas_call(lambda x, y, o: o.__setitem__(..., x[...] + y[...]),
                     out_shape=jax.ShapeDtypeStruct((8192, 8192), jnp.float32), grid=(1,),
                     in_specs=[block, block], out_specs=block)
  with pytest.raises(Exception) as refused:
    build(f, spec((8192, 8192), jnp.float32), spec((8192, 8192), jnp.float32))
  line = short_error(refused.value)
  assert "\n" not in line and len(line) <= 300
  assert "RESOURCE_EXHAUSTED" in line and "vmem" in line.lower(), line
