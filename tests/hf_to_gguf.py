"""Test helper: write an HF transformers model (Mixtral, Qwen2-MoE, Qwen3-MoE) as a GGUF file,
tensors named and laid out as llama.cpp's convert_hf_to_gguf writes them."""
from __future__ import annotations

from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from tests.tiny_gguf import llama_cpp_permute

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _add_shape(w: gguf.GGUFWriter, c) -> None:
  """The metadata every architecture's file has: layers, context, widths, heads."""
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)


def write_hf_as_gguf(path: str, hf, *, quantize: dict[str, Q] | None = None,
                     drop: tuple[str, ...] = (),
                     extra: Callable[[gguf.GGUFWriter], None] | None = None) -> None:
  """`quantize`: storage type by GGUF tensor kind (e.g. "ffn_down_exps"), float32 otherwise.
  `drop`: GGUF tensor names left out. `extra` adds to the file (metadata, tensors)."""
  c = hf.config
  arch = GGUF_ARCH[c.model_type]
  sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  w = gguf.GGUFWriter(path, arch)
  _add_shape(w, c)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_rope_freq_base(c.rope_parameters["rope_theta"])
  head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
  w.add_rope_dimension_count(head_dim)
  w.add_key_length(head_dim)
  experts = getattr(c, "num_local_experts", None) or c.num_experts
  w.add_expert_count(experts)
  w.add_expert_used_count(c.num_experts_per_tok)
  if arch != "llama":
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
  if arch == "qwen2moe":
    w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
  if extra:
    extra(w)
  w.add_tokenizer_model("gpt2")
  w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
  if c.bos_token_id is not None:
    w.add_bos_token_id(c.bos_token_id)
  if c.eos_token_id is not None:
    w.add_eos_token_id(c.eos_token_id)

  def add(name: str, arr: np.ndarray):
    if name in drop:
      return
    kind = name.split(".")[-2]
    qtype = (quantize or {}).get(kind, Q.F32)
    arr = np.ascontiguousarray(arr, np.float32)
    if qtype == Q.F32:
      w.add_tensor(name, arr)
    else:
      w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

  add("token_embd.weight", sd["model.embed_tokens.weight"])
  for i in range(c.num_hidden_layers):
    p, b = f"model.layers.{i}", f"blk.{i}"
    add(f"{b}.attn_norm.weight", sd[f"{p}.input_layernorm.weight"])
    add(f"{b}.ffn_norm.weight", sd[f"{p}.post_attention_layernorm.weight"])
    for ours, theirs, heads in (("attn_q", "q_proj", c.num_attention_heads),
                                ("attn_k", "k_proj", c.num_key_value_heads),
                                ("attn_v", "v_proj", None), ("attn_output", "o_proj", None)):
      t = sd[f"{p}.self_attn.{theirs}.weight"]
      add(f"{b}.{ours}.weight", llama_cpp_permute(t, heads) if arch == "llama" and heads else t)
      if f"{p}.self_attn.{theirs}.bias" in sd:
        add(f"{b}.{ours}.bias", sd[f"{p}.self_attn.{theirs}.bias"])
    for norm in ("q_norm", "k_norm"):
      if f"{p}.self_attn.{norm}.weight" in sd:
        add(f"{b}.attn_{norm}.weight", sd[f"{p}.self_attn.{norm}.weight"])
    if f"{p}.mlp.experts.gate_up_proj" in sd:
      gate_up = sd[f"{p}.mlp.experts.gate_up_proj"]  # [X, 2F, E], gate first
      f = gate_up.shape[1] // 2
      add(f"{b}.ffn_gate_inp.weight", sd[f"{p}.mlp.gate.weight"])
      add(f"{b}.ffn_gate_exps.weight", gate_up[:, :f])
      add(f"{b}.ffn_up_exps.weight", gate_up[:, f:])
      add(f"{b}.ffn_down_exps.weight", sd[f"{p}.mlp.experts.down_proj"])
      if f"{p}.mlp.shared_expert_gate.weight" in sd:
        for proj in ("gate", "up", "down"):
          add(f"{b}.ffn_{proj}_shexp.weight", sd[f"{p}.mlp.shared_expert.{proj}_proj.weight"])
        add(f"{b}.ffn_gate_inp_shexp.weight", sd[f"{p}.mlp.shared_expert_gate.weight"][0])
    else:
      for proj in ("gate", "up", "down"):
        add(f"{b}.ffn_{proj}.weight", sd[f"{p}.mlp.{proj}_proj.weight"])
  add("output_norm.weight", sd["model.norm.weight"])
  add("output.weight", sd["lm_head.weight"])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def write_gemma3_as_gguf(path: str, hf, tokens: list[str], scores: list[float],
                         types: list[int]) -> None:
  """A transformers Gemma-3 text model as llama.cpp's convert_hf_to_gguf writes it: arch
  `gemma3`, every norm weight stored plus one, no local/global pattern and no local rope base in
  the metadata, a SentencePiece ("llama") vocabulary of tokens with scores and types."""
  c = hf.config
  sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  w = gguf.GGUFWriter(path, "gemma3")
  _add_shape(w, c)
  w.add_key_length(c.head_dim)
  w.add_value_length(c.head_dim)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
  w.add_sliding_window(c.sliding_window)
  w.add_tokenizer_model("llama")
  w.add_tokenizer_pre("default")
  w.add_token_list(tokens)
  w.add_token_scores(scores)
  w.add_token_types(types)
  w.add_bos_token_id(c.bos_token_id)
  w.add_eos_token_id(c.eos_token_id)
  w.add_unk_token_id(3)
  w.add_pad_token_id(c.pad_token_id)
  w.add_add_bos_token(True)

  def add(name: str, arr: np.ndarray):
    arr = np.ascontiguousarray(arr, np.float32)
    w.add_tensor(name, arr + 1 if name.endswith("norm.weight") else arr)

  add("token_embd.weight", sd["model.embed_tokens.weight"])
  for i in range(c.num_hidden_layers):
    p, b = f"model.layers.{i}", f"blk.{i}"
    for ours, theirs in (("attn_norm", "input_layernorm"),
                         ("post_attention_norm", "post_attention_layernorm"),
                         ("ffn_norm", "pre_feedforward_layernorm"),
                         ("post_ffw_norm", "post_feedforward_layernorm"),
                         ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                         ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                         ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                         ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                         ("ffn_down", "mlp.down_proj")):
      add(f"{b}.{ours}.weight", sd[f"{p}.{theirs}.weight"])
  add("output_norm.weight", sd["model.norm.weight"])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
