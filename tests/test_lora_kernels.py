"""The LoRA product of jinfer/models/lora.py through every grouped-matmul backend (the Pallas
TPU and GPU kernels in interpret mode) and its masked dense form (a mesh's): each row gets its
own slot's `x @ a @ b`, rows without an adapter nothing."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.lora import LoraRows, lora_delta, lora_rows
from pallas_kernels.grouped_matmul import BACKENDS


def _case(t=24, k=64, n=96, m=4, r=16, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(t, k)).astype(np.float32)
  a = rng.normal(size=(m, k, r)).astype(np.float32) / 8
  b = rng.normal(size=(m, r, n)).astype(np.float32) / 4
  slots = rng.integers(-1, m - 1, size=t)  # -1: no adapter; slot m - 1 stays empty
  slots[:2] = [-1, 0]
  want = np.stack([np.zeros(n, np.float32) if s < 0 else x[i] @ a[s] @ b[s]
                   for i, s in enumerate(slots)])
  rows = LoraRows(**{f: jnp.asarray(v) for f, v in lora_rows(slots, m).items()})
  return jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), rows, want


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_by_slot_matches_each_rows_own_adapter(backend):
  x, a, b, rows, want = _case()
  got = lora_delta(x, a, b, rows, backend=backend, interpret=backend.startswith("pallas"),
                   masked=False)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_masked_form_matches_each_rows_own_adapter():
  x, a, b, rows, want = _case(seed=1)
  got = jax.jit(lambda *args: lora_delta(*args, backend="xla", interpret=False,
                                         masked=True))(x, a, b, rows)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
