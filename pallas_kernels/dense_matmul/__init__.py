"""Float matmul: the dense linear layers and the tied LM head. One entry point, implementations
chosen by `backend`:

  reference  `jnp.tensordot`: the oracle, and what accelerators and sharded params run (XLA
             picks its own GEMM there)
  xla_cpu    the same product shaped for XLA:CPU on one device (see xla_cpu.py)

The model calls this op and never asks which platform it runs on; the engine picks the backend
(`default_backend`, or `reference` when params are sharded over a mesh).
"""
from __future__ import annotations

import jax

from pallas_kernels.dense_matmul.reference import dense_matmul_reference
from pallas_kernels.dense_matmul.xla_cpu import dense_matmul_xla_cpu

_IMPLS = {"reference": dense_matmul_reference, "xla_cpu": dense_matmul_xla_cpu}
BACKENDS = tuple(_IMPLS)

__all__ = ["BACKENDS", "default_backend", "dense_matmul"]


def default_backend() -> str:
  """For params on one device of the default platform."""
  return "xla_cpu" if jax.default_backend() == "cpu" else "reference"


def dense_matmul(
    x: jax.Array,  # [..., K...]: the trailing `n_in` axes contract
    w: jax.Array,  # [K..., N...] ([N, K] with transpose_w)
    *,
    n_in: int = 1,
    transpose_w: bool = False,
    backend: str | None = None,
) -> jax.Array:  # [..., N...] x.dtype
  """x . w over x's trailing `n_in` axes and w's leading ones. `transpose_w`: w is [N, K] (a
  tied embedding used as the LM head; n_in must be 1), read in place. `backend` None: the
  default for the platform (`default_backend`)."""
  backend = backend or default_backend()
  if backend not in _IMPLS:
    raise ValueError(f"unknown dense matmul backend {backend!r}; choose one of {BACKENDS}")
  if transpose_w and (n_in != 1 or w.ndim != 2):
    raise ValueError(f"transpose_w takes a 2-d [N, K] weight and n_in=1, got {w.shape}, {n_in}")
  k_shape = (w.shape[1],) if transpose_w else w.shape[:n_in]
  if x.shape[x.ndim - n_in:] != k_shape:
    raise ValueError(f"shapes do not match: x {x.shape}, w {w.shape}, n_in {n_in}")
  return _IMPLS[backend](x, w.astype(x.dtype), n_in, transpose_w)
