"""GGUF tensors re-encoded into the group-wise format without going through float weights.

Every GGUF quantization type jinfer reads is affine per sub-block: w = d_sub * q + m_sub with a
small integer q. That is exactly `q * scale + offset` (see `groupwise_tensor`), so each block's
integers are kept and its float16 scales widened to float32:

  type   bits group  q                 scale        offset
  Q8_0   8    32     int8              d            -0.0
  Q4_0   4    32     0..15             d            -8 d
  Q4_1   4    32     0..15             d            m
  Q5_0   8    32     q - 16 (signed)   d            -0.0
  Q5_1   8    32     0..31             d            m
  Q2_K   4    16     0..3              d sc         -dmin m
  Q3_K   4    16     q + 4 (0..7)      d (sc - 32)  -4 d (sc - 32)
  Q4_K   4    32     0..15             d sc         -dmin m
  Q5_K   8    32     0..31             d sc         -dmin m
  Q6_K   8    16     q - 32 (signed)   d sc         -0.0

The codebook types index a table of 16 values with their 4-bit codes (the group-wise codebook
form, w = table[q] * scale, no offset), codes kept packed as stored:

  type    group  table                      scale
  IQ4_NL  32     IQ4's 16 non-uniform ints  d
  IQ4_XS  32     IQ4's 16 non-uniform ints  d (sc - 32), sc 6 bits per 32 of a 256-block
  MXFP4   32     e2m1 doubled (0..12)       e8m0 as ggml decodes it (its half)
  NVFP4   16     e2m1 doubled (0..12)       ue4m3 as ggml decodes it (its half), 4 per 64-block

Each scale is computed as gguf-py computes it and multiplies the same table value, so these are
bit for bit gguf-py's values (no signed-zero exception: gguf-py multiplies too). GGUF's NVFP4
blocks carry no tensor scale; gguf-py's dequantization reads none.

Exactness against `gguf.quants.dequantize` (float32): every product q * scale is exact (a
float16 mantissa of 11 bits times integers of at most 13 more bits fits float32's 24), and
where gguf-py subtracts a product we add its negation, which IEEE defines to be the same. So the
values are identical bit for bit, with one exception: Q4_0 and Q3_K store signed codes that
become q * d + (-c d); where the code is the zero point, that sum is +0.0 while gguf-py's
d * 0 is -0.0 for a negative d. Equal as numbers; only the sign bit of zero differs. An offset
of -0.0 (rather than +0.0) keeps x + offset == x for x = -0.0 as well.

Rows: a GGUF matrix with shape (cols, rows) stores `rows` rows of `cols` values, blocks along
the row: that is HF's [out, in], so blocks run along our K and rows become N columns. Stacked
experts [X, rows, cols] become [X, K, N].
"""
from __future__ import annotations

import re
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jinfer.config import ModelConfig
from jinfer.quant.microfloat import E2M1_DOUBLED
from jinfer.weights.gguf_file import (_EXPERTS, _dequantized, _unpermute_rope, gguf_config,
                                      gguf_to_hf_name, gguf_value, open_gguf,
                                      stored_norm_offset)
from jinfer.weights.gguf_reader import GGUFTensor
from jinfer.weights.groupwise_tensor import GroupwiseTensor, GroupwiseWeights, concat_columns
from jinfer.weights.hf_layout import WeightError

_Q = GGMLQuantizationType
FLOAT_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.F64)
# Types a file may hold that are not re-encoded, and why (the error and fallback say it).
_WHY_NOT = {
    _Q.TQ1_0: "ternary base-3 packing is not re-encoded",
    _Q.TQ2_0: "ternary packing is not re-encoded",
}
_CODEBOOK = "it decodes through a lattice codebook (8 values per grid index), not per value"

# (blocks [R, nb, type size] uint8) -> (codes [R, nb, block], scale [R, nb, S], offset
# [R, nb, S]) with S sub-blocks per block; codes already packed ([R, nb, block/2]) for the
# types whose block layout is the format's own.
Encoder = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _f16(b: np.ndarray, at: int) -> np.ndarray:  # [R, nb, 1] float32: the float16 at byte `at`
  return np.ascontiguousarray(b[..., at:at + 2]).view("<f2").astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:  # [..., n] -> [..., 2, n]: low nibbles, then high
  return np.stack([b & 15, b >> 4], axis=-2)


def _fields(b: np.ndarray, count: int, width: int) -> np.ndarray:
  """[..., n] -> [..., count, n]: field i is (b >> width * i) & (2**width - 1)."""
  shifts = (np.arange(count, dtype=b.dtype) * width)[:, None]
  return (b[..., None, :] >> shifts) & b.dtype.type((1 << width) - 1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:  # [R, nb, 4] bytes -> [R, nb, 32] uint8 of bit e
  bits = np.ascontiguousarray(qh).view("<u4")  # [R, nb, 1]
  return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _neg_zero(d: np.ndarray) -> np.ndarray:
  return np.full(d.shape, -0.0, np.float32)


def _q8_0(b):
  d = _f16(b, 0)
  return b[..., 2:].view(np.int8), d, _neg_zero(d)


def _q4_0(b):  # Q4_0 and Q4_1 pack byte j as (value j, value j + 16): the format's own layout
  d = _f16(b, 0)
  return b[..., 2:], d, -8 * d


def _q4_1(b):
  return b[..., 4:], _f16(b, 0), _f16(b, 2)


def _q5_0(b):
  r, nb, _ = b.shape
  low = _nibbles(b[..., 6:]).reshape(r, nb, 32)
  d = _f16(b, 0)
  return (low | _fifth_bits(b[..., 2:6]) << 4).astype(np.int8) - 16, d, _neg_zero(d)


def _q5_1(b):
  r, nb, _ = b.shape
  low = _nibbles(b[..., 8:]).reshape(r, nb, 32)
  return (low | _fifth_bits(b[..., 4:8]) << 4).view(np.int8), _f16(b, 0), _f16(b, 2)


def _q2_k(b):
  r, nb, _ = b.shape
  scales, d, dmin = b[..., :16], _f16(b, 80), _f16(b, 82)
  codes = _fields(b[..., 16:80].reshape(r, nb, 2, 32), 4, 2).reshape(r, nb, 256)
  return codes, d * (scales & 15).astype(np.float32), -(dmin * (scales >> 4).astype(np.float32))


def _q3_k(b):
  r, nb, _ = b.shape
  sc = b[..., 96:108]
  # 16 six-bit scales: low nibbles in bytes 0..7 (low halves first), top two bits in 8..11.
  six = (_nibbles(sc[..., :8]).reshape(r, nb, 16)
         | _fields(sc[..., 8:], 4, 2).reshape(r, nb, 16) << 4)
  dl = _f16(b, 108) * (six.astype(np.int8) - 32).astype(np.float32)
  low = _fields(b[..., 32:96].reshape(r, nb, 2, 32), 4, 2).reshape(r, nb, 256)
  high = _fields(b[..., :32], 8, 1).reshape(r, nb, 256)
  # gguf-py: q = low - 4 * (1 - high), in -4..3; stored shifted by 4 to fit unsigned 4 bits.
  return low | high << 2, dl, -4 * dl


def _k_scales(b):
  """Q4_K/Q5_K's 8 six-bit sub-block scales and mins from bytes 4..15: [R, nb, 8] each."""
  s = b[..., 4:16].reshape(*b.shape[:2], 3, 4)
  lo, mn, top = s[..., 0, :], s[..., 1, :], s[..., 2, :]
  sc = np.concatenate([lo & 63, (top & 15) | ((lo >> 2) & 48)], axis=-1)
  m = np.concatenate([mn & 63, (top >> 4) | ((mn >> 2) & 48)], axis=-1)
  return sc.astype(np.float32), m.astype(np.float32)


def _q4_k(b):
  r, nb, _ = b.shape
  sc, m = _k_scales(b)
  codes = _nibbles(b[..., 16:].reshape(r, nb, 4, 32)).reshape(r, nb, 256)
  return codes, _f16(b, 0) * sc, -(_f16(b, 2) * m)


def _q5_k(b):
  r, nb, _ = b.shape
  sc, m = _k_scales(b)
  low = _nibbles(b[..., 48:].reshape(r, nb, 4, 32)).reshape(r, nb, 256)
  high = _fields(b[..., 16:48], 8, 1).reshape(r, nb, 256)
  return (low | high << 4).view(np.int8), _f16(b, 0) * sc, -(_f16(b, 2) * m)


def _q6_k(b):
  r, nb, _ = b.shape
  low = _nibbles(b[..., :128].reshape(r, nb, 2, 64)).reshape(r, nb, 256)
  high = _fields(b[..., 128:192].reshape(r, nb, 2, 32), 4, 2).reshape(r, nb, 256)
  d = _f16(b, 208) * b[..., 192:208].view(np.int8).astype(np.float32)
  return (low | high << 4).astype(np.int8) - 32, d, _neg_zero(d)


IQ4_TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                     np.float32)  # ggml's kvalues_iq4nl


def _iq4_nl(b):  # byte j of a block: value j low, j + 16 high (the format's own packing)
  d = _f16(b, 0)
  return b[..., 2:], d, None


def _iq4_xs(b):
  r, nb, _ = b.shape
  d = _f16(b, 0)
  high = _fields(np.ascontiguousarray(b[..., 2:4]).view("<u2"), 8, 2).reshape(r, nb, 8)
  low = _nibbles(b[..., 4:8]).swapaxes(-1, -2).reshape(r, nb, 8)  # sub-block i: byte i // 2
  sc = (low | high.astype(np.uint8) << 4).astype(np.int8) - np.int8(32)
  return b[..., 8:], d * sc.astype(np.float32), None


def _mxfp4(b):
  e = b[..., :1].astype(np.uint32)  # ggml_e8m0_to_fp32_half's bits
  bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
  return b[..., 1:], bits.view(np.float32), None


def _nvfp4(b):
  x = b[..., :4]  # four ue4m3 scales, one per 16 values; 0 and 0x7F decode to 0
  exp, man = ((x >> 3) & 15).astype(np.int32), (x & 7).astype(np.float32)
  # (1 + man / 8) 2^(exp - 7) / 2, or man 2^-9 / 2 (subnormal): exact in float32
  d = np.where(exp == 0, man * np.float32(2.0 ** -10),
               np.ldexp(8 + man, exp - 11).astype(np.float32))
  return b[..., 4:], np.where((x == 0) | (x == 0x7F), np.float32(0), d).astype(np.float32), None


# type -> (encoder, group size, table): the codebook form, codes packed as stored
_CODEBOOK_ENCODERS: dict[GGMLQuantizationType, tuple[Encoder, int, np.ndarray]] = {
    _Q.IQ4_NL: (_iq4_nl, 32, IQ4_TABLE), _Q.IQ4_XS: (_iq4_xs, 32, IQ4_TABLE),
    _Q.MXFP4: (_mxfp4, 32, E2M1_DOUBLED), _Q.NVFP4: (_nvfp4, 16, E2M1_DOUBLED),
}

# type -> (encoder, bits, group size)
_ENCODERS: dict[GGMLQuantizationType, tuple[Encoder, int, int]] = {
    _Q.Q8_0: (_q8_0, 8, 32), _Q.Q4_0: (_q4_0, 4, 32), _Q.Q4_1: (_q4_1, 4, 32),
    _Q.Q5_0: (_q5_0, 8, 32), _Q.Q5_1: (_q5_1, 8, 32), _Q.Q2_K: (_q2_k, 4, 16),
    _Q.Q3_K: (_q3_k, 4, 16), _Q.Q4_K: (_q4_k, 4, 32), _Q.Q5_K: (_q5_k, 8, 32),
    _Q.Q6_K: (_q6_k, 8, 16),
}
REENCODED_TYPES = tuple(_ENCODERS) + tuple(_CODEBOOK_ENCODERS)
_PACKED = (_Q.Q4_0, _Q.Q4_1)  # codes come out already packed


def why_not_groupwise(qtype: GGMLQuantizationType) -> str | None:
  """None when tensors of `qtype` re-encode exactly, else the reason they do not."""
  if qtype in _ENCODERS or qtype in _CODEBOOK_ENCODERS:
    return None
  if qtype in FLOAT_TYPES:
    return "it is stored as floats"
  if qtype.name.startswith(("IQ1", "IQ2", "IQ3")):
    return _CODEBOOK
  return _WHY_NOT.get(qtype, "it is not a block-quantized type jinfer re-encodes")


def _type_error(t: GGUFTensor, why: str, source: str) -> WeightError:
  supported = ", ".join(q.name for q in REENCODED_TYPES)
  return WeightError(f"{source}: tensor {t.name!r} has type {t.tensor_type.name}, which cannot "
                     f"be re-encoded group-wise: {why} (re-encoded: {supported})")


def gguf_to_groupwise(t: GGUFTensor, source: str) -> GroupwiseTensor:
  """A block-quantized GGUF tensor (rows of N, blocks along K; experts stacked in front) as
  its exact group-wise re-encoding [..., K, N]. A vector is one row: [K, 1]."""
  if (why := why_not_groupwise(t.tensor_type)) is not None:
    raise _type_error(t, why, source)
  codebook = _CODEBOOK_ENCODERS.get(t.tensor_type)
  encode, bits, g = (codebook[0], 4, codebook[1]) if codebook else _ENCODERS[t.tensor_type]
  type_size = GGML_QUANT_SIZES[t.tensor_type][1]
  data = t.data if t.data.ndim > 1 else t.data[None]  # [..., N, row bytes]
  *lead, n, row_bytes = data.shape
  codes, scale, offset = encode(data.reshape(-1, row_bytes // type_size, type_size))
  # [R, nb, ...] -> [..., N, K(/2) or K/g] -> [..., K(/2) or K/g, N]
  to_kn = lambda a: np.ascontiguousarray(a.reshape(*lead, n, -1).swapaxes(-1, -2))
  scale = to_kn(scale)
  if codebook:
    return GroupwiseTensor(q=to_kn(codes), scale=scale, offset=None, bits=4, group_size=g,
                           table=np.broadcast_to(codebook[2], (*lead, 16)).copy())
  offset = to_kn(offset)
  if t.tensor_type in _PACKED:
    return GroupwiseTensor(q=to_kn(codes), scale=scale, offset=offset, bits=bits, group_size=g)
  return GroupwiseTensor.from_codes(to_kn(codes), scale, offset, bits=bits, group_size=g)


_EXPERT_RE = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight")


def read_gguf_groupwise(path: str, *, dequantize_unsupported: bool = False
                        ) -> tuple[ModelConfig, GroupwiseWeights]:
  """A GGUF file's config and tensors: what it stores block-quantized stays quantized (keyed by
  HF module name), what it stores as floats comes back as float32 in HF layout, named as
  `load_gguf` names them (Q/K un-permuted for llama, experts fused as gate_up_proj/down_proj).

  The token embedding, when quantized, is in `linears` as "model.embed_tokens" with the
  orientation of the tied output projection, [K=hidden, N=vocab]; a lookup is a column gather.
  A quantized tensor of a type that does not re-encode raises a WeightError naming it and its
  type, unless `dequantize_unsupported`, which dequantizes that tensor alone into `floats`
  and records why in `dequantized` (for the types `gguf_file` dequantizes; others still raise
  there). Fused experts whose parts differ in format take the same path.
  """
  reader = open_gguf(path)
  config = gguf_config(reader, path)
  # llama.cpp permutes Q/K rows only for its llama architecture (see gguf_file.load_gguf).
  arch = gguf_value(reader, "general.architecture")
  permute = arch == "llama"
  linears: dict[str, GroupwiseTensor] = {}
  floats: dict[str, np.ndarray] = {}
  dequantized: dict[str, str] = {}

  def put(name: str, parts: list[GGUFTensor]) -> None:
    """Store HF tensor `name`, made of GGUF `parts` joined along the output dimension."""
    if all(p.tensor_type in FLOAT_TYPES for p in parts):
      floats[name] = _joined_floats(parts, name, path)
      if offset := stored_norm_offset(arch, name):
        floats[name] = floats[name] - np.float32(offset)
      return
    bad = next(((p, w) for p in parts if (w := why_not_groupwise(p.tensor_type))), None)
    if bad is None:
      encoded = [gguf_to_groupwise(p, path) for p in parts]
      try:
        linears[name.removesuffix(".weight")] = (
            encoded[0] if len(encoded) == 1 else concat_columns(encoded, name))
        return
      except ValueError as e:  # fused parts of different types
        error = WeightError(f"{path}: HF tensor {name!r} cannot be re-encoded group-wise: {e}")
    else:
      error = _type_error(bad[0], bad[1], path)
    if not dequantize_unsupported:
      raise error
    why = str(error).removeprefix(f"{path}: ")
    floats[name] = _joined_floats(parts, name, path)
    dequantized[name] = why

  experts: dict[int, dict[str, GGUFTensor]] = {}
  for t in reader.tensors:
    if m := _EXPERT_RE.fullmatch(t.name):
      experts.setdefault(int(m[1]), {})[m[2]] = t
      continue
    name = gguf_to_hf_name(t.name, arch)
    if name is None:
      continue  # e.g. rope_freqs: already part of the config
    is_q, is_k = ".self_attn.q_proj." in name, ".self_attn.k_proj." in name
    if permute and (is_q or is_k) and t.data.ndim > 1:
      heads = config.num_heads if is_q else config.num_kv_heads
      if t.shape[-1] != heads * config.head_dim:
        raise WeightError(f"{path}: tensor {t.name!r} has {t.shape[-1]} rows, expected "
                          f"{heads} heads x {config.head_dim}")
      # Stored rows are output channels: un-permuting them permutes our N columns.
      t = t._replace(data=_unpermute_rope(t.data, heads))
    put(name, [t])
  for layer, parts in sorted(experts.items()):
    for fused, kinds in _EXPERTS.items():
      missing = [k for k in kinds if k not in parts]
      if missing:
        raise WeightError(f"{path}: missing tensor 'blk.{layer}.{missing[0]}.weight' (part of "
                          f"HF 'model.layers.{layer}.mlp.experts.{fused}')")
      put(f"model.layers.{layer}.mlp.experts.{fused}", [parts[k] for k in kinds])
  return config, GroupwiseWeights(linears, floats, dequantized)


def _joined_floats(parts: list[GGUFTensor], name: str, source: str) -> np.ndarray:
  """float32 HF layout: [rows, cols] (experts [X, rows, cols]), parts joined along rows."""
  arrays = [_dequantized(p, source) for p in parts]
  w = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=-2)
  # llama.cpp stores the shared expert's gate as a vector; transformers' is a [1, E] linear.
  return w[None] if name.endswith("shared_expert_gate.weight") else w
