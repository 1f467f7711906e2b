"""A quantized model saved by jinfer: quantize once (AWQ and GPTQ calibrate for a while), load it
back without calibrating again.

On disk, a directory with `jinfer_quantized.json` and `params/`, an orbax checkpoint of plain
arrays. The JSON names the model the weights came from (a built-in name or a path: its config
and tokenizer are read from there), the quantization and its options, and, per quantized leaf
of the params tree, its type and static fields; `params/` holds every array, a quantized leaf as
a dict of its arrays (`q`, `scale`, `offset`, `perm`, `table`; `values`, `scale`).
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from jinfer.quant.groupwise import GroupwiseArray
from jinfer.quant.qarray import QArray
from jinfer.weights.hf_layout import WeightError
from jinfer.weights.orbax_checkpoint import save_params

META = "jinfer_quantized.json"
_is_quantized = lambda x: isinstance(x, (GroupwiseArray, QArray))


def is_quantized_checkpoint(path: str) -> bool:
  return os.path.isfile(os.path.join(path, META))


def save_quantized(path: str, params: dict, *, source: str, quantization: str,
                   quantization_config: dict) -> None:
  """Write `params` (quantized by `quantization` from model `source`) under directory `path`."""
  leaves: dict[str, dict[str, Any]] = {}

  def plain(keypath, x):
    if isinstance(x, GroupwiseArray):
      leaves[jax.tree_util.keystr(keypath)] = dict(type="groupwise", bits=x.bits,
                                                   group_size=x.group_size)
      return {k: v for k, v in (("q", x.q), ("scale", x.scale), ("offset", x.offset),
                                ("perm", x.perm), ("table", x.table)) if v is not None}
    if isinstance(x, QArray):
      leaves[jax.tree_util.keystr(keypath)] = dict(type="qarray", n_in=x.n_in, n_out=x.n_out,
                                                   transposed=x.transposed)
      return {"values": x.values, "scale": x.scale}
    return x

  arrays = jax.tree_util.tree_map_with_path(plain, params, is_leaf=_is_quantized)
  os.makedirs(path, exist_ok=True)
  save_params(os.path.join(path, "params"), arrays)
  with open(os.path.join(path, META), "w") as fh:
    json.dump({"source": source, "quantization": quantization,
               "quantization_config": quantization_config, "leaves": leaves}, fh, indent=1)


def read_meta(path: str) -> dict:
  try:
    with open(os.path.join(path, META)) as fh:
      meta = json.load(fh)
  except json.JSONDecodeError as e:
    raise WeightError(f"{path}/{META}: not valid JSON ({e})") from None
  for key in ("source", "quantization", "leaves"):
    if key not in meta:
      raise WeightError(f"{path}/{META}: missing {key!r}")
  return meta


def load_quantized(path: str) -> tuple[dict, dict]:
  """(the metadata, the params) saved under `path`."""
  import orbax.checkpoint as ocp
  meta = read_meta(path)
  arrays = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(path, "params")))
  leaves = meta["leaves"]

  def rebuild(node, key: str):
    leaf = leaves.get(key)
    if leaf is None and isinstance(node, dict):
      return {k: rebuild(v, f"{key}[{k!r}]") for k, v in node.items()}
    if leaf is None:
      return jnp.asarray(node)  # uncommitted, as the rest of the engine's arrays
    a = {k: jnp.asarray(v) for k, v in node.items()}
    if leaf["type"] == "groupwise":
      return GroupwiseArray(q=a["q"], scale=a["scale"], offset=a.get("offset"),
                            bits=leaf["bits"], group_size=leaf["group_size"], perm=a.get("perm"),
                            table=a.get("table"))
    return QArray(values=a["values"], scale=a["scale"], n_in=leaf["n_in"], n_out=leaf["n_out"],
                  transposed=leaf["transposed"])

  params = rebuild(arrays, "")
  found = {jax.tree_util.keystr(kp) for kp, x in
           jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_quantized)[0]
           if _is_quantized(x)}
  missing = sorted(set(leaves) - found)
  if missing:
    raise WeightError(f"{path}: {META} names {missing[0]}, which params/ lacks")
  return meta, params
