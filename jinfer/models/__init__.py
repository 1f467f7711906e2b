"""Model stack: pure functions of (params, tokens, positions, kv cache, attention metadata)."""
from jinfer.models.llama import (CausalLM, layer_runs, linear_kernels, lm_head, logical_axes,
                                 param_shapes, unstack_layers)

__all__ = ["CausalLM", "layer_runs", "linear_kernels", "lm_head", "logical_axes", "param_shapes",
           "unstack_layers"]
