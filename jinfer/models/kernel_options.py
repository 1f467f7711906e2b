"""Which kernels the model's attention and linear layers run, and how weights are stored."""
from __future__ import annotations

import dataclasses

from jax.sharding import Mesh


# None: float weights. "int8": int8 weights with per-output-channel scales, float activations
# (W8A16). "w8a8": activations quantized per token too, int32 accumulation. "int4": 4-bit
# group-wise weights (W4A16; see jinfer/quant/). "mxfp4" / "nvfp4": 4-bit micro-float weights,
# the group-wise codebook form. "gguf": a GGUF file's blocks kept quantized.
# "fp8": float8 e4m3 weights per output channel, activations float8 per token (vLLM's
# FP8-dynamic) or float (W8A16-FP8, `fp8_activations=False`).
# "mixed": each layer int4, int8 (W8A16) or float by measured sensitivity (jinfer/quant/mixed.py).
QUANTIZATIONS = (None, "int8", "w8a8", "int4", "mxfp4", "nvfp4", "gguf", "fp8", "mixed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelOptions:
  attention: str = "xla"  # ragged_paged_attention backend
  # dense_matmul backend: float linear layers and the tied head (None: the op's default for the
  # platform, for params on one device; the engine takes "reference" for sharded ones).
  dense: str | None = None
  matmul: str = "xla"  # int8_matmul backend (used only when quantized)
  # groupwise_matmul backend: int4 and group-wise int8 weights (None: the op's platform default)
  groupwise: str | None = None
  grouped_matmul: str = "xla"  # grouped_matmul backend: MoE experts
  interpret: bool = False  # Pallas kernels in interpret mode (CPU testing)
  quantization: str | None = None  # one of QUANTIZATIONS
  fp8_activations: bool = True  # "fp8": activations float8 per token (else float)
  # Quantized linear kernels stored outputs first, `[out..., in...]`: XLA:CPU's integer GEMM
  # reads that layout faster at a few rows (one SmolLM2 stack at 2 rows: ~17 -> ~13 ms on a
  # 2-core box; the same at 64). Set where the "xla" matmul runs on one device.
  int8_transposed: bool = False
  # Devices the model runs over: attention runs per shard of this `(context, tensor)` mesh (see
  # jinfer/parallel/attention.py); None is one device.
  mesh: Mesh | None = None
  context_layout: str = "zigzag"  # how a step's query rows lie over the context ranks
  expert_parallel: bool = False  # MoE experts split over the mesh's tensor axis, whole

  def __post_init__(self):
    if self.quantization not in QUANTIZATIONS:
      raise ValueError(f"unknown quantization {self.quantization!r}; choose one of "
                       f"{', '.join(str(q) for q in QUANTIZATIONS)}")

  @property
  def matmul_mode(self) -> str:
    """Whether activations are quantized too ("w8a8": int8 or float8 per token, as the
    weights' dtype says) or stay float ("w8a16")."""
    quantized = self.quantization == "w8a8" or (self.quantization == "fp8" and
                                                self.fp8_activations)
    return "w8a8" if quantized else "w8a16"
