"""Model stack: pure functions of (params, tokens, positions, kv cache, attention metadata)."""
from jinfer.models.llama import (CausalLM, linear_kernels, lm_head, logical_axes, param_shapes,
                                 unstack_layers)

__all__ = ["CausalLM", "linear_kernels", "lm_head", "logical_axes", "param_shapes",
           "unstack_layers"]
