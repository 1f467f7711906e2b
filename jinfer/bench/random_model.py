"""Llama models of known shapes with random weights, for benchmarks that measure layouts and
scheduling, where only the shapes matter."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jinfer.config import ModelConfig
from jinfer.models import param_shapes

SHAPES = {
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=4,
                 num_heads=8, num_kv_heads=4, head_dim=32),
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=8,
                  num_heads=8, num_kv_heads=4, head_dim=64),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      rope_theta=500000.0),
}


def random_llama(shape: str, dtype) -> tuple[ModelConfig, dict]:
  """(config, params) of the named shape, weights N(0, 0.02) in `dtype`."""
  config = ModelConfig(architecture="llama", max_position_embeddings=8192, **SHAPES[shape])
  keys = iter(jax.random.split(jax.random.key(0), 1000))
  params = jax.tree.map(lambda s: (jax.random.normal(next(keys), s.shape, jnp.float32) * 0.02)
                        .astype(dtype), param_shapes(config))
  return config, params
