"""Attention and matmul kernels. Imports nothing from jinfer.

Each op has one public entry point and a pure-jnp oracle beside its kernels.
"""
from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.dense_matmul import dense_matmul
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.groupwise_matmul import groupwise_matmul
from pallas_kernels.int8_matmul import int8_matmul, quantize_per_channel
from pallas_kernels.kv_cache_layout import KVCacheSpec, QuantizedKVCache, write_kv
from pallas_kernels.ragged_paged_attention import (default_backend, merge_attention,
                                                   ragged_paged_attention)

__all__ = ["AttentionMetadata", "KVCacheSpec", "QuantizedKVCache", "write_kv",
           "ragged_paged_attention", "merge_attention", "default_backend", "dense_matmul",
           "fp8_matmul", "grouped_matmul", "groupwise_matmul", "int8_matmul",
           "quantize_per_channel"]
