"""SmoothQuant (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models"): W8A8 rounds each token's activations on one scale, so a
few outlier channels take the whole int8 range and the rest round to a handful of levels. Moving
part of each channel's range into the weights evens that out:

    X W = (X / s) (diag(s) W),    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

with max|W_j| over every output of every linear that reads input channel j (they share s, which
is folded into what produces their input: `jinfer/quant/folding.py`). alpha = 0.5 balances the
two ranges; larger alpha moves more of the activations' difficulty onto the weights. The
smoothed weights then go through the usual per-channel int8 quantizer (`qarray.quantize`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def smooth_scales(x_max: jax.Array, w: jax.Array, alpha: float | jax.Array = 0.5) -> jax.Array:
  """x_max [lead..., K] max|x| per input channel over the calibration rows, w [lead..., K, N]
  (the group's kernels side by side) -> s [lead..., K]. Clamped as the reference
  implementation does, so dead channels stay finite."""
  w_max = jnp.maximum(jnp.abs(w).max(-1), 1e-5)  # [lead..., K]
  return jnp.maximum(x_max ** alpha / w_max ** (1 - alpha), 1e-5)

