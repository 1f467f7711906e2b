"""An engine's steps built for devices it does not run on (a TPU slice, a GPU), from shapes only.

`AbstractEngine` makes what `LLMEngine` makes, by the same functions, for a model config and
engine options: the config resolved for the target's platform (its kernels, dtype, buckets, KV
groups), the mesh over the target's devices, the params quantized and laid out by the sharding
rules, the KV pool, and the jitted step (`runner.jit_step`). Params and the cache are
`ShapeDtypeStruct`s with their shardings: nothing is allocated, so a 70B model plans on a laptop.
`build(shape)` runs the real compiler on one step shape (the engine's warmup list,
`buckets.shapes`) and reports what it says: built or its error, seconds, the bytes its
`memory_analysis()` gives per device, the collectives in the optimized HLO, and its cost model's
figures where the platform has one.

What it does not plan yet: speculation with a draft model or Medusa heads (their own steps and
weights), GGUF blocks kept quantized (their layout comes from a file), several processes.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jinfer.config import ModelConfig
from jinfer.engine import weight_quantization
from jinfer.engine.engine_config import EngineConfig, default_dtype
from jinfer.engine.runner import jit_step, step_shardings
from jinfer.engine.step_input import empty_step_input, to_step_input
from jinfer.errors import ParameterError
from jinfer.models import CausalLM, linear_kernels, logical_axes, param_shapes
from jinfer.models.lora import empty_slots, target_shapes
from jinfer.parallel.mesh import make_mesh
from jinfer.parallel.sharding import (abstract, check_tensor_parallel, duplicate_kv_heads,
                                     lora_slot_specs,
                                     shard_params, valid_tensor_parallel_sizes)

# Collective ops in optimized HLO (their `-start` halves for async ones), with the first shape
# of their result.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"= \(?(\w+)\[([\d,]*)\][^=]*? (" + "|".join(COLLECTIVES)
                         + r")(-start)?\(")
# A plain copy changes an array's layout (memory-space moves are copy-start / copy-done pairs).
_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(")


@dataclasses.dataclass(frozen=True)
class StepBuild:
  """What the compiler said of one step shape, per device."""
  tokens: int  # T, the token bucket
  prompt_logprobs: bool
  verify: bool
  seconds: float  # to lower and compile
  error: str | None = None  # the compiler's refusal, shortened to its cause; None: it built
  argument_bytes: int = 0
  output_bytes: int = 0
  alias_bytes: int = 0  # outputs written into donated arguments (the KV cache)
  temp_bytes: int = 0  # the step's own scratch: what it needs beyond params and cache
  code_bytes: int = 0
  collectives: dict[str, int] = dataclasses.field(default_factory=dict)
  copy_bytes: int = 0  # of the relayouts (plain copies) of arrays of 1 MiB or more, per step
  # The compiler's cost model ("flops", "bytes accessed", TPU's "optimal_seconds" ...): an
  # estimate, and Pallas kernels count nothing there unless they declare a cost.
  cost: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def built(self) -> bool:
    return self.error is None

  @property
  def peak_bytes(self) -> int:
    """Device memory while the step runs: its arguments, outputs not aliased to them, temps."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def short_error(e: BaseException, limit: int = 300) -> str:
  """A compiler's exception as one line of at most `limit` characters: its first paragraph
  without the parts XLA:TPU wraps around the cause (the HLO instruction being allocated, the
  compilation result proto, advice on filing a bug), whitespace collapsed."""
  text = str(e).split(" [type.googleapis.com")[0].split("\n\n")[0]
  text = text.split(" It should not be possible")[0]
  text = re.sub(r" while allocating on stack for %.*?stack_frame_id=\d+\}\.", ".", text, flags=re.S)
  text = re.sub(r" :: #\S+ \[shape = '[^']*', space=(\w+),.*?The window shape is (\S+?\]),.*",
                r" (space=\1, window \2)", text, flags=re.S)
  line = f"{type(e).__name__}: {' '.join(text.split())}"
  return line if len(line) <= limit else line[:limit - 3] + "..."


def compile_lowered(lowered):
  """`lowered.compile()` past JAX's persistent compilation cache, which cannot load an
  executable for compile-only devices. JAX decides once per process whether the cache is in use:
  where a compile used it before (the test suite turns it on at start) it still looks, warns that
  it cannot read the entry, and compiles anyway."""
  on = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    return lowered.compile()
  finally:
    jax.config.update("jax_enable_compilation_cache", on)


def _bytes(dtype: str, dims: str) -> int:
  bits = re.match(r"[a-z]+?(\d+)", dtype)  # bf16, f32, s8, f8e4m3fn ...; pred: a byte
  return (int(bits.group(1)) // 8 if bits else 1) * math.prod(int(d) for d in dims.split(",") if d)


def collectives(hlo_text: str) -> list[tuple[str, int]]:
  """(op, bytes of its result) for every collective in optimized HLO text."""
  return [(m.group(3), _bytes(m.group(1), m.group(2))) for m in _COLLECTIVE.finditer(hlo_text)]


def relayout_bytes(hlo_text: str, at_least: int = 1 << 20) -> int:
  """Bytes of the plain copies of arrays of `at_least` bytes or more in optimized HLO text:
  relayouts, which a step that reads its cache and weights in place has none of."""
  sizes = (_bytes(m.group(1), m.group(2)) for m in _COPY.finditer(hlo_text))
  return sum(b for b in sizes if b >= at_least)


def count_collectives(hlo_text: str) -> dict[str, int]:
  return dict(collections.Counter(op for op, _ in collectives(hlo_text)))


def _shape_only_quantization(quantization: str | None, options: dict) -> dict:
  """The quantizer options with the same output shapes and no calibration (AWQ and GPTQ store
  what RTN stores; SmoothQuant folds into the norms): shapes are all a plan needs."""
  if quantization in ("int4", "mxfp4", "nvfp4"):
    return dict(options, method="rtn")
  if quantization == "w8a8":
    return dict(options, smoothquant=False)
  return options


class AbstractEngine:
  """`devices`: the target's devices (compile-only ones, or real ones), at least the engine's
  tensor x context parallel size; `platform`: theirs ("tpu", "gpu" or "cpu"). `params`: the
  loaded params (arrays or their shapes), where the model's declaration does not give them:
  a GGUF file's kept blocks (`quantization="gguf"`)."""

  def __init__(self, model_config: ModelConfig, config: EngineConfig, devices, platform: str,
               dtype=None, params: dict | None = None):
    dtype = dtype or default_dtype(platform)
    if config.model.quantization == "mixed":
      raise ParameterError("quantization", "planning quantization='mixed' is not supported: "
                           "which layers take which precision is measured on the weights "
                           "(plan int4 and int8 for its bounds)")
    if config.model.quantization == "gguf" and params is None:
      raise ParameterError("quantization", "planning quantization='gguf' needs the GGUF "
                           "file's blocks: pass the params it loads")
    if config.speculative is not None and config.speculative.method != "ngram":
      raise ParameterError("speculative_config", f"planning {config.speculative.method!r} "
                           f"speculation is not supported yet (its proposer has steps and "
                           f"weights of its own): plan 'ngram', or without speculation")
    if config.parallel.data_parallel_size > 1:
      raise ParameterError("data_parallel_size", "plan one data-parallel rank (each is an "
                           "engine of its own): leave data_parallel_size at 1")
    self.model_config, self.platform, self.dtype = model_config, platform, dtype
    self.config = c = config.resolve(model_config, dtype, platform)
    par = c.parallel
    devices = list(devices)
    if par.devices_per_engine > len(devices):
      sizes = valid_tensor_parallel_sizes(model_config, len(devices) //
                                          par.context_parallel_size)
      raise ParameterError("tensor_parallel_size", f"tensor_parallel_size x "
                           f"context_parallel_size = {par.devices_per_engine} devices; the "
                           f"target has {len(devices)} (valid tensor_parallel_size here: "
                           f"{', '.join(map(str, sizes))})")
    mesh = None
    if par.is_parallel:
      check_tensor_parallel(model_config, par.tensor_parallel_size, par.enable_expert_parallel)
      mesh = make_mesh(par, devices)
    self.mesh = mesh
    self.kernels = kernels = c.kernel_options(mesh)
    self.buckets = dataclasses.replace(c.buckets(), vocab_size=model_config.vocab_size)

    q = c.model.quantization
    options = _shape_only_quantization(
        q, weight_quantization.check_config(q, c.model.quantization_config))

    self.run_config = model_config

    def run_params(params):  # what the engine's _build does to the params it loads
      params = weight_quantization.quantize_weights(
          model_config, params, q, options, int8_transposed=kernels.int8_transposed)
      if mesh is not None:
        self.run_config, params = duplicate_kv_heads(model_config, params,
                                                     par.tensor_parallel_size)
      return params

    params = jax.eval_shape(run_params, param_shapes(model_config, dtype) if params is None else
                            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params))
    run_config = self.run_config
    self.kv_spec = spec = c.kv_spec(run_config)
    kv = jax.eval_shape(spec.allocate)
    if mesh is not None:
      self.params = shard_params(params, logical_axes(run_config), mesh,
                                 par.enable_expert_parallel, linear=linear_kernels(run_config),
                                 place=abstract)
      kv_sharding, out_shardings = step_shardings(mesh, spec.quantized)
      self.kv_cache = jax.tree.map(abstract, kv, kv_sharding)
      self._replicated = NamedSharding(mesh, P())
    else:
      one = self._replicated = SingleDeviceSharding(devices[0])
      self.params, self.kv_cache = jax.tree.map(lambda a: abstract(a, one), (params, kv))
      out_shardings = None
    self.lora = None  # the adapter slots, with enable_lora (jinfer/models/lora.py)
    if c.lora.enable_lora:
      targets = target_shapes(param_shapes(run_config), linear_kernels(run_config))
      slots = jax.eval_shape(lambda: empty_slots(targets, c.lora.max_loras,
                                                 c.lora.max_lora_rank, dtype))
      place = (jax.tree.map(lambda p: NamedSharding(mesh, p), lora_slot_specs(
          logical_axes(run_config), linear_kernels(run_config), targets))
          if mesh is not None else jax.tree.map(lambda _: self._replicated, slots))
      self.lora = jax.tree.map(abstract, slots, place)
    model = CausalLM(run_config, kernels, dtype=dtype, scan_layers=True, kv_groups=c.kv_groups,
                     unroll_scan=c.unroll_scan)
    self._step = jit_step(model, None, out_shardings)

  def shapes(self) -> list[tuple[int, bool, bool]]:
    """Every step shape the engine would warm up: (tokens, prompt_logprobs, verify)."""
    return self.buckets.shapes(self.config.model.enable_prompt_logprobs)

  def lower(self, shape: tuple[int, bool, bool]):
    t, prompt_lp, verify = shape
    inp = to_step_input(empty_step_input(self.buckets, t, prompt_lp, verify), self.buckets)
    inp = jax.tree.map(lambda a: abstract(jnp.asarray(a), self._replicated), inp)
    return self._step.lower(self.params, self.kv_cache, inp, None, None, self.lora)

  def build(self, shape: tuple[int, bool, bool]) -> StepBuild:
    """Compile one step shape; a refusal is reported, not raised."""
    t0 = time.monotonic()
    try:
      compiled = compile_lowered(self.lower(shape))
    except Exception as e:  # the compiler's refusal (Mosaic, VMEM, shared memory, HBM ...)
      return StepBuild(*shape, seconds=time.monotonic() - t0, error=short_error(e))
    seconds = time.monotonic() - t0
    m = compiled.memory_analysis()
    try:
      cost = compiled.cost_analysis() or {}
    except Exception:  # the GPU compiler has no cost model in compile-only mode
      cost = {}
    if isinstance(cost, list):  # older jax: one dict per program
      cost = cost[0] if cost else {}
    keep = {k: float(v) for k, v in cost.items()
            if k in ("flops", "transcendentals", "bytes accessed", "optimal_seconds")}
    text = compiled.as_text()
    return StepBuild(
        *shape, seconds=seconds, argument_bytes=m.argument_size_in_bytes,
        output_bytes=m.output_size_in_bytes, alias_bytes=m.alias_size_in_bytes,
        temp_bytes=m.temp_size_in_bytes, code_bytes=m.generated_code_size_in_bytes,
        collectives=count_collectives(text), copy_bytes=relayout_bytes(text), cost=keep)

  # -- sizes, per device ----------------------------------------------------------------------
  @property
  def weight_bytes(self) -> int:
    """The params' bytes per device, the adapter slots' included."""
    return _per_device(self.params) + self.lora_bytes

  @property
  def lora_bytes(self) -> int:
    return 0 if self.lora is None else _per_device(self.lora)

  @property
  def weight_elements(self) -> int:
    """Values of the params per device (a quantized weight's scales counted too: few)."""
    return _per_device(self.params, in_bytes=False)

  @property
  def kv_cache_bytes(self) -> int:
    return _per_device(self.kv_cache)

  @property
  def page_bytes(self) -> int:
    """One page of the pool on one device (every layer slot, K and V, scales included)."""
    return self.kv_cache_bytes // (self.kv_spec.num_pages // self.config.parallel.context_parallel_size)


def _per_device(tree, in_bytes: bool = True) -> int:
  """Bytes (or values) the first device holds of `tree`'s abstract arrays (every device holds
  as much: the sharding rules split evenly or replicate)."""
  return sum(math.prod(a.sharding.shard_shape(a.shape))
             * (jnp.dtype(a.dtype).itemsize if in_bytes else 1) for a in jax.tree.leaves(tree))
