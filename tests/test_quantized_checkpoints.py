"""Quantized checkpoints read into the group-wise format without dequantizing: GGUF blocks
re-encoded exactly (against gguf-py's dequantize), AWQ/GPTQ safetensors written here with
packers that follow the published layouts (independent of the reader) and read back exactly."""
from __future__ import annotations

import json
import os
from unittest import mock

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file, save_file

from jinfer.quant.microfloat import E2M1_DOUBLED
from jinfer.weights import gguf_quantized
from jinfer.weights.gguf_file import _unpermute_rope, gguf_to_hf_name, load_gguf, open_gguf
from jinfer.weights.gguf_quantized import (IQ4_TABLE, REENCODED_TYPES, gguf_to_groupwise,
                                           read_gguf_groupwise, why_not_groupwise)
from jinfer.weights.gguf_reader import GGUFTensor
from jinfer.weights.groupwise_tensor import GroupwiseTensor
from jinfer.weights.hf_layout import WeightError
from jinfer.weights.hf_quantized import read_hf_groupwise
from tests.tiny_gguf import write_tiny_gguf

# ---------------------------------------------------------------------------------------------
# GGUF

# Byte offsets of each block's float16 scale fields (llama.cpp's block structs).
_F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
               Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
               Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
               # no float16 fields: every byte of an e8m0 / ue4m3 scale decodes to a number
               Q.MXFP4: (), Q.NVFP4: ()}
CODEBOOK_TYPES = (Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.NVFP4)
# Signed codes stored unsigned: where the code is the zero point, q * d + (-c * d) is +0.0 and
# gguf-py's d * 0 is -0.0 for a negative d (see gguf_quantized's docstring).
_SIGNED_ZERO_TYPES = (Q.Q4_0, Q.Q3_K)


def _random_blocks(rng, qtype: Q, lead: tuple[int, ...], k: int) -> np.ndarray:
  """[*lead, K/block * type size] uint8: every bit pattern, finite float16 scales of both
  signs (some zero)."""
  block, size = GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (*lead, k // block, size), dtype=np.uint8)
  for at in _F16_FIELDS[qtype]:
    d = (rng.standard_normal((*lead, k // block, 1)) * 0.02).astype(np.float16)
    d[..., ::7, :] = 0
    raw[..., at:at + 2] = d.view(np.uint8)
  if qtype == Q.MXFP4:
    # e8m0 exponents below 2 decode to float32 subnormals, which XLA's CPU and accelerator
    # kernels flush to zero (no weight is that small); from 241 up 12 * scale overflows.
    raw[..., 0] = rng.integers(2, 241, raw.shape[:-1])
  return raw.reshape(*lead, -1)


def _tensor(qtype: Q, data: np.ndarray, name: str = "blk.0.ffn_up.weight") -> GGUFTensor:
  block, size = GGML_QUANT_SIZES[qtype]
  dims = (data.shape[-1] // size * block, *data.shape[:-1][::-1])  # GGUF order: row first
  return GGUFTensor(name, qtype, dims, int(np.prod(dims)), data.nbytes, 0, data)


def _assert_exact(qtype: Q, ours: np.ndarray, ref: np.ndarray) -> None:
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  assert np.array_equal(ours, ref)
  differ = ours.view(np.uint32) != ref.view(np.uint32)
  if qtype in _SIGNED_ZERO_TYPES:
    assert np.all(ref[differ] == 0), "only the sign of a zero may differ"
  else:
    assert not differ.any(), f"{differ.sum()} values differ in their bits"


@pytest.mark.parametrize("qtype", REENCODED_TYPES, ids=lambda q: q.name)
def test_gguf_blocks_reencode_exactly(qtype):
  rng = np.random.default_rng(int(qtype))
  data = _random_blocks(rng, qtype, (24,), 512)  # N=24 rows of K=512
  w = gguf_to_groupwise(_tensor(qtype, data), "test")
  assert w.shape == (512, 24) and w.perm is None
  assert (w.bits, w.group_size) == {
      Q.Q8_0: (8, 32), Q.Q4_0: (4, 32), Q.Q4_1: (4, 32), Q.Q5_0: (8, 32), Q.Q5_1: (8, 32),
      Q.Q2_K: (4, 16), Q.Q3_K: (4, 16), Q.Q4_K: (4, 32), Q.Q5_K: (8, 32),
      Q.Q6_K: (8, 16), Q.IQ4_NL: (4, 32), Q.IQ4_XS: (4, 32), Q.MXFP4: (4, 32),
      Q.NVFP4: (4, 16)}[qtype]
  assert (w.table is not None) == (qtype in CODEBOOK_TYPES) and w.q.nbytes == 512 * 24 // (
      1 if w.bits == 8 else 2)
  ref = gguf.quants.dequantize(data, qtype).T
  _assert_exact(qtype, w.dequantize(), ref)
  if w.table is not None:  # widened to 8-bit affine codes (a stack with affine layers): exact
    _assert_exact(qtype, GroupwiseTensor.stack([w, w._as(8, w.group_size)]).dequantize()[1],
                  ref)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4],
                         ids=lambda q: q.name)
def test_gguf_quantized_floats_reencode_exactly(qtype):
  """Blocks as gguf-py's quantizer writes them, stacked experts [X, N, K] -> [X, K, N]."""
  floats = np.random.default_rng(1).standard_normal((3, 40, 256)).astype(np.float32)
  data = gguf.quants.quantize(floats, qtype)
  w = gguf_to_groupwise(_tensor(qtype, data, "blk.0.ffn_up_exps.weight"), "test")
  assert w.shape == (3, 256, 40)
  _assert_exact(qtype, w.dequantize(), gguf.quants.dequantize(data, qtype).swapaxes(-1, -2))


def test_gguf_types_that_do_not_reencode_say_why():
  assert why_not_groupwise(Q.F16) == "it is stored as floats"
  assert "ternary" in why_not_groupwise(Q.TQ2_0)
  assert "codebook" in why_not_groupwise(Q.IQ2_XXS)
  data = np.zeros((4, GGML_QUANT_SIZES[Q.IQ3_S][1]), np.uint8)
  with pytest.raises(WeightError, match=r"file.gguf: tensor 'blk.3.attn_q.weight' has type "
                                        r"IQ3_S, which cannot be re-encoded group-wise: it "
                                        r"decodes through a lattice codebook"):
    gguf_to_groupwise(_tensor(Q.IQ3_S, data, "blk.3.attn_q.weight"), "file.gguf")


def test_iq4_xs_scales_follow_ggml_layout():
  """One IQ4_XS super-block written by hand from ggml's block_iq4_xs (d, scales_h with 2 bits
  per sub-block, scales_l with 4, then 8 x 16 bytes of nibbles, value j low and j + 16 high),
  read back against a literal reading, and gguf-py's dequantization agrees."""
  rng = np.random.default_rng(5)
  ls = rng.integers(0, 64, 8)  # six-bit scales, stored + 32
  codes = rng.integers(0, 16, (8, 32))
  d = np.float16(0.01)
  scales_h = sum(int(v >> 4) << 2 * i for i, v in enumerate(ls))
  scales_l = [(ls[2 * j] & 15) | (ls[2 * j + 1] & 15) << 4 for j in range(4)]
  qs = (codes[:, :16] | codes[:, 16:] << 4).astype(np.uint8).reshape(-1)
  block = np.concatenate([np.frombuffer(d.tobytes() + np.uint16(scales_h).tobytes(), np.uint8),
                          np.array(scales_l, np.uint8), qs])[None]  # one row of 256 values
  want = (np.float32(d) * (ls - 32).astype(np.float32))[:, None] * IQ4_TABLE[codes]
  got = gguf_to_groupwise(_tensor(Q.IQ4_XS, block), "test").dequantize()[:, 0]
  np.testing.assert_array_equal(got, want.reshape(-1))
  np.testing.assert_array_equal(gguf.quants.dequantize(block, Q.IQ4_XS)[0], got)


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory) -> str:
  """A 2-layer llama file whose layers hold every type jinfer reads (tiny_gguf.MIXED_TYPES)."""
  path = str(tmp_path_factory.mktemp("gq") / "tiny-llama.gguf")
  write_tiny_gguf(path, "llama")
  return path


def test_gguf_file_reads_into_the_params_load_gguf_builds(tiny_llama_gguf):
  """Names, Q/K un-permutation and [K, N] orientation, through the existing float loader."""
  config, w = read_gguf_groupwise(tiny_llama_gguf)
  _, params = load_gguf(tiny_llama_gguf)
  e, hq, hkv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
  assert w.dequantized == {}
  kinds = {  # HF module -> (params path, our [K, N] -> params layout)
      "self_attn.q_proj": (("attn", "q_proj"), lambda a: a.reshape(e, hq, d)),
      "self_attn.k_proj": (("attn", "k_proj"), lambda a: a.reshape(e, hkv, d)),
      "self_attn.v_proj": (("attn", "v_proj"), lambda a: a.reshape(e, hkv, d)),
      "self_attn.o_proj": (("attn", "o_proj"), lambda a: a.reshape(hq, d, e)),
      "mlp.gate_proj": (("mlp", "gate_proj"), lambda a: a),
      "mlp.up_proj": (("mlp", "up_proj"), lambda a: a),
      "mlp.down_proj": (("mlp", "down_proj"), lambda a: a)}
  seen = 0
  for layer in range(config.num_layers):
    for kind, ((group, proj), to) in kinds.items():
      name = f"model.layers.{layer}.{kind}"
      want = np.asarray(params["layers"][group][proj]["kernel"][layer])
      if name in w.linears:
        seen += 1
        np.testing.assert_array_equal(to(w.linears[name].dequantize()), want)
      else:  # F16 / BF16 / F32 layers come back as floats, HF layout
        np.testing.assert_array_equal(to(w.floats[name + ".weight"].T), want)
  assert seen == 11  # 14 projections, 3 of them stored as floats
  np.testing.assert_array_equal(w.linears["model.embed_tokens"].dequantize().T,
                                np.asarray(params["embedding"]))
  np.testing.assert_array_equal(w.linears["lm_head"].dequantize(),
                                np.asarray(params["lm_head"]["kernel"]))
  np.testing.assert_array_equal(w.floats["model.norm.weight"], np.asarray(params["norm"]["scale"]))


def test_gguf_unsupported_type_raises_or_falls_back_when_asked(tiny_llama_gguf):
  # blk.1.attn_output is Q5_K: pretend Q5_K does not re-encode.
  with mock.patch.dict(gguf_quantized._ENCODERS):
    del gguf_quantized._ENCODERS[Q.Q5_K]
    with pytest.raises(WeightError, match=r"tensor 'blk.1.attn_output.weight' has type Q5_K, "
                                          r"which cannot be re-encoded group-wise"):
      read_gguf_groupwise(tiny_llama_gguf)
    _, w = read_gguf_groupwise(tiny_llama_gguf, dequantize_unsupported=True)
  name = "model.layers.1.self_attn.o_proj.weight"
  assert list(w.dequantized) == [name] and "Q5_K" in w.dequantized[name]
  assert "model.layers.1.self_attn.o_proj" not in w.linears
  t = next(t for t in open_gguf(tiny_llama_gguf).tensors if t.name == "blk.1.attn_output.weight")
  np.testing.assert_array_equal(w.floats[name], gguf.quants.dequantize(t.data, Q.Q5_K))


@pytest.mark.parametrize("up_type", [Q.Q4_K, Q.Q6_K], ids=["same-format", "mixed"])
def test_gguf_stacked_experts_fuse_along_n(tmp_path, up_type):
  """blk.N.ffn_{gate,up}_exps [X, F, H] fuse into experts.gate_up_proj [X, H, 2F] (gate first)
  when their formats agree; otherwise the fused tensor is an error or, when asked, floats."""
  rng = np.random.default_rng(6)
  x, f, h = 3, 32, 256
  raw = {"ffn_gate_exps": _random_blocks(rng, Q.Q4_K, (x, f), h),
         "ffn_up_exps": _random_blocks(rng, up_type, (x, f), h),
         "ffn_down_exps": _random_blocks(rng, Q.Q5_K, (x, h), 256)}
  types = {"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": up_type, "ffn_down_exps": Q.Q5_K}
  path = str(tmp_path / "experts.gguf")

  def add(w):
    for kind, data in raw.items():
      w.add_tensor(f"blk.0.{kind}.weight", data, raw_dtype=types[kind])
  write_tiny_gguf(path, "llama", extra=add)
  ref = {k: gguf.quants.dequantize(v, types[k]) for k, v in raw.items()}  # [X, rows, cols]
  gate_up = "model.layers.0.mlp.experts.gate_up_proj"
  if up_type == Q.Q4_K:
    _, w = read_gguf_groupwise(path)
    np.testing.assert_array_equal(
        w.linears[gate_up].dequantize(),
        np.concatenate([ref["ffn_gate_exps"], ref["ffn_up_exps"]], axis=1).swapaxes(1, 2))
  else:
    with pytest.raises(WeightError, match=rf"HF tensor '{gate_up}' cannot be re-encoded "
                                          r"group-wise: .*cannot be joined"):
      read_gguf_groupwise(path)
    _, w = read_gguf_groupwise(path, dequantize_unsupported=True)
    assert list(w.dequantized) == [gate_up]
    np.testing.assert_array_equal(
        w.floats[gate_up], np.concatenate([ref["ffn_gate_exps"], ref["ffn_up_exps"]], axis=1))
  np.testing.assert_array_equal(w.linears["model.layers.0.mlp.experts.down_proj"].dequantize(),
                                ref["ffn_down_exps"].swapaxes(1, 2))


def test_gguf_row_the_block_does_not_divide_is_a_precise_error(tmp_path):
  """An IQ4_XS tensor whose rows (128 values) are half its 256-value block: a WeightError
  naming the file, the tensor and the block, before any weight is read."""
  import struct
  path, name = str(tmp_path / "odd.gguf"), b"blk.0.ffn_up_exps.weight"
  write_tiny_gguf(path, "llama", extra=lambda w: w.add_tensor(
      name.decode(), np.zeros((2, 136), np.uint8), raw_dtype=Q.IQ4_XS))
  raw = bytearray(open(path, "rb").read())  # the writer refuses such a shape: patch its dims
  at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
  assert struct.unpack_from("<I2Q", raw, at) == (2, 256, 2)
  struct.pack_into("<2Q", raw, at + 4, 128, 4)
  open(path, "wb").write(raw)
  with pytest.raises(WeightError, match=r"odd.gguf: .*tensor 'blk.0.ffn_up_exps.weight': "
                                        r".*row size \(128\) is not a multiple of IQ4_XS block "
                                        r"size \(256\)"):
    read_gguf_groupwise(path)


@pytest.mark.slow
def test_gguf_codebook_file_runs_kept_as_dequantized(tmp_path):
  """A file whose layers are IQ4_NL / IQ4_XS / MXFP4 / NVFP4 (tiny_gguf.CODEBOOK_LAYER_TYPES),
  loaded with its blocks kept: stacks of codebook layers stay codebook weights (per-layer
  tables, the smaller group size), stacks with affine layers widen to 8-bit codes, and the
  model's logits are those of the file dequantized by gguf-py."""
  from jinfer.loader import load_model
  from jinfer.quant.groupwise import GroupwiseArray
  from tests.test_gguf import _logits
  from tests.tiny_gguf import CODEBOOK_LAYER_TYPES
  path = str(tmp_path / "codebook.gguf")
  write_tiny_gguf(path, "llama", layer_types=CODEBOOK_LAYER_TYPES)
  config, kept, _ = load_model(path, load_tokenizer=False, keep_gguf_quantized=True)
  _, floats = load_gguf(path)
  layers = kept["layers"]
  form = lambda w: (w.bits, w.group_size, w.table is not None)
  assert form(layers["attn"]["q_proj"]["kernel"]) == (4, 32, True)
  assert form(layers["attn"]["o_proj"]["kernel"]) == (4, 16, True)  # NVFP4 + IQ4_NL
  assert form(layers["mlp"]["gate_proj"]["kernel"]) == (4, 32, True)  # IQ4_XS + MXFP4
  assert form(layers["mlp"]["down_proj"]["kernel"]) == (8, 32, False)  # Q4_K + IQ4_NL
  assert isinstance(layers["attn"]["k_proj"]["kernel"], GroupwiseArray)
  gate_tables = np.asarray(layers["mlp"]["gate_proj"]["kernel"].table)
  np.testing.assert_array_equal(gate_tables, np.stack([IQ4_TABLE, E2M1_DOUBLED]))
  ids = list(range(3, 40))
  np.testing.assert_allclose(_logits(config, kept, ids), _logits(config, floats, ids),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_builtin_smollm2_reencodes_exactly_and_small(smollm2_gguf):
  config, w = read_gguf_groupwise(smollm2_gguf)
  assert w.dequantized == {}
  tensors = {t.name: t for t in open_gguf(smollm2_gguf).tensors}
  quantized = {n for n, t in tensors.items() if t.tensor_type not in gguf_quantized.FLOAT_TYPES}
  assert len(w.linears) == len(quantized) == 211  # 30 layers x 7 projections + the embedding
  for name in quantized:
    t = tensors[name]
    hf = gguf_to_hf_name(name).removesuffix(".weight")
    data = t.data
    if hf.endswith((".q_proj", ".k_proj")):
      data = _unpermute_rope(data, config.num_heads if hf.endswith("q_proj") else
                             config.num_kv_heads)
    _assert_exact(t.tensor_type, w.linears[hf].dequantize(),
                  gguf.quants.dequantize(data, t.tensor_type).T)
  projections = [v for k, v in w.linears.items() if k != "model.embed_tokens"]
  ratio = (sum(v.nbytes for v in projections)
           / sum(4 * int(np.prod(v.shape)) for v in projections))
  everything = (sum(v.nbytes for v in w.linears.values())
                / sum(4 * int(np.prod(v.shape)) for v in w.linears.values()))
  print(f"re-encoded / float32 bytes: projections {ratio:.4f}, with the embedding "
        f"{everything:.4f}")
  assert ratio <= 0.22 and everything <= 0.22


# ---------------------------------------------------------------------------------------------
# AWQ / GPTQ: packers written from the published layouts, independent of the reader.

_AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i holds column 8c + order[i]


def awq_pack(ints: np.ndarray) -> np.ndarray:  # [R, C] in 0..15 -> [R, C/8] int32
  words = np.zeros((ints.shape[0], ints.shape[1] // 8), np.uint32)
  for c in range(words.shape[1]):
    for i, col in enumerate(_AWQ_PACK_ORDER):
      words[:, c] |= ints[:, 8 * c + col].astype(np.uint32) << (4 * i)
  return words.view(np.int32)


def gptq_pack_rows(ints: np.ndarray) -> np.ndarray:  # qweight: [K, N] -> [K/8, N] int32
  words = np.zeros((ints.shape[0] // 8, ints.shape[1]), np.uint32)
  for r in range(words.shape[0]):
    for i in range(8):
      words[r] |= ints[8 * r + i].astype(np.uint32) << (4 * i)
  return words.view(np.int32)


def gptq_pack_columns(ints: np.ndarray) -> np.ndarray:  # qzeros: [G, N] -> [G, N/8] int32
  return gptq_pack_rows(ints.T).T.copy()


K, N, LAYERS = 128, 64, 2
PROJ = "model.layers.{}.self_attn.q_proj"


def _write_dir(path, quant_config: dict, tensors: dict[str, np.ndarray]) -> str:
  os.makedirs(path, exist_ok=True)
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": K,
            "quantization_config": quant_config}
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(config, fh)
  save_file(tensors, os.path.join(path, "model.safetensors"))
  return str(path)


def _floats(rng) -> dict[str, np.ndarray]:
  """Tensors a quantized checkpoint keeps as floats."""
  return {"model.embed_tokens.weight": rng.standard_normal((32, K)).astype(np.float16),
          "model.norm.weight": np.ones(K, np.float16),
          "lm_head.weight": rng.standard_normal((32, K)).astype(np.float16),
          PROJ.format(0) + ".bias": rng.standard_normal(N).astype(np.float16)}


def _known_layer(rng, g: int, zeros: str):
  """Integer codes q [K, N], zeros [K/g, N] and float16 scales [K/g, N]."""
  q = rng.integers(0, 16, (K, N))
  z = np.full((K // g, N), 8) if zeros == "sym" else rng.integers(0, 16, (K // g, N))
  s = (rng.random((K // g, N)) * 0.02 + 1e-3).astype(np.float16)
  return q, z, s


def _hand_dequantize(q, z, s, g_idx):  # scales * (q - zeros), row by row through g_idx
  return s.astype(np.float32)[g_idx] * (q - z[g_idx]).astype(np.float32)


def _awq_checkpoint(tmp_path, rng, g=32, **config):
  tensors, want = _floats(rng), {}
  for layer in range(LAYERS):
    q, z, s = _known_layer(rng, g, "asym")
    p = PROJ.format(layer)
    tensors |= {p + ".qweight": awq_pack(q), p + ".qzeros": awq_pack(z), p + ".scales": s}
    want[p] = _hand_dequantize(q, z, s, np.arange(K) // g)
  qc = {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
        "version": "gemm"} | config
  return _write_dir(tmp_path / "awq", qc, tensors), tensors, want


def test_awq_reads_exactly(tmp_path):
  rng = np.random.default_rng(0)
  path, tensors, want = _awq_checkpoint(tmp_path, rng)
  w = read_hf_groupwise(path)
  assert sorted(w.linears) == sorted(want)
  for name, ref in want.items():
    t = w.linears[name]
    assert (t.bits, t.group_size, t.shape, t.perm) == (4, 32, (K, N), None)
    np.testing.assert_array_equal(t.dequantize(), ref)
  assert sorted(w.floats) == sorted(_floats(rng))
  for name, arr in w.floats.items():
    np.testing.assert_array_equal(arr, tensors[name])


def _gptq_checkpoint(tmp_path, rng, *, zeros: str, fmt: str, act_order: bool, g: int = 32):
  tensors, want = _floats(rng), {}
  for layer in range(LAYERS):
    q, z, s = _known_layer(rng, g, zeros)
    if fmt == "gptq":
      z = np.maximum(z, 1)  # v1 stores zero - 1 in 4 bits: zeros are 1..16
    g_idx = np.arange(K) // g
    if act_order:  # GPTQ's desc_act: groups are formed in a shuffled column order
      g_idx = np.empty(K, np.int64)
      g_idx[rng.permutation(K)] = np.arange(K) // g
    p = PROJ.format(layer)
    stored_z = z - 1 if fmt == "gptq" else z
    tensors |= {p + ".qweight": gptq_pack_rows(q), p + ".qzeros": gptq_pack_columns(stored_z),
                p + ".scales": s, p + ".g_idx": g_idx.astype(np.int32)}
    want[p] = (_hand_dequantize(q, z, s, g_idx), q, g_idx)
  qc = {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": act_order,
        "sym": zeros == "sym", "checkpoint_format": fmt}
  return _write_dir(tmp_path / "gptq", qc, tensors), want


@pytest.mark.parametrize("zeros", ["sym", "asym"])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "desc_act"])
def test_gptq_reads_exactly(tmp_path, zeros, fmt, act_order):
  rng = np.random.default_rng(1)
  path, want = _gptq_checkpoint(tmp_path, rng, zeros=zeros, fmt=fmt, act_order=act_order)
  w = read_hf_groupwise(path)
  assert sorted(w.linears) == sorted(want)
  x = rng.standard_normal((3, K)).astype(np.float32)
  for name, (ref, q, g_idx) in want.items():
    t = w.linears[name]
    np.testing.assert_array_equal(t.dequantize(), ref)
    if not act_order:
      assert t.perm is None
      continue
    # Stored rows are whole groups in order; the caller permutes the activations.
    assert np.array_equal(g_idx[t.perm], np.arange(K) // 32)
    stored = GroupwiseTensor(q=t.q, scale=t.scale, offset=t.offset, bits=4,
                             group_size=32).dequantize()
    np.testing.assert_array_equal(stored, ref[t.perm])
    np.testing.assert_allclose(x[:, t.perm] @ stored, x @ ref, rtol=1e-5, atol=1e-5)


def test_gptq_one_group_over_k(tmp_path):
  rng = np.random.default_rng(2)
  q, z, s = _known_layer(rng, K, "asym")
  p = PROJ.format(0)
  path = _write_dir(tmp_path / "g", {"quant_method": "gptq", "bits": 4, "group_size": -1,
                                     "checkpoint_format": "gptq_v2"},
                    {p + ".qweight": gptq_pack_rows(q), p + ".qzeros": gptq_pack_columns(z),
                     p + ".scales": s})  # no g_idx: groups in order
  t = read_hf_groupwise(path).linears[p]
  assert t.group_size == K
  np.testing.assert_array_equal(t.dequantize(), _hand_dequantize(q, z, s, np.zeros(K, int)))


@pytest.mark.parametrize("change, message", [
    ({"bits": 3}, r"quantization_config.bits=3: only 4-bit GPTQ checkpoints are supported"),
    ({"quant_method": "bitsandbytes"},
     r"quantization_config.quant_method='bitsandbytes' is not supported \(supported: awq, gptq\)"),
    ({"group_size": 48}, r"quantization_config.group_size=48 does not divide the 128 input rows "
                         r"of 'model.layers.0.self_attn.q_proj.qweight'"),
    ({"checkpoint_format": "marlin"},
     r"quantization_config.checkpoint_format='marlin' is not supported"),
])
def test_bad_gptq_config_is_a_precise_error(tmp_path, change, message):
  path, _ = _gptq_checkpoint(tmp_path, np.random.default_rng(3), zeros="asym", fmt="gptq",
                             act_order=False)
  with open(os.path.join(path, "config.json")) as fh:
    config = json.load(fh)
  config["quantization_config"] |= change
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(config, fh)
  with pytest.raises(WeightError, match=message):
    read_hf_groupwise(path)


def test_bad_awq_tensors_are_precise_errors_before_any_weight_is_read(tmp_path):
  rng = np.random.default_rng(4)
  path, tensors, _ = _awq_checkpoint(tmp_path, rng)
  with pytest.raises(WeightError, match=r"quantization_config.version='gemv': only AWQ's GEMM"):
    read_hf_groupwise(_awq_checkpoint(tmp_path / "v", rng, version="gemv")[0])
  p = PROJ.format(1)
  cases = [
      ({k: v for k, v in tensors.items() if k != p + ".qzeros"},
       rf"AWQ layer '{p}' has no tensor '{p}.qzeros'"),
      (tensors | {p + ".scales": tensors[p + ".scales"][:2]},
       rf"tensor '{p}.scales' has shape \[2, 64\], expected \[4, 64\]"),
      (tensors | {p + ".qweight": tensors[p + ".qweight"].astype(np.int64)},
       rf"tensor '{p}.qweight' is I64 \[128, 8\], expected a 2-D I32 tensor"),
  ]
  for i, (bad, message) in enumerate(cases):
    save_file(bad, os.path.join(path, "model.safetensors"))
    # Layer 1 is the bad one: layer 0 must not have been decoded by the time it is found.
    with mock.patch.object(GroupwiseTensor, "from_codes") as decode:
      with pytest.raises(WeightError, match=message):
        read_hf_groupwise(path)
    decode.assert_not_called()


def test_gptq_g_idx_that_breaks_groups_is_a_precise_error(tmp_path):
  path, _ = _gptq_checkpoint(tmp_path, np.random.default_rng(5), zeros="asym", fmt="gptq_v2",
                             act_order=True)
  tensors = load_file(os.path.join(path, "model.safetensors"))
  p = PROJ.format(0)
  tensors[p + ".g_idx"] = np.zeros(K, np.int32)  # every row in group 0
  save_file(tensors, os.path.join(path, "model.safetensors"))
  with pytest.raises(WeightError, match=rf"tensor '{p}.g_idx' does not put exactly "
                                        r"quantization_config.group_size=32 rows in each of the "
                                        r"4 groups"):
    read_hf_groupwise(path)


def test_missing_quantization_config_is_a_precise_error(tmp_path):
  path = _write_dir(tmp_path / "plain", None, {"lm_head.weight": np.zeros((2, 2), np.float32)})
  with pytest.raises(WeightError, match=r"config.json: no quantization_config: not an AWQ or "
                                        r"GPTQ checkpoint"):
    read_hf_groupwise(path)
