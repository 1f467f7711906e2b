"""Model stack: pure functions of (params, tokens, positions, kv cache, attention metadata)."""
from jinfer.models.attention_metadata import AttentionMetadata
from jinfer.models.llama import CausalLM, logical_axes

__all__ = ["AttentionMetadata", "CausalLM", "logical_axes"]
