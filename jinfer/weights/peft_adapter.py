"""PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`, what HF peft's
`save_pretrained` writes) <-> low-rank factors in jinfer's kernel layout.

PEFT adapts a linear layer `y = x W^T` to `y = x W^T + scaling * x A^T B^T` with
`lora_A.weight` A [r, in] and `lora_B.weight` B [out, r], scaling `lora_alpha / r` (or
`lora_alpha / sqrt(r)` with rsLoRA). A jinfer kernel is `[in..., out...]` (`jinfer/models/llama.py`,
HF's tensors rearranged by `jinfer/weights/hf_layout.py`); flattened to [K, N] it is W^T with the
same row and column order as HF's, so the adapter is `kernel + (a @ b).reshape(kernel.shape)` with
a = A^T [K, r] and b = scaling * B^T [r, N], stacked over the layers like the kernels.

Which modules an adapter covers follows PEFT's own matching rules (`target_modules`,
`layers_to_transform`, `exclude_modules`, "all-linear"), evaluated over the HF module names of the
model the config describes, and the file's tensors must be exactly those. Everything is checked
here on the host, so a bad adapter fails at load, before anything reaches a device.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import ml_dtypes
import numpy as np

from jinfer.config import ModelConfig
from jinfer.errors import ParameterError
from jinfer.weights.builtin import resolve_adapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class AdapterError(ParameterError):
  """An adapter that cannot be served: the message names the offending field, tensor or file;
  `param` the argument that brought it."""

  def __init__(self, message: str, param: str = "lora_request"):
    super().__init__(param, message)


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
  path: str
  rank: int  # `r` of adapter_config.json
  target_modules: tuple[str, ...]  # HF short names adapted, sorted, e.g. ("q_proj", "v_proj")
  # The Linear module's path in the params tree (without "kernel"), e.g. ("layers", "attn",
  # "q_proj"), -> (a [L, K, r], b [L, r, N]) float32, the scaling folded into b; K, N the
  # kernel's flattened input and output dims; L the stack's layers (zeros where not adapted).
  weights: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]]
  scaling: float = 1.0  # lora_alpha / r (or / sqrt(r)), already in b: new tensors get it too
  modules: tuple[str, ...] = ()  # the HF module names adapted, as adapter_config.json picks them

  def num_bytes(self) -> int:
    return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


@dataclasses.dataclass(frozen=True)
class _Site:
  """One adaptable HF module: its params path, the stack's layer count and this layer's slot."""
  path: tuple[str, ...]
  layers: int
  slot: int
  k: int
  n: int


def _modules(config: ModelConfig) -> tuple[dict[str, _Site | None], list[str]]:
  """(every nn.Linear/nn.Embedding name of the HF model -> its site, or None where jinfer
  cannot adapt it; the names "all-linear" covers). Names as `model.named_modules()` gives them."""
  c = config
  e, f, d = c.hidden_size, c.intermediate_size, c.head_dim
  moe = set(c.moe_layer_ids)
  dense = [i for i in range(c.num_layers) if i not in moe]
  mlp_prefix = ("mlp_layers",) if moe and dense else ("layers", "mlp")
  shapes = {"q_proj": (e, c.num_heads * d), "k_proj": (e, c.num_kv_heads * d),
            "v_proj": (e, c.num_kv_heads * d), "o_proj": (c.num_heads * d, e),
            "gate_proj": (e, f), "up_proj": (e, f), "down_proj": (f, e)}
  out: dict[str, _Site | None] = {}
  for i in range(c.num_layers):
    p = f"model.layers.{i}"
    for m in ATTENTION:
      out[f"{p}.self_attn.{m}"] = _Site(("layers", "attn", m), c.num_layers, i, *shapes[m])
    if i in moe:  # routers and shared experts are nn.Linear; routed experts are fused params
      router = "block_sparse_moe.gate" if c.architecture == "mixtral" else "mlp.gate"
      out[f"{p}.{router}"] = None
      if c.shared_expert_intermediate_size:
        for m in MLP + ("shared_expert_gate",):
          out[f"{p}.mlp.shared_expert.{m}" if m in MLP else f"{p}.mlp.{m}"] = None
    else:
      for m in MLP:
        out[f"{p}.mlp.{m}"] = _Site(mlp_prefix + (m,), len(dense), dense.index(i), *shapes[m])
  linear = list(out)  # "all-linear": every linear layer but the output layer
  out["model.embed_tokens"] = None
  out["lm_head"] = None
  return out, linear


def _matches(cfg: dict, key: str) -> bool:
  """PEFT's `check_target_module_exists` (peft 0.22) for one module name."""
  exclude = cfg.get("exclude_modules")
  if exclude:
    if isinstance(exclude, str):
      if re.fullmatch(exclude, key):
        return False
    elif key in exclude or any(key.endswith(f".{x}") for x in exclude):
      return False
  targets = cfg["target_modules"]
  if isinstance(targets, str):
    return re.fullmatch(targets, key) is not None
  if key in targets:
    return True
  if not any(key.endswith(f".{t}") for t in targets):
    return False
  layers = cfg.get("layers_to_transform")
  if layers is None or layers == []:
    return True
  patterns = cfg.get("layers_pattern") or None
  if patterns is None:
    m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
  else:
    m = None
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
      m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
      if m is not None:
        break
  if m is None:
    return False
  idx = int(m.group("idx"))
  return idx == layers if isinstance(layers, int) else idx in layers


def _read_config(path: str) -> dict:
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.isdir(path):
    raise AdapterError(f"LoRA adapter {path!r}: no such directory")
  if not os.path.isfile(file):
    raise AdapterError(f"LoRA adapter {path!r}: missing {CONFIG_FILE}")
  try:
    with open(file) as fh:
      cfg = json.load(fh)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise AdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not valid JSON: {e}") from None
  if not isinstance(cfg, dict):
    raise AdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} must hold a JSON object")
  return cfg


def _check_config(cfg: dict, path: str, max_rank: int | None) -> tuple[int, float]:
  """(rank, scaling) of a plain LoRA config; anything else refused, naming the field."""
  where = f"LoRA adapter {path!r}: {CONFIG_FILE}"
  if cfg.get("peft_type") != "LORA":
    raise AdapterError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (only "
                       f"'LORA')")
  r = cfg.get("r")
  if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
    raise AdapterError(f"{where}: r must be a positive integer, got {r!r}")
  if max_rank is not None and r > max_rank:
    raise AdapterError(f"{where}: r={r} exceeds max_lora_rank={max_rank}")
  alpha = cfg.get("lora_alpha", 8)
  if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
    raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
  refused = {"modules_to_save": "extra trained modules", "use_dora": "DoRA",
             "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
             "target_parameters": "adapted parameters (MoE experts)",
             "layer_replication": "replicated layers", "lora_bias": "LoRA biases",
             "fan_in_fan_out": "Conv1D-layout weights",
             "trainable_token_indices": "trainable tokens"}
  for field, what in refused.items():
    if cfg.get(field):
      raise AdapterError(f"{where}: {field}={cfg[field]!r} is not supported ({what}); jinfer "
                         f"serves plain LoRA on linear layers")
  if cfg.get("bias", "none") != "none":
    raise AdapterError(f"{where}: bias={cfg['bias']!r} is not supported (only 'none')")
  targets = cfg.get("target_modules")
  if not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                       and all(isinstance(t, str) for t in targets))):
    raise AdapterError(f"{where}: target_modules must be a non-empty list of module names or a "
                       f"regex string, got {targets!r}")
  layers = cfg.get("layers_to_transform")
  if not (layers is None or (isinstance(layers, int) and not isinstance(layers, bool))
          or (isinstance(layers, list) and all(isinstance(x, int) for x in layers))):
    raise AdapterError(f"{where}: layers_to_transform must be an int or a list of ints, got "
                       f"{layers!r}")
  return r, alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)


def _targets(cfg: dict, config: ModelConfig, path: str) -> dict[str, _Site]:
  """The HF module names the adapter covers by PEFT's rules, each with its site."""
  modules, linear = _modules(config)
  if isinstance(cfg["target_modules"], str) and cfg["target_modules"].lower() == "all-linear":
    cfg = {**cfg, "target_modules": linear}
  picked = {name: site for name, site in modules.items() if _matches(cfg, name)}
  where = f"LoRA adapter {path!r}: {CONFIG_FILE}"
  bad = sorted(name for name, site in picked.items() if site is None)
  if bad:
    raise AdapterError(f"{where}: target_modules selects {', '.join(bad[:4])}"
                       f"{' ...' if len(bad) > 4 else ''}, which jinfer cannot adapt (only the "
                       f"attention projections {'/'.join(ATTENTION)} and the dense MLP's "
                       f"{'/'.join(MLP)}; no embeddings, lm_head, routers or experts)")
  if not picked:
    raise AdapterError(f"{where}: target_modules {cfg['target_modules']!r} (with "
                       f"layers_to_transform={cfg.get('layers_to_transform')!r}) matches no "
                       f"module of this {config.architecture} model")
  return picked


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  from safetensors import SafetensorError, deserialize
  file = os.path.join(path, WEIGHTS_FILE)
  if not os.path.isfile(file):
    other = " (adapter_model.bin, a pickle, is not read: save with safe_serialization)" if (
        os.path.isfile(os.path.join(path, "adapter_model.bin"))) else ""
    raise AdapterError(f"LoRA adapter {path!r}: missing {WEIGHTS_FILE}{other}")
  with open(file, "rb") as fh:
    data = fh.read()
  try:
    views = deserialize(data)
  except SafetensorError as e:
    raise AdapterError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} is not a valid safetensors file: "
                       f"{e}") from None
  dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
  out = {}
  for name, v in views:
    if v["dtype"] not in dtypes:
      raise AdapterError(f"LoRA adapter {path!r}: tensor {name!r} has dtype {v['dtype']}; "
                         f"expected a float type ({', '.join(dtypes)})")
    out[name] = np.frombuffer(v["data"], dtypes[v["dtype"]]).reshape(v["shape"])
  return out


def adapter_rank(path: str) -> int:
  """The rank `r` of a PEFT adapter directory (or shipped adapter's name), its config checked."""
  path = resolve_adapter(path)
  return _check_config(_read_config(path), path, None)[0]


def load_peft_adapter(path: str, config: ModelConfig, *, max_rank: int | None = None
                      ) -> LoraAdapter:
  """Read and check a PEFT LoRA adapter directory (or shipped adapter's built-in name, e.g.
  "smollm2-135m-signoff") for the model `config` describes; the factors in jinfer's layout,
  float32, the scaling folded into b. Raises AdapterError."""
  path = resolve_adapter(path)
  cfg = _read_config(path)
  rank, scaling = _check_config(cfg, path, max_rank)
  picked = _targets(cfg, config, path)
  where = f"LoRA adapter {path!r}: {WEIGHTS_FILE}"
  weights = _factors(_read_tensors(path), picked, rank, scaling, where, "lora_request")
  short = tuple(sorted({site.path[-1] for site in picked.values()}))
  return LoraAdapter(path=path, rank=rank, target_modules=short, weights=weights,
                     scaling=scaling, modules=tuple(picked))


def _factors(tensors: dict[str, np.ndarray], picked: dict[str, _Site], rank: int,
             scaling: float, where: str, param: str
             ) -> dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]]:
  """The factors of PEFT-named `tensors` for the modules `picked`, every tensor checked (present,
  its shape, finite, none left over); AdapterError(param) naming the first that is not."""
  weights: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
  used = set()
  for name, site in picked.items():
    if site.path not in weights:
      weights[site.path] = (np.zeros((site.layers, site.k, rank), np.float32),
                            np.zeros((site.layers, rank, site.n), np.float32))
    a, b = weights[site.path]
    for part, shape, dest in (("lora_A", (rank, site.k), a), ("lora_B", (site.n, rank), b)):
      keys = [f"base_model.model.{name}.{part}{infix}.weight" for infix in ("", ".default")]
      key = next((k for k in keys if k in tensors), None)
      if key is None:
        raise AdapterError(f"{where} is missing tensor {keys[0]!r} (adapter_config.json's "
                           f"target_modules selects {name})", param)
      w = tensors[key]
      if tuple(w.shape) != shape:
        raise AdapterError(f"{where}: tensor {key!r} has shape {tuple(w.shape)}, expected "
                           f"{shape} (r={rank} and the model's {name})", param)
      w = w.astype(np.float32)
      if not np.isfinite(w).all():
        raise AdapterError(f"{where}: tensor {key!r} has non-finite values", param)
      dest[site.slot] = w.T * (scaling if part == "lora_B" else 1.0)
      used.add(key)
  extra = sorted(set(tensors) - used)
  if extra:
    raise AdapterError(f"{where} has tensor {extra[0]!r}"
                       f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''} that "
                       f"adapter_config.json's target_modules does not select for this model",
                       param)
  return weights


def replace_tensors(adapter: LoraAdapter, config: ModelConfig, tensors: dict) -> LoraAdapter:
  """`adapter` with new factors, checked exactly as its files were (same rank, same modules,
  every tensor present with its shape, finite, none extra); AdapterError("tensors") naming the
  first that is not. `tensors`: PEFT's names (`base_model.model.<module>.lora_A.weight` [r, in],
  `lora_B.weight` [out, r]), or jinfer's trainer layout, `{params path: (a [L, K, r],
  b [L, r, N])}` with b unscaled, covering every layer of each adapted stack (what
  `save_peft_adapter` takes). The adapter's scaling applies to either."""
  where = f"update_lora({adapter.path!r})"
  if not isinstance(tensors, dict) or not tensors:
    raise AdapterError(f"{where}: tensors must be a non-empty dict, got "
                       f"{type(tensors).__name__}", "tensors")
  if all(isinstance(k, tuple) for k in tensors):
    tensors = peft_tensors(config, tensors, adapter.rank, where)
  elif not all(isinstance(k, str) for k in tensors):
    raise AdapterError(f"{where}: tensors are keyed by PEFT tensor names (str) or by params "
                       f"paths (tuples), not a mix", "tensors")
  host = {}
  for name, value in tensors.items():
    w = np.asarray(value)
    if w.dtype not in (np.float32, np.float16, ml_dtypes.bfloat16, np.float64):
      raise AdapterError(f"{where}: tensor {name!r} has dtype {w.dtype}; expected a float type",
                         "tensors")
    host[name] = w
  modules, _ = _modules(config)
  picked = {name: modules[name] for name in adapter.modules}
  weights = _factors(host, picked, adapter.rank, adapter.scaling, where, "tensors")
  return dataclasses.replace(adapter, weights=weights)


def peft_tensors(config: ModelConfig, weights, rank: int, where: str = "save_peft_adapter"
                 ) -> dict[str, np.ndarray]:
  """Factors keyed like `LoraAdapter.weights` (a [L, K, r], b [L, r, N]) as PEFT's tensors,
  every layer of each stack; an AdapterError("tensors") naming a path or shape that does not
  fit the model."""
  modules, _ = _modules(config)
  names = {(site.path, site.slot): name for name, site in modules.items() if site is not None}
  tensors = {}
  for site_path, pair in weights.items():
    site_path = tuple(site_path)
    layers = sum(1 for p, _ in names if p == site_path)
    if not layers:
      raise AdapterError(f"{where}: {site_path} is not an adaptable module of this model",
                         "tensors")
    a, b = (np.asarray(x) for x in pair)
    if (a.ndim != 3 or b.ndim != 3 or a.shape[0] != layers or a.shape[2] != rank
        or b.shape[:2] != (layers, rank)):
      raise AdapterError(f"{where}: {site_path} has a {a.shape} and b {b.shape}; expected "
                         f"[{layers}, K, {rank}] and [{layers}, {rank}, N]", "tensors")
    for slot in range(layers):
      name = names[(site_path, slot)]
      tensors[f"base_model.model.{name}.lora_A.weight"] = a[slot].T
      tensors[f"base_model.model.{name}.lora_B.weight"] = b[slot].T
  return tensors


def save_peft_adapter(path: str, config: ModelConfig, weights, *, rank: int, alpha: float,
                      use_rslora: bool = False, base_model: str | None = None,
                      dtype=np.float32) -> None:
  """Write `weights` as a PEFT LoRA adapter directory that `PeftModel.from_pretrained` loads on
  the HF model and `load_peft_adapter` reads back.

  `weights` is keyed like `LoraAdapter.weights`, (a [L, K, r], b [L, r, N]), but with b UNSCALED:
  the trainer's own factors, the adapter's delta being (alpha / r, or alpha / sqrt(r) with
  rsLoRA) * a @ b. Every layer of each stack is written (zeros included); `dtype` (float32 or
  float16) is the stored precision."""
  from safetensors.numpy import save_file
  modules, _ = _modules(config)
  names = {(site.path, site.slot): name for name, site in modules.items() if site is not None}
  tensors = {k: np.asarray(v, np.float32) for k, v in peft_tensors(config, weights, rank).items()}
  if np.dtype(dtype) not in (np.float32, np.float16):
    raise ValueError(f"save_peft_adapter: dtype must be float32 or float16, got {dtype}")
  os.makedirs(path, exist_ok=True)
  save_file({k: np.ascontiguousarray(v.astype(dtype)) for k, v in sorted(tensors.items())},
            os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
  cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
         "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora, "lora_dropout": 0.0,
         "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
         # Short names as PEFT users write them; full names where a short one would also pick
         # an MoE layer's shared expert.
         "target_modules": (sorted({tuple(p)[-1] for p in weights}) if not config.moe_layer_ids
                            else sorted(names[(tuple(p), s)] for p, (a, _) in weights.items()
                                        for s in range(a.shape[0]))),
         "modules_to_save": None,
         "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
         "alpha_pattern": {}, "use_dora": False, "init_lora_weights": True}
  with open(os.path.join(path, CONFIG_FILE), "w") as fh:
    json.dump(cfg, fh, indent=2)
