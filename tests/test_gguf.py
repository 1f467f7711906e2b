"""GGUF loading: tiny random files of every supported architecture and storage type against HF
transformers' own GGUF loader, the real SmolLM2 file, and the errors bad files raise."""
from __future__ import annotations

import math
import os
import struct

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jinfer.models import CausalLM, param_shapes
from jinfer.weights import gguf_file
from jinfer.weights.gguf_file import (gguf_array_len, gguf_to_hf_name, gguf_value, load_gguf,
                                     open_gguf)
from jinfer.weights.gguf_reader import GGUFFile
from jinfer.weights.hf_layout import WeightError, hf_to_params
from pallas_kernels import AttentionMetadata, KVCacheSpec
from tests.tiny_gguf import HIDDEN, SHAPES, write_tiny_gguf

V = gguf.GGUFValueType

PAGE_SIZE = 16


def _logits(config, params, ids: list[int]) -> np.ndarray:  # [T, V]: one sequence, all rows
  t = len(ids)
  pages = -(-t // PAGE_SIZE)
  spec = KVCacheSpec(num_layers=config.num_layers, num_pages=1 + pages, page_size=PAGE_SIZE,
                     num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
  md = AttentionMetadata(
      slot_mapping=jnp.arange(PAGE_SIZE, PAGE_SIZE + t, dtype=jnp.int32),  # pages 1.. in order
      block_table=jnp.arange(1, 1 + pages, dtype=jnp.int32)[None], kv_lens=jnp.array([t], jnp.int32),
      cu_q_lens=jnp.array([0, t], jnp.int32), num_seqs=jnp.array([1], jnp.int32), max_q_len=t)
  # Jitted: op-by-op dispatch of 30 layers' attention loops is several times slower here.
  logits, _, _ = jax.jit(CausalLM(config).apply)({"params": params}, jnp.asarray(ids, jnp.int32),
                                              jnp.arange(t, dtype=jnp.int32), spec.allocate(), md)
  return np.asarray(logits)


def _hf_from_gguf(path: str):
  folder, name = os.path.split(path)
  return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                           dtype=torch.float32).eval()


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
  with torch.no_grad():
    return hf(torch.tensor([ids])).logits[0].numpy()


# (architecture, tied embeddings): Llama undoes llama.cpp's Q/K permutation, Qwen2 has biases,
# Qwen3 has q/k norms and a head dim that is not hidden / heads.
VARIANTS = [("llama", False), ("qwen2", True), ("qwen3", False)]


@pytest.fixture(scope="module", params=VARIANTS, ids=[a for a, _ in VARIANTS])
def tiny(request, tmp_path_factory):
  arch, tied = request.param
  path = str(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf")
  write_tiny_gguf(path, arch, tied=tied)
  config, params = load_gguf(path)
  return path, config, params, _hf_from_gguf(path)


def test_tiny_config(tiny):
  path, config, _, hf = tiny
  heads, kv_heads, head_dim = SHAPES[config.architecture]
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (heads, kv_heads, head_dim)
  assert config.hidden_size == HIDDEN and config.num_layers == 2 and config.vocab_size == 96
  assert config.tie_word_embeddings == hf.config.tie_word_embeddings
  assert config.rope_theta == 50000.0 and config.rms_norm_eps == pytest.approx(1e-5)
  assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


def test_params_equal_transformers_dequantized_tensors(tiny):
  """Every storage type, the renaming and the Q/K un-permutation match transformers bit for bit
  (transformers dequantizes with gguf.quants.dequantize too)."""
  _, config, params, hf = tiny
  state = {k: v.numpy() for k, v in hf.state_dict().items()}
  expected = hf_to_params(config, state.__getitem__, source="transformers")
  jax.tree.map(np.testing.assert_array_equal, params, expected)


def test_logits_match_transformers(tiny):
  _, config, params, hf = tiny
  ids = np.random.default_rng(0).integers(0, config.vocab_size, 21).tolist()
  ours, ref = _logits(config, params, ids), _hf_logits(hf, ids)
  np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)


def test_unquantized_llama_reproduces_hf_weights_exactly(tmp_path):
  """Independent of transformers: llama.cpp's permutation written, ours undoes it exactly."""
  path = str(tmp_path / "f32.gguf")
  originals = write_tiny_gguf(path, "llama", all_f32=True)
  config, params = load_gguf(path)
  expected = hf_to_params(config, {gguf_to_hf_name(k): v for k, v in originals.items()}.__getitem__,
                          source="originals")
  jax.tree.map(np.testing.assert_array_equal, params, expected)


def _llama_cpp_rope_factors(theta: float, dim: int, factor: float) -> np.ndarray:
  """llama.cpp convert_hf_to_gguf's `rope_freqs` for Llama 3.1 scaling (lo 1, hi 4, 8192)."""
  freqs = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
  out = []
  for f in freqs:
    wavelen = 2 * math.pi / f
    if wavelen < 8192 / 4:
      out.append(1.0)
    elif wavelen > 8192 / 1:
      out.append(factor)
    else:
      smooth = (8192 / wavelen - 1) / (4 - 1)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.array(out, np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
  path = str(tmp_path / "rope.gguf")
  factors = _llama_cpp_rope_factors(50000.0, 64, 8.0)
  assert (factors == 1).any() and (factors == 8).any() and ((factors > 1) & (factors < 8)).any()
  write_tiny_gguf(path, "llama", extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
  config, _ = load_gguf(path)
  assert config.rope_scaling_dict == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}

  bad = str(tmp_path / "bad-rope.gguf")
  write_tiny_gguf(bad, "llama", extra=lambda w: w.add_tensor("rope_freqs.weight", factors[::-1].copy()))
  with pytest.raises(WeightError, match="rope_freqs"):
    load_gguf(bad)


def test_joined_rows_dequantize_as_gguf_py(tmp_path):
  """Short rows are joined before gguf.quants.dequantize (97 rows join with no other)."""
  path = str(tmp_path / "rows.gguf")
  write_tiny_gguf(path, "llama", replace={"output.weight": np.ones((97, HIDDEN), np.float32)})
  for t in open_gguf(path).tensors:
    np.testing.assert_array_equal(gguf_file._dequantized(t, path),
                                  gguf.quants.dequantize(t.data, t.tensor_type), err_msg=t.name)


# --- the GGUF reader against gguf-py's GGUFReader ----------------------------------------------


def assert_reader_matches_gguf_py(path: str) -> None:
  """Every metadata key, value (as Python, element types included) and type list, and every
  tensor's info and data view, as gguf-py's GGUFReader gives them."""
  ours, ref = GGUFFile(path), gguf.GGUFReader(path)
  assert list(ours.fields) == list(ref.fields)
  for key, field in ref.fields.items():
    mine = ours.fields[key]
    assert mine.types == tuple(field.types), key
    got, want = mine.contents(), field.contents()
    assert got == want, key
    assert [type(v) for v in (got if isinstance(got, list) else [got])] == \
        [type(v) for v in (want if isinstance(want, list) else [want])], key
  assert (ours.alignment, ours.data_offset) == (ref.alignment, ref.data_offset)
  assert len(ours.tensors) == len(ref.tensors)
  for mine, t in zip(ours.tensors, ref.tensors):
    assert (mine.name, mine.tensor_type, mine.shape, mine.n_elements, mine.n_bytes,
            mine.data_offset) == (t.name, t.tensor_type, tuple(t.shape.tolist()), t.n_elements,
                                  t.n_bytes, t.data_offset)
    assert (mine.data.shape, mine.data.dtype) == (t.data.shape, t.data.dtype), t.name
    assert mine.data.tobytes() == t.data.tobytes(), t.name


def _add_every_value_type(w: gguf.GGUFWriter) -> None:
  for vtype, value in [(V.UINT8, 255), (V.INT8, -128), (V.UINT16, 65535), (V.INT16, -32768),
                       (V.UINT32, 2**32 - 1), (V.INT32, -2**31), (V.UINT64, 2**64 - 1),
                       (V.INT64, -2**63), (V.FLOAT32, 0.1), (V.FLOAT64, 0.1), (V.BOOL, True),
                       (V.STRING, "naïve ☃ \x00 \n")]:
    w.add_key_value(f"test.{vtype.name.lower()}", value, vtype)
    w.add_key_value(f"test.array.{vtype.name.lower()}",
                    [value, value] if vtype != V.BOOL else [True, False, True], V.ARRAY,
                    sub_type=vtype)
  w.add_key_value("test.string.empty", "", V.STRING)
  w.add_array("test.array.nested", [[1, 2, 3], [4], [5, 6]])
  w.add_array("test.array.nested_strings", [["a", "bc"], ["", "日本"]])
  w.add_array("test.array.deeply_nested", [[[1.5], [2.5, 3.5]], [[4.5]]])
  w.add_array("test.array.bytes", b"\x00\x01\xff")


READER_FILES = {
    "llama": lambda p: write_tiny_gguf(p, "llama"),
    "qwen2-tied": lambda p: write_tiny_gguf(p, "qwen2", tied=True),
    "qwen3": lambda p: write_tiny_gguf(p, "qwen3"),
    "f32": lambda p: write_tiny_gguf(p, "llama", all_f32=True),
    "every-value-type": lambda p: write_tiny_gguf(p, "llama", extra=_add_every_value_type),
    "alignment-64": lambda p: write_tiny_gguf(p, "llama",
                                              extra=lambda w: w.add_custom_alignment(64)),
    "other-storage-types": lambda p: write_tiny_gguf(p, "llama", replace={
        "blk.0.attn_norm.weight": np.arange(HIDDEN, dtype=np.int32),
        "blk.0.ffn_norm.weight": np.linspace(0, 1, HIDDEN, dtype=np.float64),
        "blk.1.attn_norm.weight": np.arange(HIDDEN, dtype=np.int8),
        "blk.1.ffn_norm.weight": np.arange(HIDDEN, dtype=np.int16)[None, :, None],  # 3-D
        "output_norm.weight": np.arange(HIDDEN, dtype=np.int64)}),
}


@pytest.mark.parametrize("kind", READER_FILES)
def test_reader_matches_gguf_py(tmp_path, kind):
  path = str(tmp_path / f"{kind}.gguf")
  READER_FILES[kind](path)
  assert_reader_matches_gguf_py(path)


def test_reader_reads_big_endian_files(tmp_path):
  path = str(tmp_path / "be.gguf")
  w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
  _add_every_value_type(w)
  a = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
  w.add_tensor("a.weight", a)
  w.add_tensor("b.weight", a.astype(np.float16))
  w.add_tensor("c.weight", gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
               raw_dtype=gguf.GGMLQuantizationType.Q8_0)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  assert_reader_matches_gguf_py(path)
  reader = GGUFFile(path)
  assert reader.byte_order == ">" and gguf_value(reader, "test.uint16") == 65535
  np.testing.assert_array_equal(reader.tensors[0].data, a)


def test_reader_reads_version_2(tmp_path):
  path = str(tmp_path / "v2.gguf")
  write_tiny_gguf(path, "llama")
  with open(path, "r+b") as fh:
    fh.seek(4)
    fh.write(struct.pack("<I", 2))  # version 2's layout is version 3's
  assert_reader_matches_gguf_py(path)
  assert gguf_value(open_gguf(path), "GGUF.version") == 2


def _handmade_gguf(path: str, kvs: list[tuple[str, int, bytes]], version: int = 3) -> None:
  """A GGUF file without tensors, metadata given as (key, value type, encoded value)."""
  out = struct.pack("<IIQQ", gguf.GGUF_MAGIC, version, 0, len(kvs))
  for key, vtype, payload in kvs:
    out += struct.pack("<Q", len(key.encode())) + key.encode() + struct.pack("<I", vtype) + payload
  with open(path, "wb") as fh:
    fh.write(out)


def test_reader_reads_empty_arrays(tmp_path):
  """gguf-py's writer refuses empty arrays, so this file is put together by hand."""
  path = str(tmp_path / "empty.gguf")
  inner = struct.pack("<IQ", V.INT32, 0) + struct.pack("<IQi", V.INT32, 1, 7)
  _handmade_gguf(path, [("a.uint8", V.ARRAY, struct.pack("<IQ", V.UINT8, 0)),
                        ("a.string", V.ARRAY, struct.pack("<IQ", V.STRING, 0)),
                        ("a.array", V.ARRAY, struct.pack("<IQ", V.ARRAY, 0)),
                        ("a.nested", V.ARRAY, struct.pack("<IQ", V.ARRAY, 2) + inner)])
  assert_reader_matches_gguf_py(path)
  reader = open_gguf(path)
  assert gguf_value(reader, "a.string") == [] and gguf_array_len(reader, "a.string") == 0
  assert gguf_value(reader, "a.nested") == [7]


@pytest.mark.slow
def test_reader_matches_gguf_py_on_smollm2(smollm2_gguf):
  assert_reader_matches_gguf_py(smollm2_gguf)


def test_metadata_lists_are_fresh_copies(tmp_path):
  """Callers may edit what gguf_value returns; the cached reader must not change."""
  path = str(tmp_path / "tiny.gguf")
  write_tiny_gguf(path, "llama")
  reader = open_gguf(path)
  tokens = gguf_value(reader, "tokenizer.ggml.tokens")
  tokens[0] = "changed"
  assert gguf_value(reader, "tokenizer.ggml.tokens")[0] == "<t0>"
  assert gguf_array_len(reader, "tokenizer.ggml.tokens") == 96
  assert gguf_array_len(reader, "llama.block_count") == 1  # a scalar counts as one, as in gguf-py
  assert gguf_array_len(reader, "no.such.key") is None and gguf_value(reader, "no.such.key", 5) == 5


def test_readers_are_cached_per_file_version(tmp_path):
  path = str(tmp_path / "tiny.gguf")
  write_tiny_gguf(path, "llama")
  first = open_gguf(path)
  assert open_gguf(path) is first
  write_tiny_gguf(path, "qwen2")
  assert gguf_value(open_gguf(path), "general.architecture") == "qwen2"


# --- errors -----------------------------------------------------------------------------------


def test_truncated_file_names_file_and_tensor(tmp_path):
  path = str(tmp_path / "cut.gguf")
  write_tiny_gguf(path, "llama")
  size = os.path.getsize(path)
  with open(path, "r+b") as fh:
    fh.truncate(size - 1000)  # the last tensor, output.weight, loses its tail
  with pytest.raises(WeightError, match=rf"{path}: truncated or corrupt .*tensor 'output\.weight'"):
    load_gguf(path)
  with open(path, "r+b") as fh:
    fh.truncate(200)  # inside the metadata
  with pytest.raises(WeightError, match=rf"{path}: truncated or corrupt"):
    load_gguf(path)


def test_not_a_gguf_file(tmp_path):
  path = tmp_path / "x.gguf"
  path.write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(WeightError, match="truncated or corrupt"):
    load_gguf(str(path))


def test_every_truncation_and_corruption_is_a_weight_error(tmp_path):
  """Cut anywhere in the header, or with bytes overwritten: a WeightError naming the file (or a
  file that still parses), never another exception."""
  path = str(tmp_path / "tiny.gguf")
  write_tiny_gguf(path, "llama", extra=_add_every_value_type)
  header = GGUFFile(path).data_offset
  with open(path, "rb") as fh:
    good = fh.read(header)

  rng = np.random.default_rng(0)
  for trial in range(300):
    with open(path, "r+b") as fh:
      for at in rng.integers(0, header, rng.integers(1, 5)):
        fh.seek(at)
        fh.write(bytes([rng.integers(0, 256)]))
    os.utime(path, ns=(trial, trial))  # a new file version for open_gguf's cache
    try:
      open_gguf(path)
    except WeightError as e:
      assert str(e).startswith(f"{path}: truncated or corrupt GGUF file: ")
    with open(path, "r+b") as fh:
      fh.write(good)

  for size in range(header, -1, -1):
    os.truncate(path, size)
    with pytest.raises(WeightError, match=rf"{path}: truncated or corrupt"):
      open_gguf(path)


def _patched(path: str, old: bytes, new: bytes) -> None:
  with open(path, "rb") as fh:
    data = fh.read()
  assert data.count(old) == 1
  with open(path, "wb") as fh:
    fh.write(data.replace(old, new))


def test_duplicate_tensor_names(tmp_path):
  path = str(tmp_path / "dup.gguf")
  write_tiny_gguf(path, "llama")
  _patched(path, b"blk.1.attn_q.weight", b"blk.0.attn_q.weight")
  with pytest.raises(WeightError,
                     match=rf"{path}: .*tensor 'blk\.0\.attn_q\.weight' appears twice"):
    load_gguf(path)


def test_duplicate_metadata_keys(tmp_path):
  path = str(tmp_path / "dup.gguf")
  write_tiny_gguf(path, "llama", extra=lambda w: (w.add_uint32("test.aaaa", 1),
                                                 w.add_uint32("test.bbbb", 2)))
  _patched(path, b"test.bbbb", b"test.aaaa")
  with pytest.raises(WeightError, match=rf"{path}: .*metadata key 'test\.aaaa' appears twice"):
    load_gguf(path)


def test_bad_metadata(tmp_path):
  for name, kvs, message in [
      ("version", [], "GGUF version 4 is not supported"),
      ("type", [("k", 13, b"")], r"metadata 'k': 13 is not a valid GGUFValueType"),
      ("alignment", [("general.alignment", V.UINT32, struct.pack("<I", 48))],
       "general.alignment 48 is not a power of two"),
      ("alignment-type", [("general.alignment", V.UINT64, struct.pack("<Q", 64))],
       "general.alignment has type UINT64"),
      ("long-array", [("k", V.ARRAY, struct.pack("<IQ", V.STRING, 2**60))],
       r"metadata 'k': an array of 1152921504606846976 strings runs past the end"),
      ("utf8", [("k", V.STRING, struct.pack("<Q", 2) + b"\xff\xfe")],
       "metadata 'k': 'utf-8' codec")]:
    path = str(tmp_path / f"{name}.gguf")
    _handmade_gguf(path, kvs, version=4 if name == "version" else 3)
    with pytest.raises(WeightError, match=rf"{path}: truncated or corrupt GGUF file: {message}"):
      open_gguf(path)


def test_unsupported_architecture(tmp_path):
  path = str(tmp_path / "gpt2.gguf")
  w = gguf.GGUFWriter(path, "gpt2")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(WeightError, match=rf"{path}: unsupported GGUF architecture 'gpt2'"):
    load_gguf(path)


def test_experts_without_routers_are_rejected(tmp_path):
  """MoE files load (tests/test_moe_gguf.py); one that declares experts and has none fails."""
  path = str(tmp_path / "moe.gguf")
  write_tiny_gguf(path, "llama", extra=lambda w: w.add_expert_count(8))
  with pytest.raises(WeightError, match="expert_count=8 but no layer has a router"):
    load_gguf(path)


def test_missing_tensor(tmp_path):
  path = str(tmp_path / "missing.gguf")
  write_tiny_gguf(path, "llama", drop=("blk.1.ffn_up.weight",))
  with pytest.raises(WeightError, match=rf"{path}: missing tensor 'blk\.1\.ffn_up\.weight'"):
    load_gguf(path)


def test_unsupported_storage_type(tmp_path):
  path = str(tmp_path / "int.gguf")
  write_tiny_gguf(path, "llama", replace={"blk.0.ffn_norm.weight": np.ones(HIDDEN, np.int32)})
  with pytest.raises(WeightError, match=r"tensor 'blk\.0\.ffn_norm\.weight' has type I32"):
    load_gguf(path)


def test_wrong_shape(tmp_path):
  path = str(tmp_path / "shape.gguf")
  write_tiny_gguf(path, "llama", replace={"blk.0.attn_v.weight": np.zeros((64, HIDDEN), np.float32)})
  with pytest.raises(WeightError, match=r"v_proj\.weight' has shape \(64, 256\), expected \(128, 256\)"):
    load_gguf(path)


# --- the real SmolLM2-135M-Instruct (Q4_1 + Q8_0 embeddings) ------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
  return load_gguf(smollm2_gguf)


@pytest.mark.slow
def test_smollm2_config_and_params(smollm2):
  config, params = smollm2
  assert config.architecture == "llama"
  assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
  assert config.vocab_size == 49152 and config.tie_word_embeddings
  assert config.rope_theta == 100000.0 and config.rope_scaling is None
  assert config.max_position_embeddings == 8192
  assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
  assert "lm_head" not in params
  shapes = jax.tree.map(lambda s: (s.shape, s.dtype), param_shapes(config))
  assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == shapes


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2, hf_smollm2_model):
  config, params = smollm2
  # "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"
  ids = [1, 4093, 198, 19161, 253, 421, 30614, 563, 260, 3426, 30, 2, 198, 1, 520, 9531, 198]
  ours, ref = _logits(config, params, ids), _hf_logits(hf_smollm2_model, ids)
  np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
  assert (ours.argmax(-1) == ref.argmax(-1)).all()
