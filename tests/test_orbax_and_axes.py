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


def test_moe_expert_params_carry_the_expert_axis():
  """Stacked experts name their `expert` axis (so it can be sharded) at the dimension that holds
  the experts; the shared expert, which every token runs, has none."""
  config = ModelConfig(architecture="qwen2_moe", vocab_size=64, hidden_size=32,
                       intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                       num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40, moe_layers=(False, True, True))
  shapes = param_shapes(config)
  axes = logical_axes(config)
  is_names = lambda x: isinstance(x, tuple)
  with_expert = {}
  for (path, s), names in zip(jax.tree_util.tree_leaves_with_path(shapes),
                              jax.tree.leaves(axes, is_leaf=is_names)):
    assert len(names) == len(s.shape), jax.tree_util.keystr(path)
    if "expert" in names:
      with_expert[jax.tree_util.keystr(path)] = s.shape[names.index("expert")]
  assert with_expert == {"['moe_layers']['down']['kernel']": 5,
                         "['moe_layers']['gate_up']['kernel']": 5,
                         "['moe_layers']['router']": 5}
  moe = axes["moe_layers"]
  assert moe["gate_up"]["kernel"] == ("layers", "expert", "embed", "gate_up", "mlp")
  assert moe["down"]["kernel"] == ("layers", "expert", "mlp", "embed")
  assert shapes["moe_layers"]["down"]["kernel"].shape == (2, 5, 24, 32)  # MoE layers 1 and 2
  assert shapes["mlp_layers"]["down_proj"]["kernel"].shape == (1, 48, 32)  # dense layer 0
