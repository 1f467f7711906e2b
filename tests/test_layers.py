"""Imports point down the layers of docs/architecture.md: every module of `pallas_kernels` and
`jinfer` is parsed (`ast`, nothing is imported) and each import of a project module must name one
of its own layer or a lower one. No exceptions list: a module that needs something above it
means the code is in the wrong place."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Lowest first. A module belongs to the layer of the longest prefix that names it.
LAYERS = [
    ["pallas_kernels"],
    ["jinfer.config", "jinfer.errors", "jinfer.quant", "jinfer.targets"],
    ["jinfer.weights"],  # checkpoint formats: safetensors, GGUF, orbax, built-in names
    ["jinfer.tokenizer"],  # reads GGUF metadata through jinfer.weights
    ["jinfer.loader"],  # a model name -> (config, params, tokenizer)
    ["jinfer.parallel"],  # meshes, sharding rules, ring attention, expert-parallel matmul
    ["jinfer.models"],
    ["jinfer.sampling"],  # the sampling floor: params, device sampling, acceptance, trees
    # The engine's host bookkeeping and its configuration; the wing's configuration and
    # checkpoint formats sit here too, so that the engine's config can name them.
    ["jinfer.engine.request", "jinfer.engine.block_manager", "jinfer.engine.scheduler",
     "jinfer.engine.step_input", "jinfer.engine.engine_config", "jinfer.engine.compilation_cache",
     "jinfer.engine.step_compiler", "jinfer.engine.compile_guard",
     "jinfer.engine.expert_load", "jinfer.engine.speculative.config",
     "jinfer.engine.speculative.medusa_heads", "jinfer.engine.speculative.draft_checkpoint",
     "jinfer.engine.speculative.stats", "jinfer.engine.kv_transfer",
     "jinfer.engine.json_option", "jinfer.engine.lora_slots"],
    ["jinfer.engine.speculative"],  # the wing: proposers, built on the engine's types
    ["jinfer.engine"],  # the step, the engine loop, async and data-parallel engines
    ["jinfer.llm", "jinfer.serving", "jinfer"],  # entry points (and the package's own __init__)
    # What runs jinfer from outside, imported by nothing in the library: the command line (whose
    # `bench` and `bench-serve` run benchmarks), the benchmarks and the training runs.
    ["jinfer.cli", "jinfer.bench", "jinfer.training"],
]


def layer_of(module: str) -> int | None:
  best, found = -1, None
  for i, prefixes in enumerate(LAYERS):
    for p in prefixes:
      if (module == p or module.startswith(p + ".")) and len(p) > best:
        best, found = len(p), i
  return found


def modules() -> dict[str, pathlib.Path]:
  out = {}
  for top in ("pallas_kernels", "jinfer"):
    for path in sorted((ROOT / top).rglob("*.py")):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      out[".".join(parts)] = path
  return out


def imports(module: str, path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, imported module) for every import of a project module, at any depth (function
  bodies included): `from a.b import c` counts as a.b.c when that is a module, else a.b."""
  known = modules()
  is_package = path.name == "__init__.py"
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: resolve against this module's package
        pkg = module.split(".")[:len(module.split(".")) - node.level + is_package]
        base = ".".join(pkg + ([base] if base else []))
      for a in node.names:
        full = f"{base}.{a.name}"
        out.append((node.lineno, full if full in known else base))
  return [(line, m) for line, m in out if m.split(".")[0] in ("jinfer", "pallas_kernels")]


def test_every_module_has_a_layer():
  assert [m for m in modules() if layer_of(m) is None] == []


def upward(module: str, path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, imported module) for each import of `module` that points up."""
  return [(line, t) for line, t in imports(module, path) if layer_of(t) > layer_of(module)]


def test_imports_point_down():
  bad = [f"{path.relative_to(ROOT)}:{line}: {module} (layer {layer_of(module)}) imports "
         f"{target} (layer {layer_of(target)})"
         for module, path in modules().items() for line, target in upward(module, path)]
  assert bad == [], "\n".join(bad)


def test_an_upward_import_is_caught(tmp_path):
  """The checker itself: an upward import inside a function body of a model module is found,
  a downward one is not."""
  path = tmp_path / "fake.py"
  path.write_text("from jinfer.config import ModelConfig\n\ndef f():\n"
                  "  from jinfer.engine import engine\n  return engine\n")
  assert upward("jinfer.models.fake", path) == [(4, "jinfer.engine.engine")]
