"""Test helper: write a tiny random model as a GGUF file laid out the way llama.cpp writes it."""
from __future__ import annotations

from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

HIDDEN, FFN, LAYERS, VOCAB = 256, 512, 2, 96  # K-quants need rows of 256 values
SHAPES = {  # arch -> (heads, kv heads, head dim); Qwen3 in transformers assumes head dim 128
    "llama": (4, 2, 64), "qwen2": (4, 2, 64), "qwen3": (4, 2, 128),
}
# Storage type of each tensor kind per layer, together covering every type jinfer dequantizes.
MIXED_TYPES = [
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1,
     "ffn_gate": Q.Q4_K, "ffn_up": Q.Q2_K, "ffn_down": Q.Q3_K},
    {"attn_q": Q.F16, "attn_k": Q.BF16, "attn_v": Q.F32, "attn_output": Q.Q5_K,
     "ffn_gate": Q.Q6_K, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_K},
]
# The codebook types (IQ4_NL, IQ4_XS, MXFP4, NVFP4), and stacks where they meet each other (other
# tables, other group sizes) and affine types.
CODEBOOK_LAYER_TYPES = [
    {"attn_q": Q.IQ4_NL, "attn_k": Q.IQ4_XS, "attn_v": Q.MXFP4, "attn_output": Q.NVFP4,
     "ffn_gate": Q.IQ4_XS, "ffn_up": Q.MXFP4, "ffn_down": Q.Q4_K},
    {"attn_q": Q.IQ4_NL, "attn_k": Q.Q8_0, "attn_v": Q.MXFP4, "attn_output": Q.IQ4_NL,
     "ffn_gate": Q.MXFP4, "ffn_up": Q.NVFP4, "ffn_down": Q.IQ4_NL},
]
GLOBAL_TYPES = {"token_embd": Q.Q8_0, "output": Q.Q6_K}
# gguf.quants cannot quantize K-quants, IQ4 or NVFP4, so those tensors are random blocks with
# sane scales: byte offsets of each block's float16 scale fields.
_KQUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
                  Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.NVFP4: ()}
# NVFP4's four ue4m3 block scales: exponent 1..3, i.e. 2^-6..2^-4 (x 12 at most, doubled values)
_NVFP4_SCALES = (0x08, 0x20)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's convert_hf_to_gguf `permute`: interleave each head's rotary halves."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_kquant(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
  for off in _KQUANT_SCALES[qtype]:
    d = 1e-3 if qtype == Q.IQ4_NL else 1e-4  # IQ4_NL: d times values up to 127
    raw[..., off:off + 2] = np.full(raw.shape[:2] + (1,), d, np.float16).view(np.uint8)
  if qtype == Q.NVFP4:
    raw[..., :4] = rng.integers(*_NVFP4_SCALES, raw.shape[:2] + (4,))
  return raw.reshape(rows, -1)


def write_tiny_gguf(path: str, arch: str = "llama", *, tied: bool = False, all_f32: bool = False,
                    drop: tuple[str, ...] = (), replace: dict[str, np.ndarray] | None = None,
                    extra: Callable[[gguf.GGUFWriter], None] | None = None, seed: int = 0,
                    layer_types: list[dict] = MIXED_TYPES) -> dict:
  """Write the file; return the float32 HF-layout tensors it was made from (random blocks
  excluded).

  all_f32 stores every tensor unquantized, so a loader must reproduce the returned tensors
  exactly. `drop` omits GGUF tensors; `replace` stores the given arrays instead; `layer_types`:
  each layer's storage types (MIXED_TYPES, or CODEBOOK_LAYER_TYPES).
  """
  heads, kv_heads, head_dim = SHAPES[arch]
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(LAYERS)
  w.add_context_length(128)
  w.add_embedding_length(HIDDEN)
  w.add_feed_forward_length(FFN)
  w.add_head_count(heads)
  w.add_head_count_kv(kv_heads)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_freq_base(50000.0)
  w.add_rope_dimension_count(head_dim)
  if arch == "qwen3":
    w.add_key_length(head_dim)
  w.add_tokenizer_model("gpt2")
  w.add_token_list([f"<t{i}>" for i in range(VOCAB)])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  if extra:
    extra(w)

  originals: dict[str, np.ndarray] = {}

  def add(name: str, shape: tuple[int, ...], qtype: Q, permute_heads: int | None = None,
          scale: float = 0.05):
    if name in drop:
      return
    if replace and name in replace:
      w.add_tensor(name, replace[name])
      return
    if all_f32:
      qtype = Q.F32
    if qtype in _KQUANT_SCALES:
      w.add_tensor(name, _random_kquant(rng, shape[0], shape[1], qtype), raw_dtype=qtype)
      return
    hf = (rng.standard_normal(shape) * scale).astype(np.float32)
    if len(shape) == 1 and name.endswith("norm.weight"):
      hf += 1.0
    originals[name] = hf
    stored = llama_cpp_permute(hf, permute_heads) if arch == "llama" and permute_heads else hf
    if qtype == Q.F32:
      w.add_tensor(name, stored)
    elif qtype == Q.F16:
      w.add_tensor(name, stored.astype(np.float16))
    else:
      w.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)

  add("token_embd.weight", (VOCAB, HIDDEN), GLOBAL_TYPES["token_embd"])
  for i, types in enumerate(layer_types[:LAYERS]):
    b = f"blk.{i}"
    add(f"{b}.attn_norm.weight", (HIDDEN,), Q.F32)
    add(f"{b}.attn_q.weight", (heads * head_dim, HIDDEN), types["attn_q"], heads)
    add(f"{b}.attn_k.weight", (kv_heads * head_dim, HIDDEN), types["attn_k"], kv_heads)
    add(f"{b}.attn_v.weight", (kv_heads * head_dim, HIDDEN), types["attn_v"])
    add(f"{b}.attn_output.weight", (HIDDEN, heads * head_dim), types["attn_output"])
    if arch == "qwen2":
      add(f"{b}.attn_q.bias", (heads * head_dim,), Q.F32)
      add(f"{b}.attn_k.bias", (kv_heads * head_dim,), Q.F32)
      add(f"{b}.attn_v.bias", (kv_heads * head_dim,), Q.F32)
    if arch == "qwen3":
      add(f"{b}.attn_q_norm.weight", (head_dim,), Q.F32)
      add(f"{b}.attn_k_norm.weight", (head_dim,), Q.F32)
    add(f"{b}.ffn_norm.weight", (HIDDEN,), Q.F32)
    add(f"{b}.ffn_gate.weight", (FFN, HIDDEN), types["ffn_gate"])
    add(f"{b}.ffn_up.weight", (FFN, HIDDEN), types["ffn_up"])
    add(f"{b}.ffn_down.weight", (HIDDEN, FFN), types["ffn_down"])
  add("output_norm.weight", (HIDDEN,), Q.F32)
  if not tied:
    add("output.weight", (VOCAB, HIDDEN), GLOBAL_TYPES["output"])

  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return originals
