"""Test helper for the compile-only tier: a target's devices, or a skip that names the extra;
abstract arrays placed on one of them; plans, and configs cut short."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from jinfer.engine.compile_only import compile_lowered
from jinfer.engine.engine_config import EngineConfig
from jinfer.plan import plan
from jinfer.targets import CompilerMissing, target

TPUS = ("v5e-1", "v6e-1")
GPUS = ("h100",)


def devices(name: str) -> list:
  try:
    return target(name).devices()
  except CompilerMissing as e:  # a plain install; `.[test]` brings both compilers
    pytest.skip(str(e))


def on(device):
  """`spec(shape, dtype)` -> a ShapeDtypeStruct on `device`."""
  sharding = SingleDeviceSharding(device)
  return lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def build(fn, *args):
  """The compiled executable of `fn` over abstract `args` (statics closed over in `fn`)."""
  return compile_lowered(jax.jit(fn).lower(*args))


def plan_for(model, target, buckets, **options):
  """`jinfer.plan` of `model` on `target` with engine `options`, for these token buckets."""
  devices(target)  # skips, naming the extra, without the compiler
  return plan(model, target, config=EngineConfig.of(**options), buckets=buckets)


def shallow(tmp_path, name: str, layers: int, vocab: int = 4096) -> str:
  """A config.json of `name`'s shipped config cut to `layers` layers and `vocab` tokens."""
  from jinfer.weights.builtin import config_only_path
  d = json.loads(open(config_only_path(name)).read())
  d = dict(d, num_hidden_layers=layers, vocab_size=vocab)
  out = tmp_path / f"{name}-{layers}"
  out.mkdir()
  (out / "config.json").write_text(json.dumps(d))
  return str(out)


def built(p):
  for s in p.steps:
    assert s.built, f"{s.tokens}-token step: {s.error}"
