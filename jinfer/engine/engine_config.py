"""Engine configuration: one section per concern, the flat names users pass, and `resolve()`.

The sections (`ModelOptions`, `CacheConfig`, `SchedulerConfig`, `ParallelConfig`,
`KernelConfig`, `SpeculativeConfig`) are the single source of truth: each field is declared,
defaulted and described once, in its section, and checked there without reading a file or asking
the platform. `EngineConfig.of(**options)` takes vLLM's flat names (`max_model_len=`,
`tensor_parallel_size=`, ...), as `LLM(**kwargs)` and the CLI flags (generated from the same
fields) do. `EngineConfig.resolve(model)` is the one step that reads files (speculation's
checkpoints) and asks which platform jax runs on; the engine runs what it returns.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jinfer.config import ModelConfig
from jinfer.engine.kv_transfer import NAME as KV_TRANSFER, KVTransferConfig
from jinfer.engine.lora_slots import LoRAConfig
from jinfer.engine.scheduler import SchedulerConfig
from jinfer.engine.speculative.config import SpeculativeConfig
from jinfer.engine.step_input import Buckets
from jinfer.errors import ParameterError
from jinfer.models.kernel_options import QUANTIZATIONS, KernelOptions
from jinfer.models.kv_groups import KVGroups
from jinfer.parallel.mesh import ParallelConfig
from jinfer.sampling.sample import LOGPROBS_MODES
from pallas_kernels import KVCacheSpec

# platform -> (attention, int8 matmul, grouped matmul, group-wise matmul, dense matmul): chosen
# from the platform the engine resolves for, never from where jax happens to run (a step built
# for a TPU on a CPU machine must pick the TPU's kernels).
PLATFORM_DEFAULTS = {
    "tpu": ("pallas_tpu", "pallas_tpu", "pallas_tpu", "pallas_tpu", "reference"),
    "gpu": ("pallas_gpu", "pallas_gpu", "pallas_gpu", "pallas_gpu", "reference"),
}
CPU_DEFAULTS = ("xla", "xla", "xla", "xla", "xla_cpu")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# What a quantized KV cache stores (with a float32 scale per token and KV head, see
# pallas_kernels/kv_cache_layout.py); "auto" stores the model's dtype.
KV_STORAGE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelOptions:
  max_model_len: int = 2048  # prompt + output tokens per sequence (capped by the model's)
  # None, "int8" (int8 weights, float activations: W8A16), "w8a8", "int4", "gguf" or "fp8"
  # (see jinfer/engine/weight_quantization.py); applied at load time.
  quantization: str | None = None
  # How `quantization` quantizes, as JSON or a dict (vLLM's name), e.g. {"method": "awq",
  # "group_size": 128}; None: the mode's defaults.
  quantization_config: dict | None = None
  seed: int | None = 0  # seeds requests that bring none; None: a different seed every run
  # Requests may ask for prompt_logprobs: compiles a second step variant per bucket that
  # projects every row to logits, used only by steps that carry such a request.
  enable_prompt_logprobs: bool = False
  # What a sampled token's `logprobs` report (vLLM's names): "raw_logprobs" (the model's
  # distribution), "processed_logprobs" (the distribution the token was drawn from: after
  # penalties, banned tokens, structured-output masks, temperature, top-k/top-p/min-p),
  # "raw_logits" or "processed_logits". Prompt logprobs are always raw.
  logprobs_mode: str = "raw_logprobs"

  def __post_init__(self):
    if self.logprobs_mode not in LOGPROBS_MODES:
      raise ParameterError("logprobs_mode", f"logprobs_mode must be one of "
                           f"{', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
    if self.max_model_len < 1:
      raise ParameterError("max_model_len", f"max_model_len must be >= 1, got "
                                            f"{self.max_model_len}")
    if self.quantization not in QUANTIZATIONS:
      raise ParameterError("quantization", f"unknown quantization {self.quantization!r}; choose "
                           f"one of {', '.join(str(q) for q in QUANTIZATIONS)}")
    q = self.quantization_config
    if isinstance(q, str):  # the CLI's JSON
      try:
        q = json.loads(q)
      except json.JSONDecodeError as e:
        raise ParameterError("quantization_config", f"quantization_config is not valid JSON: "
                                                    f"{e}") from None
      object.__setattr__(self, "quantization_config", q)
    if q is not None and not isinstance(q, dict):
      raise ParameterError("quantization_config", f"quantization_config must be a dict (JSON "
                                                  f"object), got {type(q).__name__}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
  page_size: int | None = None  # tokens per KV-cache page; None: by platform (`page_size_for`)
  num_pages: int | None = None  # default: room for max_num_seqs sequences of half max_model_len
  enable_prefix_caching: bool = True  # reuse the KV pages of prompts' shared full pages
  # What the KV cache stores: "auto" (the model's dtype), "int8" (a scale per token and KV
  # head, stored with its page) or "fp8" (e4m3, where the platform has it).
  kv_cache_dtype: str = "auto"
  # True: every layer keeps the whole context's pages. False (default): sliding-window layers
  # page as their own KV groups and give back the pages that left their window (Gemma-3,
  # Mistral; see jinfer/models/kv_groups.py).
  disable_hybrid_kv_cache_manager: bool = False

  def __post_init__(self):
    if self.page_size is not None and self.page_size < 1:
      raise ParameterError("page_size", f"page_size must be >= 1, got {self.page_size}")
    if self.kv_cache_dtype not in KV_CACHE_DTYPES:
      raise ParameterError("kv_cache_dtype", f"kv_cache_dtype must be one of "
                           f"{', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

  def page_size_for(self, platform: str) -> int:
    """`page_size`, or the platform's: 16 tokens (bf16's sublane tile on a TPU, the smallest
    key block of the GPU kernel, the CPU's measured choice), and on a TPU 128 for an int8 or
    fp8 cache. There a page's per-token scales, `[Hkv, page_size]` float32 at the end of the
    scales array, fill whole 128-lane tiles only when page_size is a multiple of 128; below, the
    TPU compiler lays the array out pages-minor and each layer's attention copies all of it back
    (the compile-only tier measured Llama-3.1-8B's int8 step on a v6e: 132 MB of temporaries at
    page 16, 2.9 MB at 128; docs/compile-only.md)."""
    if platform == "tpu" and self.kv_cache_dtype != "auto":
      if self.page_size is not None and self.page_size % 128:
        raise ParameterError("page_size", f"kv_cache_dtype={self.kv_cache_dtype!r} on a TPU needs "
                             f"page_size a multiple of 128, got {self.page_size}: the TPU "
                             f"attention kernel reads the per-token scales in 128-lane tiles, "
                             f"and smaller pages make every layer copy all of them")
      return self.page_size or 128
    return self.page_size or 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
  attention_backend: str | None = None  # None: by platform (xla on CPU, Pallas elsewhere)
  matmul_backend: str | None = None  # int8 matmul, likewise
  grouped_matmul_backend: str | None = None  # MoE experts' grouped matmul, likewise
  interpret: bool = False  # run Pallas kernels in interpret mode (CPU testing)
  # Run the layer stack under a scan (compiles in seconds) or unrolled (each matmul reads its
  # weights in place). None: by step size, see `max_unrolled_tokens`.
  scan_layers: bool | None = None
  # With scan_layers=None on the CPU: steps of at most this many tokens run unrolled, larger
  # ones scanned, each unrolled bucket costing a compile of every layer (~10x a scanned one).
  # None: a single stream's steps, its verify step included when it speculates.
  max_unrolled_tokens: int | None = None
  # Keep compiled steps on disk (JAX's persistent compilation cache, see compilation_cache.py),
  # so the next process with the same model and options compiles nothing.
  compilation_cache: bool = True
  # Startup compiles the smallest step bucket and one prefill bucket, then serves while a
  # background thread compiles the rest (steps keep to compiled buckets meanwhile: long prompts
  # are chunked, small batches padded). False: every bucket is compiled before serving.
  compile_in_background: bool = True
  # Raise after a step that compiled anything after startup (the recompile guard counts and
  # logs such compiles in any case): for tests and CI.
  strict_compiles: bool = False


SECTIONS = {"model": ModelOptions, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "parallel": ParallelConfig, "kernels": KernelConfig, "lora": LoRAConfig}
SPECULATIVE = "speculative_config"  # the flat name of the `speculative` section


def option_fields() -> list[tuple[str, dataclasses.Field]]:
  """(section, field) for every flat option, in declaration order."""
  return [(name, f) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


_SECTION_OF = {f.name: section for section, f in option_fields()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
  cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
  scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
  kernels: KernelConfig = dataclasses.field(default_factory=KernelConfig)
  lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
  speculative: SpeculativeConfig | None = None  # None: no speculative decoding
  # Prefill and decode on separate device groups (`kv_transfer_config`); None: colocated.
  kv_transfer: KVTransferConfig | None = None

  def __post_init__(self):
    """What no single section can check: how they fit together."""
    cp = self.parallel.context_parallel_size
    if self.kv_transfer is not None:
      if self.parallel.data_parallel_size > 1:
        raise ParameterError("data_parallel_size", "with kv_transfer_config each group's devices "
                             "decide its engines: leave data_parallel_size at 1")
      if cp > 1:
        raise ParameterError("context_parallel_size", "kv_transfer_config does not run with "
                             "context parallelism yet (use context_parallel_size=1)")
      if self.speculative is not None and self.speculative.method == "draft_model":
        raise ParameterError(SPECULATIVE, "a draft model's own KV cache is not handed over "
                             "by kv_transfer_config: decode-side speculation takes 'ngram' or "
                             "'medusa'")
    if self.model.quantization == "mixed" and (self.parallel.is_parallel or self.lora.enable_lora):
      raise ParameterError("quantization", "quantization='mixed' runs on one device without LoRA "
                           "adapters: its layer stack is split into runs of one precision, "
                           "which the sharding rules and the adapter slots do not follow yet")
    if self.lora.enable_lora:
      if self.kv_transfer is not None:
        raise ParameterError("enable_lora", "LoRA adapters are not handed over by "
                             "kv_transfer_config yet: serve them colocated")
      if not self.scheduler.continuous_batching:
        raise ParameterError("enable_lora", "LoRA adapters need continuous_batching=True")
    if cp > 1 and self.speculative is not None and self.speculative.verifies_tree:
      raise ParameterError(SPECULATIVE, f"{self.speculative.method} verifies a tree, which does "
                           f"not run with context parallelism yet: the ring attention takes no "
                           f"tree mask (use context_parallel_size=1)")
    if self.scheduler.max_num_batched_tokens < 2 * cp:
      raise ParameterError("max_num_batched_tokens",
                           f"max_num_batched_tokens ({self.scheduler.max_num_batched_tokens}) "
                           f"must be at least 2 x context_parallel_size ({cp}): each rank holds "
                           f"two chunks")

  @property
  def runs_own_steps(self) -> bool:
    """Whether every process of several schedules and steps engines of its own (disaggregated
    across processes) rather than running process 0's steps."""
    return self.kv_transfer is not None and not self.kv_transfer.in_process

  @classmethod
  def of(cls, **options: Any) -> "EngineConfig":
    """From flat option names (vLLM's): `EngineConfig.of(max_model_len=1024, page_size=32,
    speculative_config={"method": "ngram", "num_speculative_tokens": 4})`."""
    return cls().replace(**options)

  def replace(self, **options: Any) -> "EngineConfig":
    """This config with the named flat options changed."""
    sections: dict[str, dict] = {}
    spec, kvt = self.speculative, self.kv_transfer
    for name, value in options.items():
      if name == SPECULATIVE:
        spec = None if value is None else SpeculativeConfig.parse(value)
      elif name == KV_TRANSFER:
        kvt = None if value is None else KVTransferConfig.parse(value)
      elif name in _SECTION_OF:
        sections.setdefault(_SECTION_OF[name], {})[name] = value
      else:
        raise ParameterError(name, f"unknown engine option {name!r}; known options: "
                             f"{', '.join(sorted([*_SECTION_OF, SPECULATIVE, KV_TRANSFER]))}")
    changed = {s: dataclasses.replace(getattr(self, s), **kw) for s, kw in sections.items()}
    return dataclasses.replace(self, **changed, speculative=spec, kv_transfer=kvt)

  def options(self) -> dict[str, Any]:
    """Every flat option and its value."""
    out = {f.name: getattr(getattr(self, s), f.name) for s, f in option_fields()}
    out[SPECULATIVE] = self.speculative
    out[KV_TRANSFER] = self.kv_transfer
    return out

  def resolve(self, model: ModelConfig, dtype=None, platform: str | None = None
              ) -> "ResolvedConfig":
    """This config for `model` on `platform` (default: where jax runs): every default the
    platform decides filled in, every file named checked, `max_model_len` capped by the model's.
    """
    platform = platform or jax.default_backend()
    max_len = min(self.model.max_model_len, model.max_position_embeddings)
    config = dataclasses.replace(
        self, model=dataclasses.replace(self.model, max_model_len=max_len),
        cache=dataclasses.replace(self.cache, page_size=self.cache.page_size_for(platform)),
        speculative=self.speculative and self.speculative.resolve(platform))
    defaults = PLATFORM_DEFAULTS.get(platform, CPU_DEFAULTS)
    k = config.kernels
    attention = k.attention_backend or defaults[0]
    d = model.head_dim
    if attention == "pallas_gpu" and (d < 16 or d & (d - 1)):
      raise ParameterError("attention_backend", f"the GPU attention kernel (Triton) takes a "
                           f"power-of-two head_dim >= 16; this model's is {d}: pass "
                           f"attention_backend='xla' to run XLA's attention instead")
    pages_per_seq = -(-max_len // config.cache.page_size)
    groups = KVGroups.of(model, max_len, hybrid=not config.cache.disable_hybrid_kv_cache_manager)
    return ResolvedConfig(
        config=config, platform=platform, dtype=dtype or default_dtype(platform),
        max_pages_per_seq=pages_per_seq, kv_groups=groups,
        num_pages=_num_pages(config, groups),
        attention_backend=attention,
        matmul_backend=k.matmul_backend or defaults[1],
        grouped_matmul_backend=k.grouped_matmul_backend or defaults[2],
        groupwise_backend=defaults[3], dense_backend=defaults[4])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedConfig:
  """An `EngineConfig` for one model on one platform: what an engine runs."""
  config: EngineConfig
  platform: str
  dtype: Any
  max_pages_per_seq: int
  kv_groups: KVGroups
  num_pages: int  # of one engine's pool (over all its context ranks: a multiple of their number)
  attention_backend: str
  matmul_backend: str
  grouped_matmul_backend: str
  groupwise_backend: str
  dense_backend: str

  # The sections, as resolved.
  model = property(lambda self: self.config.model)
  cache = property(lambda self: self.config.cache)
  scheduler = property(lambda self: self.config.scheduler)
  parallel = property(lambda self: self.config.parallel)
  kernels = property(lambda self: self.config.kernels)
  speculative = property(lambda self: self.config.speculative)
  lora = property(lambda self: self.config.lora)

  @property
  def num_draft_rows(self) -> int:
    spec = self.speculative
    return 0 if spec is None else spec.num_draft_rows

  def buckets(self) -> Buckets:
    s, cp = self.scheduler, self.parallel.context_parallel_size
    return Buckets(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                   max_prefill_seqs=s.max_prefill_seqs, max_pages_per_seq=self.max_pages_per_seq,
                   max_model_len=self.model.max_model_len,
                   # Single-stream decode runs a 1-token bucket; context parallelism needs
                   # every bucket a multiple of 2 x CP (each rank holds two chunks).
                   smallest_bucket=1 if cp == 1 else 2 * cp,
                   num_speculative_tokens=self.num_draft_rows,
                   num_kv_groups=self.kv_groups.num_groups,
                   max_loras=self.lora.max_loras if self.lora.enable_lora else 0,
                   tree=None if self.speculative is None else self.speculative.tree())

  @property
  def unroll_scan(self) -> bool:
    """Whether the scanned stack runs unrolled: on a GPU (see `CausalLM.unroll_scan`)."""
    return self.platform == "gpu"

  def unrolled_max_tokens(self) -> int:
    """Steps of at most this many tokens run the unrolled stack, larger ones the scanned one.

    By default, on the CPU, small decode steps run unrolled: a scanned layer copies its weights
    out of the stack before each matmul there (a dynamic slice feeds no dot in place), which
    dominates a step that reads every weight for a few rows; each unrolled bucket compiles ~10x
    slower, so only the smallest is by default. Prefill and large batches measure the same or
    better scanned. Elsewhere the scan reads its weights in place and runs everything.
    """
    k = self.kernels
    if k.scan_layers is not None:
      return 0 if k.scan_layers else self.scheduler.max_num_batched_tokens
    if self.platform != "cpu":
      return 0
    if k.max_unrolled_tokens is not None:
      return k.max_unrolled_tokens
    return self.buckets().pick(1 + self.num_draft_rows)

  @property
  def kv_dtype(self):
    """What the KV cache stores: the model's dtype, or int8 / float8_e4m3fn (with scales)."""
    return KV_STORAGE_DTYPES.get(self.cache.kv_cache_dtype, self.dtype)

  def kv_spec(self, model: ModelConfig) -> KVCacheSpec:
    return KVCacheSpec(num_layers=self.kv_groups.num_slots, num_pages=self.num_pages,
                       page_size=self.cache.page_size, num_kv_heads=model.num_kv_heads,
                       head_dim=model.head_dim, dtype=self.kv_dtype)

  def kernel_options(self, mesh: Mesh | None = None) -> KernelOptions:
    """`mesh`: the devices the model runs over, None for one device."""
    # Over a mesh the quantized matmuls run their kernels per shard, under shard_map
    # (jinfer/parallel/linear.py), as attention and the expert-parallel experts do: a Mosaic
    # kernel refuses to be partitioned, and XLA partitioning the XLA forms relayouted stacked
    # int8 weights on eight H100s. Float layers take the plain dot, which XLA partitions in
    # place, and experts split along their MLP axis (no expert parallelism) `ragged_dot`.
    sharded = mesh is not None
    ep = self.parallel.enable_expert_parallel
    return KernelOptions(attention=self.attention_backend, matmul=self.matmul_backend,
                         int8_transposed=self.matmul_backend == "xla" and mesh is None,
                         dense="reference" if sharded else self.dense_backend,
                         groupwise=self.groupwise_backend,
                         grouped_matmul=("ragged_dot" if sharded and not ep and
                                         self.grouped_matmul_backend.startswith("pallas")
                                         else self.grouped_matmul_backend),
                         interpret=self.kernels.interpret, quantization=self.model.quantization,
                         fp8_activations=(self.model.quantization_config or {}).get(
                             "activations", "fp8") == "fp8",
                         mesh=mesh, context_layout=self.parallel.context_layout,
                         expert_parallel=self.parallel.enable_expert_parallel)


def _num_pages(config: EngineConfig, groups: KVGroups) -> int:
  """The pool's pages: `num_pages`, or room for `max_num_seqs` sequences of half
  `max_model_len`; either way, room for one sequence of `max_model_len`."""
  n, c = config.cache.num_pages, config
  need = lambda tokens: groups.page_need(tokens, c.cache.page_size,
                                         c.scheduler.max_num_batched_tokens)
  longest = need(c.model.max_model_len)
  if n is not None:
    if n - 1 < longest:
      raise ParameterError("num_pages", f"num_pages={n} cannot hold one sequence of "
                                        f"max_model_len={c.model.max_model_len} "
                                        f"({longest} pages + the sink page)")
  else:
    n = 1 + max(longest, c.scheduler.max_num_seqs * need(c.model.max_model_len // 2))
  cp = c.parallel.context_parallel_size
  return -(-n // cp) * cp


def default_dtype(platform: str | None = None):
  """float32 on the CPU (XLA:CPU's bf16 matvec is ~15x slower), bfloat16 on accelerators."""
  return jnp.float32 if (platform or jax.default_backend()) == "cpu" else jnp.bfloat16
