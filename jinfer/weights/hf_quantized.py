"""HF AWQ and GPTQ checkpoints read into the group-wise format, codes kept as they are.

Both store w[k, n] = scale[g, n] * (q[k, n] - zero[g, n]) with 4-bit q and zero, for the
linear `y = x @ w` (w [K=in, N=out]); both re-encode exactly as q * scale + (-zero * scale),
since every product of a 5-bit integer and a float16 scale is exact in float32.

AWQ (AutoAWQ's GEMM layout, `quant_method: awq`, `version: gemm`):
  qweight [K, N/8] int32   8 output columns per word; nibble i (bits 4i..4i+3) holds column
                           8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]
  qzeros  [K/g, N/8] int32 the same interleaving
  scales  [K/g, N] float16
GPTQ (AutoGPTQ / GPTQModel, `quant_method: gptq`):
  qweight [K/8, N] int32   8 input rows per word, sequential: row 8r + i in nibble i
  qzeros  [K/g, N/8] int32 8 output columns per word, sequential
  scales  [K/g, N] float16
  g_idx   [K] int32        the group of each input row
  `checkpoint_format: gptq` (v1, the default and AutoGPTQ's) stores zero - 1 in qzeros;
  `gptq_v2` stores the zero itself. `sym` only decides which zeros were chosen, not the layout.

With act-order (`desc_act: true`) g_idx puts rows into groups out of order. The rows are then
sorted into contiguous groups and the tensor carries `perm`: the caller computes
x[..., perm] @ w_stored (see GroupwiseTensor.perm).

Everything (config, tensor presence, dtypes, shapes, g_idx) is checked before any weight is
read, and the errors name the tensor and the config field.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jinfer.weights.groupwise_tensor import GroupwiseTensor, GroupwiseWeights
from jinfer.weights.hf_layout import WeightError
from jinfer.weights.safetensors_dir import TensorFiles

METHODS = ("awq", "gptq")
_GPTQ_FORMATS = ("gptq", "gptq_v2")
# AutoAWQ's packing order: nibble i of a word holds column _AWQ_ORDER[i] of its 8.
_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_SCALE_DTYPES = ("F16", "BF16", "F32")
_CF = "quantization_config"  # the config field errors name


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantScheme:
  method: str  # "awq" | "gptq"
  group_size: int  # -1: one group spanning K
  zero_minus_one: bool  # GPTQ v1: qzeros hold zero - 1
  source: str  # the file the scheme came from, for errors


def is_quantized_dir(path: str) -> bool:
  """Whether HF directory `path` says it holds a quantized checkpoint (any `quant_method`,
  supported or not: `quant_scheme` then says why it cannot load)."""
  try:
    with open(os.path.join(path, "config.json")) as fh:
      config = json.load(fh)
  except (OSError, json.JSONDecodeError):
    return False  # the plain loader reports a missing or broken config
  return (isinstance(config, dict) and config.get(_CF) is not None) or os.path.exists(
      os.path.join(path, "quantize_config.json"))


def quant_scheme(path: str) -> QuantScheme:
  """The AWQ/GPTQ scheme of HF directory `path`, from config.json's quantization_config (or an
  AutoGPTQ quantize_config.json beside it), validated."""
  source = os.path.join(path, "config.json")
  try:
    with open(source) as fh:
      q = json.load(fh).get(_CF)
  except FileNotFoundError:
    raise WeightError(f"{path}: no config.json (expected an HF model directory)") from None
  except json.JSONDecodeError as e:
    raise WeightError(f"{source}: not valid JSON ({e})") from None
  if q is None and os.path.exists(alt := os.path.join(path, "quantize_config.json")):
    source = alt
    try:
      with open(alt) as fh:
        q = {"quant_method": "gptq", **json.load(fh)}  # AutoGPTQ's file predates the field
    except json.JSONDecodeError as e:
      raise WeightError(f"{alt}: not valid JSON ({e})") from None
  if not isinstance(q, dict):
    raise WeightError(f"{source}: no {_CF}: not an AWQ or GPTQ checkpoint")

  def field(*names: str, default=None):
    return next((q[n] for n in names if n in q), default)

  method = str(field("quant_method", default="")).lower()
  if method not in METHODS:
    raise WeightError(f"{source}: {_CF}.quant_method={q.get('quant_method')!r} is not supported "
                      f"(supported: {', '.join(METHODS)})")
  bits = field("bits", "w_bit")
  if bits != 4:
    raise WeightError(f"{source}: {_CF}.bits={bits}: only 4-bit {method.upper()} checkpoints "
                      f"are supported")
  group = field("group_size", "q_group_size", default=128 if method == "awq" else -1)
  if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 2 == 0)):
    raise WeightError(f"{source}: {_CF}.group_size={group!r} must be -1 or a positive even "
                      f"number")
  if method == "awq":
    version = str(field("version", default="gemm")).lower()
    if version != "gemm":
      raise WeightError(f"{source}: {_CF}.version={version!r}: only AWQ's GEMM layout is "
                        f"supported")
    if not field("zero_point", default=True):
      raise WeightError(f"{source}: {_CF}.zero_point=false: only AWQ with zero points is "
                        f"supported")
    return QuantScheme(method=method, group_size=group, zero_minus_one=False, source=source)
  if field("is_marlin_format", default=False):
    raise WeightError(f"{source}: {_CF}.is_marlin_format=true: Marlin-repacked GPTQ is not "
                      f"supported")
  fmt = str(field("checkpoint_format", default="gptq")).lower()
  if fmt not in _GPTQ_FORMATS:
    raise WeightError(f"{source}: {_CF}.checkpoint_format={fmt!r} is not supported (supported: "
                      f"{', '.join(_GPTQ_FORMATS)})")
  if (pack := field("pack_dtype", default="int32")) not in ("int32", "torch.int32"):
    raise WeightError(f"{source}: {_CF}.pack_dtype={pack!r}: only int32 packing is supported")
  return QuantScheme(method=method, group_size=group, zero_minus_one=fmt == "gptq",
                     source=source)


@dataclasses.dataclass(frozen=True)
class _Layer:
  """One quantized linear after its checks: sizes, group size and GPTQ row order."""
  prefix: str
  k: int
  n: int
  group_size: int
  perm: np.ndarray | None  # [K] int32, or None when the groups are contiguous rows


def read_hf_groupwise(path: str) -> GroupwiseWeights:
  """An AWQ/GPTQ HF safetensors directory: every quantized linear (HF module name -> weight
  [K, N]), every other tensor under its HF name as stored (embeddings, norms, biases, layers
  left unquantized such as lm_head). Nothing is dequantized."""
  scheme = quant_scheme(path)
  tensors = TensorFiles(path)
  files, header, read = tensors.files, tensors.header, tensors.read
  prefixes = sorted(n.removesuffix(".qweight") for n in files if n.endswith(".qweight"))
  if not prefixes:
    raise WeightError(f"{path}: {scheme.source} declares {scheme.method.upper()} but no tensor "
                      f"is named *.qweight")
  layers = [_check_layer(scheme, p, files, header, read) for p in prefixes]

  linears = {layer.prefix: _read_layer(scheme, layer, read) for layer in layers}
  taken = {f"{p}.{part}" for p in prefixes for part in ("qweight", "qzeros", "scales", "g_idx")}
  floats = {name: read(name) for name in sorted(files) if name not in taken}
  return GroupwiseWeights(linears, floats, {})


def _check_layer(scheme: QuantScheme, prefix: str, files, header, read) -> _Layer:
  """Validate one layer's tensors from their headers (g_idx read: [K] int32) -> _Layer."""
  src, method = scheme.source, scheme.method.upper()
  needed = ("qweight", "qzeros", "scales")
  for part in needed:
    if f"{prefix}.{part}" not in files:
      raise WeightError(f"{src}: {method} layer {prefix!r} has no tensor '{prefix}.{part}' "
                        f"({method} stores {', '.join(needed)})")
  (qw, qw_t), (qz, qz_t), (sc, sc_t) = (header(f"{prefix}.{p}") for p in needed)
  for part, shape, dtype, want in (("qweight", qw, qw_t, ("I32",)), ("qzeros", qz, qz_t, ("I32",)),
                                   ("scales", sc, sc_t, _SCALE_DTYPES)):
    if len(shape) != 2 or dtype not in want:
      raise WeightError(f"{src}: tensor '{prefix}.{part}' is {dtype} {list(shape)}, expected a "
                        f"2-D {' or '.join(want)} tensor")
  k, n = (qw[0], qw[1] * 8) if scheme.method == "awq" else (qw[0] * 8, qw[1])
  g = k if scheme.group_size == -1 else scheme.group_size
  if k % g:
    raise WeightError(f"{src}: {_CF}.group_size={scheme.group_size} does not divide the "
                      f"{k} input rows of '{prefix}.qweight'")
  if n % 8:
    raise WeightError(f"{src}: tensor '{prefix}.scales' has {n} output columns, not a multiple "
                      f"of the 8 that qzeros packs per word")
  for part, shape, want in (("scales", sc, (k // g, n)), ("qzeros", qz, (k // g, n // 8))):
    if shape != want:
      raise WeightError(f"{src}: tensor '{prefix}.{part}' has shape {list(shape)}, expected "
                        f"{list(want)} for '{prefix}.qweight' {list(qw)} ({method}, "
                        f"{_CF}.group_size={scheme.group_size})")
  perm = None
  if scheme.method == "gptq" and (name := f"{prefix}.g_idx") in files:
    if (shape := header(name)[0]) != (k,):
      raise WeightError(f"{src}: tensor '{name}' has shape {list(shape)}, expected [{k}]")
    perm = _group_order(read(name).astype(np.int64), g, name, src)
  return _Layer(prefix, k, n, g, perm)


def _group_order(g_idx: np.ndarray, g: int, name: str, src: str) -> np.ndarray | None:
  """The row order that makes g_idx's groups contiguous, or None when they already are."""
  k = g_idx.shape[0]
  if np.array_equal(g_idx, np.arange(k) // g):
    return None
  counts = np.bincount(g_idx, minlength=k // g) if g_idx.min() >= 0 else None
  if counts is None or counts.shape[0] != k // g or np.any(counts != g):
    raise WeightError(f"{src}: tensor {name!r} does not put exactly {_CF}.group_size={g} rows "
                      f"in each of the {k // g} groups; the group-wise format needs that to "
                      f"sort rows into whole groups")
  return np.argsort(g_idx, kind="stable").astype(np.int32)


def _nibbles(words: np.ndarray) -> np.ndarray:  # [..., W] int32 -> [..., W, 8] uint8, nibble i
  w = words.view(np.uint32)
  out = np.empty((*w.shape, 8), np.uint8)
  for i in range(8):  # one nibble at a time: a [..., W, 8] uint32 temporary is 4x the codes
    out[..., i] = (w >> np.uint32(4 * i)) & np.uint32(15)
  return out


def _read_layer(scheme: QuantScheme, layer: _Layer, read) -> GroupwiseTensor:
  p, k, n = layer.prefix, layer.k, layer.n
  scale = read(f"{p}.scales").astype(np.float32)  # [K/g, N]
  zeros = _nibbles(read(f"{p}.qzeros"))  # [K/g, N/8, 8]
  if scheme.method == "awq":
    column_nibble = np.argsort(_AWQ_ORDER)  # column j of 8 sits in nibble column_nibble[j]
    codes = _nibbles(read(f"{p}.qweight"))[..., column_nibble].reshape(k, n)
    zeros = zeros[..., column_nibble].reshape(-1, n).astype(np.float32)
  else:
    codes = _nibbles(read(f"{p}.qweight").T).reshape(n, k).T  # [N, K/8, 8] -> [K, N]
    zeros = zeros.reshape(-1, n).astype(np.float32) + (1 if scheme.zero_minus_one else 0)
    if layer.perm is not None:
      codes = codes[layer.perm]
  offset = -(zeros * scale)  # exact: an integer of at most 5 bits times a float16
  return GroupwiseTensor.from_codes(np.ascontiguousarray(codes), scale, offset, bits=4,
                                    group_size=layer.group_size, perm=layer.perm)
