"""Weight quantization applied to loaded params: int8 per channel (`qarray`), 4-bit group-wise
by RTN, AWQ or GPTQ (`quantize_model`), SmoothQuant before W8A8 (`smooth_model`), and the
calibration they run on."""
from jinfer.quant.calibration import LinearStats, calibrate, calibration_tokens
from jinfer.quant.groupwise import GroupwiseArray, dequantize_like
from jinfer.quant.model import METHODS, quantize_model, smooth_model
from jinfer.quant.qarray import QArray, quantize, quantize_params

__all__ = ["GroupwiseArray", "LinearStats", "METHODS", "QArray", "calibrate",
           "calibration_tokens", "dequantize_like", "quantize", "quantize_model",
           "quantize_params", "smooth_model"]
