"""compressed-tensors checkpoints (vLLM's and llm-compressor's format) and transformers' own
FP8 checkpoints, read kept quantized: no weight passes through float.

compressed-tensors (`quantization_config.quant_method: "compressed-tensors"`), one config group
whose `format` says how each quantized linear `p` is stored (HF layout, w [N=out, K=in]):
  int-quantized    p.weight [N, K] int8, p.weight_scale [N, 1] (channel) or [1] (tensor);
                   w = weight * scale. Symmetric 8-bit. -> `QArray` (int8)
  float-quantized  p.weight [N, K] float8_e4m3fn, p.weight_scale likewise. -> `QArray` (fp8)
  pack-quantized   p.weight_packed [N, K/8] int32: eight 4-bit values per word along K, value
                   8w + i in nibble i, stored q + 8; p.weight_shape [2] = (N, K);
                   p.weight_scale [N, K/g] (group) or [N, 1] (channel: one group);
                   asymmetric: p.weight_zero_point [N/8, K/g] int32 packed likewise along N;
                   optional p.weight_g_idx [K] (the group of each input, activation order);
                   w = (q - zero) * scale. -> `GroupwiseArray` (4 bits, exact: code = q + 8,
                   offset = -(8 + zero) * scale)
  Activations (`input_activations`): none (W8A16 / W4A16), or 8-bit per token or per tensor,
  dynamic or static (p.input_scale). jinfer quantizes activations per token, dynamically, in
  both cases: a static checkpoint's per-tensor input_scale is checked and not used.

transformers FP8 (`quant_method: "fp8"`, FineGrainedFP8Config): p.weight [N, K] float8_e4m3fn
and p.weight_scale_inv (a multiplier, despite the name): one per tensor when
`weight_block_size` is null. Block-wise scales (`weight_block_size: [128, 128]`) vary along K
within an output channel, which no jinfer matmul reads yet: an error names the field.

Everything (config, presence, dtypes and shapes of every tensor) is checked from the files'
headers before any weight is read, and errors name the tensor and the config field.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jinfer.weights.channel_tensor import ChannelTensor
from jinfer.weights.groupwise_tensor import GroupwiseTensor, GroupwiseWeights
from jinfer.weights.hf_layout import WeightError
from jinfer.weights.hf_quantized import _group_order, _nibbles
from jinfer.weights.safetensors_dir import TensorFiles

_CF = "quantization_config"
FORMATS = ("int-quantized", "float-quantized", "pack-quantized")
_VALUES = {"int-quantized": "I8", "float-quantized": "F8_E4M3", "fp8": "F8_E4M3"}
_SCALE_DTYPES = ("F32", "BF16", "F16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scheme:
  """One checkpoint's quantization, validated."""
  format: str  # one of FORMATS, or "fp8" (transformers' own)
  strategy: str  # weights: "channel", "tensor" or "group"
  group_size: int | None  # "group" only
  symmetric: bool
  activations: bool  # activations quantized too (8 bits, as the weights' type)
  static: bool  # ... with a stored per-tensor input scale
  field: str  # where the weights' arguments sit in config.json, for errors
  source: str  # config.json, for errors

  @property
  def quantization(self) -> tuple[str, dict | None]:
    """What jinfer runs it as: (quantization, quantization_config)."""
    if self.format == "pack-quantized":
      return "int4", None
    if self.format == "int-quantized":
      return ("w8a8", {"smoothquant": False}) if self.activations else ("int8", None)
    return "fp8", {"activations": "fp8" if self.activations else "float"}

  @property
  def scale_name(self) -> str:
    return "weight_scale_inv" if self.format == "fp8" else "weight_scale"

  @property
  def input_scale_name(self) -> str:
    return "activation_scale" if self.format == "fp8" else "input_scale"


def scheme(q: dict, source: str) -> Scheme:
  """The scheme of `quantization_config` q (quant_method "compressed-tensors" or "fp8")."""
  if q.get("quant_method") == "fp8":
    return _hf_fp8_scheme(q, source)
  fmt = q.get("format")
  groups = q.get("config_groups")
  if not isinstance(groups, dict) or len(groups) != 1:
    raise WeightError(f"{source}: {_CF}.config_groups has {len(groups or {})} groups; one "
                      f"quantization scheme for every quantized layer is supported")
  (name, group), = groups.items()
  field = f"{_CF}.config_groups.{name}"
  fmt = group.get("format") or fmt
  if fmt not in FORMATS:
    raise WeightError(f"{source}: {_CF}.format={fmt!r} is not supported (supported: "
                      f"{', '.join(FORMATS)})")
  w, a = group.get("weights"), group.get("input_activations")
  if not isinstance(w, dict):
    raise WeightError(f"{source}: {field}.weights is missing: a scheme without quantized "
                      f"weights is not supported")
  if group.get("output_activations"):
    raise WeightError(f"{source}: {field}.output_activations: quantized outputs are not "
                      f"supported")
  kind = "float" if fmt == "float-quantized" else "int"
  bits = 4 if fmt == "pack-quantized" else 8
  strategies = ("group", "channel") if fmt == "pack-quantized" else ("channel", "tensor")
  for key, want in (("type", kind), ("num_bits", bits)):
    if w.get(key) != want:
      raise WeightError(f"{source}: {field}.weights.{key}={w.get(key)!r}: format {fmt!r} is "
                        f"read with {key} {want!r}")
  if w.get("strategy") not in strategies:
    raise WeightError(f"{source}: {field}.weights.strategy={w.get('strategy')!r} is not "
                      f"supported for {fmt!r} (supported: {', '.join(strategies)})")
  if w.get("dynamic"):
    raise WeightError(f"{source}: {field}.weights.dynamic=true: weights must be stored "
                      f"quantized")
  symmetric = w.get("symmetric", True)
  if not symmetric and fmt != "pack-quantized":
    raise WeightError(f"{source}: {field}.weights.symmetric=false: 8-bit weights are read "
                      f"symmetric only")
  group_size = w.get("group_size")
  if w.get("strategy") == "group" and (not isinstance(group_size, int) or group_size < 2
                                       or group_size % 2):
    raise WeightError(f"{source}: {field}.weights.group_size={group_size!r} must be an even "
                      f"number >= 2")
  if a is not None:
    if fmt == "pack-quantized":
      raise WeightError(f"{source}: {field}.input_activations: 4-bit weights are read with "
                        f"float activations (W4A16) only")
    if a.get("type") != kind or a.get("num_bits") != 8 or a.get("strategy") not in (
        "token", "tensor"):
      raise WeightError(f"{source}: {field}.input_activations: {a.get('num_bits')}-bit "
                        f"{a.get('type')} per {a.get('strategy')} is not supported (8-bit "
                        f"{kind} per token or per tensor)")
  return Scheme(format=fmt, strategy=w["strategy"], group_size=group_size, symmetric=symmetric,
                activations=a is not None, static=a is not None and not a.get("dynamic"),
                field=f"{field}.weights", source=source)


def _hf_fp8_scheme(q: dict, source: str) -> Scheme:
  if q.get("weight_block_size") is not None:
    raise WeightError(f"{source}: {_CF}.weight_block_size={q['weight_block_size']!r}: "
                      f"block-wise FP8 scales are not read yet (per-tensor scales are: "
                      f"weight_block_size null)")
  act = q.get("activation_scheme", "dynamic")
  if act not in ("dynamic", "static"):
    raise WeightError(f"{source}: {_CF}.activation_scheme={act!r} must be dynamic or static")
  return Scheme(format="fp8", strategy="tensor", group_size=None, symmetric=True,
                activations=True, static=act == "static", field=_CF, source=source)


def read(path: str, s: Scheme) -> GroupwiseWeights:
  """Every quantized linear of HF directory `path` (HF module name -> `ChannelTensor` [N, K] or
  `GroupwiseTensor` [K, N]) and every other tensor under its HF name, as stored."""
  tensors = TensorFiles(path)
  files, header, read_tensor = tensors.files, tensors.header, tensors.read
  if s.format == "pack-quantized":
    prefixes = sorted(n.removesuffix(".weight_packed") for n in files
                      if n.endswith(".weight_packed"))
  else:
    prefixes = sorted(n.removesuffix(".weight") for n in files if n.endswith(".weight")
                      and header(n)[1] == _VALUES[s.format])
  if not prefixes:
    raise WeightError(f"{path}: {s.source} declares {s.format} weights but no tensor is stored "
                      f"so")
  check = _check_packed if s.format == "pack-quantized" else _check_channel
  layers = {p: check(s, p, files, header, read_tensor) for p in prefixes}
  linears = {p: (_read_packed if s.format == "pack-quantized" else _read_channel)(
      s, p, layer, read_tensor) for p, layer in layers.items()}
  taken = {f"{p}.{part}" for p in prefixes for part in (
      "weight", "weight_packed", "weight_shape", "weight_scale", "weight_scale_inv",
      "weight_zero_point", "weight_g_idx", "input_scale", "activation_scale")}
  floats = {name: read_tensor(name) for name in sorted(files) if name not in taken}
  return GroupwiseWeights(linears, floats, {})


def _need(s: Scheme, name: str, files, why: str) -> None:
  if name not in files:
    raise WeightError(f"{s.source}: missing tensor {name!r} ({s.field}: {why})")


def _check_channel(s: Scheme, p: str, files, header, read_tensor) -> tuple[int, int]:
  """(N, K) of int8 / float8 layer p, every tensor it needs checked from its header."""
  (w, _) = header(f"{p}.weight")
  if len(w) != 2:
    raise WeightError(f"{s.source}: tensor '{p}.weight' has shape {list(w)}, expected [N, K]")
  n, _k = w
  scale = f"{p}.{s.scale_name}"
  _need(s, scale, files, f"strategy {s.strategy!r} stores a scale")
  shape, dtype = header(scale)
  want = ((n, 1), (n,)) if s.strategy == "channel" else ((1,), ())
  if shape not in want or dtype not in _SCALE_DTYPES:
    raise WeightError(f"{s.source}: tensor {scale!r} is {dtype} {list(shape)}, expected a float "
                      f"{list(want[0])} ({s.field}.strategy={s.strategy!r})")
  if s.static:
    name = f"{p}.{s.input_scale_name}"
    _need(s, name, files, "static activations store an input scale")
    if int(np.prod(header(name)[0])) != 1:
      raise WeightError(f"{s.source}: tensor {name!r} has shape {list(header(name)[0])}, "
                        f"expected one scale per tensor")
  return n, _k


def _read_channel(s: Scheme, p: str, nk: tuple[int, int], read_tensor) -> ChannelTensor:
  n, _ = nk
  values = read_tensor(f"{p}.weight")
  scale = np.broadcast_to(read_tensor(f"{p}.{s.scale_name}").astype(np.float32).reshape(-1),
                          (n,))
  return ChannelTensor(values=values, scale=np.ascontiguousarray(scale))


@dataclasses.dataclass(frozen=True)
class _Packed:
  n: int
  k: int
  group_size: int
  perm: np.ndarray | None


def _check_packed(s: Scheme, p: str, files, header, read_tensor) -> _Packed:
  for part in ("weight_shape", "weight_scale") + (() if s.symmetric else
                                                   ("weight_zero_point",)):
    _need(s, f"{p}.{part}", files, f"symmetric={s.symmetric} pack-quantized weights store it")
  packed, packed_t = header(f"{p}.weight_packed")
  shape_t = header(f"{p}.weight_shape")
  if shape_t[0] != (2,):
    raise WeightError(f"{s.source}: tensor '{p}.weight_shape' has shape {list(shape_t[0])}, "
                      f"expected [2]")
  n, k = (int(x) for x in read_tensor(f"{p}.weight_shape"))
  if packed_t != "I32" or packed != (n, -(-k // 8)):
    raise WeightError(f"{s.source}: tensor '{p}.weight_packed' is {packed_t} {list(packed)}, "
                      f"expected I32 {[n, -(-k // 8)]} for weight_shape {[n, k]}")
  g = s.group_size if s.strategy == "group" else k
  if k % g or k % 8:
    raise WeightError(f"{s.source}: {s.field}.group_size={g} does not divide the {k} inputs "
                      f"of '{p}.weight_packed' (whole groups of whole words are read)")
  scale, scale_t = header(f"{p}.weight_scale")
  if scale != (n, k // g) or scale_t not in _SCALE_DTYPES:
    raise WeightError(f"{s.source}: tensor '{p}.weight_scale' is {scale_t} {list(scale)}, "
                      f"expected a float {[n, k // g]} ({s.field}.group_size={g})")
  if not s.symmetric:
    zp, zp_t = header(f"{p}.weight_zero_point")
    if zp != (-(-n // 8), k // g) or zp_t != "I32":
      raise WeightError(f"{s.source}: tensor '{p}.weight_zero_point' is {zp_t} {list(zp)}, "
                        f"expected I32 {[-(-n // 8), k // g]}")
  perm = None
  if (name := f"{p}.weight_g_idx") in files:
    if header(name)[0] != (k,):
      raise WeightError(f"{s.source}: tensor {name!r} has shape {list(header(name)[0])}, "
                        f"expected [{k}]")
    perm = _group_order(read_tensor(name).astype(np.int64), g, name, s.source)
  return _Packed(n, k, g, perm)


def _read_packed(s: Scheme, p: str, layer: _Packed, read_tensor) -> GroupwiseTensor:
  n, k, g = layer.n, layer.k, layer.group_size
  codes = _nibbles(read_tensor(f"{p}.weight_packed")).reshape(n, -1)[:, :k].T  # [K, N] q + 8
  scale = read_tensor(f"{p}.weight_scale").astype(np.float32).T  # [K/g, N]
  zero = 0.0
  if not s.symmetric:
    zp = _nibbles(read_tensor(f"{p}.weight_zero_point").T)  # [K/g, N/8, 8]
    zero = zp.reshape(k // g, -1)[:, :n].astype(np.float32) - 8
  if layer.perm is not None:
    codes = codes[layer.perm]
  # Exact for float16 / bfloat16 scales (what checkpoints store): a 5-bit integer times one.
  offset = -((8 + zero) * scale)
  return GroupwiseTensor.from_codes(np.ascontiguousarray(codes), scale, offset, bits=4,
                                    group_size=g, perm=layer.perm)
