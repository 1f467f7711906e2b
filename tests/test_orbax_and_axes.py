"""orbax round trip of jinfer params, and logical axis names on every param leaf."""
from __future__ import annotations

import jax
import numpy as np

from jinfer.config import ModelConfig
from jinfer.models import logical_axes, param_shapes
from jinfer.weights.orbax_checkpoint import restore_params, save_params

CONFIG = ModelConfig(architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     attention_bias=True)


def _random_params(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), param_shapes(CONFIG))


def test_orbax_round_trip(tmp_path):
  params = _random_params(0)
  save_params(str(tmp_path / "ckpt"), params)
  restored = restore_params(str(tmp_path / "ckpt"), _random_params(1))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_every_param_has_logical_axes():
  shapes = param_shapes(CONFIG)
  axes = logical_axes(CONFIG)
  is_names = lambda x: isinstance(x, tuple)
  assert jax.tree.structure(shapes) == jax.tree.structure(axes, is_leaf=is_names)
  for s, names in zip(jax.tree.leaves(shapes), jax.tree.leaves(axes, is_leaf=is_names)):
    assert len(names) == len(s.shape)
  assert axes["layers"]["attn"]["q_proj"]["kernel"] == ("layers", "embed", "q_heads", "head_dim")
  assert shapes["layers"]["attn"]["q_proj"]["kernel"].shape == (2, 32, 4, 8)
