"""Test helper for the compile-only tier: a target's devices, or a skip that names the extra, and
abstract arrays placed on one of them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from jinfer.engine.compile_only import compile_lowered
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
